"""Kernels that never finish: what the instrumentation needs to know about a while loop.

pallet runs a grid's programs one after another, so inside one program nothing but
the program itself changes memory. A `while_loop` iteration that leaves its carry and
every ref the loop reads unchanged will repeat forever: if the loop reads a ref it
never writes (a spin-wait on a flag, a counter or a semaphore), it waits for a value
only a later program (or none) can write, a deadlock on a TPU or GPU where that
program is scheduled after it; otherwise it is an infinite loop. Loops that do make
progress are bounded by a generous iteration count instead, except counted loops
(`fori_loop` with bounds known at run time), which always finish.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Literal, jaxprs_in_params

from pallet import _internals as internals

# Refs larger than this are not compared from one iteration to the next (that would
# copy them every iteration); loops writing one are only bounded.
SNAPSHOT_LIMIT = 1 << 14
_READ_ONLY = ("get", "masked_load", "semaphore_read")
_CALLS = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
          "custom_vjp_call_jaxpr", "remat", "checkpoint")


@dataclasses.dataclass(frozen=True)
class RefUses:
  """Operand positions of a loop's refs that it reads, and that it writes."""
  reads: frozenset[int]
  writes: frozenset[int]
  read_sites: tuple[tuple[Any, int], ...] = ()   # (equation, operand) of each read, in order

  def waited_on(self) -> tuple[Any, int] | None:
    """The first read of a ref the loop does not write itself (what it waits on)."""
    return next(((e, k) for e, k in self.read_sites if k not in self.writes), None)


def ref_uses(eqn: Any) -> RefUses:
  """Which of a `while` equation's operands (refs) its condition and body read and write."""
  params = eqn.params
  nc, nb = params["cond_nconsts"], params["body_nconsts"]
  n = len(eqn.invars)
  cond_args = list(range(nc)) + list(range(nc + nb, n))
  body_args = list(range(nc, n))
  reads, writes, sites = set(), set(), []
  refs = {k for k, v in enumerate(eqn.invars)
          if isinstance(getattr(v, "aval", None), internals.AbstractRef)}
  for jaxpr, args in ((params["cond_jaxpr"].jaxpr, cond_args),
                      (params["body_jaxpr"].jaxpr, body_args)):
    _walk(jaxpr, {v: k for v, k in zip(jaxpr.invars, args) if k in refs}, reads, writes, sites)
  return RefUses(frozenset(reads), frozenset(writes), tuple(sites))


def _walk(jaxpr: Any, refs: dict, reads: set, writes: set, sites: list) -> None:
  for eqn in jaxpr.eqns:
    touched = [refs[v] for v in eqn.invars if not isinstance(v, Literal) and v in refs]
    name = eqn.primitive.name
    subs = list(jaxprs_in_params(eqn.params))
    if subs:
      for sub in subs:
        inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
        operands = eqn.invars[1:] if name == "cond" else eqn.invars
        if name == "while":
          nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
          cond = eqn.params["cond_jaxpr"].jaxpr
          operands = (list(eqn.invars[:nc]) + list(eqn.invars[nc + nb:]) if inner is cond
                      else eqn.invars[nc:])
        mapping = {iv: refs[ov] for iv, ov in zip(inner.invars, operands)
                   if not isinstance(ov, Literal) and ov in refs}
        _walk(inner, mapping, reads, writes, sites)
      continue
    if not touched:
      continue
    if name != "swap":
      reads.update(touched)
      sites.extend((eqn, k) for k in touched)
    if name not in _READ_ONLY:   # swap, addupdate, atomics, DMAs, semaphores, ...
      writes.update(touched)


def counted(eqn: Any) -> bool:
  """Whether the loop is `fori_loop`'s: `i < n` on the carry, `i + 1` each iteration,
  `n` unchanged (it finishes after n - i iterations)."""
  params = eqn.params
  nc, nb = params["cond_nconsts"], params["body_nconsts"]
  cj, bj = params["cond_jaxpr"].jaxpr, params["body_jaxpr"].jaxpr
  if len(cj.eqns) != 1 or cj.eqns[0].primitive.name != "lt" or cj.outvars[0] != cj.eqns[0].outvars[0]:
    return False
  i_var, n_var = cj.eqns[0].invars
  carry = list(cj.invars[nc:])
  if i_var not in carry:
    return False
  i = carry.index(i_var)
  if not (isinstance(n_var, Literal) or n_var in cj.invars[:nc] or n_var in carry):
    return False
  body_carry = list(bj.invars[nb:])
  if n_var in carry and bj.outvars[carry.index(n_var)] is not body_carry[carry.index(n_var)]:
    return False
  step = next((e for e in bj.eqns if bj.outvars[i] in e.outvars), None)
  if step is None or step.primitive.name != "add":
    return False
  a, b = step.invars
  one = lambda x: isinstance(x, Literal) and x.val == 1
  return (a is body_carry[i] and one(b)) or (b is body_carry[i] and one(a))


def steering_carry(eqn: Any) -> list[int]:
  """Positions of the carry that can reach the loop's condition: those it reads, and
  (through the body, transitively) those they are computed from. The others (an
  attempt counter of a spin-wait) cannot make the loop stop."""
  params = eqn.params
  nc, nb = params["cond_nconsts"], params["body_nconsts"]
  cj, bj = params["cond_jaxpr"].jaxpr, params["body_jaxpr"].jaxpr
  carry_in = list(bj.invars[nb:])
  read_by_cond = _depends(cj, cj.outvars, set(cj.invars[nc:]))
  steering = {list(cj.invars[nc:]).index(v) for v in read_by_cond}
  while True:
    sources = _depends(bj, [bj.outvars[k] for k in steering], set(carry_in))
    grown = steering | {carry_in.index(v) for v in sources}
    if grown == steering:
      return sorted(steering)
    steering = grown


def _depends(jaxpr: Any, outs: Sequence[Any], candidates: set) -> set:
  """Which of `candidates` (inputs of `jaxpr`) the values `outs` depend on (any
  equation's results depend on all its operands)."""
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  seen, stack, found = set(), [v for v in outs if not isinstance(v, Literal)], set()
  while stack:
    v = stack.pop()
    if v in seen:
      continue
    seen.add(v)
    if v in candidates:
      found.add(v)
    eqn = producer.get(v)
    if eqn is not None:
      stack.extend(x for x in eqn.invars if not isinstance(x, Literal))
  return found


def unchanged(before: Sequence[Any], after: Sequence[Any]) -> Any:
  """Whether every value is bit for bit the same (a scalar bool)."""
  same = jnp.bool_(True)
  for x, y in zip(before, after):
    x, y = jnp.asarray(x), jnp.asarray(y)
    if jnp.issubdtype(x.dtype, jnp.floating):
      bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
      x, y = lax.bitcast_convert_type(x, bits), lax.bitcast_convert_type(y, bits)
    same = same & jnp.all(x == y)
  return same


def snapshottable(refs: Sequence[Any]) -> bool:
  return all(jax.typeof(r).size <= SNAPSHOT_LIMIT and not jax.dtypes.issubdtype(
      jax.typeof(r).dtype, jax.dtypes.extended) for r in refs)
