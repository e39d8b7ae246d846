"""Views whose size is known only at run time: `ref.at[pl.ds(start, n)]` with a traced `n`.

TPU kernels copy ragged amounts with them: a paged KV-cache update writes the `n` new
tokens of a sequence into its page, a causal convolution carries the last `n` rows
of its input over to the next block. In JAX such a view may be the source or
destination of a DMA (JAX refuses it in plain loads and stores, and so does pallet);
the copy moves exactly `n` elements along that dimension, its semaphore counts them
and a wait on a descriptor of the same views waits for them.

An array cannot have a traced shape, so a DMA is run as a masked copy over a static
bound: along a dimension of traced size, the block read and written is as large as
the enclosing extent (the dimension of the ref being sliced), the data is aligned to
the window's start with a rotation, and only the first `n` positions are written.
Like every other window in pallet, a start or size that reaches outside the ref is
clamped inside it (checking mode reports it, see pallet/checking/bounds.py).

Only unit-stride slices, scalar indices and reshapes of a whole trailing part of the
array compose into such windows. Serving kernels merge a paged KV cache's page and
token dimensions, `cache.reshape(pages * page_size, ...)`, and then copy `n` tokens
from any position: the window then lies in the array seen with that shape (a reshape
of contiguous data, so the same elements). A dynamic size combined with strides,
integer-array indices, bitcasts or a reshape of a part of the array is refused by
the DMA that uses it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np
from jax import lax

from pallet import _internals as internals

Size = Any   # a Python int, or an int32 scalar known at run time


def is_static(x: Any) -> bool:
  return isinstance(x, (int, np.integer))


def has_dynamic_size(transforms: Sequence[Any] | None) -> bool:
  """Whether any slice among `transforms` has a size known only at run time."""
  return any(isinstance(t, internals.NDIndexer)
             and any(isinstance(i, internals.Slice) and not is_static(i.size)
                     for i in t.indices)
             for t in transforms or ())


@dataclasses.dataclass(frozen=True)
class Window:
  """The part of a base array that a view selects, per dimension of the base seen with
  static `shape` (the base's own shape, `base_shape`, unless a view reshapes it):
  `starts` (clamped inside), `sizes` (clamped to [0, bound]), static `bounds` on the
  sizes, and `requested` (the sizes the view asked for, before clamping). `visible`
  lists the dimensions of `shape` that are dimensions of the view."""
  shape: tuple[int, ...]
  starts: tuple[Size, ...]
  sizes: tuple[Size, ...]
  bounds: tuple[int, ...]
  requested: tuple[Size, ...]
  visible: tuple[int, ...]
  base_shape: tuple[int, ...]

  @property
  def view_sizes(self) -> tuple[Size, ...]:
    return tuple(self.sizes[d] for d in self.visible)

  @property
  def view_bounds(self) -> tuple[int, ...]:
    return tuple(self.bounds[d] for d in self.visible)

  @property
  def view_requested(self) -> tuple[Size, ...]:
    return tuple(self.requested[d] for d in self.visible)

  def count(self) -> Size:
    """How many elements the view holds: an int, or an int32 scalar."""
    return product(self.view_sizes)


def product(sizes: Sequence[Size]) -> Size:
  static = math.prod(int(s) for s in sizes if is_static(s))
  total: Size = static
  for s in sizes:
    if not is_static(s):
      total = lax.mul(_i32(total), _i32(s))
  return total


def smallest(*sizes: Size) -> Size:
  """The least of `sizes`: an int where all are static."""
  if all(is_static(s) for s in sizes):
    return min(int(s) for s in sizes)
  out = _i32(sizes[0])
  for s in sizes[1:]:
    out = lax.min(out, _i32(s))
  return out


def window(shape: Sequence[Any], transforms: Sequence[Any] | None) -> Window | None:
  """The window `transforms` select in an array of `shape`; None where they are not
  all unit-stride slices, scalar indices and whole-part reshapes (or the shape is
  symbolic)."""
  if not all(is_static(n) for n in shape):
    return None
  base_shape = tuple(int(n) for n in shape)
  rank = len(shape)
  starts: list[Size] = [0] * rank
  sizes: list[Size] = list(base_shape)
  bounds: list[int] = list(base_shape)
  requested: list[Size] = list(base_shape)
  visible = list(range(rank))
  seen = list(base_shape)   # the base array as the views see it (reshapes applied)
  for t in transforms or ():
    if t is None:
      continue
    if isinstance(t, internals.ReshapeTransform):
      kept = _whole_trailing_part(seen, starts, sizes, visible)
      new = tuple(int(n) for n in t.shape)
      if kept is None or math.prod(new) != math.prod(seen[kept:]):
        return None
      seen = seen[:kept] + list(new)
      starts = starts[:kept] + [0] * len(new)
      sizes = sizes[:kept] + list(new)           # dimensions ..kept: 1 (scalar indices)
      bounds = bounds[:kept] + list(new)
      requested = requested[:kept] + list(new)
      visible = list(range(kept, len(seen)))
      continue
    if not isinstance(t, internals.NDIndexer) or len(t.indices) != len(visible):
      return None
    still_visible = []
    for d, index in zip(visible, t.indices):
      extent = sizes[d]
      if isinstance(index, internals.Slice):
        if index.stride != 1:
          return None
        if is_static(index.size):
          size = int(index.size)
          if size > bounds[d]:
            return None
          bound = size
        else:   # traced: at most the extent it slices
          size = _clamp(_i32(0), _i32(index.size), _i32(extent))
          bound = bounds[d]
        requested[d] = index.size
        start = index.start
        still_visible.append(d)
      elif np.shape(index) == ():
        size, bound, start = 1, 1, index
        requested[d] = 1
      else:
        return None
      starts[d] = _offset(starts[d], _fitted(start, extent, size))
      sizes[d], bounds[d] = size, bound
    visible = still_visible
  return Window(tuple(seen), tuple(starts), tuple(sizes), tuple(bounds),
                tuple(requested), tuple(visible), base_shape)


def _whole_trailing_part(shape: list[int], starts: list[Size], sizes: list[Size],
                         visible: list[int]) -> int | None:
  """k where the view so far is all of dimensions k.. of `shape` at one position of
  dimensions ..k (scalar indices there): contiguous data, which a reshape of the view
  reads as the array reshaped to shape[:k] + new shape. None for any other view."""
  kept = len(shape) - len(visible)
  if visible != list(range(kept, len(shape))):
    return None
  for d in visible:
    if not (is_static(starts[d]) and int(starts[d]) == 0
            and is_static(sizes[d]) and int(sizes[d]) == shape[d]):
      return None
  return kept


def read(x: Any, w: Window, bounds: Sequence[int]) -> Any:
  """The view's data as an array of shape `bounds` (one per view dimension, each at
  least the view's size there when in bounds): position i of a dimension holds element
  i of the window; positions past the window's size hold other elements of `x`."""
  slab_starts, slab_sizes, shifts = _slab(w, bounds)
  x = lax.reshape(x, w.shape) if x.shape != w.shape else x
  slab = lax.dynamic_slice(x, [_i32(s) for s in slab_starts], slab_sizes,
                           allow_negative_indices=False)
  slab = lax.reshape(slab, tuple(bounds))
  for axis, shift in shifts.items():
    slab = _rotate_left(slab, shift, axis)
  return slab


def write(x: Any, w: Window, bounds: Sequence[int], counts: Sequence[Size], value: Any,
          add: bool = False) -> Any:
  """`x` with the first `counts[i]` positions of each view dimension i of the window
  replaced by `value`'s (or incremented by them, with `add`); `value` has shape
  `bounds`, as `read` returns."""
  slab_starts, slab_sizes, shifts = _slab(w, bounds)
  starts = [_i32(s) for s in slab_starts]
  x = lax.reshape(x, w.shape) if x.shape != w.shape else x
  old = lax.reshape(lax.dynamic_slice(x, starts, slab_sizes, allow_negative_indices=False),
                    tuple(bounds))
  value = lax.convert_element_type(value, x.dtype)
  mask = None
  for axis, (bound, count) in enumerate(zip(bounds, counts)):
    if axis in shifts:
      value = _rotate_right(value, shifts[axis], axis)
    elif is_static(count) and count == bound:
      continue
    position = lax.broadcasted_iota(np.int32, tuple(bounds), axis)
    first = shifts.get(axis, _i32(0))
    inside = lax.bitwise_and(lax.ge(position, first),
                             lax.lt(position, lax.add(first, _i32(count))))
    mask = inside if mask is None else lax.bitwise_and(mask, inside)
  new = lax.add(old, value) if add else value
  if mask is not None:
    new = lax.select(mask, new, old)
  x = lax.dynamic_update_slice(x, lax.reshape(new, tuple(slab_sizes)), starts,
                               allow_negative_indices=False)
  return lax.reshape(x, w.base_shape) if x.shape != w.base_shape else x


def valid_mask(bounds: Sequence[int], counts: Sequence[Size]) -> Any:
  """True at the first `counts[i]` positions of every dimension of a `bounds` block."""
  mask = lax.full(tuple(bounds), True, np.bool_)
  for axis, count in enumerate(counts):
    position = lax.broadcasted_iota(np.int32, tuple(bounds), axis)
    mask = lax.bitwise_and(mask, lax.lt(position, _i32(count)))
  return mask


def _slab(w: Window, bounds: Sequence[int]) -> tuple[list[Size], list[int], dict[int, Any]]:
  """(starts, sizes) of the block of `x` read for a view read over `bounds`, and per
  view axis of traced size the offset of the window's start inside that block."""
  starts, sizes = list(w.starts), [1] * len(w.shape)
  shifts: dict[int, Any] = {}
  for axis, (d, bound) in enumerate(zip(w.visible, bounds)):
    sizes[d] = int(bound)
    if is_static(w.sizes[d]):
      continue   # start + size stays inside the array, so start + bound does too
    # a traced size: the block of `bound` elements that holds the window
    begin = _clamp(_i32(0), _i32(w.starts[d]), _i32(w.shape[d] - bound))
    starts[d] = begin
    shifts[axis] = lax.sub(_i32(w.starts[d]), begin)
  return starts, sizes, shifts


def _rotate_left(x: Any, shift: Any, axis: int) -> Any:
  """`x` rotated along `axis` so that position i gets x[i + shift], for a `shift` in
  [0, n) (a window's offset in its slab)."""
  n = x.shape[axis]
  if n == 0:
    return x
  return lax.dynamic_slice_in_dim(lax.concatenate([x, x], axis), shift, n, axis,
                                  allow_negative_indices=False)


def _rotate_right(x: Any, shift: Any, axis: int) -> Any:
  """The inverse of `_rotate_left`: position i gets x[i - shift], `shift` in [0, n)."""
  n = x.shape[axis]
  if n == 0:
    return x
  return lax.dynamic_slice_in_dim(lax.concatenate([x, x], axis), lax.sub(_i32(n), shift),
                                  n, axis, allow_negative_indices=False)


def _fitted(start: Any, extent: Size, size: Size) -> Size:
  """`start` in a dimension of `extent`, as a dynamic slice of `size` takes it:
  negative starts count from the end, then the window is clamped inside."""
  if is_static(start) and is_static(extent) and is_static(size):
    start = int(start) + int(extent) if int(start) < 0 else int(start)
    return min(max(start, 0), int(extent) - int(size))
  start = _i32(start)
  wrapped = lax.select(lax.lt(start, _i32(0)), lax.add(start, _i32(extent)), start)
  last = lax.max(lax.sub(_i32(extent), _i32(size)), _i32(0))
  return _clamp(_i32(0), wrapped, last)


def _offset(base: Size, start: Size) -> Size:
  if is_static(base) and is_static(start):
    return int(base) + int(start)
  return lax.add(_i32(base), _i32(start))


def _clamp(low: Any, x: Any, high: Any) -> Any:
  """`x` limited to [low, high] (low <= high). Not JAX's clamp: these windows are also
  computed per device under `jax.vmap` (pallet.distributed's lockstep run), where JAX's
  clamp batching rule fails for a shared scalar `x` between per-device bounds."""
  return lax.min(lax.max(x, low), high)


def _i32(x: Any) -> Any:
  return lax.convert_element_type(x, np.int32)
