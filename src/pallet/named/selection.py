"""From a named selection to the raw index a JAX array or ref understands.

A selection is `...`, a dict `{axis: indexer}`, or a positional tuple (with at most
one `...`) over the axes in order. Each selected axis is *composed* with what was
already staged for it: a strided window `Range` (possibly the full axis), a `Fixed`
position (the axis disappears), or a `Gather` of positions (integer arrays; the axis is
replaced by the indexer's own axes). All positions are kept in coordinates of the
underlying buffer, so a slice of a slice is one `Range` again:
`slice(1, 9, 2)` then `slice(1, 3)` is `Range(start=3, size=2, stride=2)`.

Result axes follow NumPy placement: slices are basic indexing; once an array indexer is
present, integers and arrays are advanced indices whose broadcast axes go where the
first of them was when they are adjacent, and in front otherwise.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallet import _internals
from pallet.named.axis import AxesArray, Axis, axis_name, laid_out, union_axes


@dataclasses.dataclass(frozen=True)
class Range:
  """Positions start, start + stride, ..., size of them (start may be traced)."""
  start: Any
  size: int
  stride: int


@dataclasses.dataclass(frozen=True)
class Fixed:
  """A single position; the axis is dropped (the index may be traced)."""
  index: Any


@dataclasses.dataclass(frozen=True, eq=False)
class Gather:
  """Integer positions laid out over `axes` (advanced indexing)."""
  positions: Any
  axes: tuple[Axis, ...]


Entry = Range | Fixed | Gather


def full_prefix(axes: Sequence[Axis]) -> tuple[Entry, ...]:
  return tuple(Range(0, ax.size, 1) for ax in axes)


def view_axes(base_axes: Sequence[Axis], prefix: Sequence[Entry]) -> tuple[Axis, ...]:
  """Axes visible through a prefix: fixed axes vanish, windows resize theirs."""
  return tuple(ax.resize(p.size) for ax, p in zip(base_axes, prefix) if isinstance(p, Range))


def is_dynamic(x: Any) -> bool:
  return _internals.is_tracer(x)


def _is_ds(idx: Any) -> bool:
  return (not isinstance(idx, slice) and hasattr(idx, "start") and hasattr(idx, "size")
          and hasattr(idx, "stride"))


def _static_int(x: Any) -> int | None:
  """x as a Python int when it is a concrete integer, else None."""
  if isinstance(x, (bool, np.bool_)):
    return None
  if isinstance(x, (int, np.integer)):
    return int(x)
  if isinstance(x, (jax.Array, np.ndarray)) and not is_dynamic(x) and x.ndim == 0 \
      and jnp.issubdtype(x.dtype, jnp.integer):
    return int(x)
  return None


def _traced_int(x: Any, name: str) -> Any:
  if not (is_dynamic(x) and x.ndim == 0 and jnp.issubdtype(x.dtype, jnp.integer)):
    raise TypeError(f"axis {name!r}: expected an integer scalar, got {x!r}")
  return x


def _wrap_negative(i: Any, size: int) -> Any:
  return jnp.where(i < 0, i + size, i)


def resolve(selection: Any, axes: Sequence[Axis], fixed_names: Sequence[str] = ()
            ) -> dict[int, Any]:
  """Which indexer applies to which axis (by position in `axes`)."""
  if selection is Ellipsis:
    return {}
  names = [ax.name for ax in axes]
  if isinstance(selection, Mapping):
    chosen: dict[int, Any] = {}
    for key, idx in selection.items():
      if key is Ellipsis:
        if idx is not Ellipsis:
          raise TypeError("an Ellipsis key must map to ... (it stands for the remaining axes)")
        continue
      name = axis_name(key)
      if name in fixed_names:
        raise IndexError(f"axis {name!r} is already fixed by an integer in this slice ref's "
                         "prefix and cannot be indexed again")
      if name not in names:
        raise ValueError(f"unknown axis {name!r}; the axes are {tuple(names)}")
      pos = names.index(name)
      if pos in chosen:
        raise ValueError(f"axis {name!r} is selected twice in {selection!r}")
      chosen[pos] = idx
    return chosen
  items = selection if isinstance(selection, tuple) else (selection,)
  n_ellipsis = sum(1 for i in items if i is Ellipsis)
  if n_ellipsis > 1:
    raise IndexError("a selection can contain at most one ... (ellipsis)")
  explicit = len(items) - n_ellipsis
  if explicit > len(axes):
    raise IndexError(f"too many indices: {explicit} given for axes {tuple(names)}")
  chosen = {}
  pos = 0
  for idx in items:
    if idx is Ellipsis:
      pos += len(axes) - explicit  # the ellipsis covers the axes nobody named
      continue
    chosen[pos] = idx
    pos += 1
  return chosen


def compose_one(name: str, window: Range, idx: Any, allow_arrays: bool) -> Entry:
  """Applies one indexer to an axis currently seen through `window`."""
  n, start, stride = window.size, window.start, window.stride
  if isinstance(idx, AxesArray):
    if not allow_arrays:
      raise NotImplementedError(
          f"axis {name!r}: array indexers cannot be staged in a slice ref; index with them "
          "at call time instead")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
      raise TypeError(f"axis {name!r}: a NamedArray indexer must hold integers, got {idx.dtype}")
    return Gather(start + _wrap_negative(idx.array, n) * stride, idx.axes)
  if isinstance(idx, slice):
    for bound in (idx.start, idx.stop, idx.step):
      if bound is not None and _static_int(bound) is None:
        raise TypeError(f"axis {name!r}: slice bounds must be static ints, got {idx!r}; "
                        "use ds(start, size) for a traced start")
    if idx.step is not None and _static_int(idx.step) <= 0:
      raise ValueError(f"axis {name!r}: slice step must be positive, got {idx!r}")
    picked = range(n)[slice(*(None if b is None else _static_int(b)
                               for b in (idx.start, idx.stop, idx.step)))]
    return Range(start + picked.start * stride, len(picked), stride * picked.step)
  if _is_ds(idx):
    size, step = _static_int(idx.size), _static_int(idx.stride)
    if size is None or size < 0 or step is None or step < 1:
      raise TypeError(f"axis {name!r}: ds needs a static size >= 0 and stride >= 1, got "
                      f"size={idx.size!r}, stride={idx.stride!r}")
    first = _static_int(idx.start)
    if first is None:
      first = _traced_int(idx.start, name)
    elif first < 0 or (size > 0 and first + (size - 1) * step >= n) or first > n:
      raise IndexError(f"ds(start={first}, size={size}, stride={step}) is out of range for "
                       f"axis {name!r} of size {n}")
    return Range(start + first * stride, size, stride * step)
  if isinstance(idx, (list, tuple)):
    idx = np.asarray(idx)
  static = _static_int(idx)
  if static is not None:
    if not -n <= static < n:
      raise IndexError(f"index {static} is out of range for axis {name!r} of size {n}")
    return Fixed(start + (static % n) * stride)
  if isinstance(idx, (jax.Array, np.ndarray)):
    if not jnp.issubdtype(idx.dtype, jnp.integer):
      raise TypeError(f"axis {name!r}: array indexers must hold integers, got dtype {idx.dtype}")
    if idx.ndim == 0:
      return Fixed(start + _wrap_negative(idx, n) * stride)
    if not allow_arrays:
      raise NotImplementedError(
          f"axis {name!r}: array indexers cannot be staged in a slice ref; index with them "
          "at call time instead")
    if idx.ndim != 1:
      raise TypeError(f"axis {name!r}: an unnamed integer array indexer must be 0-d or 1-d "
                      f"(got shape {idx.shape}); use a NamedArray indexer to name its axes")
    return Gather(start + _wrap_negative(jnp.asarray(idx), n) * stride,
                  (Axis(name, idx.shape[0]),))
  raise TypeError(f"axis {name!r}: unsupported indexer {idx!r}; expected an int, a slice, "
                  "ds(start, size, stride), an integer array or a NamedArray")


def compose(base_axes: Sequence[Axis], prefix: Sequence[Entry], selection: Any, *,
            allow_arrays: bool) -> tuple[Entry, ...]:
  """The prefix with `selection` (written against the prefix's view) folded in."""
  windows = [(b, p) for b, p in enumerate(prefix) if isinstance(p, Range)]
  shown = [base_axes[b].resize(p.size) for b, p in windows]
  fixed = [base_axes[b].name for b, p in enumerate(prefix) if not isinstance(p, Range)]
  entries = list(prefix)
  for pos, idx in resolve(selection, shown, fixed).items():
    b, window = windows[pos]
    entries[b] = compose_one(base_axes[b].name, window, idx, allow_arrays)
  return tuple(entries)


def result_axes(base_axes: Sequence[Axis], entries: Sequence[Entry]) -> tuple[Axis, ...]:
  """Axes of `buffer[entries]` under NumPy's placement rules."""
  gathers = [e for e in entries if isinstance(e, Gather)]
  basic = [ax.resize(e.size) for ax, e in zip(base_axes, entries) if isinstance(e, Range)]
  if not gathers:
    out = tuple(basic)
  else:
    advanced_axes = union_axes(*(g.axes for g in gathers))
    advanced = [i for i, e in enumerate(entries) if not isinstance(e, Range)]
    if advanced == list(range(advanced[0], advanced[-1] + 1)):
      before = sum(1 for e in entries[:advanced[0]] if isinstance(e, Range))
      out = tuple(basic[:before]) + advanced_axes + tuple(basic[before:])
    else:
      out = advanced_axes + tuple(basic)
  names = [ax.name for ax in out]
  for name in names:
    if names.count(name) > 1:
      raise ValueError(f"indexing would produce axis {name!r} twice (result axes {names}); "
                       "rename the indexer's axes")
  return out


def user_axes(base_axes: Sequence[Axis], prefix: Sequence[Entry],
              entries: Sequence[Entry]) -> tuple[Axis, ...]:
  """Result axes as NumPy would lay them out indexing the *view* (prefix-fixed axes absent)."""
  shown = [(ax, e) for ax, p, e in zip(base_axes, prefix, entries) if isinstance(p, Range)]
  return result_axes([ax for ax, _ in shown], [e for _, e in shown])


def _gather_positions(entries: Sequence[Entry]) -> dict[int, Any]:
  """Each Gather's positions laid out to broadcast over the union of all Gathers' axes."""
  gathers = {i: e for i, e in enumerate(entries) if isinstance(e, Gather)}
  union = union_axes(*(g.axes for g in gathers.values()))
  return {i: laid_out(jnp.asarray(g.positions), g.axes, union)
          for i, g in gathers.items()}


def _static_slice(r: Range) -> slice:
  return slice(r.start, r.start + (r.size - 1) * r.stride + 1 if r.size else r.start, r.stride)


def ref_index(entries: Sequence[Entry]) -> tuple:
  """The index tuple for `jax.ref.get/swap` on the underlying buffer."""
  gathered = _gather_positions(entries)
  index = []
  for i, e in enumerate(entries):
    if isinstance(e, Range):
      index.append(_internals.Slice(e.start, e.size, e.stride) if is_dynamic(e.start)
                   else _static_slice(e))
    elif isinstance(e, Fixed):
      index.append(e.index)
    else:
      index.append(gathered[i])
  return tuple(index)
