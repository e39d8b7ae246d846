"""Named axes: the vocabulary every named array, ref and kernel spec is written in."""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence, Union

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Axis:
  """A dimension identified by its name; the size travels with it so shapes can be built."""
  name: str
  size: int

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise TypeError(f"Axis name must be a non-empty string, got {self.name!r}")
    if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 0:
      raise TypeError(f"Axis {self.name!r}: size must be a non-negative int, got {self.size!r}")

  def resize(self, size: int) -> "Axis":
    """The same-named axis with another size (e.g. a window of it)."""
    return Axis(self.name, size)

  def __repr__(self) -> str:
    return f"Axis({self.name!r}, {self.size})"


AxisSpec = Union[Axis, Sequence[Axis], Mapping[str, int]]
AxisSelector = Union[Axis, str]


def make_axes(**sizes: int) -> tuple[Axis, ...]:
  """`Batch, Feature = make_axes(Batch=4, Feature=8)`: axes in keyword order."""
  return tuple(Axis(name, size) for name, size in sizes.items())


def axis_name(axis: AxisSelector) -> str:
  if isinstance(axis, Axis):
    return axis.name
  if isinstance(axis, str):
    return axis
  raise TypeError(f"expected an Axis or an axis name, got {axis!r}")


def axis_names(selectors: AxisSelector | Sequence[AxisSelector]) -> tuple[str, ...]:
  """Names from one axis selector or a sequence of them (as reductions and `dot` take)."""
  if isinstance(selectors, (list, tuple)):
    return tuple(axis_name(s) for s in selectors)
  return (axis_name(selectors),)


def as_axes(spec: AxisSpec) -> tuple[Axis, ...]:
  """Normalises the ways a shape can be written (one Axis, several, or {name: size})."""
  if isinstance(spec, Axis):
    axes = (spec,)
  elif isinstance(spec, Mapping):
    axes = tuple(Axis(name, size) for name, size in spec.items())
  elif isinstance(spec, Sequence) and not isinstance(spec, str):
    axes = tuple(spec)
    for ax in axes:
      if not isinstance(ax, Axis):
        raise TypeError(f"expected a sequence of Axis, got element {ax!r} in {spec!r}")
  else:
    raise TypeError(f"expected an Axis, a sequence of Axis or a {{name: size}} dict, got {spec!r}")
  check_unique(axes)
  return axes


def check_unique(axes: Sequence[Axis]) -> None:
  names = [ax.name for ax in axes]
  for name in names:
    if names.count(name) > 1:
      raise ValueError(f"axis names must be unique, {name!r} appears twice in {tuple(axes)}")


def axes_shape(axes: Sequence[Axis]) -> dict[str, int]:
  return {ax.name: ax.size for ax in axes}


def find_axis(axes: Sequence[Axis], selector: AxisSelector) -> int:
  """Position of an axis by name; unknown names raise ValueError listing the axes that exist."""
  name = axis_name(selector)
  for i, ax in enumerate(axes):
    if ax.name == name:
      return i
  raise ValueError(f"unknown axis {name!r}; the axes are {tuple(ax.name for ax in axes)}")

def union_axes(*axes_lists: Sequence[Axis]) -> tuple[Axis, ...]:
  """Axes of a name-aligned result: the first operand's axes, then new ones in order seen."""
  out: dict[str, Axis] = {}
  for axes in axes_lists:
    for ax in axes:
      seen = out.get(ax.name)
      if seen is None:
        out[ax.name] = ax
      elif seen.size != ax.size:
        raise ValueError(f"axis {ax.name!r} has size {seen.size} in one operand and "
                         f"{ax.size} in another")
  return tuple(out.values())


class AxesArray:
  """An array whose dimensions are named `Axis`es: what indexing (selection.py) needs of
  a NamedArray indexer (its raw `array` and its `axes`). NamedArray is the one kind;
  the base lets selection.py, which array.py builds on, recognize it."""
  __slots__ = ()


def laid_out(array: jax.Array, axes: Sequence[Axis], target: Sequence[Axis]) -> jax.Array:
  """`array` (dimensions `axes`, each one of `target`) transposed into `target`'s order
  with size-1 dimensions for the axes it lacks: it broadcasts against `target`."""
  names = [ax.name for ax in axes]
  order = [names.index(ax.name) for ax in target if ax.name in names]
  if order != list(range(len(order))):
    array = jnp.transpose(array, order)
  return jnp.reshape(array, [ax.size if ax.name in names else 1 for ax in target])
