"""Loops whose trip count has a static bound, run as that many masked steps.

A `fori_loop` whose trip count depends on the grid (`pl.program_id`) or on data
(a sequence length read from a ref) lowers to a `while` loop. Run under `vmap`,
JAX batches such a loop: every iteration reduces the per-program predicates and
selects every carry, and the planner keeps the axes feeding the count looped
(`body_analysis.trip_count_axes`), so the grid runs as many small steps. At the
sizes kernels are tested with, those steps cost more than their work (JAX's GPU
decode attention: 16 split steps of one key block each, 3-4x jax.numpy's time).

Many such loops have a small static bound: decode attention runs
`min(blocks in the split, ceil(length / block_k))` key blocks, at most the split's
block count; causal attention at most the key blocks of the sequence. `bounds`
proves one with interval arithmetic over the discharged body: the loop is JAX's
`fori_loop` form (a counter carry `i`, `i < upper` as the condition, `i + 1` in the
body, `upper` unchanged), the grid indices range over the grid, a value read from
data is unbounded unless clamped (`min(length, ...)`). Then

    while cond(c): c = body(c)    ==    repeat B times: c = select(cond(c), body(c), c)

exactly, for any trip count up to B. `rewrite` emits that form: unrolled when B is
small, else a fixed-length `fori_loop`. Under `vmap` it is B steps of batched
arithmetic with a per-program select, and the axes feeding the count can be
vectorized; programs with fewer steps compute and discard the rest (the planner
weighs that, see plan.py). Carries the body passes through unchanged (refs the loop
only reads) are never selected, so they stay unbatched.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Literal

from pallet import _internals as internals
from pallet.core import trace_cache
from pallet.backends.xla import body_analysis
from pallet.core.tracing import KernelDescription

# Loops of at most this many steps are unrolled (straight-line code XLA fuses across
# steps); longer ones run as a fixed-length loop.
UNROLL_STEPS = 4
_CALLS = ("pjit", "jit", "closed_call", "core_call")


@dataclasses.dataclass(frozen=True)
class BoundedLoop:
  """A while loop of the body (by its equation) with a static trip-count bound."""
  eqn: Any
  bound: int          # most steps any program runs
  steps: float        # upper bound of the steps all programs run together
  flops: int          # arithmetic per step (dot products count 2 per multiply-add)
  source: str
  counter: int        # the carry counting the steps
  gathers: bool       # the body gathers or scatters (at indices not known statically)
  effects: bool       # the body has effects (checks, prints): a masked step would run them


@dataclasses.dataclass(frozen=True)
class LoopBounds:
  bounded: tuple[BoundedLoop, ...]
  unbounded: tuple[str, ...]        # sources of while loops without a static bound

  def describe(self) -> str:
    return ", ".join(f"{b.source} (at most {b.bound} steps)" for b in self.bounded)


# ------------------------------------------------------------------ interval arithmetic
# An interval is a pair of float64 arrays (lo, hi), one entry per grid point (or
# scalars), -inf/inf for an unknown end. Grid indices are exact per point, so
# `min(start + n, length) - start` keeps its bound n (intervals over the whole grid
# would lose the correlation between the two `start`s).
_INF = np.inf


def _unknown() -> tuple:
  return np.float64(-_INF), np.float64(_INF)


def _exact(value: Any) -> tuple:
  v = np.asarray(value, np.float64)
  return v, v


def _mul(a: tuple, b: tuple) -> tuple:
  with np.errstate(invalid="ignore"):
    products = [x * y for x in a for y in b]
  products = [np.where(np.isnan(p), 0.0, p) for p in products]   # 0 * inf: an exact zero
  return np.minimum.reduce(products), np.maximum.reduce(products)


def _div(a: tuple, b: tuple) -> tuple:
  """Integer division truncating toward zero (XLA's), by a positive constant."""
  c = b[0]
  if np.ndim(c) or np.ndim(b[1]) or c != b[1] or not c > 0 or not np.isfinite(c):
    return _unknown()
  return np.trunc(a[0] / c), np.trunc(a[1] / c)


def _interval_of_eqn(eqn: Any, ins: list) -> list:
  name = eqn.primitive.name
  outs = eqn.outvars
  if not all(_integer_scalar(v.aval) for v in outs):
    return [_unknown() for _ in outs]
  if name in _COMPARISONS:
    return [(np.float64(0), np.float64(1))]
  if name == "add":
    return [(ins[0][0] + ins[1][0], ins[0][1] + ins[1][1])]
  if name == "sub":
    return [(ins[0][0] - ins[1][1], ins[0][1] - ins[1][0])]
  if name == "neg":
    return [(-ins[0][1], -ins[0][0])]
  if name == "mul":
    return [_mul(*ins)]
  if name == "div":
    return [_div(*ins)]
  if name == "max":
    return [(np.maximum(ins[0][0], ins[1][0]), np.maximum(ins[0][1], ins[1][1]))]
  if name == "min":
    return [(np.minimum(ins[0][0], ins[1][0]), np.minimum(ins[0][1], ins[1][1]))]
  if name == "clamp":
    lo, x, hi = ins
    return [(np.maximum(lo[0], np.minimum(x[0], hi[0])),
             np.maximum(lo[1], np.minimum(x[1], hi[1])))]
  if name == "select_n":
    # Pairwise, so that per-grid-point bounds broadcast against scalar ones.
    return [(functools.reduce(np.minimum, [c[0] for c in ins[1:]]),
             functools.reduce(np.maximum, [c[1] for c in ins[1:]]))]
  if name in ("convert_element_type", "copy", "copy_p", "reshape", "squeeze",
              "broadcast_in_dim", "reduce_precision"):
    return [ins[0] if _integer_scalar(eqn.invars[0].aval) else _unknown()]
  return [_unknown() for _ in outs]


_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor")


def _integer_scalar(aval: Any) -> bool:
  dtype = getattr(aval, "dtype", None)
  try:
    return getattr(aval, "shape", None) == () and (
        dtype == bool or np.issubdtype(dtype, np.integer))
  except TypeError:
    return False


def _read(env: dict, x: Any) -> tuple:
  if isinstance(x, Literal):
    return _exact(x.val) if _integer_scalar(x.aval) else _unknown()
  return env.get(x) or _unknown()


# ------------------------------------------------------------------ the analysis
def _counted_form(eqn: Any) -> tuple[int, Any] | None:
  """(carry index of the counter `i`, the condition's `lt` equation) when the loop
  is `while i < u: i += 1; ...` with `u` computed in the condition from its
  constants and carries the body leaves unchanged (JAX's fori_loop form)."""
  p = eqn.params
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cond, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
  producer = {v: e for e in cond.eqns for v in e.outvars}
  lt = producer.get(cond.outvars[0]) if not isinstance(cond.outvars[0], Literal) else None
  if lt is None or lt.primitive.name != "lt" or lt.invars[0] not in cond.invars:
    return None
  counter = cond.invars.index(lt.invars[0])
  if counter < nc:
    return None
  k = counter - nc
  carry_in = body.invars[nb:]
  step = producer_of(body, body.outvars[k])
  if step is None or step.primitive.name != "add":
    return None
  a, b = step.invars
  one = lambda x: isinstance(x, Literal) and _integer_scalar(x.aval) and int(x.val) == 1
  if not ((a is carry_in[k] and one(b)) or (b is carry_in[k] and one(a))):
    return None
  invariant = set(cond.invars[:nc]) | {cond.invars[nc + j] for j, (v, out) in
                                       enumerate(zip(carry_in, body.outvars)) if out is v}
  if not _depends_only_on(lt.invars[1], producer, invariant):
    return None
  return k, lt


def producer_of(jaxpr: Any, var: Any) -> Any:
  if isinstance(var, Literal):
    return None
  return next((e for e in jaxpr.eqns if var in e.outvars), None)


def _depends_only_on(var: Any, producer: dict, allowed: set) -> bool:
  stack, seen = [var], set()
  while stack:
    v = stack.pop()
    if isinstance(v, Literal) or v in seen:
      continue
    seen.add(v)
    if v in producer:
      stack.extend(producer[v].invars)
    elif v not in allowed:
      return False
  return True


def _flops(jaxpr: Any) -> int:
  """Arithmetic per run of `jaxpr`: 2 per multiply-add of each matrix product, one
  per element of every other result (nested jaxprs counted once)."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      k = math.prod(lhs[d] for d in contract)
      total += 2 * k * math.prod(eqn.outvars[0].aval.shape)
    else:
      total += sum(math.prod(getattr(v.aval, "shape", ()) or (1,)) for v in eqn.outvars)
    for sub in body_analysis._nested_jaxprs(eqn):
      total += _flops(sub)
  return total


def _gathers_data(jaxpr: Any, data: set | None = None) -> bool:
  """Whether a gather or scatter in `jaxpr` takes its indices from an array input
  (a block table read from a ref), not from scalars and iotas. Under vmap such a
  gather of pages becomes a gather of single elements."""
  data = {v for v in jaxpr.invars if getattr(v.aval, "shape", ())} if data is None else data
  for eqn in jaxpr.eqns:
    touched = any(not isinstance(x, Literal) and x in data for x in eqn.invars)
    if eqn.primitive.name in ("gather", "scatter", "scatter-add", "scatter_add") and (
        not isinstance(eqn.invars[1], Literal) and eqn.invars[1] in data):
      return True
    for sub, operands in _nested_operands(eqn):
      inner = set(sub.invars) if operands is None else {
          v for v, x in zip(sub.invars, operands) if not isinstance(x, Literal) and x in data}
      if _gathers_data(sub, inner):
        return True
    if touched:
      data.update(eqn.outvars)
  return False


def _nested_operands(eqn: Any) -> list[tuple[Any, list | None]]:
  """(nested jaxpr, the equation's operands its inputs receive); None for a nested
  jaxpr of another layout (a scan: every input then counts as data)."""
  p, ins = eqn.params, list(eqn.invars)
  if eqn.primitive.name == "cond":
    return [(b.jaxpr, ins[1:]) for b in p["branches"]]
  if eqn.primitive.name == "while":
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    carry = ins[nc + nb:]
    return [(p["cond_jaxpr"].jaxpr, ins[:nc] + carry),
            (p["body_jaxpr"].jaxpr, ins[nc:nc + nb] + carry)]
  if eqn.primitive.name in _CALLS and "jaxpr" in p:
    sub = p["jaxpr"]
    return [(getattr(sub, "jaxpr", sub), ins)]
  return [(sub, None) for sub in body_analysis._nested_jaxprs(eqn)]


def _source(eqn: Any) -> str:
  where = internals.equation_source(eqn)
  return f"the loop at {where[0]}:{where[1]}" if where else "a while loop"


def _scan(jaxpr: Any, env: dict, found: list, unbounded: list, points: int) -> None:
  """Intervals of the scalar integers of `jaxpr`, collecting its loops' bounds."""
  for eqn in jaxpr.eqns:
    ins = [_read(env, x) for x in eqn.invars]
    name = eqn.primitive.name
    if name == "while":
      form = _counted_form(eqn)
      bound = None
      if form is not None:
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        k, lt = form
        cond = p["cond_jaxpr"].jaxpr
        cond_env = dict(zip(cond.invars, ins[:nc] + ins[nc + nb:]))
        _scan(cond, cond_env, [], [], points)
        lo, hi = ins[nc + nb + k][0], _read(cond_env, lt.invars[1])[1]
        steps = np.maximum(hi - lo, 0)   # per grid point
        if np.all(np.isfinite(steps)):
          bound = steps
      if bound is None:
        unbounded.append(_source(eqn))
      else:
        found.append(BoundedLoop(eqn, int(np.max(bound)), float(np.sum(
            np.broadcast_to(bound, (points,)))), _flops(eqn.params["body_jaxpr"].jaxpr),
            _source(eqn), form[0], _gathers_data(eqn.params["body_jaxpr"].jaxpr),
            bool(eqn.params["body_jaxpr"].jaxpr.effects or eqn.params["cond_jaxpr"].jaxpr.effects)))
      outs = [_unknown() for _ in eqn.outvars]
    elif name == "cond":
      for branch in eqn.params["branches"]:
        _scan(branch.jaxpr, dict(zip(branch.jaxpr.invars, ins[1:])), found, unbounded,
              points)
      outs = [_unknown() for _ in eqn.outvars]
    elif name in _CALLS and "jaxpr" in eqn.params:
      sub = eqn.params["jaxpr"]
      inner = getattr(sub, "jaxpr", sub)
      sub_env = dict(zip(inner.invars, ins))
      _scan(inner, sub_env, found, unbounded, points)
      outs = [_read(sub_env, x) for x in inner.outvars]
    else:
      for sub in body_analysis._nested_jaxprs(eqn):   # scans, nested loops: no bounds known
        _scan(sub, {}, found, unbounded, points)
      outs = _interval_of_eqn(eqn, ins)
    env.update(zip(eqn.outvars, outs))


@trace_cache.kernel_cache
def bounded_body(kernel: KernelDescription) -> ClosedJaxpr:
  """The discharged body with every loop `bounds` bounds in its masked form."""
  return rewrite(body_analysis.discharged(kernel), bounds(kernel))


@trace_cache.kernel_cache
def bounds(kernel: KernelDescription) -> LoopBounds:
  """The while loops of the kernel's discharged body and their static bounds."""
  pure = body_analysis.discharged(kernel)
  grid = kernel.grid_mapping.grid
  found: list[BoundedLoop] = []
  unbounded: list[str] = []
  if None in grid:   # traced grid sizes: programs unknown
    env, points = {}, 1
  else:
    points = math.prod(grid)
    ids = np.indices(grid).reshape(len(grid), points).astype(np.float64)
    env = {v: (ids[g], ids[g]) for g, v in enumerate(pure.jaxpr.invars[:len(grid)])}
  _scan(pure.jaxpr, env, found, unbounded, points)
  return LoopBounds(tuple(found), tuple(unbounded))


# ------------------------------------------------------------------ the rewrite
def rewrite(closed: ClosedJaxpr, loops: LoopBounds) -> ClosedJaxpr:
  """`closed` (the discharged body `loops` was found in) with each bounded loop as
  its masked fixed-length form."""
  if not loops.bounded:
    return closed
  by_eqn = {id(b.eqn): b for b in loops.bounded}
  args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
  return jax.make_jaxpr(lambda *xs: _run(closed.jaxpr, closed.consts, xs, by_eqn))(*args)


def _run(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], by_eqn: dict) -> list:
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda x: x.val if isinstance(x, Literal) else env[x]
  for eqn in jaxpr.eqns:
    ins = [read(x) for x in eqn.invars]
    if id(eqn) in by_eqn:
      outs = _masked_loop(eqn, ins, by_eqn[id(eqn)])
    elif eqn.primitive.name == "cond" and _contains(eqn, by_eqn):
      branches = [lambda *a, b=b: _run(b.jaxpr, b.consts, a, by_eqn)
                  for b in eqn.params["branches"]]
      outs = list(lax.switch(ins[0], branches, *ins[1:]))
    elif eqn.primitive.name in _CALLS and "jaxpr" in eqn.params and _contains(eqn, by_eqn):
      sub = eqn.params["jaxpr"]
      outs = _run(sub.jaxpr, sub.consts, ins, by_eqn)
    else:
      outs = internals.bind_equation(eqn, ins)
    env.update(zip(eqn.outvars, outs))
  return [read(x) for x in jaxpr.outvars]


def _contains(eqn: Any, by_eqn: dict) -> bool:
  return any(id(e) in by_eqn or _contains(e, by_eqn)
             for sub in body_analysis._nested_jaxprs(eqn) for e in sub.eqns)


def _masked_loop(eqn: Any, ins: list, loop: BoundedLoop) -> list:
  """The loop as `loop.bound` steps, each `select(cond(c), body(c), c)`. The body
  sees the counter as `start + step`, the same whenever the step is taken and, unlike
  the selected counter, not per program: its blocks stay slices under vmap."""
  bound, k_counter = loop.bound, loop.counter
  p = eqn.params
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cond, body = p["cond_jaxpr"], p["body_jaxpr"]
  cconsts, bconsts, init = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
  carry_in = body.jaxpr.invars[nb:]
  fixed = {k for k, (v, out) in enumerate(zip(carry_in, body.jaxpr.outvars)) if out is v}
  moving = [k for k in range(len(init)) if k not in fixed]

  def step(t, carry):
    full = list(init)
    for k, c in zip(moving, carry):
      full[k] = c
    active = jax.core.eval_jaxpr(cond.jaxpr, cond.consts, *cconsts, *full)[0]
    seen = list(full)
    start = init[k_counter]
    dtype = jax.numpy.result_type(start)
    seen[k_counter] = start + (np.asarray(t, dtype) if isinstance(t, int) else t.astype(dtype))
    new = jax.core.eval_jaxpr(body.jaxpr, body.consts, *bconsts, *seen)
    return [jax.numpy.where(active, new[k], full[k]) for k in moving]

  carry = [init[k] for k in moving]
  if bound <= UNROLL_STEPS:
    for t in range(bound):
      carry = step(t, carry)
  else:
    carry = lax.fori_loop(0, bound, step, carry)
  outs = list(init)
  for k, c in zip(moving, carry):
    outs[k] = c
  return outs

