"""Scoped regions: a stateful function bound as one equation whose effects are only the
reads and writes of the refs it was given or closes over.

Pallas's own constructs that allocate (`pl.run_scoped`, the TPU pipeline) declare the
effects of their operands and hide their buffers. pallet allocates with `jax.new_ref`,
whose effect (`InternalMutableArrayEffect`) would otherwise leak into any jaxpr traced
around it. A region traces the function once, binds it as `pallet_scoped_region`, and
computes its effects from the inner jaxpr: effects on the region's inputs are kept,
allocation effects inside are dropped. Discharging a region discharges its jaxpr.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
from jax.extend.core import Primitive

from pallet import _internals as internals
from pallet.core import discharge

scoped_region_p = Primitive("pallet_scoped_region")
scoped_region_p.multiple_results = True


def run_region(fn: Callable[..., None], *args: Any) -> None:
  """Calls `fn(*args)` (pytrees of refs and values; it returns nothing) as a region."""
  # a view (`ref.at[...]`) enters as its ref and its indexers, so the effects name the ref
  top, outer = jax.tree_util.tree_flatten(args, is_leaf=_is_view)
  is_view = [_is_view(v) for v in top]
  leaves, inner = jax.tree_util.tree_flatten(
      [(v.ref, v.transforms) if view else v for v, view in zip(top, is_view)])

  def flat(*leaves):
    views = [internals.TransformedRef(*v) if view else v for v, view in
             zip(jax.tree_util.tree_unflatten(inner, leaves), is_view)]
    fn(*jax.tree_util.tree_unflatten(outer, views))
    return []

  closed = jax.make_jaxpr(flat)(*leaves)
  scoped_region_p.bind(*closed.consts, *leaves, jaxpr=internals.consts_as_inputs(closed))


def _is_view(x: Any) -> bool:
  return isinstance(x, internals.TransformedRef)


def _effects(jaxpr: Any) -> set:
  return {e for e in internals.input_effects(jaxpr) if e != internals.internal_ref_effect}


scoped_region_p.def_effectful_abstract_eval(lambda *avals, jaxpr: ([], _effects(jaxpr)))


@scoped_region_p.def_impl
def _impl(*args: Any, jaxpr: Any) -> list:
  jax.core.eval_jaxpr(jaxpr, [], *args)
  return []


@internals.register_discharge_rule(scoped_region_p)
def _discharge(in_avals, out_avals, *args, jaxpr):
  """The region's pure form: its jaxpr discharged, the final value of every ref input."""
  pure = discharge.discharge_state(jax.extend.core.ClosedJaxpr(jaxpr, []))
  finals = iter(jax.core.eval_jaxpr(pure.jaxpr, pure.consts, *args))
  return [next(finals) if isinstance(a, internals.AbstractRef) else None
          for a in in_avals], []
