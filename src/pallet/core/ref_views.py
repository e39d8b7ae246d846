"""A ref's value read or written through its `.at[...]` views as one window.

JAX's `transform_array` and `transform_swap_array` apply the views of a ref one
after another and wrap every start, static ones included, with traced
`select(i < 0, i + n, i)` arithmetic; the swap also reads the old view before it
writes the new one. A DMA in a TPU kernel names its window of an HBM array and of
a VMEM buffer through two such views each and its semaphore through one more, so
JAX's TPU paged attention discharged from 216 equations to 3,400, all of which
are traced again, lowered and compiled: first-call time.

Views made only of unit-stride slices and scalar indices compose into one window
of the base array. Static starts are wrapped and clamped in Python; a traced start
gets the same wrapping and clamping, per view, as JAX applies, in four scalar
equations. A read is one slice, a write one `dynamic_update_slice`, and a
read-modify-write (a semaphore count) works its window out once. Any other view
(strided slices, integer-array indices, bitcasts, reshapes, dynamic sizes, symbolic
shapes) goes through JAX's helpers, as before.

A write through a reshaped or bitcast view (`ref.reshape(...)`, `ref.bitcast(...)`) is
taken one view at a time (`_swap_view_by_view`): JAX 0.10's rule refuses both views.
Where the stored value reads the same ref elsewhere, the XLA backend writes the update
as a select (backends/xla/self_updates.py: XLA:CPU mis-compiles it otherwise).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from jax import lax

from pallet import _internals as internals

Window = tuple[list[Any], list[int], tuple[int, ...]]   # starts, sizes, result shape


def read(x: Any, transforms: Sequence[Any] | None) -> Any:
  """`x` seen through `transforms` (as `ref.at[...][...]` would read it)."""
  window = _window(x.shape, transforms)
  if window is None:
    return internals.transform_array(x, transforms)
  return _read_window(x, window)


def write(x: Any, transforms: Sequence[Any] | None, value: Any) -> Any:
  """`x` with `value` written where `transforms` look (the view's old value unread)."""
  window = _window(x.shape, transforms)
  if window is None:
    return _swap(x, transforms, value)[1]
  return _write_window(x, window, value)


def swap(x: Any, transforms: Sequence[Any] | None, value: Any) -> tuple[Any, Any]:
  """(the view's old value, `x` with `value` written there), as a store returns them."""
  window = _window(x.shape, transforms)
  if window is None:
    return _swap(x, transforms, value)
  return _read_window(x, window), _write_window(x, window, value)


def update(x: Any, transforms: Sequence[Any] | None, fn: Callable[[Any], Any]) -> Any:
  """`x` with the view `transforms` look at replaced by `fn(view)`: the window (and a
  traced start's arithmetic) is worked out once for the read and the write."""
  window = _window(x.shape, transforms)
  if window is None:
    old = internals.transform_array(x, transforms)
    return _swap(x, transforms, fn(old))[1]
  return _write_window(x, window, fn(_read_window(x, window)))


def _swap(x: Any, transforms: Sequence[Any] | None, value: Any) -> tuple[Any, Any]:
  """JAX's swap through `transforms`; one view at a time where one reshapes or bitcasts."""
  transforms = [t for t in (transforms or ()) if t is not None]
  if not any(_reinterprets(t) for t in transforms):
    return internals.transform_swap_array(x, transforms, value)
  return _swap_view_by_view(x, transforms, value)


def _reinterprets(t: Any) -> bool:
  return isinstance(t, (internals.ReshapeTransform, internals.BitcastTransform))


def _swap_view_by_view(x: Any, transforms: list[Any], value: Any) -> tuple[Any, Any]:
  """(the view's old value, `x` with `value` written through `transforms`): each view
  of the chain is taken, then written back from the last to the first. Where the chain
  bitcasts, the views are unsigned integers of the same widths while the bits move:
  jaxlib 0.10's XLA:CPU quiets signaling-NaN patterns in a floating array it updates
  (all of a bfloat16 array's, on a `dynamic_update_slice`), and a bitcast view's
  elements are any bits (the low halves of float32s seen as bfloat16)."""
  as_bits = any(isinstance(t, internals.BitcastTransform) for t in transforms)
  views = [_bits(x) if as_bits else x]
  for t in transforms:
    if isinstance(t, internals.ReshapeTransform):
      views.append(views[-1].reshape(t.shape))
    elif isinstance(t, internals.BitcastTransform):
      views.append(internals.bitcast_value(views[-1], _bits_type(t.dtype)))
    else:
      views.append(internals.transform_array(views[-1], [t]))
  new = _bits(value) if as_bits else value
  for t, view in reversed(list(zip(transforms, views))):
    if isinstance(t, internals.ReshapeTransform):
      new = new.reshape(view.shape)
    elif isinstance(t, internals.BitcastTransform):
      new = internals.bitcast_value(new, view.dtype)
    else:
      new = internals.transform_swap_array(view, [t], new)[1]
  if not as_bits:
    return views[-1], new
  seen_as = [t.dtype for t in transforms if isinstance(t, internals.BitcastTransform)][-1]
  return _from_bits(views[-1], seen_as), _from_bits(new, x.dtype)


def _bits_type(dtype: Any) -> np.dtype:
  """The unsigned integer type of `dtype`'s width (`dtype` itself for integers, bools,
  complex numbers and odd widths)."""
  dtype = np.dtype(dtype)
  if dtype.kind in "iubc" or dtype.itemsize not in (1, 2, 4, 8):
    return dtype
  return np.dtype(f"uint{8 * dtype.itemsize}")


def _bits(x: Any) -> Any:
  bits = _bits_type(x.dtype)
  return x if bits == np.dtype(x.dtype) else lax.bitcast_convert_type(x, bits)


def _from_bits(x: Any, dtype: Any) -> Any:
  return x if np.dtype(x.dtype) == np.dtype(dtype) else lax.bitcast_convert_type(x, dtype)


def _read_window(x: Any, window: Window) -> Any:
  starts, sizes, shape = window
  if all(isinstance(s, int) for s in starts):
    view = lax.slice(x, starts, [s + n for s, n in zip(starts, sizes)])
  else:
    view = lax.dynamic_slice(x, starts, sizes, allow_negative_indices=False)
  return lax.reshape(view, shape) if view.shape != shape else view


def _write_window(x: Any, window: Window, value: Any) -> Any:
  starts, sizes, _ = window
  block = lax.reshape(lax.convert_element_type(value, x.dtype), tuple(sizes))
  return lax.dynamic_update_slice(x, block, starts, allow_negative_indices=False)


def _window(shape: tuple[int, ...], transforms: Sequence[Any] | None) -> Window | None:
  """The one window of an array of `shape` that `transforms` select, or None where
  they are not all unit-stride slices and scalar indices of static size (or the shape
  is symbolic, as under `jax.export`)."""
  if not all(isinstance(n, int) for n in shape):
    return None
  starts: list[Any] = [0] * len(shape)
  sizes = list(shape)
  visible = list(range(len(shape)))   # base dimension of each dimension of the view
  for t in transforms or ():
    if t is None:
      continue
    if not isinstance(t, internals.NDIndexer) or len(t.indices) != len(visible):
      return None
    still_visible = []
    for d, index in zip(visible, t.indices):
      if isinstance(index, internals.Slice):
        if index.stride != 1 or not isinstance(index.size, (int, np.integer)):
          return None
        size, start = int(index.size), index.start
        still_visible.append(d)
      elif np.shape(index) == ():
        size, start = 1, index
      else:
        return None
      starts[d] = _offset(starts[d], _fitted(start, sizes[d], size))
      sizes[d] = size
    visible = still_visible
  return starts, sizes, tuple(sizes[d] for d in visible)


def _fitted(start: Any, extent: int, size: int) -> Any:
  """`start` in a dimension of `extent`, as a dynamic slice of `size` takes it:
  negative starts count from the end, then the window is clamped inside."""
  if isinstance(start, (int, np.integer)):
    start = int(start)
    start = start + extent if start < 0 else start
    return min(max(start, 0), extent - size)
  start = lax.convert_element_type(start, np.int32)
  wrapped = lax.select(lax.lt(start, np.int32(0)), lax.add(start, np.int32(extent)), start)
  return lax.clamp(np.int32(0), wrapped, np.int32(extent - size))


def _offset(base: Any, start: Any) -> Any:
  if isinstance(base, int) and base == 0:
    return start
  if isinstance(base, int) and isinstance(start, int):
    return base + start
  return lax.add(lax.convert_element_type(base, np.int32),
                 lax.convert_element_type(start, np.int32))
