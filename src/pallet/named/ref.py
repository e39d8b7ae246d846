"""NamedRef: a named view on a JAX ref (`jax.new_ref` / `jax.ref.get` / `jax.ref.swap`).

A NamedRef holds the JAX ref, the axes of the whole buffer and a staged *prefix*: one
entry per buffer axis (a window, a fixed position, or the full axis). Every read and
write composes the caller's selection with that prefix into one index on the buffer,
so a slice ref costs nothing until it is used and all aliases see the same data.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallet.named import selection
from pallet.named.array import NamedArray, named
from pallet.named.axis import Axis, AxisSelector, axes_shape


class NamedRef:
  """A mutable, named view on a JAX ref; reads give NamedArrays, writes align by name."""
  __slots__ = ("ref", "base_axes", "prefix")

  def __init__(self, ref: Any, axes: Sequence[Axis], prefix: Sequence[selection.Entry] | None = None):
    axes = tuple(axes)
    if tuple(ref.shape) != tuple(ax.size for ax in axes):
      raise ValueError(f"NamedRef: ref of shape {tuple(ref.shape)} does not match axes {axes}")
    self.ref = ref
    self.base_axes = axes
    self.prefix = selection.full_prefix(axes) if prefix is None else tuple(prefix)

  @classmethod
  def _unchecked(cls, ref: Any, axes: tuple[Axis, ...], prefix: tuple) -> "NamedRef":
    out = object.__new__(cls)
    out.ref, out.base_axes, out.prefix = ref, axes, prefix
    return out

  # --- shape of the view -----------------------------------------------------------
  @property
  def axes(self) -> tuple[Axis, ...]:
    return selection.view_axes(self.base_axes, self.prefix)

  @property
  def shape(self) -> dict[str, int]:
    return axes_shape(self.axes)

  @property
  def ndim(self) -> int:
    return len(self.axes)

  @property
  def dtype(self) -> Any:
    return self.ref.dtype

  def __repr__(self) -> str:
    names = ", ".join(f"{ax.name}={ax.size}" for ax in self.axes)
    return f"NamedRef({names}; dtype={self.dtype})"

  # --- views -----------------------------------------------------------------------
  def slice(self, sel: Any) -> "NamedRef":
    """A ref on the same buffer with `sel` staged (ints and slices/ds only)."""
    entries = selection.compose(self.base_axes, self.prefix, sel, allow_arrays=False)
    return NamedRef._unchecked(self.ref, self.base_axes, entries)

  def unsliced(self) -> "NamedRef":
    """The whole buffer again, without any staged prefix."""
    return NamedRef._unchecked(self.ref, self.base_axes, selection.full_prefix(self.base_axes))

  # --- reads and writes ------------------------------------------------------------
  def _target(self, sel: Any):
    entries = selection.compose(self.base_axes, self.prefix, sel, allow_arrays=True)
    raw_axes = selection.result_axes(self.base_axes, entries)
    shown_axes = selection.user_axes(self.base_axes, self.prefix, entries)
    return selection.ref_index(entries), raw_axes, shown_axes

  def get(self, sel: Any = ...) -> NamedArray:
    index, raw_axes, shown_axes = self._target(sel)
    raw = NamedArray(jax.ref.get(self.ref, index), raw_axes)
    return raw.rearrange([ax.name for ax in shown_axes])

  def swap(self, sel: Any, value: Any) -> NamedArray:
    """Stores `value` at `sel` and returns what was there."""
    index, raw_axes, shown_axes = self._target(sel)
    new = _value_for(value, raw_axes, shown_axes, self.dtype)
    old = NamedArray(jax.ref.swap(self.ref, index, new), raw_axes)
    return old.rearrange([ax.name for ax in shown_axes])

  def set(self, sel: Any, value: Any) -> None:
    index, raw_axes, shown_axes = self._target(sel)
    jax.ref.set(self.ref, index, _value_for(value, raw_axes, shown_axes, self.dtype))

  __getitem__ = get
  __setitem__ = set

  def value(self) -> NamedArray:
    """The current contents of this view."""
    return self.get(...)

  def freeze(self) -> NamedArray:
    """A snapshot of the view; the ref stays usable and later writes do not reach it."""
    return self.get(...)


# --- pytree: the JAX ref is the only leaf; axes and prefix are static structure ----------


class _RefStructure:
  """Static part of a NamedRef. Hashing it (as jit does for arguments) needs a static prefix."""
  __slots__ = ("axes", "prefix")

  def __init__(self, axes: tuple[Axis, ...], prefix: tuple):
    self.axes, self.prefix = axes, prefix

  def _key(self) -> tuple:
    for entry in self.prefix:
      for field in (entry.start,) if isinstance(entry, selection.Range) else (entry.index,):
        if selection.is_dynamic(field):
          raise TypeError(
              "a NamedRef whose slice prefix holds a traced index cannot be passed into a "
              "transformed function; pass the unsliced ref (or call .slice inside)")
    return (self.axes, self.prefix)

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, _RefStructure) and (
        (self.axes, self.prefix) is (other.axes, other.prefix) or self._key() == other._key())

  def __hash__(self) -> int:
    return hash(self._key())

  def __repr__(self) -> str:
    return f"axes={self.axes}, prefix={self.prefix}"


def _flatten(r: NamedRef):
  return (r.ref,), _RefStructure(r.base_axes, r.prefix)


def _unflatten(structure: _RefStructure, children) -> NamedRef:
  return NamedRef._unchecked(children[0], structure.axes, structure.prefix)


jax.tree_util.register_pytree_node(NamedRef, _flatten, _unflatten)


# --- writing: align a value to the selected region -------------------------------------

_KIND_RANK = ((jnp.bool_, 0), (jnp.integer, 1), (jnp.floating, 2), (jnp.complexfloating, 3))


def _kind(dtype: Any) -> int:
  for kind, rank in _KIND_RANK:
    if jnp.issubdtype(dtype, kind):
      return rank
  raise TypeError(f"unsupported dtype {dtype}")


def _check_castable(src: Any, dst: Any) -> None:
  """Allow casts within a kind or to a wider kind (int -> float), never float -> int."""
  if _kind(src) > _kind(dst):
    raise TypeError(f"cannot write a {np.dtype(src).name} value into a "
                    f"{np.dtype(dst).name} ref: the conversion would lose information")


def _value_for(value: Any, raw_axes: tuple[Axis, ...], shown_axes: tuple[Axis, ...],
               dtype: Any) -> jax.Array:
  """`value` as a raw array laid out like the buffer region `raw_axes` describes."""
  if isinstance(value, NamedArray):
    names = [ax.name for ax in raw_axes]
    for ax in value.axes:
      if ax.name not in names:
        raise ValueError(f"cannot write a value with axes {value.names} into a selection with "
                         f"axes {tuple(names)}: axis {ax.name!r} is not in the target")
      target = raw_axes[names.index(ax.name)]
      if target.size != ax.size:
        raise ValueError(f"cannot write a value with axes {value.axes} into a selection with "
                         f"axes {raw_axes}: axis {ax.name!r} has size {ax.size}, the target "
                         f"{target.size}")
    value_named = value
  elif isinstance(value, (bool, int, float, complex)):
    _check_castable(jnp.result_type(type(value)), dtype)
    return jnp.full([ax.size for ax in raw_axes], value, dtype)
  else:
    raw = jnp.asarray(value)
    if raw.ndim == 0:
      value_named = NamedArray(raw, ())
    elif raw.shape == tuple(ax.size for ax in shown_axes):
      value_named = NamedArray(raw, shown_axes)
    else:
      raise ValueError(f"cannot write an unnamed array of shape {raw.shape} into a selection "
                       f"with axes {shown_axes}: shapes differ (use a NamedArray to write by "
                       "name)")
  _check_castable(value_named.dtype, dtype)
  return value_named.astype(dtype).broadcast_to(raw_axes).array


# --- functional spelling -------------------------------------------------------------------


def new_ref(x: Any, axes: Sequence[AxisSelector] | None = None) -> NamedRef:
  """A fresh mutable buffer holding `x` (a NamedArray, or a raw array plus its axes)."""
  if isinstance(x, NamedArray):
    if axes is not None:
      raise TypeError("new_ref: axes are taken from the NamedArray; do not pass axes too")
  elif axes is None:
    raise TypeError("new_ref: a raw array needs its axes, e.g. new_ref(x, (Batch, Feature))")
  else:
    x = named(x, axes)
  return NamedRef(jax.new_ref(x.array), x.axes)


def get(ref: NamedRef, sel: Any = ...) -> NamedArray:
  """`ref[sel]`, as a function."""
  return ref.get(sel)


def swap(ref: NamedRef, sel: Any, value: Any) -> NamedArray:
  """Stores `value` at `sel` and returns the previous contents."""
  return ref.swap(sel, value)


def freeze(ref: NamedRef) -> NamedArray:
  """A snapshot of the ref's view (the ref stays usable)."""
  return ref.freeze()
