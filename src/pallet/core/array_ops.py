"""jax.numpy helpers that pallet's emitted and discharged programs use, written as
the lax operations they bind.

`jnp.moveaxis` is a jitted function, and `x.at[idx].get/.set` go through NumPy-style
index analysis that calls jitted helpers (`_broadcast_arrays`, `ravel`, `squeeze`):
on a first call (cold caches) each new shape is traced as a program of its own
before it is inlined, a JAX trace's fixed cost each time, and the index analysis is
Python work of its own. The program pallet emits moves axes per operand and loop
step, and every masked load or store through an index vector discharges to a gather
or a scatter. The helpers here bind the same operations directly, with the same
semantics as the jax.numpy calls they replace (negative indices counted from the
end, out-of-bounds reads filled, out-of-bounds writes dropped).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from jax import lax


def moveaxis(x: Any, source: Sequence[int], destination: Sequence[int]) -> Any:
  """`jnp.moveaxis(x, source, destination)` (non-negative axes), as one transpose."""
  source, destination = list(source), list(destination)
  if len(source) != len(destination):
    raise ValueError(f"moveaxis: {len(source)} source axes but {len(destination)} "
                     f"destinations")
  perm = [d for d in range(len(x.shape)) if d not in source]
  for dst, src in sorted(zip(destination, source)):
    perm.insert(dst, src)
  return lax.transpose(x, perm)


def _wrapped(index: Any, n: int) -> Any:
  """Negative integer indices counted from the end (as jax.numpy indexing does)."""
  zero, size = np.array(0, index.dtype), np.array(n, index.dtype)
  return lax.select(lax.lt(index, zero), lax.add(index, size), index)


def take_or_fill(x: Any, positions: Sequence[Any], fill: Any) -> Any:
  """`x.at[tuple(positions)].get(mode="fill", fill_value=fill)`: one integer array per
  dimension of `x` (broadcast together); out-of-bounds positions read `fill`."""
  if len(positions) != len(x.shape):
    raise ValueError(f"take_or_fill: {len(positions)} index arrays for {len(x.shape)} "
                     f"dimensions")
  if not positions:   # a 0-d array indexed by (): itself
    return x
  shape = tuple(np.broadcast_shapes(*(tuple(p.shape) for p in positions)))
  positions = [p if tuple(p.shape) == shape else lax.broadcast_in_dim(
      p, shape, tuple(range(len(shape) - len(p.shape), len(shape)))) for p in positions]
  dims = tuple(range(len(shape)))
  columns = [lax.broadcast_in_dim(_wrapped(p, n), shape + (1,), dims)
             for p, n in zip(positions, x.shape)]
  indices = columns[0] if len(columns) == 1 else lax.concatenate(columns, len(shape))
  every = tuple(range(len(x.shape)))
  numbers = lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=every,
                                       start_index_map=every)
  return lax.gather(x, indices, numbers, slice_sizes=(1,) * len(x.shape),
                    mode=lax.GatherScatterMode.FILL_OR_DROP, fill_value=fill)


def set_or_drop(flat: Any, index: Any, updates: Any) -> Any:
  """`flat.at[index].set(updates, mode="drop")` for a 1-D `flat`, `index` and
  `updates` of one length: out-of-bounds writes are dropped."""
  indices = lax.broadcast_in_dim(_wrapped(index, flat.shape[0]), tuple(index.shape) + (1,),
                                 (0,))
  numbers = lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(0,),
                                        scatter_dims_to_operand_dims=(0,))
  return lax.scatter(flat, indices, updates, numbers, indices_are_sorted=False,
                     unique_indices=False, mode=lax.GatherScatterMode.FILL_OR_DROP)
