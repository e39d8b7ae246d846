"""Functions over NamedArrays: constructors, elementwise maps, reductions, `dot`, `where`."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax.numpy as jnp

from pallet.named.array import NamedArray, align, binary, reduce
from pallet.named.axis import Axis, AxisSelector, AxisSpec, as_axes, axis_names

# --- constructors ----------------------------------------------------------------


def full(axes: AxisSpec, fill_value: Any, dtype: Any = None) -> NamedArray:
  axes = as_axes(axes)
  return NamedArray(jnp.full([ax.size for ax in axes], fill_value, dtype), axes)


def zeros(axes: AxisSpec, dtype: Any = None) -> NamedArray:
  return full(axes, 0, jnp.float32 if dtype is None else dtype)


def ones(axes: AxisSpec, dtype: Any = None) -> NamedArray:
  return full(axes, 1, jnp.float32 if dtype is None else dtype)


def zeros_like(x: NamedArray, dtype: Any = None) -> NamedArray:
  return full(x.axes, 0, x.dtype if dtype is None else dtype)


def ones_like(x: NamedArray, dtype: Any = None) -> NamedArray:
  return full(x.axes, 1, x.dtype if dtype is None else dtype)


def full_like(x: NamedArray, fill_value: Any, dtype: Any = None) -> NamedArray:
  return full(x.axes, fill_value, x.dtype if dtype is None else dtype)


def arange(axis: Axis, start: Any = 0, step: Any = 1, dtype: Any = None) -> NamedArray:
  """`start, start + step, ...` along `axis` (axis.size values)."""
  values = start + step * jnp.arange(axis.size, dtype=dtype)
  return NamedArray(values if dtype is None else values.astype(dtype), (axis,))


# --- elementwise -------------------------------------------------------------------


def _unary(fn: Callable) -> Callable[[NamedArray], NamedArray]:
  def apply(x: NamedArray) -> NamedArray:
    if not isinstance(x, NamedArray):
      raise TypeError(f"{fn.__name__}: expected a NamedArray, got {type(x).__name__}")
    return NamedArray(fn(x.array), x.axes)
  apply.__name__ = fn.__name__
  apply.__doc__ = f"Elementwise `jnp.{fn.__name__}`, axes unchanged."
  return apply


sin = _unary(jnp.sin)
cos = _unary(jnp.cos)
tanh = _unary(jnp.tanh)
exp = _unary(jnp.exp)
log = _unary(jnp.log)
sqrt = _unary(jnp.sqrt)
abs = _unary(jnp.abs)  # noqa: A001 - mirrors jnp.abs
square = _unary(jnp.square)


def maximum(a: Any, b: Any) -> NamedArray:
  return binary(jnp.maximum, a, b)


def minimum(a: Any, b: Any) -> NamedArray:
  return binary(jnp.minimum, a, b)


def where(condition: Any, x: Any, y: Any) -> NamedArray:
  """Elementwise choice, all three operands aligned by name."""
  axes, raws = align(condition, x, y, op_name="where")
  return NamedArray(jnp.where(*raws), axes)


# --- reductions -------------------------------------------------------------------

AxisArg = AxisSelector | Sequence[AxisSelector] | None


def sum(x: NamedArray, axis: AxisArg = None) -> NamedArray:  # noqa: A001
  return reduce(jnp.sum, x, axis)


def mean(x: NamedArray, axis: AxisArg = None) -> NamedArray:
  return reduce(jnp.mean, x, axis)


def max(x: NamedArray, axis: AxisArg = None) -> NamedArray:  # noqa: A001
  return reduce(jnp.max, x, axis)


def min(x: NamedArray, axis: AxisArg = None) -> NamedArray:  # noqa: A001
  return reduce(jnp.min, x, axis)


# --- contraction ------------------------------------------------------------------


def dot(*arrays: NamedArray, axis: AxisSelector | Sequence[AxisSelector],
        preferred_element_type: Any = None) -> NamedArray:
  """Multiplies the operands aligned by name and sums over `axis`: `dot(q, k, axis="feature")`.

  Axes shared by operands but not contracted are batch axes; the result keeps every
  non-contracted axis in order of first appearance.
  """
  contracted = set(axis_names(axis))
  for name in contracted:
    if not any(name in x.names for x in arrays):
      raise ValueError(f"dot: axis {name!r} is in none of the operands "
                       f"{[x.names for x in arrays]}")
  letters: dict[str, str] = {}
  sizes: dict[str, int] = {}
  for x in arrays:
    for ax in x.axes:
      if ax.name in sizes and sizes[ax.name] != ax.size:
        raise ValueError(f"dot: axis {ax.name!r} has sizes {sizes[ax.name]} and {ax.size}")
      sizes[ax.name] = ax.size
      letters.setdefault(ax.name, chr(ord("a") + len(letters)))
  kept = [name for name in letters if name not in contracted]
  spec = ",".join("".join(letters[n] for n in x.names) for x in arrays)
  spec += "->" + "".join(letters[n] for n in kept)
  out = jnp.einsum(spec, *(x.array for x in arrays),
                   preferred_element_type=preferred_element_type)
  return NamedArray(out, [Axis(n, sizes[n]) for n in kept])
