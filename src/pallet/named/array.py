"""NamedArray: an immutable JAX array whose dimensions are addressed by name.

Only what named refs and named kernels need lives here: construction, alignment of
operands by axis name (transpose, broadcast), `rearrange`, `astype`, dict indexing and
the Python operators. Functions over named arrays (reductions, `exp`, `dot`, ...) are in
`ops.py`.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallet.named import selection as _selection
from pallet.named.axis import (AxesArray, Axis, AxisSelector, axes_shape, axis_name,
                               axis_names, check_unique, find_axis, union_axes)


class NamedArray(AxesArray):
  """A JAX array plus one uniquely named `Axis` per dimension (a pytree with one leaf)."""
  __slots__ = ("array", "axes")
  __array_priority__ = 100  # numpy scalars defer to our reflected operators
  __hash__ = None  # `==` is elementwise

  def __init__(self, array: Any, axes: Sequence[Axis]):
    array = jnp.asarray(array)
    axes = tuple(axes)
    for ax in axes:
      if not isinstance(ax, Axis):
        raise TypeError(f"NamedArray axes must be Axis objects, got {ax!r}")
    check_unique(axes)
    if array.shape != tuple(ax.size for ax in axes):
      raise ValueError(f"array of shape {array.shape} does not match axes {axes}")
    self.array = array
    self.axes = axes

  @classmethod
  def _unchecked(cls, array: Any, axes: tuple[Axis, ...]) -> "NamedArray":
    # pytree unflattening may carry placeholders (None, object()) instead of arrays
    out = object.__new__(cls)
    out.array = array
    out.axes = axes
    return out

  # --- shape --------------------------------------------------------------------
  @property
  def shape(self) -> dict[str, int]:
    return axes_shape(self.axes)

  @property
  def dtype(self) -> Any:
    return self.array.dtype

  @property
  def ndim(self) -> int:
    return len(self.axes)

  @property
  def size(self) -> int:
    return int(np.prod([ax.size for ax in self.axes], dtype=np.int64))

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(ax.name for ax in self.axes)

  def axis(self, selector: AxisSelector) -> Axis:
    """The Axis (with its size) called `selector`."""
    return self.axes[find_axis(self.axes, selector)]

  def __repr__(self) -> str:
    names = ", ".join(f"{ax.name}={ax.size}" for ax in self.axes)
    return f"NamedArray({names}; dtype={self.dtype},\n{self.array})"

  def __len__(self):
    raise TypeError("len() of a NamedArray is ambiguous; use .shape[name]")

  def __iter__(self):
    raise TypeError("iterating a NamedArray is ambiguous; index an axis by name instead")

  def item(self) -> Any:
    return self.array.item()

  def __bool__(self) -> bool:
    return bool(self.array)

  # --- structure ----------------------------------------------------------------
  def rearrange(self, axes: Sequence[AxisSelector]) -> "NamedArray":
    """Transposes to the given axis order; `...` stands for the axes not named."""
    names = [a if a is Ellipsis else axis_name(a) for a in axes]
    if names.count(Ellipsis) > 1:
      raise ValueError("rearrange: at most one ... is allowed")
    listed = [n for n in names if n is not Ellipsis]
    for n in listed:
      find_axis(self.axes, n)
      if listed.count(n) > 1:
        raise ValueError(f"rearrange: axis {n!r} is listed twice")
    rest = [ax.name for ax in self.axes if ax.name not in listed]
    if Ellipsis in names:
      at = names.index(Ellipsis)
      listed = listed[:at] + rest + listed[at:]
    elif rest:
      raise ValueError(f"rearrange: axes {tuple(rest)} are missing from {tuple(names)} "
                       "(add ... to keep them in their current order)")
    perm = [find_axis(self.axes, n) for n in listed]
    if perm == list(range(self.ndim)):
      return self
    return NamedArray(jnp.transpose(self.array, perm), [self.axes[p] for p in perm])

  def broadcast_to(self, axes: Sequence[Axis]) -> "NamedArray":
    """This array laid out over `axes` (a superset of its own), repeated along new ones."""
    axes = tuple(axes)
    names = [ax.name for ax in axes]
    for ax in self.axes:
      if ax.name not in names:
        raise ValueError(f"cannot broadcast axes {self.axes} to {axes}: axis {ax.name!r} "
                         "is not in the target")
      target = axes[names.index(ax.name)]
      if target.size != ax.size:
        raise ValueError(f"cannot broadcast axes {self.axes} to {axes}: axis {ax.name!r} "
                         f"has size {ax.size}, the target has {target.size}")
    return NamedArray(jnp.broadcast_to(expand_to(self, axes), [ax.size for ax in axes]), axes)

  def rename(self, mapping: Mapping[AxisSelector, AxisSelector]) -> "NamedArray":
    """Same data, some axes called differently (`{"seq": "key_seq"}`)."""
    renames = {axis_name(k): axis_name(v) for k, v in mapping.items()}
    for old in renames:
      find_axis(self.axes, old)
    return NamedArray(self.array, [Axis(renames.get(ax.name, ax.name), ax.size)
                                   for ax in self.axes])

  def astype(self, dtype: Any) -> "NamedArray":
    return NamedArray(self.array.astype(dtype), self.axes)

  def __getitem__(self, selection: Any) -> "NamedArray":
    return index_array(self, selection)

  # --- operators ------------------------------------------------------------------
  def __neg__(self): return NamedArray(-self.array, self.axes)
  def __pos__(self): return self
  def __abs__(self): return NamedArray(abs(self.array), self.axes)
  def __invert__(self): return NamedArray(~self.array, self.axes)

  def __add__(self, other): return binary(jnp.add, self, other)
  def __radd__(self, other): return binary(jnp.add, other, self)
  def __sub__(self, other): return binary(jnp.subtract, self, other)
  def __rsub__(self, other): return binary(jnp.subtract, other, self)
  def __mul__(self, other): return binary(jnp.multiply, self, other)
  def __rmul__(self, other): return binary(jnp.multiply, other, self)
  def __truediv__(self, other): return binary(jnp.true_divide, self, other)
  def __rtruediv__(self, other): return binary(jnp.true_divide, other, self)
  def __floordiv__(self, other): return binary(jnp.floor_divide, self, other)
  def __rfloordiv__(self, other): return binary(jnp.floor_divide, other, self)
  def __mod__(self, other): return binary(jnp.mod, self, other)
  def __rmod__(self, other): return binary(jnp.mod, other, self)
  def __pow__(self, other): return binary(jnp.power, self, other)
  def __rpow__(self, other): return binary(jnp.power, other, self)
  def __and__(self, other): return binary(jnp.bitwise_and, self, other)
  def __rand__(self, other): return binary(jnp.bitwise_and, other, self)
  def __or__(self, other): return binary(jnp.bitwise_or, self, other)
  def __ror__(self, other): return binary(jnp.bitwise_or, other, self)
  def __xor__(self, other): return binary(jnp.bitwise_xor, self, other)
  def __rxor__(self, other): return binary(jnp.bitwise_xor, other, self)
  def __lt__(self, other): return binary(jnp.less, self, other)
  def __le__(self, other): return binary(jnp.less_equal, self, other)
  def __gt__(self, other): return binary(jnp.greater, self, other)
  def __ge__(self, other): return binary(jnp.greater_equal, self, other)
  def __eq__(self, other): return binary(jnp.equal, self, other)  # type: ignore[override]
  def __ne__(self, other): return binary(jnp.not_equal, self, other)  # type: ignore[override]

  # --- reductions as methods --------------------------------------------------------
  def sum(self, axis=None): return reduce(jnp.sum, self, axis)
  def mean(self, axis=None): return reduce(jnp.mean, self, axis)
  def max(self, axis=None): return reduce(jnp.max, self, axis)
  def min(self, axis=None): return reduce(jnp.min, self, axis)


def _flatten(x: NamedArray):
  return (x.array,), x.axes


def _unflatten(axes, children):
  return NamedArray._unchecked(children[0], axes)


jax.tree_util.register_pytree_node(NamedArray, _flatten, _unflatten)


def named(array: Any, names: AxisSelector | Sequence[AxisSelector]) -> NamedArray:
  """Attaches names to a raw array; sizes come from the array (an Axis must agree)."""
  array = jnp.asarray(array)
  if isinstance(names, (str, Axis)):
    names = (names,)
  names = tuple(names)
  if len(names) != array.ndim:
    raise ValueError(f"named: array of shape {array.shape} needs {array.ndim} names, "
                     f"got {names}")
  axes = []
  for sel, size in zip(names, array.shape):
    if isinstance(sel, Axis) and sel.size != size:
      raise ValueError(f"named: axis {sel.name!r} has size {sel.size} but the array has "
                       f"{size} there (shape {array.shape})")
    axes.append(Axis(axis_name(sel), size))
  return NamedArray(array, axes)


def _as_operand(x: Any, op_name: str) -> NamedArray | Any:
  if isinstance(x, NamedArray):
    return x
  if isinstance(x, (bool, int, float, complex)):
    return x
  arr = jnp.asarray(x)
  if arr.ndim != 0:
    raise TypeError(f"{op_name}: cannot combine a NamedArray with an unnamed array of shape "
                    f"{arr.shape}; give it names with named(array, names)")
  return arr


def align(*operands: Any, op_name: str = "operation") -> tuple[tuple[Axis, ...], list[Any]]:
  """Raw arrays that broadcast against each other, plus the axes of the result."""
  operands = [_as_operand(x, op_name) for x in operands]
  named_ops = [x for x in operands if isinstance(x, NamedArray)]
  axes = union_axes(*(x.axes for x in named_ops))
  return axes, [expand_to(x, axes) if isinstance(x, NamedArray) else x for x in operands]


def expand_to(x: NamedArray, axes: Sequence[Axis]) -> Any:
  """x's raw data transposed into `axes` order with size-1 dims for the axes it lacks,
  ready for NumPy broadcasting against arrays laid out over `axes`."""
  ordered = x.rearrange([ax.name for ax in axes if ax.name in x.names])
  present = set(x.names)
  return jnp.reshape(ordered.array, [ax.size if ax.name in present else 1 for ax in axes])


def binary(fn: Callable, a: Any, b: Any) -> NamedArray:
  axes, (ra, rb) = align(a, b, op_name=getattr(fn, "__name__", "operation"))
  return NamedArray(fn(ra, rb), axes)


def reduce(fn: Callable, x: NamedArray, axis: AxisSelector | Sequence[AxisSelector] | None
           ) -> NamedArray:
  """`fn` over the named axes (all of them when `axis` is None); those axes disappear."""
  if axis is None:
    positions = tuple(range(x.ndim))
  else:
    positions = tuple(find_axis(x.axes, a) for a in axis_names(axis))
  kept = [ax for i, ax in enumerate(x.axes) if i not in positions]
  return NamedArray(fn(x.array, axis=positions), kept)


def index_array(x: "NamedArray", selection: Any) -> "NamedArray":
  """`x[selection]` for a NamedArray (same rules as refs, no staged prefix)."""
  entries = _selection.compose(x.axes, _selection.full_prefix(x.axes), selection,
                               allow_arrays=True)
  raw = x.array
  for dim, e in enumerate(entries):
    if isinstance(e, _selection.Range) and _selection.is_dynamic(e.start):
      # jnp indexing has no traced-start slice; cut the window first, keep the dim
      span = (e.size - 1) * e.stride + 1 if e.size else 0
      raw = jax.lax.dynamic_slice_in_dim(raw, e.start, span, axis=dim)
      entries = entries[:dim] + (_selection.Range(0, e.size, e.stride),) + entries[dim + 1:]
  index = _selection.ref_index(entries)
  return NamedArray(raw[index], _selection.result_axes(x.axes, entries))

