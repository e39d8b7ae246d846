"""Block padding: where a block overhangs its array (an edge block that does not
divide the array, a `pl.Element` window with padding or reaching past the end), the
lanes outside the array hold no data (their contents are unspecified). Reading them
is fine as long as what comes of them stays in such lanes (an elementwise result
there is dropped when the block is written back); the bug is an operation that
mixes them into lanes that hold data (a reduction or matrix product over the padded
dimension), or a store of them into an output where the array holds data (a
`pl.Element` window shifted onto the block it is for).

Values loaded from such blocks carry two boolean masks through the kernel
(`Taint`): `garbage`, the lanes whose value depends on padding, and `outside`, the
lanes that stand for positions outside the array (so their results are dropped).
A constant put in a lane outside (`jnp.where(valid, x, -inf)`) is not garbage but
still outside. Reductions and products check that no result at a position inside
the array mixes in garbage; stores check that no garbage lands inside an output.
Past operations pallet does not follow, the masks are dropped: that can miss a bug
but never reports a false one.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pallet.core import primitives

_SAME = ("broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "slice",
         "rev")
_REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
               "reduce_or", "reduce_xor", "argmax", "argmin")
_CUMULATIVE = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")


@dataclasses.dataclass(frozen=True)
class Taint:
  garbage: Any    # bool, broadcastable to the value: True where it depends on padding
  outside: Any    # bool, broadcastable: True where the lane lies outside the array
  ref: str        # the operand whose padding it is


def block_extents(mapping: Any, ids: Sequence[Any], prefetch: Sequence[Any]) -> list | None:
  """Per block dimension (squeezed ones dropped), the lanes that hold data at this grid
  step, as (first, end) (None: all of them); None when no block of this operand can
  reach outside its array."""
  padded = [(d.kind == "blocked" and n % d.size != 0) or d.kind == "element"
            for d, n in zip(mapping.dims, mapping.array_shape)]
  if mapping.whole or not any(padded):
    return None
  im = mapping.index_map
  indices = jax.core.eval_jaxpr(im.jaxpr, im.consts, *ids, *prefetch)
  extents = []
  for d, idx, n, pads in zip(mapping.dims, indices, mapping.array_shape, padded):
    if d.kind == "squeezed":
      continue
    if not pads:
      extents.append(None)
    elif d.kind == "element":   # the offset counts in the array padded by (lo, hi)
      start = idx - d.padding[0]
      extents.append((-start, n - start))
    else:
      extents.append((0, n - idx * d.size))
  return extents


def _outside(pos: Any, extent: Any) -> Any:
  first, end = extent
  return (pos < first) | (pos >= end)


def loaded(extents: list, transforms: Sequence[Any], shape: tuple[int, ...]) -> Any:
  """Where a load (or store) through `transforms` (one indexer, or none) touches lanes
  outside the array; None where pallet does not follow the transforms."""
  if not transforms:
    mask = jnp.bool_(False)
    for d, extent in enumerate(extents):
      if extent is not None:
        mask = mask | _outside(lax.broadcasted_iota(jnp.int32, shape, d), extent)
    return jnp.broadcast_to(mask, shape)
  if len(transforms) != 1 or not hasattr(transforms[0], "indices"):
    return None
  positions = primitives._indexer_positions(transforms[0])
  mask = jnp.bool_(False)
  for pos, extent in zip(positions, extents):
    if extent is not None:
      mask = mask | _outside(pos, extent)
  return jnp.broadcast_to(mask, shape)


def _shape(x: Any) -> tuple[int, ...]:
  return tuple(jnp.shape(x))


def propagate(eqn: Any, ins: Sequence[Any], outs: Sequence[Any],
              taints: Sequence[Taint | None]) -> tuple[list, Any, str | None]:
  """(taints of the results, `ok` of a mixing check or None, the ref it concerns)."""
  name, params = eqn.primitive.name, eqn.params
  ref = next(t.ref for t in taints if t is not None)
  out = outs[0]
  full = lambda m, x: jnp.broadcast_to(m, _shape(x))
  garbage = [None if t is None else full(t.garbage, x) for t, x in zip(taints, ins)]
  outside = [None if t is None else full(t.outside, x) for t, x in zip(taints, ins)]
  if name in _SAME and taints[0] is not None:
    apply = lambda m: eqn.primitive.bind(m, **eqn.params)
    return [Taint(apply(garbage[0]), apply(outside[0]), ref)], None, None
  if name in ("convert_element_type", "copy", "copy_p"):
    return [taints[0]], None, None
  if name == "select_n":
    cases = [full(g if g is not None else False, out) for g in garbage[1:]]
    mask = lax.select_n(ins[0], *cases) if len(cases) > 1 else cases[0]
    if garbage[0] is not None:
      mask = mask | full(garbage[0], out)
    return [Taint(mask, _any_of(outside, out), ref)], None, None
  if name in ("and", "or") and jnp.dtype(out.dtype) == jnp.bool_ and len(ins) == 2:
    # a clean False (and) or True (or) decides the lane whatever the padding holds
    decides = lambda x, g: (~g if g is not None else True) & (
        ~full(x, out) if name == "and" else full(x, out))
    decided = decides(ins[0], garbage[0]) | decides(ins[1], garbage[1])
    return [Taint(_any_of(garbage, out) & ~decided, _any_of(outside, out), ref)], None, None
  if name in _REDUCTIONS and taints[0] is not None:
    axes = tuple(params["axes"])
    some = jnp.any(garbage[0], axis=axes)
    there = jnp.all(outside[0], axis=axes)      # every contributor lies outside
    return [Taint(some & there, there, ref)] * len(outs), ~(some & ~there), ref
  if name == "dot_general":
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    dims = ((lc, rc), (lb, rb))

    def count(masks):   # contributions where neither factor is masked
      clean = [(~m).astype(jnp.float32) if m is not None else jnp.ones(_shape(x), jnp.float32)
               for m, x in zip(masks, ins)]
      return lax.dot_general(clean[0], clean[1], dims, preferred_element_type=jnp.float32)

    k = 1
    for d in lc:
      k *= _shape(ins[0])[d]
    some = count(garbage) < k
    there = count(outside) == 0
    return [Taint(some & there, there, ref)], ~(some & ~there), ref
  if name in _CUMULATIVE and taints[0] is not None:
    axis, reverse = params["axis"], params.get("reverse", False)
    some = lax.cummax(garbage[0].astype(jnp.int32), axis, reverse=reverse) > 0
    there = outside[0]
    return [Taint(some & there, there, ref)], ~(some & ~there), ref
  if all(_shape(o) == _shape(out) for o in outs) and all(
      _broadcasts(_shape(x), _shape(out)) for x, t in zip(ins, taints) if t is not None):
    return [Taint(_any_of(garbage, out), _any_of(outside, out), ref) for _ in outs], None, None
  # not followed: the padding is forgotten (a bug may go unseen, none is made up)
  return [None] * len(outs), None, None


def _any_of(masks: Sequence[Any], out: Any) -> Any:
  result = jnp.zeros(_shape(out), jnp.bool_)
  for m in masks:
    if m is not None:
      result = result | jnp.broadcast_to(m, _shape(out))
  return result


def _broadcasts(shape: tuple[int, ...], out: tuple[int, ...]) -> bool:
  """Whether an operand of `shape` maps element by element onto a result of `out`
  (lax's elementwise operations broadcast scalars and size-1 dimensions)."""
  return shape == () or (len(shape) == len(out)
                         and all(a in (1, b) for a, b in zip(shape, out)))
