"""Matrix products of the emitted program as plain 2-D products.

Under `vmap` a kernel's `dot(x_block, y_block)` becomes a product whose operands
carry the programs as extra free dimensions (`f32[8,16,128] . f32[128,2,64]`).
XLA runs that as fast as the plain product, but the products JAX derives from it
for `jax.grad` contract over those split dimensions (`f32[8,16,2,64] . f32[8,16,128]`,
contracting {0,1}), which XLA:CPU does not hand to its matrix-multiply library: each
costs 100-400 ms to compile, against about 15 ms for the same product written
`x.T @ g` on 2-D arrays. `canonical` rewrites every product whose contracting and
free dimensions each form one contiguous run per operand, after leading batch
dimensions (the same positions in both operands), as a reshape of each operand to
2-D (3-D with the batch dimensions kept in front), a plain product and a reshape
back: the same numbers, bitcasts for XLA, and its derivatives are plain products too.

The forward program needs the same form where a narrow product is accumulated wide:
XLA:CPU (jaxlib 0.10-0.12) compiles `bf16 x bf16 -> f32` whose left operand contracts
before its free dimension and whose right operand has several free dimensions into
a product its runtime refuses ("Unsupported element type for DotThunk::Execute");
one free run per operand runs.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
from jax import lax
from jax.extend.core import ClosedJaxpr, Literal

from pallet import _internals as internals

_NESTED = {"cond": ("branches",), "while": ("cond_jaxpr", "body_jaxpr"), "scan": ("jaxpr",),
           "pjit": ("jaxpr",), "jit": ("jaxpr",), "closed_call": ("call_jaxpr",)}


def _runs(dims: Sequence[int], rank: int) -> tuple[list[int], list[int]] | None:
  """(contracting dims, free dims) of an operand when each is one ascending run."""
  contract = list(dims)
  free = [d for d in range(rank) if d not in contract]
  for run in (contract, free):
    if run and run != list(range(run[0], run[0] + len(run))):
      return None
  if contract != sorted(contract):
    return None
  return contract, free


def _plan(eqn: Any) -> tuple | None:
  """How to run a dot_general equation as a plain product, or None (already plain,
  batch dimensions not leading, or dimensions not in contiguous runs)."""
  if eqn.primitive.name != "dot_general":
    return None
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  batch = len(lb)
  if list(lb) != list(range(batch)) or list(rb) != list(range(batch)):
    return None
  lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
  lr = _runs([d - batch for d in lc], len(lhs) - batch)
  rr = _runs([d - batch for d in rc], len(rhs) - batch)
  if lr is None or rr is None:
    return None
  if all(len(run) <= 1 for run in (*lr, *rr)):
    return None
  return batch, lr, rr


def _collapse(x: Any, batch: int, contract: list[int], free: list[int]) -> tuple[Any, int]:
  """`x` with its `batch` leading dimensions kept and its contracting run and free run
  (counted after them) each one dimension; returns it and where the contracting
  dimension is."""
  shape = jax.numpy.shape(x)
  parts = sorted([r for r in (contract, free) if r], key=lambda r: r[0])
  x = lax.reshape(x, shape[:batch] + tuple(math.prod(shape[batch + d] for d in r)
                                           for r in parts))
  return x, batch + (next(i for i, r in enumerate(parts) if r is contract) if contract else 0)


def _dot(eqn: Any, lhs: Any, rhs: Any, plan: tuple) -> Any:
  batch, (lc, lf), (rc, rf) = plan
  lhs2, lpos = _collapse(lhs, batch, lc, lf)
  rhs2, rpos = _collapse(rhs, batch, rc, rf)
  dn = (((lpos,), (rpos,)) if lc else ((), ()), (tuple(range(batch)), tuple(range(batch))))
  params = {**eqn.params, "dimension_numbers": dn}
  out = eqn.primitive.bind(lhs2, rhs2, **params)
  return lax.reshape(out, eqn.outvars[0].aval.shape)


def needs_rewrite(jaxpr: Any) -> bool:
  """Whether `jaxpr` (or one nested in it) has a product `canonical` rewrites."""
  for eqn in jaxpr.eqns:
    if _plan(eqn) is not None:
      return True
    for name in _NESTED.get(eqn.primitive.name, ()):
      value = eqn.params.get(name)
      for sub in (value if isinstance(value, tuple) else (value,)):
        if sub is not None and needs_rewrite(getattr(sub, "jaxpr", sub)):
          return True
  return False


def canonical(closed: ClosedJaxpr) -> ClosedJaxpr:
  """`closed` with its products (nested ones too) as 2-D products (itself if none)."""
  if not needs_rewrite(closed.jaxpr):
    return closed
  return jax.make_jaxpr(lambda *args: evaluate(closed, args))(
      *[v.aval for v in closed.jaxpr.invars])


def evaluate(closed: ClosedJaxpr, args: Sequence[Any]) -> list[Any]:
  """`closed` applied to `args` with its products as 2-D products: what `canonical`
  traces, bound in the caller's trace instead of a trace of its own."""
  return _evaluate(closed.jaxpr, closed.consts, args)


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda x: x.val if isinstance(x, Literal) else env[x]
  for eqn in jaxpr.eqns:
    ins = [read(x) for x in eqn.invars]
    plan = _plan(eqn)
    if plan is not None:
      outs = [_dot(eqn, *ins, plan)]
    else:
      outs = _bind(eqn, ins)
    env.update(zip(eqn.outvars, outs))
  return [read(x) for x in jaxpr.outvars]


def _bind(eqn: Any, args: list) -> list:
  params = dict(eqn.params)
  for name in _NESTED.get(eqn.primitive.name, ()):
    value = params.get(name)
    if isinstance(value, tuple):
      params[name] = tuple(_canonical_inner(v) for v in value)
    elif value is not None:
      params[name] = _canonical_inner(value)
  bind_params = eqn.primitive.get_bind_params(params)
  subfuns, bound = bind_params if isinstance(bind_params, tuple) else ((), bind_params)
  with internals.equation_context(eqn):
    outs = eqn.primitive.bind(*subfuns, *args, **bound)
  return list(outs) if eqn.primitive.multiple_results else [outs]


def _canonical_inner(x: Any) -> Any:
  if isinstance(x, ClosedJaxpr):
    return canonical(x)
  return x
