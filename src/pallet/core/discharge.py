"""What a kernel's loads and stores through ref views mean once its refs become
values: pallet's discharge of a jaxpr over refs into a pure function.

Every backend runs the discharged kernel (the XLA backend compiles it; index maps,
regions and checking mode evaluate discharged pieces), so this is the one place
where pallet departs from JAX's discharge rules, and only in three ways:

* Views chained with `.at[...]` read and write one window of the base array
  (`ref_views`). JAX applies the views one after another: a store through
  `buf.at[slot][i] = v` (a double-buffered TPU scratch) slices out the whole slot,
  updates it and writes it back, which XLA cannot do in place, so every such store
  in a loop copied the slot; and on jaxlib 0.10 XLA folded the nested dynamic slices
  into one and dropped the first one's clamp, reading the wrong element for a traced
  start clamped by one view and indexed by the next. A single view keeps JAX's rule,
  which is as short.
* A store through a reshaped or bitcast view (`ref.reshape(...)[...] = v`) is written
  back one view at a time, bitcast chains as unsigned integers (`ref_views`): JAX
  0.10's rule refuses it, and jaxlib 0.10 changes bits of bfloat16 arrays it updates.
* A load `ref[pl.ds(i, n, 0)]` reads element i n times (a TPU sublane broadcast: a
  scale row repeated over 8 sublanes). JAX's rule slices with stride 0 and divides by
  zero; here it is a read of element i, broadcast.

Everything else is JAX's own rule (`_internals.discharge_state` restores them after).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
from jax import lax

from pallet import _internals as internals
from pallet.core import ref_views


def discharge_state(closed_jaxpr: Any) -> Any:
  """Pure version of a jaxpr over refs: ref inputs become values, their final values
  are appended to the outputs."""
  return internals.discharge_state(closed_jaxpr, load=_load, store=_store)


def _chained(transforms: Sequence[Any]) -> bool:
  return sum(t is not None for t in transforms) > 1


def _load(x: Any, transforms: Sequence[Any]) -> Any:
  once = _read_once(transforms)
  if once is not None:
    view, repeats = once
    y = ref_views.read(x, view)
    for axis, size in repeats:
      shape = list(y.shape)
      shape[axis] = size
      y = lax.broadcast_in_dim(y, tuple(shape), tuple(range(y.ndim)))
    return y
  return ref_views.read(x, transforms) if _chained(transforms) else None


def _store(x: Any, transforms: Sequence[Any], value: Any) -> tuple[Any, Any] | None:
  reinterpreted = any(isinstance(t, (internals.ReshapeTransform, internals.BitcastTransform))
                      for t in transforms)
  return (ref_views.swap(x, transforms, value) if _chained(transforms) or reinterpreted
          else None)


def _read_once(transforms: Sequence[Any]) -> tuple[Any, list[tuple[int, int]]] | None:
  """(`transforms` with every stride-0 slice of their last indexer made a one-element
  slice, [(axis of the result, repeats)]), or None where there is no such slice (or
  integer-array indices reorder the result's axes)."""
  last = transforms[-1] if transforms else None
  if not isinstance(last, internals.NDIndexer) or not any(
      isinstance(i, internals.Slice) and isinstance(i.stride, int) and i.stride == 0
      for i in last.indices):
    return None
  indices, repeats, axis = [], [], 0
  for i in last.indices:
    if isinstance(i, internals.Slice):
      if i.stride == 0:
        indices.append(internals.Slice(i.start, 1, 1))
        repeats.append((axis, i.size))
      else:
        indices.append(i)
      axis += 1
    elif jax.numpy.shape(i) == ():
      indices.append(i)
    else:
      return None
  return [*transforms[:-1], dataclasses.replace(last, indices=tuple(indices))], repeats
