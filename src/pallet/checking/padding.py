"""Edge-block padding: where a block overhangs its array, the lanes past the edge hold
no data. Reading them is fine as long as they stay in their lanes (an elementwise
result there is dropped when the block is written back); the bug is an operation
that mixes them into lanes that hold data: a reduction or a matrix product over
the padded dimension.

Values loaded from such blocks carry a boolean "padding" mask along with them
through the kernel (`Taint`); reductions and products check that no result element
mixes padding with data. Past operations pallet does not follow, the mask is
dropped: that can miss a bug but never reports a false one.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pallet import primitives

_SAME = ("broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "slice",
         "rev")
_REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
               "reduce_or", "reduce_xor", "argmax", "argmin")
_CUMULATIVE = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")


@dataclasses.dataclass(frozen=True)
class Taint:
  mask: Any       # bool, broadcastable to the value: True in padding lanes
  ref: str        # the input whose padding it is


def block_extents(mapping: Any, ids: Sequence[Any], prefetch: Sequence[Any]) -> list | None:
  """Per block dimension (squeezed ones dropped), how many leading lanes hold data at
  this grid step; None when no block of this operand can overhang."""
  overhang = [d.kind == "blocked" and n % d.size != 0
              for d, n in zip(mapping.dims, mapping.array_shape)]
  if mapping.whole or not any(overhang):
    return None
  im = mapping.index_map
  indices = jax.core.eval_jaxpr(im.jaxpr, im.consts, *ids, *prefetch)
  extents = []
  for d, idx, n, hangs in zip(mapping.dims, indices, mapping.array_shape, overhang):
    if d.kind == "squeezed":
      continue
    extents.append(n - idx * d.size if hangs else None)
  return extents


def loaded(extents: list, transforms: Sequence[Any], shape: tuple[int, ...]) -> Any:
  """The padding mask of a load through `transforms` (one indexer, or none)."""
  if not transforms:
    mask = jnp.bool_(False)
    for d, extent in enumerate(extents):
      if extent is not None:
        mask = mask | (lax.broadcasted_iota(jnp.int32, shape, d) >= extent)
    return mask
  if len(transforms) != 1 or not hasattr(transforms[0], "indices"):
    return None
  positions = primitives._indexer_positions(transforms[0])
  mask = jnp.bool_(False)
  for pos, extent in zip(positions, extents):
    if extent is not None:
      mask = mask | (pos >= extent)
  return jnp.broadcast_to(mask, shape)


def _shape(x: Any) -> tuple[int, ...]:
  return tuple(jnp.shape(x))


def propagate(eqn: Any, ins: Sequence[Any], outs: Sequence[Any],
              taints: Sequence[Taint | None]) -> tuple[list, Any, str | None]:
  """(taints of the results, `ok` of a mixing check or None, the ref it concerns)."""
  name, params = eqn.primitive.name, eqn.params
  ref = next(t.ref for t in taints if t is not None)
  masks = [None if t is None else t.mask for t in taints]
  out = outs[0]
  if name in _SAME and masks[0] is not None:
    return [Taint(eqn.primitive.bind(jnp.broadcast_to(masks[0], _shape(ins[0])),
                                     **eqn.params), ref)], None, None
  if name == "convert_element_type" or name == "copy" or name == "copy_p":
    return [taints[0]], None, None
  if name == "select_n":
    cases = [jnp.broadcast_to(m if m is not None else False, _shape(out)) for m in masks[1:]]
    mask = lax.select_n(ins[0], *cases) if len(cases) > 1 else cases[0]
    if masks[0] is not None:
      mask = mask | masks[0]
    return [Taint(mask, ref)], None, None
  if name in _REDUCTIONS and masks[0] is not None:
    axes = tuple(params["axes"])
    mask = jnp.broadcast_to(masks[0], _shape(ins[0]))
    some, every = jnp.any(mask, axis=axes), jnp.all(mask, axis=axes)
    return [Taint(every, ref)] * len(outs), ~(some & ~every), ref
  if name == "dot_general":
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    clean = [jnp.broadcast_to(~m, _shape(x)).astype(jnp.float32) if m is not None else
             jnp.ones(_shape(x), jnp.float32) for m, x in zip(masks, ins)]
    clean_count = lax.dot_general(clean[0], clean[1], ((lc, rc), (lb, rb)),
                                  preferred_element_type=jnp.float32)
    k = 1
    for d in lc:
      k *= _shape(ins[0])[d]
    every = clean_count == 0
    return [Taint(every, ref)], ~((clean_count < k) & ~every), ref
  if name in _CUMULATIVE and masks[0] is not None:
    mask = jnp.broadcast_to(masks[0], _shape(ins[0]))
    axis = params["axis"]
    some = lax.cummax(mask.astype(jnp.int32), axis, reverse=params.get("reverse", False)) > 0
    every = lax.cummin(mask.astype(jnp.int32), axis, reverse=params.get("reverse", False)) > 0
    return [Taint(every, ref)], ~(some & ~every), ref
  if all(_shape(o) == _shape(out) for o in outs) and all(
      _broadcasts(_shape(x), _shape(out)) for x, m in zip(ins, masks) if m is not None):
    tainted = [jnp.broadcast_to(m, _shape(out)) for m in masks if m is not None]
    mask = tainted[0]
    for m in tainted[1:]:
      mask = mask | m
    return [Taint(mask, ref) for _ in outs], None, None
  # not followed: the padding is forgotten (a bug may go unseen, none is made up)
  return [None] * len(outs), None, None


def _broadcasts(shape: tuple[int, ...], out: tuple[int, ...]) -> bool:
  """Whether an operand of `shape` maps element by element onto a result of `out`
  (lax's elementwise operations broadcast scalars and size-1 dimensions)."""
  return shape == () or (len(shape) == len(out)
                         and all(a in (1, b) for a, b in zip(shape, out)))
