"""The order in which the lockstep run of a kernel (pallet/distributed/lockstep.py) takes the
operations of one block (a kernel body, a loop body, a branch): devices that take
different branches run as far as each can before it waits.

Devices that take different branches of a `pl.when` / `lax.cond` run concurrently on
the hardware, so one branch may wait for something another branch (or code after the
`pl.when`, which the devices skipping it reach first) has yet to do: even devices
wait for a copy that odd devices start in a later `pl.when`. Lockstep would run the
first branch's wait before the second branch starts. Here a block is flattened into
one list of statements, the operations of every branch that holds a wait guarded by
the branch it sits in (its path: index == k for each enclosing cond), and run by
"threads": sets of devices, each at one statement, described by a condition on the
branch indices (a disjunction of conjunctions of path literals, so contradictory
sets are dropped while tracing). A thread runs statement after statement, each
masked to its devices on that statement's path; at a wait, the devices on its path
stop there and the others go on. When every thread has stopped, the one that
stopped first passes its wait and goes on (first come, first served: a ping-pong
between two branches alternates). Each device runs its own statements in program
order, once each, so this is still one interleaving the hardware may produce: a race-
free kernel computes the same results, and a wait still unsatisfied when its turn
comes is the same clear error as before.

Loops stay whole (a wait inside a loop body is ordered within that body), so the
whole schedule is decided while tracing: no run-time loop, and `jax.grad` still works.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Sequence

import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from pallet import _internals as internals

WAITS = ("dma_wait", "semaphore_wait")
# Equations that call one jaxpr on their operands (flattened like a branch that is taken).
CALLS = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
         "custom_vjp_call_jaxpr", "remat2", "checkpoint")


@dataclasses.dataclass(frozen=True)
class _Lit:
  """On the path: the cond index read from `source` is (`holds`) or is not `branch`."""
  source: Any
  branch: int
  holds: bool

  def negated(self) -> "_Lit":
    return _Lit(self.source, self.branch, not self.holds)


@dataclasses.dataclass(frozen=True)
class _Const:
  value: Any


@dataclasses.dataclass(frozen=True)
class _Stmt:
  kind: str                  # "eqn" (a wait included), "cond", "bind" or "merge"
  guard: frozenset           # of _Lit: the path to this statement
  eqn: Any = None
  scope: int = 0
  end: int = 0               # cond: the statement after its flattened branches
  pairs: tuple = ()          # bind: (destination key, source) pairs
  index: Any = None          # merge: the cond's index source
  outs: tuple = ()           # merge: (destination key, sources per branch) per output


TRUE = frozenset({frozenset()})


def _consistent(conj: frozenset) -> bool:
  taken = {}
  for lit in conj:
    if lit.holds and taken.setdefault(lit.source, lit.branch) != lit.branch:
      return False
  return not any(not lit.holds and taken.get(lit.source) == lit.branch for lit in conj)


def _resolved(conjs: set) -> set:
  """`c & l | c & ~l` is `c`: a thread that split at a wait (the devices on its path
  stopped, the others went on) is one thread again once both halves meet. Without
  this, every wait in a batched branch doubles the conjunctions of what follows."""
  todo = set(conjs)
  while True:
    pair = next(((c, lit) for c in todo for lit in c
                 if (c - {lit}) | {lit.negated()} in todo), None)
    if pair is None:
      return todo
    c, lit = pair
    todo -= {c, (c - {lit}) | {lit.negated()}}
    todo.add(c - {lit})


def _simplified(conjs) -> frozenset:
  """Consistent conjunctions, merged where they differ in one literal's sign
  (resolution), none implied by a smaller one (absorption)."""
  kept = sorted(_resolved({c for c in conjs if _consistent(c)}), key=len)
  out = []
  for c in kept:
    if not any(k <= c for k in out):
      out.append(c)
  return frozenset(out)


def _and(cond: frozenset, lits: frozenset) -> frozenset:
  return _simplified(c | lits for c in cond)


def _and_not(cond: frozenset, lits: frozenset) -> frozenset:
  return _simplified(c | {lit.negated()} for c in cond for lit in lits)


def pausable(jaxpr: Jaxpr) -> bool:
  """Whether a block holds a wait outside loops (directly, in a branch or a call)."""
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in WAITS:
      return True
    if name == "cond" or name in CALLS:
      if any(pausable(getattr(s, "jaxpr", s)) for s in _nested(eqn)):
        return True
  return False


def _nested(eqn: Any) -> list:
  subs = []
  for value in eqn.params.values():
    for v in (value if isinstance(value, (tuple, list)) else (value,)):
      if isinstance(v, (ClosedJaxpr, Jaxpr)):
        subs.append(v)
  return subs


def _flatten(jaxpr: Jaxpr, scope: int, guard: frozenset, stmts: list,
             scopes: Callable[[], int]) -> None:
  key = lambda s, v: v if isinstance(v, Literal) else (s, v)
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    subs = _nested(eqn) if name == "cond" or name in CALLS else []
    if not subs or not any(pausable(getattr(s, "jaxpr", s)) for s in subs):
      stmts.append(_Stmt("eqn", guard, eqn, scope))
      continue
    operands = eqn.invars[1:] if name == "cond" else eqn.invars
    region = len(stmts)
    if name == "cond":
      stmts.append(_Stmt("cond", guard, eqn, scope))
    ends = []
    for k, sub in enumerate(subs):
      inner, consts = (sub.jaxpr, sub.consts) if isinstance(sub, ClosedJaxpr) else (sub, ())
      s = scopes()
      path = guard | {_Lit(key(scope, eqn.invars[0]), k, True)} if name == "cond" else guard
      stmts.append(_Stmt("bind", path, pairs=tuple(
          [((s, v), _Const(c)) for v, c in zip(inner.constvars, consts)]
          + [((s, v), key(scope, o)) for v, o in zip(inner.invars, operands)])))
      _flatten(inner, s, path, stmts, scopes)
      ends.append([key(s, v) for v in inner.outvars])
    outs = tuple(((scope, v), tuple(e[j] for e in ends)) for j, v in enumerate(eqn.outvars))
    if name == "cond":
      stmts.append(_Stmt("merge", guard, index=key(scope, eqn.invars[0]), outs=outs))
      stmts[region] = dataclasses.replace(stmts[region], end=len(stmts))
    else:
      stmts.append(_Stmt("bind", guard, pairs=tuple((dst, srcs[0]) for dst, srcs in outs)))


def _index_source(s: _Stmt) -> Any:
  v = s.eqn.invars[0]
  return v if isinstance(v, Literal) else (s.scope, v)


class Block:
  """One run of a jaxpr for the devices of `mask`; `step(eqn, ins, mask)` runs one
  equation (the lockstep interpreter), `stack(value)` gives a value its device axis,
  `select(index, values)` picks a branch's value per device, `where(mask, new, old)`
  keeps `old` outside `mask`, `value(literal)` wraps a constant."""

  def __init__(self, interp: Any, mask: Any):
    self.interp, self.block_mask = interp, mask
    self.env: dict[Any, Any] = {}
    self._scopes = itertools.count(1)
    # cond -> (the branch-index values it was computed from, its device mask): consecutive
    # statements on one path share a mask, which would otherwise be traced once each
    self._masks: dict[frozenset, tuple[tuple, Any]] = {}

  def run(self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list:
    for v, c in zip(jaxpr.constvars, consts):
      self.env[(0, v)] = self.interp.value(c)
    for v, a in zip(jaxpr.invars, args):
      self.env[(0, v)] = a
    stmts: list = []
    _flatten(jaxpr, 0, frozenset(), stmts, lambda: next(self._scopes))
    self._schedule(stmts)
    return [self.read(v if isinstance(v, Literal) else (0, v)) for v in jaxpr.outvars]

  # -- values
  def read(self, source: Any) -> Any:
    if isinstance(source, Literal):
      return self.interp.value(source.val)
    if isinstance(source, _Const):
      return self.interp.value(source.value)
    return self.env[source]

  def define(self, key: Any, value: Any, mask: Any) -> None:
    """Sets a variable; where other devices defined it already, only `mask`'s entries."""
    old = self.env.get(key)
    self.env[key] = value if old is None or mask is None else self.interp.merge(mask, value,
                                                                                old)

  def _mask(self, cond: frozenset) -> Any:
    if cond == TRUE:
      return self.block_mask
    conjs = [(conj, [(lit, self.read(lit.source)) for lit in conj]) for conj in cond]
    sources = tuple(value for _, lits in conjs for _, value in lits)
    cached = self._masks.get(cond)
    if cached is not None and all(a is b for a, b in zip(cached[0], sources)):
      return cached[1]
    n = self.interp.n
    masks = []
    for _, lits in conjs:
      m = jnp.ones((n,), jnp.bool_)
      for lit, value in lits:
        index = self.interp.stacked(value)
        m = m & ((index == lit.branch) if lit.holds else (index != lit.branch))
      masks.append(m)
    out = masks[0]
    for m in masks[1:]:
      out = out | m
    out = out if self.block_mask is None else out & self.block_mask
    self._masks[cond] = (sources, out)
    return out

  # -- statements
  def _execute(self, s: _Stmt, cond: frozenset) -> None:
    cond = _and(cond, s.guard)
    if not cond:
      return
    mask = self._mask(cond)
    if s.kind == "bind":
      for dst, src in s.pairs:
        self.define(dst, self.read(src), mask)
    elif s.kind == "merge":
      index = self.read(s.index)
      for dst, srcs in s.outs:
        self.define(dst, self.interp.select(index, [self.read(x) for x in srcs]), mask)
    else:
      eqn = s.eqn
      ins = [self.read(v if isinstance(v, Literal) else (s.scope, v)) for v in eqn.invars]
      with internals.equation_context(eqn):
        outs = self.interp.eqn(eqn, ins, mask)
      for v, o in zip(eqn.outvars, outs):
        self.define((s.scope, v), o, mask)

  def _schedule(self, stmts: list) -> None:
    runnable: dict[int, frozenset] = {0: TRUE}
    waiting: dict[int, frozenset] = {}     # in the order the threads stopped
    while runnable or waiting:
      if not runnable:             # everyone waits: the thread that stopped first goes on
        pc = next(iter(waiting))
        cond = waiting.pop(pc)
        self._execute(stmts[pc], cond)
        runnable[pc + 1] = cond
        continue
      pc = min(runnable)
      cond = runnable.pop(pc)
      while pc < len(stmts) and cond:
        s = stmts[pc]
        if s.kind == "cond" and not self.read(_index_source(s)).batched:
          self._execute(s, cond)    # one branch for every device: a cond, as written
          pc = s.end
        elif s.kind == "cond":      # devices take different branches: run them flattened
          pc += 1
        elif s.kind == "eqn" and s.eqn.primitive.name in WAITS:
          inside = _and(cond, s.guard)
          if inside:                # the devices on its path stop here, the others go on
            waiting[pc] = _simplified(waiting.get(pc, frozenset()) | inside)
          cond = _and_not(cond, s.guard)
          pc += 1
        else:
          self._execute(s, cond)
          pc += 1
        if pc in runnable:          # threads meeting at one statement go on together
          cond = _simplified(cond | runnable.pop(pc))
