"""Index-map checks: a block placed wholly outside its array (often an index map
returning element offsets where block indices are expected) fails the call.

Index maps that read no scalar-prefetch operand are evaluated over the whole grid
when the call is made, so the error comes before the kernel runs; the others are
checked in the compiled program, next to the kernel.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallet import _internals as internals
from pallet.core import checks, discharge
from pallet.checking import report
from pallet.core.grid_mapping import BlockMapping
from pallet.core.tracing import KernelDescription


def _line(mapping: BlockMapping, kernel: KernelDescription) -> str:
  """The line computing the index map's result, else where the index map is defined."""
  for eqn in mapping.index_map.jaxpr.eqns:
    src = internals.equation_source(eqn)
    if src:
      return f"{src[0]}:{src[1]}"
  return mapping.index_map_source or kernel.source


def _outside(mapping: BlockMapping, indices: Sequence[Any], xp: Any) -> Any:
  """Per grid point: whether the block lies wholly outside the array."""
  bad = False
  for d, (dim, idx, n) in enumerate(zip(mapping.dims, indices, mapping.array_shape)):
    if dim.kind == "element":
      lo, hi = dim.padding
      out = (idx >= n + lo + hi) | (idx + dim.size <= 0)
    else:   # blocked or squeezed: a block index
      out = (idx < 0) | (idx * dim.size >= max(n, 1))
    bad = bad | out
  return bad


def _message(name: str, mapping: BlockMapping) -> str:
  return (f"the index map of '{name}' places its block {mapping.block_shape} wholly "
          f"outside the array of shape {mapping.array_shape} (index maps return block "
          f"indices, not element offsets)")


def _mappings(kernel: KernelDescription, names: Sequence[str]) -> list[tuple[str, BlockMapping]]:
  gm = kernel.grid_mapping
  n_pre = len(gm.prefetch_avals)
  operands = list(gm.inputs) + list(gm.outputs)
  return [(names[n_pre + i], b) for i, b in enumerate(operands)
          if not b.whole and b.array_shape]


def check_static(kernel: KernelDescription, names: Sequence[str]) -> None:
  """Raises KernelCheckError now for index maps without scalar prefetch."""
  gm = kernel.grid_mapping
  if gm.prefetch_avals or None in gm.grid or gm.num_steps == 0:
    return
  coords = np.indices(gm.grid).reshape(len(gm.grid), gm.num_steps).astype(np.int32)
  for name, b in _mappings(kernel, names):
    im = b.index_map
    with internals.eval_context():
      if gm.grid:
        outs = jax.vmap(lambda *ids: jax.core.eval_jaxpr(im.jaxpr, im.consts, *ids))(
            *[jnp.asarray(c) for c in coords])
      else:
        outs = jax.core.eval_jaxpr(im.jaxpr, im.consts)
    outs = [np.broadcast_to(np.asarray(o, np.int64), (coords.shape[1],)) for o in outs]
    bad = np.asarray(_outside(b, outs, np), bool).reshape(-1)
    if bad.any():
      step = int(np.argmax(bad))
      ids = tuple(int(c) for c in coords[:, step])
      blocks = tuple(int(o[step]) for o in outs)
      info = checks.CheckInfo(kind="index_map", kernel=kernel.name, ref=name,
                              line=_line(b, kernel), grid=tuple(gm.grid))
      raise info.error(f"{_message(name, b)}: block indices {blocks}", ids)


def check_at_run_time(kernel: KernelDescription, names: Sequence[str],
                      prefetch: Sequence[Any], catalog: list) -> list:
  """The reports (see report.py) of index maps that read scalar-prefetch operands,
  computed with the call; their checks are added to `catalog`."""
  gm = kernel.grid_mapping
  if not gm.prefetch_avals or None in gm.grid or gm.num_steps == 0:
    return []
  coords = jnp.asarray(np.indices(gm.grid).reshape(len(gm.grid), gm.num_steps).astype(np.int32))
  reports = []
  for name, b in _mappings(kernel, names):
    pure = discharge.discharge_state(b.index_map)
    n_idx = len(b.array_shape)

    def at(*ids, pure=pure):
      return jax.core.eval_jaxpr(pure.jaxpr, pure.consts, *ids, *prefetch)[:n_idx]

    outs = jax.vmap(at)(*coords) if gm.grid else at()
    outs = [jnp.broadcast_to(o, (coords.shape[1],)) for o in outs]
    bad = _outside(b, outs, jnp)
    first = jnp.argmax(bad)
    info = checks.CheckInfo(kind="index_map", kernel=kernel.name, ref=name,
                            line=_line(b, kernel), grid=tuple(gm.grid),
                            detail="block index (first dimension outside)")
    detail = outs[0][first]
    for d in reversed(range(n_idx)):
      detail = jnp.where(_outside(b.replace(dims=(b.dims[d],), array_shape=(b.array_shape[d],)),
                                  [outs[d][first]], jnp), outs[d][first], detail)
    catalog.append((_message(name, b), info))
    reports.append(report.single(jnp.any(bad), len(catalog), detail,
                                 [c[first] for c in coords], len(gm.grid)))
  return reports
