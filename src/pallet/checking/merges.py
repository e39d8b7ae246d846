"""Merge writes: `o_ref[...] = jnp.where(mask, new, o_ref[...])`.

A kernel that updates only some lanes of a block often writes it so: it reads the
block, keeps the old values where `mask` is off and stores the whole block back
(JAX's grouped matmul stores each group's rows of a shared output tile this way).
The old values are only carried through: the write is a masked store in disguise.
Checking mode treats it as one: the read is not a read of uninitialized memory, and
only the lanes the mask selects count as written (the others stay as they were, so
an output element no program selects is still reported as never written).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jax.extend.core import Literal

_PASS_THROUGH = ("convert_element_type", "copy", "copy_p")


@dataclasses.dataclass(frozen=True)
class MergeWrite:
  get: Any        # the read of the old block
  select: Any     # select_n choosing between it and the new values (or a call of one:
                  # jnp.where is a jitted function)
  pred: int       # the select equation's operand holding the predicate
  case: int       # the case holding the old values
  swap: Any       # the store of the merged block, through the same ref and indices


def find(jaxpr: Any) -> dict[int, MergeWrite]:
  """The merge writes of `jaxpr` (not of its sub-jaxprs), by id of each of their
  get, select_n and swap equations."""
  consumers: dict[Any, list] = {}
  for eqn in jaxpr.eqns:
    for k, v in enumerate(eqn.invars):
      if not isinstance(v, Literal):
        consumers.setdefault(v, []).append((eqn, k))
  for v in jaxpr.outvars:
    if not isinstance(v, Literal):
      consumers.setdefault(v, []).append((None, 0))

  def only_use(v):
    """The one (equation, operand) using `v`, past pass-through conversions."""
    while True:
      uses = consumers.get(v, [])
      if len(uses) != 1 or uses[0][0] is None:
        return None
      eqn, k = uses[0]
      if eqn.primitive.name not in _PASS_THROUGH:
        return eqn, k
      v = eqn.outvars[0]

  found: dict[int, MergeWrite] = {}
  for get in jaxpr.eqns:
    if get.primitive.name != "get":
      continue
    use = only_use(get.outvars[0])
    chosen = None if use is None else _selection(*use)
    if chosen is None:
      continue
    select, (pred, case) = use[0], chosen
    use = only_use(select.outvars[0])
    if use is None or use[0].primitive.name != "swap" or use[1] != 1:
      continue
    swap = use[0]
    if (swap.invars[0] is not get.invars[0] or swap.params["tree"] != get.params["tree"]
        or not _same(swap.invars[2:], get.invars[1:]) or swap.outvars[0] in consumers):
      continue
    merge = MergeWrite(get, select, pred, case, swap)
    for eqn in (get, select, swap):
      found[id(eqn)] = merge
  return found


def _selection(eqn: Any, k: int) -> tuple[int, int] | None:
  """(predicate operand, case) where operand k of `eqn` is a case of a select_n: the
  equation itself, or a call whose body is one (`jnp.where`)."""
  if eqn.primitive.name == "select_n":
    return (0, k - 1) if k > 0 and len(eqn.invars) == 3 else None
  inner = eqn.params.get("jaxpr") if eqn.primitive.name in ("pjit", "jit", "closed_call") else None
  inner = getattr(inner, "jaxpr", inner)
  if inner is None or len(inner.eqns) != 1 or len(eqn.outvars) != 1:
    return None
  (select,) = inner.eqns
  if (select.primitive.name != "select_n" or len(select.invars) != 3
      or inner.outvars[0] is not select.outvars[0]):
    return None
  params = list(inner.invars)
  pred, *cases = select.invars
  if pred not in params or cases.count(params[k]) != 1:
    return None
  return params.index(pred), cases.index(params[k])


def _same(xs: Any, ys: Any) -> bool:
  if len(xs) != len(ys):
    return False
  for x, y in zip(xs, ys):
    if isinstance(x, Literal) and isinstance(y, Literal):
      if x.val is not y.val and not (x.aval == y.aval and x.val == y.val):
        return False
    elif x is not y:
      return False
  return True
