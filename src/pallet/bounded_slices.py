"""The size check of `pl.BoundedSlice` blocks: an index map's `pl.ds(start, size)` must
have `0 <= size <= n` for its `pl.BoundedSlice(n)` dimension.

Pallas copies `size` elements into an `n`-element buffer and assumes the bound holds;
a larger size has no meaning there. pallet copies the `n` elements from `start`, so
a size over the bound would run without an error but not as written. A size known
while tracing is checked then (`grid_mapping`); this module checks the sizes an index
map computes, on every call (not only in checking mode): evaluated over the whole
grid when the call is made if they depend on grid indices only, else in the compiled
program beside the kernel, before it runs.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallet import _internals as internals
from pallet import checks
from pallet.grid_mapping import BlockMapping
from pallet.tracing import KernelDescription


def check(kernel: KernelDescription, prefetch: Sequence[Any]) -> None:
  """Fails the call where a traced `pl.ds` size exceeds its `pl.BoundedSlice` bound."""
  gm = kernel.grid_mapping
  mappings = [b for b in gm.inputs if b.slice_size_map is not None]
  if not mappings or None in gm.grid or gm.num_steps == 0:
    return
  coords = np.indices(gm.grid).reshape(len(gm.grid), gm.num_steps).astype(np.int32)
  for b in mappings:
    bounds = np.asarray([b.dims[d].size for d in b.slice_size_dims], np.int32)
    info = checks.CheckInfo(kind="index_map", kernel=kernel.name, ref=_ref_name(b),
                            line=b.index_map_source or kernel.source, grid=tuple(gm.grid),
                            detail="size")
    message = (f"the index map of {b.origin} returns pl.ds sizes for its pl.BoundedSlice "
               f"dimensions {b.slice_size_dims} that must lie in [0, {_bounds_text(bounds)}]")
    if gm.prefetch_avals:
      _check_in_program(b, coords, prefetch, bounds, info, message)
    else:
      _check_now(b, coords, bounds, info, message)


def _sizes(b: BlockMapping, coords: Any, prefetch: Sequence[Any]) -> list[Any]:
  """The traced sizes at every grid step: one (num_steps,) array per dimension."""
  pure = internals.discharge_state(b.slice_size_map)

  def at(*ids):   # the discharged jaxpr also returns the prefetch refs' final values
    return jax.core.eval_jaxpr(pure.jaxpr, pure.consts, *ids, *prefetch)[:len(b.slice_size_dims)]

  outs = jax.vmap(at)(*coords) if len(coords) else at()
  return [jnp.broadcast_to(o, (coords.shape[1],)) for o in outs]


def _check_now(b, coords, bounds, info, message) -> None:
  with internals.eval_context():
    sizes = np.stack([np.asarray(s) for s in _sizes(b, jnp.asarray(coords), ())], axis=1)
  bad = ((sizes < 0) | (sizes > bounds)).any(axis=1)
  if bad.any():
    step = int(np.argmax(bad))
    raise info.error(f"{message}; got sizes {tuple(int(s) for s in sizes[step])}",
                     tuple(int(c) for c in coords[:, step]))


def _check_in_program(b, coords, prefetch, bounds, info, message) -> None:
  sizes = jnp.stack(_sizes(b, jnp.asarray(coords), prefetch), axis=1)
  bad_dims = (sizes < 0) | (sizes > bounds)
  bad = bad_dims.any(axis=1)
  step = jnp.argmax(bad)
  detail = sizes[step, jnp.argmax(bad_dims[step])]
  checks.check(~jnp.any(bad), message, info,
               (*[jnp.asarray(c)[step] for c in coords], detail))


def _bounds_text(bounds: np.ndarray) -> str:
  return str(int(bounds[0])) if len(bounds) == 1 else str(tuple(int(n) for n in bounds))


def _ref_name(b: BlockMapping) -> str:
  """"input 1 ('y_ref')" -> "y_ref"."""
  return b.origin.split("('", 1)[1].split("')", 1)[0] if "('" in b.origin else b.origin
