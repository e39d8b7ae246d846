"""Whether the indices of one ref access stay inside the ref: the conditions the
instrumentation compiles into the kernel, and which of them are known statically.

An access is the ref's transforms (`ref.at[...]` views, then the indexer of the load
or store) and an optional lane mask. Each condition comes back as
`(ok, detail, what)`: `ok` a boolean scalar or array (True where in bounds, with
masked-off lanes counting as in bounds), `detail` an int32 scalar naming the
offending index (the first one out of bounds) and `what` describing the index.
Statically in-bounds indices produce nothing.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from pallet import _internals as internals
from pallet.core import primitives

Condition = tuple[Any, Any, str]


def _concrete(x: Any) -> np.ndarray | None:
  if internals.is_tracer(x):
    return None
  try:
    return np.asarray(x)
  except (TypeError, ValueError):
    return None


def _first_bad(index: Any, ok: Any) -> Any:
  """The first value of `index` where `ok` fails (int32 scalar)."""
  index = jnp.broadcast_to(jnp.asarray(index, jnp.int32), jnp.shape(ok)).reshape(-1)
  return index[jnp.argmin(jnp.asarray(ok).reshape(-1))]


def _slice_condition(sl: Any, size: Any, d: int) -> Condition | None:
  count = _concrete(sl.size)
  if count is None or _concrete(size) is None:
    return _run_time_slice_condition(sl, size, d)
  if int(count) == 0:
    return None
  start, stride = sl.start, sl.stride
  last_offset = (int(count) - 1) * stride
  what = f"dimension {d}: a slice of {int(count)} (stride {stride}) on {size} elements, start"
  static = _concrete(start)
  if static is not None:
    if 0 <= int(static) and int(static) + last_offset < size:
      return None
    return jnp.bool_(False), jnp.int32(int(static)), what
  start = jnp.asarray(start, jnp.int32)
  return (start >= 0) & (start + last_offset < size), start, what


def _run_time_slice_condition(sl: Any, size: Any, d: int) -> Condition:
  """A slice whose size (or whose dimension's extent, inside such a slice) is known only
  at run time, as DMAs of ragged amounts use: its size must lie in [0, extent] and, when
  not empty, its elements inside. The detail is the offending index (the start where it
  is negative, else the last element, or the size itself when negative)."""
  count = jnp.asarray(sl.size, jnp.int32)
  start = jnp.asarray(sl.start, jnp.int32)
  extent = jnp.asarray(size, jnp.int32)
  last = start + (count - 1) * sl.stride
  ok = (count == 0) | ((count > 0) & (start >= 0) & (last < extent))
  detail = jnp.where(count < 0, count, jnp.where(start < 0, start, last))
  what = (f"dimension {d}: a slice of a size known at run time (stride {sl.stride}) on "
          f"{'a run-time number of' if _concrete(size) is None else int(_concrete(size))} "
          f"elements, index")
  return ok, detail, what


def _index_condition(index: Any, size: int, d: int) -> Condition | None:
  what = f"dimension {d}: an index on {size} elements"
  static = _concrete(index)
  if static is not None:
    # static negative indices count from the end, as in NumPy (pallet reads them so)
    if static.size == 0 or ((static >= -size) & (static < size)).all():
      return None
    bad = static[~((static >= -size) & (static < size))].reshape(-1)[0]
    return jnp.bool_(False), jnp.int32(int(bad)), what
  index = jnp.asarray(index, jnp.int32)
  ok = (index >= 0) & (index < size)
  return ok, (index if index.ndim == 0 else _first_bad(index, ok)), what


def _indexer_conditions(indexer: Any) -> list[Condition]:
  out = []
  for d, (idx, size) in enumerate(zip(indexer.indices, indexer.shape)):
    cond = (_slice_condition(idx, size, d) if isinstance(idx, internals.Slice)
            else _index_condition(idx, size, d))
    if cond is not None:
      out.append(cond)
  return out


def _masked_conditions(indexer: Any, mask: Any) -> list[Condition]:
  """Per-lane conditions of the last indexer under a lane mask: a masked-off lane may
  point anywhere (that is what masks are for)."""
  if all(_static_in_bounds(idx, size) for idx, size in zip(indexer.indices, indexer.shape)):
    return []
  positions = primitives._indexer_positions(indexer)
  ok, detail = jnp.bool_(True), []
  shape = jnp.shape(mask)
  for d, (pos, size) in enumerate(zip(positions, indexer.shape)):
    in_dim = (pos >= 0) & (pos < size)
    ok = ok & in_dim
    detail.append((jnp.broadcast_to(pos, shape), in_dim))
  ok = jnp.broadcast_to(ok, shape) | ~mask
  first = jnp.argmin(ok.reshape(-1))
  # the offending index: in the first dimension out of bounds at the first bad lane
  value = jnp.int32(0)
  for pos, in_dim in reversed(detail):
    lane_ok = jnp.broadcast_to(in_dim, shape).reshape(-1)[first]
    value = jnp.where(lane_ok, value, pos.reshape(-1)[first])
  return [(ok, value, "a lane the mask leaves enabled, index")]


def _static_in_bounds(idx: Any, size: int) -> bool:
  if isinstance(idx, internals.Slice):
    start, count = _concrete(idx.start), _concrete(idx.size)
    if count is None:
      return False
    return int(count) == 0 or (start is not None and 0 <= int(start)
                               and int(start) + (int(count) - 1) * idx.stride < size)
  static = _concrete(idx)
  return static is not None and bool(((static >= -size) & (static < size)).all())


def access_conditions(transforms: Sequence[Any], mask: Any = None) -> list[Condition] | None:
  """The conditions for an access through `transforms` (None: transforms pallet cannot
  follow, such as a bitcast between indexers, so nothing is checked)."""
  out: list[Condition] = []
  for k, t in enumerate(transforms):
    if not isinstance(t, internals.NDIndexer):
      continue
    last = k == len(transforms) - 1
    out += (_masked_conditions(t, mask) if last and mask is not None
            else _indexer_conditions(t))
  return out


def only_indexers(transforms: Sequence[Any]) -> bool:
  return all(isinstance(t, internals.NDIndexer) for t in transforms)


# ------------------------------------------------------------------ array operations
def gather_conditions(operand_shape: Sequence[int], indices: Any, dnums: Any,
                      slice_sizes: Sequence[int]) -> list[Condition]:
  """`lax.gather` clamps or fills out-of-range starts; each start must fit its slice."""
  static = _concrete(indices)
  out = []
  index_dim = jnp.ndim(indices) - 1
  for k, d in enumerate(dnums.start_index_map):
    limit = operand_shape[d] - slice_sizes[d]
    what = f"gather start in dimension {d} (at most {limit})"
    if static is not None:
      col = np.take(static, k, axis=index_dim)
      if ((col >= 0) & (col <= limit)).all():
        continue
    col = jnp.take(jnp.asarray(indices, jnp.int32), k, axis=index_dim)
    ok = (col >= 0) & (col <= limit)
    out.append((ok, _first_bad(col, ok) if col.ndim else col, what))
  return out


def dynamic_slice_conditions(operand_shape: Sequence[int], starts: Sequence[Any],
                             sizes: Sequence[int], what: str) -> list[Condition]:
  """`lax.dynamic_slice` / `dynamic_update_slice` clamp starts that do not fit."""
  out = []
  for d, (start, n, size) in enumerate(zip(starts, operand_shape, sizes)):
    static = _concrete(start)
    if static is not None and 0 <= int(static) <= n - size:
      continue
    start = jnp.asarray(start, jnp.int32)
    out.append(((start >= 0) & (start <= n - size), start,
                f"{what} start in dimension {d} (a slice of {size} on {n} elements)"))
  return out
