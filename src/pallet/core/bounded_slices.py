"""The size check of `pl.BoundedSlice` blocks: an index map's `pl.ds(start, size)` must
have `0 <= size <= n` for its `pl.BoundedSlice(n)` dimension.

Pallas copies `size` elements into an `n`-element buffer and assumes the bound holds;
a larger size has no meaning there. pallet copies the `n` elements from `start`, so
a size over the bound would run without an error but not as written. A size known
while tracing is checked then (`grid_mapping`); this module checks the sizes an index
map computes, not only in checking mode: `check_static` evaluates those that depend on
grid indices only over the whole grid, once, when the kernel is traced; `check` puts
those that read scalar-prefetch operands in the compiled program beside the kernel,
before it runs, on every call.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallet import _internals as internals
from pallet.core import checks, discharge
from pallet.core import grid_eval
from pallet.core.grid_mapping import BlockMapping
from pallet.core.tracing import KernelDescription


def _mappings(kernel: KernelDescription) -> list[BlockMapping]:
  """The inputs with traced sizes, where the grid is static and not empty."""
  gm = kernel.grid_mapping
  if None in gm.grid or gm.num_steps == 0:
    return []
  return [b for b in gm.inputs if b.slice_size_map is not None]


def _info(kernel: KernelDescription, b: BlockMapping) -> tuple[checks.CheckInfo, str, np.ndarray]:
  bounds = np.asarray([b.dims[d].size for d in b.slice_size_dims], np.int32)
  info = checks.CheckInfo(kind="index_map", kernel=kernel.name, ref=_ref_name(b),
                          line=b.index_map_source or kernel.source,
                          grid=tuple(kernel.grid_mapping.grid), detail="size")
  message = (f"the index map of {b.origin} returns pl.ds sizes for its pl.BoundedSlice "
             f"dimensions {b.slice_size_dims} that must lie in [0, {_bounds_text(bounds)}]")
  return info, message, bounds


def check_static(kernel: KernelDescription) -> None:
  """Raises KernelCheckError now for sizes that depend on grid indices only."""
  gm = kernel.grid_mapping
  if gm.prefetch_avals:
    return
  for b in _mappings(kernel):
    info, message, bounds = _info(kernel, b)
    sizes = np.stack([s.reshape(-1) for s in _sizes_now(b.slice_size_map, gm.grid)], axis=1)
    bad = ((sizes < 0) | (sizes > bounds)).any(axis=1)
    if bad.any():
      step = int(np.argmax(bad))
      raise info.error(f"{message}; got sizes {tuple(int(s) for s in sizes[step])}",
                       info.unravel(step))


def _sizes_now(size_map: Any, grid: tuple[int, ...]) -> list[np.ndarray]:
  """The sizes at every grid point: NumPy first (eager JAX ops would compile a small
  XLA program per primitive), JAX where the index map needs more."""
  try:
    return grid_eval.over_grid(size_map.jaxpr, size_map.consts, grid)
  except grid_eval.Unsupported:
    pass
  n = int(np.prod(grid, dtype=np.int64))
  coords = jnp.asarray(np.indices(grid, dtype=np.int32).reshape(len(grid), n))
  with internals.eval_context():
    return [np.asarray(s) for s in _sizes(size_map, coords, ())]


def check(kernel: KernelDescription, prefetch: Sequence[Any]) -> None:
  """Fails the call, at run time, where a size read from scalar-prefetch operands
  exceeds its `pl.BoundedSlice` bound."""
  gm = kernel.grid_mapping
  mappings = _mappings(kernel)
  if not gm.prefetch_avals or not mappings:
    return
  coords = jnp.asarray(np.indices(gm.grid, dtype=np.int32).reshape(len(gm.grid), gm.num_steps))
  for b in mappings:
    info, message, bounds = _info(kernel, b)
    sizes = jnp.stack(_sizes(b.slice_size_map, coords, prefetch), axis=1)
    bad_dims = (sizes < 0) | (sizes > bounds)
    bad = bad_dims.any(axis=1)
    step = jnp.argmax(bad)
    detail = sizes[step, jnp.argmax(bad_dims[step])]
    checks.check(~jnp.any(bad), message, info, (*[c[step] for c in coords], detail))


def _sizes(size_map: Any, coords: Any, prefetch: Sequence[Any]) -> list[Any]:
  """The traced sizes at every grid step, with JAX: one (num_steps,) array each."""
  pure = discharge.discharge_state(size_map)
  n_sizes = len(size_map.jaxpr.outvars)

  def at(*ids):   # the discharged jaxpr also returns the prefetch refs' final values
    return jax.core.eval_jaxpr(pure.jaxpr, pure.consts, *ids, *prefetch)[:n_sizes]

  outs = jax.vmap(at)(*coords) if len(coords) else at()
  return [jnp.broadcast_to(o, (coords.shape[1],)) for o in outs]


def _bounds_text(bounds: np.ndarray) -> str:
  return str(int(bounds[0])) if len(bounds) == 1 else str(tuple(int(n) for n in bounds))


def _ref_name(b: BlockMapping) -> str:
  """"input 1 ('y_ref')" -> "y_ref"."""
  return b.origin.split("('", 1)[1].split("')", 1)[0] if "('" in b.origin else b.origin
