"""Scalar index arithmetic on literals, folded before the body is emitted.

State discharge writes every static index of a ref (`x_ref[0]`, `sem_ref[1]`) as a
bounds normalisation on literals (`select(0 < 0, 0 + n, 0)`). A kernel that
indexes refs a lot carries thousands of them: half of the lowered module of JAX's
TPU paged attention (DMA double-buffering). XLA folds them, but only after JAX has
traced them again for the emitted program and lowered them to StableHLO, which is
first-call time. `fold_literals` evaluates scalar integer and boolean equations
whose operands are all literals (with grid_eval's NumPy rules, exact as in XLA),
puts literals in place of their results and the chosen operand in place of a
select on a literal predicate, in the jaxprs of calls, conds, loops and scans too.

`evaluate` runs a jaxpr the same way with the values known when the emitted
program is traced: grid indices that are constants there (axes merged into the
blocks, loops of one step) fold too, and a `cond` (`pl.when`) on one of them runs
only its branch instead of both under a switch.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from jax.extend.core import ClosedJaxpr, Literal

from pallet import _internals as internals
from pallet.backends.xla import nested_jaxprs
from pallet.core import grid_eval

_NESTED = nested_jaxprs.NESTED


def fold_literals(closed: ClosedJaxpr) -> ClosedJaxpr:
  """`closed` with scalar literal arithmetic folded (itself if there is none)."""
  jaxpr = _fold(closed.jaxpr)
  return closed if jaxpr is closed.jaxpr else ClosedJaxpr(jaxpr, closed.consts)


def _fold(jaxpr: Any) -> Any:
  subst: dict = {}
  read = lambda x: x if isinstance(x, Literal) else subst.get(x, x)
  eqns, changed = [], False
  for eqn in jaxpr.eqns:
    invars = [read(x) for x in eqn.invars]
    moved = any(a is not b for a, b in zip(invars, eqn.invars))
    folded = None if eqn.effects else _evaluate(eqn, invars)
    if folded is not None:
      subst.update(zip(eqn.outvars, folded))
      changed = True
      continue
    params = nested_jaxprs.rewrite_params(eqn, _fold_closed)
    if params is not eqn.params or moved:
      eqn = eqn.replace(invars=invars, params=params)
      changed = True
    eqns.append(eqn)
  if not changed:
    return jaxpr
  return jaxpr.replace(eqns=eqns, outvars=[read(x) for x in jaxpr.outvars])


def _scalar_exact(aval: Any) -> bool:
  return getattr(aval, "shape", None) == () and grid_eval.exact(aval)


def _evaluate(eqn: Any, invars: list) -> list | None:
  """Literals (or, for a select on a literal, the chosen operand) for the equation's
  results; None where it is not folded."""
  if not all(isinstance(x, Literal) for x in invars[:1 if eqn.primitive.name == "select_n"
                                                   else len(invars)]):
    return None
  if eqn.primitive.name == "select_n":
    which, cases = invars[0], invars[1:]
    if not _scalar_exact(which.aval) or any(c.aval != eqn.outvars[0].aval for c in cases):
      return None
    return [cases[int(np.clip(int(which.val), 0, len(cases) - 1))]]
  if eqn.primitive.name in _NESTED or not all(
      _scalar_exact(v.aval) for v in (*invars, *eqn.outvars)):
    return None
  try:
    outs = grid_eval.apply_equation(eqn, [np.asarray(x.val, x.aval.dtype) for x in invars])
  except grid_eval.Unsupported:
    return None
  return [Literal(np.asarray(o, v.aval.dtype)[()], v.aval) for v, o in zip(eqn.outvars, outs)]


def _fold_closed(x: Any) -> Any:
  if isinstance(x, ClosedJaxpr):
    return fold_literals(x)
  return _fold(x) if hasattr(x, "eqns") else x


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  """`jaxpr` on `args` (as `jax.core.eval_jaxpr`), with scalar integer arithmetic on
  constants done in NumPy and conds on a constant index run as their branch."""
  env: dict = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda x: x.val if isinstance(x, Literal) else env[x]
  for eqn in jaxpr.eqns:
    env.update(zip(eqn.outvars, evaluate_equation(eqn, [read(x) for x in eqn.invars])))
  return [read(x) for x in jaxpr.outvars]


def evaluate_equation(eqn: Any, ins: list) -> list:
  """One equation of `evaluate`: folded where its operands are constants, else bound."""
  outs = _known_results(eqn, ins)
  return internals.bind_equation(eqn, ins) if outs is None else outs


def constant_scalar(x: Any) -> np.ndarray | None:
  """`x` as a NumPy scalar where it is a constant (not traced) scalar."""
  if internals.is_tracer(x) or not hasattr(x, "__array__") and not isinstance(x, (bool, int)):
    return None
  value = np.asarray(x)
  return value if value.ndim == 0 else None


def known_branch(eqn: Any, index: Any) -> Any | None:
  """The branch a cond runs when its index is a constant (clamped, as `lax.switch`
  clamps); None when the index is traced."""
  known = constant_scalar(index)
  if known is None:
    return None
  branches = eqn.params["branches"]
  return branches[int(np.clip(int(known), 0, len(branches) - 1))]


def _known_results(eqn: Any, ins: list) -> list | None:
  if eqn.primitive.name == "cond":
    branch = known_branch(eqn, ins[0])
    return None if branch is None else evaluate(branch.jaxpr, branch.consts, ins[1:])
  if eqn.effects or eqn.primitive.name in _NESTED or not all(
      _scalar_exact(v.aval) for v in (*eqn.invars, *eqn.outvars)):
    return None
  values = [constant_scalar(x) for x in ins]
  if any(v is None for v in values):
    return None
  try:
    return grid_eval.apply_equation(
        eqn, [v.astype(x.aval.dtype) for v, x in zip(values, eqn.invars)])
  except grid_eval.Unsupported:
    return None

