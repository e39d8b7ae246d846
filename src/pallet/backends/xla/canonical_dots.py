"""Matrix products of the emitted program as plain 2-D products.

Under `vmap` a kernel's `dot(x_block, y_block)` becomes a product whose operands
carry the programs as extra free dimensions (`f32[8,16,128] . f32[128,2,64]`).
XLA runs that as fast as the plain product, but the products JAX derives from it
for `jax.grad` contract over those split dimensions (`f32[8,16,2,64] . f32[8,16,128]`,
contracting {0,1}), which XLA:CPU does not hand to its matrix-multiply library: each
costs 100-400 ms to compile, against about 15 ms for the same product written
`x.T @ g` on 2-D arrays. `canonical` rewrites every product whose contracting and
free dimensions each form one contiguous run per operand (and no batch dimensions)
as a reshape of each operand to 2-D, a 2-D product and a reshape back: the same
numbers, bitcasts for XLA, and its derivatives are 2-D products too.

`widen=True` also gives every product of narrow floating operands into a wider
result (`bf16 x bf16 -> f32`) operands of the result's type, as XLA:CPU itself does
for such a product in a plain program. XLA:CPU (jaxlib 0.10-0.12) fails to: where
the left operand contracts before its free dimension and the right one has several
free dimensions (vmap's form of `dot(x.T, y)` over a grid axis) its later passes
make a 2-D `bf16 x bf16 -> f32` product its runtime refuses ("Unsupported element
type for DotThunk::Execute").
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
from jax import lax
from jax.extend.core import ClosedJaxpr, Literal

from pallet import _internals as internals
from pallet.backends.xla import nested_jaxprs

_NESTED = nested_jaxprs.NESTED


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
  """How to run a dot_general equation as a 2-D product, or None (already 2-D-like,
  batch dimensions, or dimensions not in contiguous runs)."""
  if eqn.primitive.name != "dot_general":
    return None
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  if lb or rb:
    return None
  lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
  lr, rr = _runs(lc, len(lhs)), _runs(rc, len(rhs))
  if lr is None or rr is None:
    return None
  if all(len(run) <= 1 for run in (*lr, *rr)):
    return None
  return lr, rr


def _collapse(x: Any, contract: list[int], free: list[int]) -> tuple[Any, int]:
  """`x` as a 2-D (or 1-D) array with its contracting run and free run each one
  dimension; returns it and where the contracting dimension is."""
  shape = jax.numpy.shape(x)
  parts = sorted([r for r in (contract, free) if r], key=lambda r: r[0])
  x = lax.reshape(x, tuple(math.prod(shape[d] for d in r) for r in parts))
  return x, next(i for i, r in enumerate(parts) if r is contract) if contract else 0


def _dot(eqn: Any, lhs: Any, rhs: Any, plan: tuple) -> Any:
  (lc, lf), (rc, rf) = plan
  lhs2, lpos = _collapse(lhs, lc, lf)
  rhs2, rpos = _collapse(rhs, rc, rf)
  dn = (((lpos,), (rpos,)) if lc else ((), ()), ((), ()))
  params = {**eqn.params, "dimension_numbers": dn}
  out = eqn.primitive.bind(lhs2, rhs2, **params)
  return lax.reshape(out, eqn.outvars[0].aval.shape)


def narrow_product(eqn: Any) -> bool:
  """Whether `eqn` multiplies narrow floating operands into a wider floating result."""
  if eqn.primitive.name != "dot_general":
    return False
  out = eqn.outvars[0].aval.dtype
  return jax.numpy.issubdtype(out, jax.numpy.floating) and any(
      jax.numpy.issubdtype(v.aval.dtype, jax.numpy.floating)
      and v.aval.dtype.itemsize < out.itemsize for v in eqn.invars)


def needs_rewrite(jaxpr: Any, widen: bool = False) -> bool:
  """Whether `jaxpr` (or one nested in it) has a product `canonical` rewrites."""
  for eqn in jaxpr.eqns:
    if _plan(eqn) is not None or (widen and narrow_product(eqn)):
      return True
    for name in _NESTED.get(eqn.primitive.name, ()):
      value = eqn.params.get(name)
      for sub in (value if isinstance(value, tuple) else (value,)):
        if sub is not None and needs_rewrite(getattr(sub, "jaxpr", sub), widen):
          return True
  return False


def canonical(closed: ClosedJaxpr, widen: bool = False) -> ClosedJaxpr:
  """`closed` with its products (nested ones too) as 2-D products (itself if none)."""
  if not needs_rewrite(closed.jaxpr, widen):
    return closed
  return jax.make_jaxpr(lambda *args: evaluate(closed, args, widen))(
      *[v.aval for v in closed.jaxpr.invars])


def evaluate(closed: ClosedJaxpr, args: Sequence[Any], widen: bool = False) -> list[Any]:
  """`closed` applied to `args` with its products as 2-D products: what `canonical`
  traces, bound in the caller's trace instead of a trace of its own."""
  return _evaluate(closed.jaxpr, closed.consts, args, widen)


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
              widen: bool) -> list[Any]:
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda x: x.val if isinstance(x, Literal) else env[x]
  for eqn in jaxpr.eqns:
    ins = [read(x) for x in eqn.invars]
    if widen and narrow_product(eqn):
      out = eqn.outvars[0].aval.dtype
      ins = [lax.convert_element_type(x, out) for x in ins]
    plan = _plan(eqn)
    if plan is not None:
      outs = [_dot(eqn, *ins, plan)]
    else:
      outs = _bind(eqn, ins, widen)
    env.update(zip(eqn.outvars, outs))
  return [read(x) for x in jaxpr.outvars]


def _bind(eqn: Any, args: list, widen: bool) -> list:
  """`eqn` on `args`, its nested jaxprs' products made canonical too."""
  params = dict(eqn.params)
  inner = lambda x: canonical(x, widen) if isinstance(x, ClosedJaxpr) else x
  for name in _NESTED.get(eqn.primitive.name, ()):
    value = params.get(name)
    if isinstance(value, tuple):
      params[name] = tuple(inner(v) for v in value)
    elif value is not None:
      params[name] = inner(value)
  return internals.bind_equation(eqn, args, params)
