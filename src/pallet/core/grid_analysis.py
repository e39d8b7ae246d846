"""Which grid axes may run out of order: a backend-neutral proof from the traced kernel.

A grid means its row-major loop (docs/semantics.md §2). A backend may run the programs
along an axis at once (XLA: under vmap; Triton: as separate programs) only when no
program along it can see what another one wrote. State crosses grid steps through:

* scratch buffers, and scalar-prefetch refs the kernel writes, which persist from one
  step to the next. A step whose value of such a buffer comes from a step with other
  indices on axes `0..a` (the buffer was last overwritten whole before the indices on
  those axes last changed) depends on another program along `a`. Steps that overwrite
  the whole buffer before reading it start afresh (the `pl.when(k == 0): acc[...] = 0`
  of a reduction over a later axis). Reads and writes (whole, or at static positions
  that add up to the whole) are followed in program order through `pl.when`/`cond`
  (conditions on grid indices only are evaluated over the grid), loops and calls;
  under conditions on data a read is assumed possible and a write not certain, and
  the finding is marked uncertain;
* output blocks (aliased or not): a block that steps with different indices on `a`
  visit is shared by programs along `a`, which read or overwrite each other's writes
  (accumulating into a resident output makes the axis a reduction);
* DMAs and semaphores, and block positions that cannot be listed (an output index map
  reading scalar prefetch, grid sizes computed at run time): no proof either way.

`pl.run_scoped` buffers are created afresh at every call, so they carry nothing from
one step to the next.

What runs in parallel (`GridFacts.parallel`), the same on every backend:
* no `dimension_semantics`, or declared "arbitrary": an axis whose programs are
  proven independent and along which some output block moves; every other axis runs
  in order. "arbitrary" promises nothing, so it gets the same proof: running proven
  independent programs at once gives the row-major loop's result;
* declared "parallel": in parallel, unless the kernel certainly carries state across
  the axis (scratch read before it is overwritten, an output block shared and written
  whole or at fixed positions): then a `GridOrderWarning` names the kernel, axis, ref
  and line, and the axis runs in order, as Pallas runs a parallel axis on one TPU core.
  Findings that are only possible (no proof) leave a declaration as it is.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal

from pallet import _internals as internals
from pallet.core import discharge, grid_eval, trace_cache, tracebacks
from pallet.core.dma import uses_dmas
from pallet.core.grid_mapping import BlockMapping
from pallet.core.tracing import KernelDescription
from pallet.errors import GridOrderWarning

_CALLS = ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint",
          "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin")
_READS = ("get", "masked_load")
_ATOMICS = ("atomic_rmw", "atomic_cas")
# Ref accesses -> where their flattened indexer starts among the operands.
_INDEX_START = {"get": 1, "masked_load": 1, "swap": 2, "addupdate": 2, "masked_store": 1,
                "atomic_rmw": 1, "atomic_cas": 1}
STATE_KINDS = ("scratch", "prefetch", "output")


@dataclasses.dataclass(frozen=True)
class Dependence:
  """Why the programs along an axis are not (proven) independent.

  kind: "scratch" / "prefetch" (a buffer carried from step to step), "output" (a block
  shared by programs along the axis), "dma" (DMAs or semaphores), "unlisted" (block
  positions or grid sizes known only at run time). `index` is the scratch, prefetch
  or output number; `certain` is False where the finding rests on conditions on data
  or on positions that may differ per program."""
  kind: str
  ref: str
  index: int | None
  line: str
  detail: str
  certain: bool = True

  @property
  def overrides_parallel(self) -> bool:
    """Whether a "parallel" declaration yields to this finding (the axis runs in order)."""
    return self.certain and self.kind in STATE_KINDS

  def __str__(self) -> str:
    return f"{self.ref + ' ' if self.ref else ''}{self.detail} ({self.line})"


@dataclasses.dataclass(frozen=True)
class AxisFacts:
  """One grid axis: why its programs are not independent (if so) and how it runs."""
  axis: int
  size: int | None
  declared: str | None                 # "parallel", "arbitrary" or None (inferred)
  reasons: tuple[Dependence, ...]      # empty: programs along the axis are independent
  parallel: bool                       # the decision: may run at once / out of order
  moves: bool                          # some output block moves along the axis

  @property
  def independent(self) -> bool:
    return not self.reasons

  @property
  def reason(self) -> Dependence | None:
    return self.reasons[0] if self.reasons else None

  @property
  def overridden(self) -> Dependence | None:
    """The finding that made a declared "parallel" axis run in order, if any."""
    if self.declared != "parallel" or self.parallel:
      return None
    return next(r for r in self.reasons if r.overrides_parallel)


@dataclasses.dataclass(frozen=True)
class GridFacts:
  """The analysis of one kernel: a backend runs `parallel` axes at once or in any
  order, and `sequential` ones in grid order."""
  kernel: str
  source: str
  axes: tuple[AxisFacts, ...]

  @property
  def parallel(self) -> tuple[int, ...]:
    return tuple(a.axis for a in self.axes if a.parallel)

  @property
  def sequential(self) -> tuple[int, ...]:
    return tuple(a.axis for a in self.axes if not a.parallel)

  def describe(self) -> list[str]:
    """One line per axis: how it runs and, when in order, the finding that forced it."""
    lines = []
    for a in self.axes:
      why = "declared" if a.declared else "inferred"
      if a.overridden is not None:
        lines.append(f"axis {a.axis} runs in order although declared parallel: "
                     f"{a.overridden}")
      elif a.parallel and a.declared == "arbitrary":
        lines.append(f"axis {a.axis} runs in parallel (declared arbitrary, proven independent: "
                     f"no state carries along it and its programs write disjoint blocks)")
      elif a.parallel:
        lines.append(f"axis {a.axis} runs in parallel ({why})"
                     + (f"; not proven independent: {a.reason}" if a.reason else ""))
      elif a.declared == "arbitrary":
        lines.append(f"axis {a.axis} runs in order (declared)"
                     + (f"; and needs to: {a.reason}" if a.reason else ""))
      elif a.reason is not None:
        lines.append(f"axis {a.axis} runs in order: {a.reason}")
      else:
        lines.append(f"axis {a.axis} runs in order: no output block moves along it")
    return lines


# ------------------------------------------------------------------ helpers
def is_var(x: Any) -> bool:
  return not isinstance(x, Literal)


def apply_equation(eqn: Any, args: list[Any]) -> list[Any]:
  """Applies an equation's primitive (jax 0.10 returns (subfuns, params), 0.12 params)."""
  return internals.bind_equation(eqn, args, source=False)


def _line(eqn: Any, kernel: KernelDescription) -> str:
  where = internals.equation_source(eqn) if eqn is not None else None
  return f"{where[0]}:{where[1]}" if where else kernel.source


def _steps(flat: Sequence[int], grid: Sequence[int]) -> list[tuple[int, ...]]:
  return [tuple(int(i) for i in np.unravel_index(t, grid)) for t in flat]


# ------------------------------------------------------------------ coverage
# Conditions are boolean arrays over the grid's steps (row-major order), evaluated
# once per `cond`. Inside a branch they hold for the steps that reach it.
@dataclasses.dataclass(frozen=True)
class _Cover:
  """Where a buffer has been overwritten in the current step: whole at the steps
  `whole`, and each region (a bool mask over its elements) at some steps."""
  whole: np.ndarray
  parts: tuple[tuple[np.ndarray, np.ndarray], ...] = ()

  def at(self, region: np.ndarray | None) -> np.ndarray:
    """Steps at which `region` (None: possibly any element) is overwritten."""
    if region is None:
      return self.whole
    hit = self.whole.copy()
    for steps, union in _groups(self.parts):
      if np.all(union[region]):
        hit |= steps
    return hit

  def write(self, region: np.ndarray | None, steps: np.ndarray) -> "_Cover":
    if region is None:
      return self
    if region.all():
      return _Cover(self.whole | steps, self.parts)
    return _normal(self.whole, self.parts + ((steps, region),))


def _groups(parts) -> list[tuple[np.ndarray, np.ndarray]]:
  """Parts with the same steps, their regions united."""
  groups: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
  for steps, region in parts:
    key = np.packbits(steps).tobytes()
    old = groups.get(key)
    groups[key] = (steps, region if old is None else old[1] | region)
  return list(groups.values())


def _normal(whole: np.ndarray, parts) -> _Cover:
  """Parts of equal regions merged, regions that add up to the whole buffer moved
  into `whole`, parts already covered dropped."""
  by_region: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
  for steps, region in parts:
    key = np.packbits(region).tobytes()
    old = by_region.get(key)
    by_region[key] = (steps if old is None else old[0] | steps, region)
  whole = whole.copy()
  for steps, union in _groups(by_region.values()):
    if union.all():
      whole |= steps
  kept = tuple((steps & ~whole, region) for steps, region in by_region.values()
               if np.any(steps & ~whole))
  return _Cover(whole, kept)


def _region(eqn: Any, start: int) -> np.ndarray | None:
  """The elements of its ref an access touches, as a mask, when its indices are
  static (integers and slices); None otherwise."""
  ref_aval = eqn.invars[0].aval
  shape = tuple(getattr(ref_aval, "inner_aval", ref_aval).shape)
  tree = eqn.params["tree"]
  transforms = jax.tree_util.tree_unflatten(tree, eqn.invars[start:start + tree.num_leaves])
  elements = np.arange(math.prod(shape)).reshape(shape)
  for t in transforms:
    if not isinstance(t, internals.NDIndexer):
      return None
    index = []
    for i in t.indices:
      if isinstance(i, internals.Slice):
        begin = _static_int(i.start)
        if begin is None or not isinstance(i.size, (int, np.integer)):
          return None
        index.append(slice(begin, begin + i.size * i.stride, i.stride))
      else:
        value = _static_int(i)
        if value is None:
          return None
        index.append(value)
    elements = elements[tuple(index)]
  mask = np.zeros(math.prod(shape), bool)
  mask[np.ravel(elements)] = True
  return mask


def _static_int(x: Any) -> int | None:
  if isinstance(x, Literal):
    x = x.val
  if isinstance(x, (int, np.integer)) or (isinstance(x, np.ndarray) and x.shape == ()
                                          and np.issubdtype(x.dtype, np.integer)):
    return int(x)
  return None


# ------------------------------------------------------------------ grid-only values
class _Scope:
  """One jaxpr of the body; knows which of its values depend only on the grid indices."""

  def __init__(self, jaxpr: Any, consts: Sequence[Any], invar_fns: Sequence[Any]):
    self.jaxpr = jaxpr
    self.consts = dict(zip(jaxpr.constvars, consts))
    self.invar_fns = dict(zip(jaxpr.invars, invar_fns))
    self.producer = {v: (eqn, k) for eqn in jaxpr.eqns for k, v in enumerate(eqn.outvars)}
    self.fns: dict[Any, Any] = {}

  def grid_only(self, x: Any) -> Callable[[Sequence[Any], dict, Callable], Any] | None:
    """`x` as a function `fn(ids, cache, apply)` of the grid indices (equations run
    by `apply`: `apply_equation` or NumPy's), or None when it depends on anything else."""
    if not is_var(x):
      return functools.partial(_constant, x.val, x.aval.dtype)
    if x in self.fns:
      return self.fns[x]
    fn = None
    if x in self.consts:
      fn = functools.partial(_constant, self.consts[x], None)
    elif x in self.invar_fns:
      fn = self.invar_fns[x]
    elif x in self.producer:
      eqn, k = self.producer[x]
      args = [self.grid_only(v) for v in eqn.invars]
      if not eqn.effects and all(a is not None for a in args):
        fn = functools.partial(_equation_value, (id(self), id(eqn)), eqn, k, args)
    self.fns[x] = fn
    return fn


def _constant(val: Any, dtype: Any, ids: Sequence[Any], cache: dict, apply: Callable) -> Any:
  if apply is grid_eval.apply_equation:   # NumPy: one scalar per grid point
    if np.ndim(val):
      raise grid_eval.Unsupported("a non-scalar constant")
    return np.asarray(val, dtype)
  return val


def _equation_value(key: Any, eqn: Any, k: int, args: list, ids: Sequence[Any],
                    cache: dict, apply: Callable) -> Any:
  if key not in cache:
    cache[key] = apply(eqn, [a(ids, cache, apply) for a in args])
  return cache[key][k]


# ------------------------------------------------------------------ the body walk
@dataclasses.dataclass
class _Access:
  slot: int
  kind: str           # "read", "write", "update" (read and write), "atomic"
  exposed: np.ndarray | None  # steps where it may read the value the step started
                              # with (buffers that persist across steps only)
  eqn: Any
  exact: bool         # not under a condition on data nor in a while loop
  fixed: bool         # indexes the ref at positions fixed for every step and program


class _Walker:
  """Follows the accesses to the kernel's refs in program order, over every grid
  step at once: which steps may read a value the step did not write itself."""

  def __init__(self, grid: tuple[int, ...], state: set[int]):
    self.grid = grid
    self.n = math.prod(grid)
    self.state = state          # the refs whose coverage is followed
    self.accesses: list[_Access] = []

  def nowhere(self) -> _Cover:
    return _Cover(np.zeros(self.n, bool))

  def values(self, fn: Callable) -> np.ndarray | None:
    """A grid-only value at every step; None if it cannot be evaluated."""
    coords = np.indices(self.grid).reshape(len(self.grid), self.n).astype(np.int32)
    try:   # NumPy first: eager JAX ops compile a program per primitive
      return np.broadcast_to(fn(list(coords), {}, grid_eval.apply_equation), (self.n,))
    except Exception:  # noqa: BLE001 - Unsupported, or a case NumPy gets wrong: JAX's path decides
      pass
    try:
      with internals.eval_context():
        out = jax.vmap(lambda *ids: jnp.broadcast_to(fn(ids, {}, apply_equation), ()))(
            *[jax.device_put(c) for c in coords])
    except Exception:  # noqa: BLE001 - e.g. no batching rule: treated as a condition on data
      return None
    return np.asarray(out).reshape(self.n)

  def walk(self, scope: _Scope, refs: dict, may: np.ndarray, covered: dict,
           exact: bool) -> dict:
    used = {v for e in scope.jaxpr.eqns for v in e.invars if is_var(v)}
    used.update(v for v in scope.jaxpr.outvars if is_var(v))
    covered = dict(covered)
    everywhere = np.ones(self.n, bool)
    for eqn in scope.jaxpr.eqns:
      operands = [refs[v] for v in eqn.invars if is_var(v) and v in refs]
      if not operands:
        continue
      name = eqn.primitive.name
      if name in _INDEX_START and is_var(eqn.invars[0]) and eqn.invars[0] in refs:
        slot = refs[eqn.invars[0]]
        reads = name != "masked_store" and (name != "swap" or eqn.outvars[0] in used)
        kind = ("atomic" if name in _ATOMICS else "read" if name in _READS
                else "update" if reads else "write")
        exposed = None
        if slot in self.state:
          cover = covered.get(slot, self.nowhere())
          region = _region(eqn, _INDEX_START[name])
          exposed = may & ~cover.at(region) if reads else np.zeros(self.n, bool)
          if name == "swap":   # what it leaves does not depend on what was there
            covered[slot] = cover.write(region, everywhere)
        self.accesses.append(_Access(slot, kind, exposed, eqn, exact, _fixed(scope, eqn)))
      elif name == "cond":
        covered = self._cond(scope, eqn, refs, may, covered, exact)
      elif name == "while":
        self._while(scope, eqn, refs, may, covered)
      elif name == "scan":
        covered = self._scan(scope, eqn, refs, may, covered, exact)
      elif name in _CALLS and _call_jaxpr(eqn) is not None:
        sub = _call_jaxpr(eqn)
        child = _child(scope, sub, eqn.invars)
        covered = self.walk(child, _sub_refs(refs, sub.jaxpr.invars, eqn.invars), may,
                            covered, exact)
      else:   # anything else touching a ref (DMAs, unknown primitives): a possible read
        for slot in operands:
          exposed = (may & ~covered.get(slot, self.nowhere()).whole if slot in self.state
                     else None)
          self.accesses.append(_Access(slot, "update", exposed, eqn, False, False))
    return covered

  def _cond(self, scope, eqn, refs, may, covered, exact):
    branches = eqn.params["branches"]
    operands = eqn.invars[1:]
    # The condition matters only to buffers that persist across steps.
    index = None
    if any(refs[v] in self.state for v in operands if is_var(v) and v in refs):
      index = scope.grid_only(eqn.invars[0])
    picked = None if index is None else self.values(index)
    if picked is not None:
      picked = np.clip(picked, 0, len(branches) - 1)
    results = []
    for b, branch in enumerate(branches):
      sel = np.ones(self.n, bool) if picked is None else picked == b
      child = _child(scope, branch, operands)
      results.append((sel, self.walk(child, _sub_refs(refs, branch.jaxpr.invars, operands),
                                     may & sel, covered, exact and picked is not None)))
    out = {}
    for slot in set(covered) | {s for _, r in results for s in r}:
      covers = [r.get(slot, self.nowhere()) for _, r in results]
      if picked is None:   # a condition on data: covered where every branch covers
        out[slot] = _Cover(np.logical_and.reduce([c.whole for c in covers]),
                           covered.get(slot, self.nowhere()).parts)
      else:
        out[slot] = _normal(
            np.logical_or.reduce([sel & c.whole for (sel, _), c in zip(results, covers)]),
            tuple((sel & steps, region) for (sel, _), c in zip(results, covers)
                  for steps, region in c.parts))
    return out

  def _while(self, scope, eqn, refs, may, covered):
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cond, body = eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]
    cond_ops = eqn.invars[:nc] + eqn.invars[nc + nb:]
    body_ops = eqn.invars[nc:nc + nb] + eqn.invars[nc + nb:]
    for sub, ops in ((cond, cond_ops), (body, body_ops)):
      self.walk(_child(scope, sub, ops, grid_only=False),
                _sub_refs(refs, sub.jaxpr.invars, ops), may, covered, False)

  def _scan(self, scope, eqn, refs, may, covered, exact):
    jaxpr, consts, _, _ = internals.scan_layout(eqn.params)
    child = _Scope(jaxpr, consts, [None] * len(jaxpr.invars))
    inner = self.walk(child, _sub_refs(refs, jaxpr.invars, eqn.invars), may, covered, exact)
    return inner if eqn.params.get("length", 0) > 0 else covered


def _call_jaxpr(eqn: Any) -> Any:
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    sub = eqn.params.get(key)
    if sub is not None and hasattr(sub, "jaxpr") and hasattr(sub, "consts"):
      return sub
    if sub is not None and hasattr(sub, "eqns"):
      return ClosedJaxpr(sub, ())
  return None


def _child(scope: _Scope, closed: Any, operands: Sequence[Any], grid_only: bool = True) -> _Scope:
  jaxpr = closed.jaxpr
  fns = [scope.grid_only(v) if grid_only else None for v in operands]
  return _Scope(jaxpr, closed.consts, fns)


def _sub_refs(refs: dict, invars: Sequence[Any], operands: Sequence[Any]) -> dict:
  return {inner: refs[outer] for inner, outer in zip(invars, operands)
          if is_var(outer) and outer in refs}


def _fixed(scope: _Scope, eqn: Any) -> bool:
  """Whether an access indexes its ref at the same positions at every step (no mask,
  indices that are literals or constants)."""
  if eqn.params.get("has_mask") or eqn.primitive.name in ("masked_load", "masked_store"):
    return False
  start = _INDEX_START[eqn.primitive.name]
  flat = eqn.invars[start:start + eqn.params["tree"].num_leaves]
  return all(not is_var(v) or v in scope.consts for v in flat)


# ------------------------------------------------------------------ the analysis
@trace_cache.kernel_cache
def analyse(kernel: KernelDescription) -> GridFacts:
  """Per grid axis: whether its programs are independent, why not, and how it runs.
  Warns (once per kernel) where a declared "parallel" axis has to run in order."""
  facts = _analyse(kernel)
  for a in facts.axes:
    r = a.overridden
    if r is not None:
      tracebacks.warn(
          f"kernel '{kernel.name}' ({kernel.source}): grid axis {a.axis} is declared "
          f"\"parallel\", but {r}. pallet runs axis {a.axis} in order (as Pallas runs a "
          f"parallel axis on one TPU core); declare it \"arbitrary\" to silence this, or "
          f"make its programs independent", GridOrderWarning)
  return facts


def _analyse(kernel: KernelDescription) -> GridFacts:
  gm = kernel.grid_mapping
  grid, G = gm.grid, len(gm.grid)
  n_pre, n_in, n_out = len(gm.prefetch_avals), len(gm.inputs), len(gm.outputs)
  static = all(n is not None for n in grid)
  if not G or (static and math.prod(grid) == 0):   # nothing to order
    declared = gm.dimension_semantics or (None,) * G
    return GridFacts(kernel.name, kernel.source, tuple(
        AxisFacts(g, grid[g], declared[g], (), declared[g] == "parallel", False)
        for g in range(G)))

  def name(slot: int) -> str:
    names = kernel.ref_names
    return f" ('{names[slot]}')" if slot < len(names) and names[slot] else ""

  reasons: list[list[Dependence]] = [[] for _ in range(G)]
  if uses_dmas(kernel.jaxpr.jaxpr):
    for g in range(G):
      reasons[g].append(Dependence("dma", "", None, kernel.source,
                                   "the kernel uses DMAs or semaphores, whose state carries "
                                   "from one grid step to the next", certain=False))
  moves = [False] * G
  if not static:
    for g in range(G):
      reasons[g].append(Dependence("unlisted", "", None, kernel.source,
                                   "grid sizes are computed at run time", certain=False))
  else:
    by_slot, end = _walk(kernel)
    # buffers that persist across steps: scratch, and prefetch refs the kernel writes
    n_refs = n_pre + n_in + n_out + len(gm.scratch_avals)
    state = [(s, "scratch", s - n_pre - n_in - n_out) for s in range(n_pre + n_in + n_out,
                                                                      n_refs)]
    state += [(s, "prefetch", s) for s in range(n_pre)
              if any(a.kind != "read" for a in by_slot.get(s, []))]
    for slot, kind, k in state:
      cover = end.get(slot)
      found = _carried(grid, by_slot.get(slot, []),
                       cover.whole if cover is not None else np.zeros(math.prod(grid), bool))
      for g, (t, src, acc) in found.items():
        steps = _steps([src, t], grid)
        reasons[g].append(Dependence(
            kind, f"{kind} {k}{name(slot)}", k, _line(acc.eqn, kernel),
            f"is read at step {steps[1]} before that step overwrites it, so it sees what "
            f"step {steps[0]} or a later one wrote (another program along axis {g})",
            certain=all(a.exact for a in by_slot[slot])))
    moves = _output_conflicts(kernel, by_slot, reasons, name)
  axes = []
  for g in range(G):
    declared = None if gm.dimension_semantics is None else gm.dimension_semantics[g]
    rs = tuple(reasons[g]) if grid[g] != 1 else ()
    if declared == "parallel":
      parallel = not any(r.overrides_parallel for r in rs)
    else:   # "arbitrary" or undeclared: in order unless proven independent
      parallel = not rs and moves[g]
    axes.append(AxisFacts(g, grid[g], declared, rs, parallel, moves[g]))
  return GridFacts(kernel.name, kernel.source, tuple(axes))


def _walk(kernel: KernelDescription) -> tuple[dict[int, list[_Access]], dict[int, _Cover]]:
  """The accesses to each ref (numbered as the kernel's ref parameters) and where
  each is overwritten by the end of a step."""
  gm = kernel.grid_mapping
  G = len(gm.grid)
  jaxpr = kernel.jaxpr.jaxpr
  top = _Scope(jaxpr, kernel.jaxpr.consts,
               [(lambda ids, cache, apply, g=g: ids[g]) for g in range(G)]
               + [None] * (len(jaxpr.invars) - G))
  n_pre, n_io = len(gm.prefetch_avals), len(gm.inputs) + len(gm.outputs)
  state = set(range(n_pre)) | set(range(n_pre + n_io, n_pre + n_io + len(gm.scratch_avals)))
  walker = _Walker(tuple(gm.grid), state)
  refs = {v: s for s, v in enumerate(jaxpr.invars[G:])}
  end = walker.walk(top, refs, np.ones(walker.n, bool), {}, True)
  by_slot: dict[int, list[_Access]] = {}
  for acc in walker.accesses:
    by_slot.setdefault(acc.slot, []).append(acc)
  return by_slot, end


def _carried(grid: tuple[int, ...], accesses: list[_Access], covered_end: np.ndarray
             ) -> dict[int, tuple[int, int, _Access]]:
  """Axis -> (step, writer step, read) for the first read that sees a value written
  under other indices on axes 0..axis; axes not listed are free of this buffer."""
  reads = [a for a in accesses if a.exposed.any()]
  if not reads:
    return {}
  n = math.prod(grid)
  exposed = np.logical_or.reduce([a.exposed for a in reads])
  # A step that overwrites the buffer whole before reading it starts a new value; the
  # value a step reads was written from the last such step before it on.
  kill = covered_end & ~exposed
  last_kill = np.maximum.accumulate(np.where(kill, np.arange(n), 0))
  source = np.concatenate([[0], last_kill[:-1]])
  found = {}
  for g in range(len(grid)):
    stride = math.prod(grid[g + 1:])
    bad = np.flatnonzero(exposed & (np.arange(n) // stride != source // stride))
    if bad.size:
      t = int(bad[0])
      found[g] = (t, int(source[t]), next(a for a in reads if a.exposed[t]))
  return found


def _output_conflicts(kernel: KernelDescription, by_slot: dict, reasons: list[list[Dependence]],
                      name: Callable[[int], str]) -> list[bool]:
  """Adds, per axis, the output blocks that several programs along it visit; returns
  per axis whether some output block moves along it."""
  gm = kernel.grid_mapping
  grid, G = gm.grid, len(gm.grid)
  n_pre, n_in = len(gm.prefetch_avals), len(gm.inputs)
  coords = np.indices(grid).reshape(G, -1)
  moves = [False] * G
  for o, mapping in enumerate(gm.outputs):
    slot = n_pre + n_in + o
    table = block_table(mapping, grid)
    accesses = by_slot.get(slot, [])
    writes = any(a.kind != "read" for a in accesses)
    if table is None:
      moves = [True] * G
      if writes:
        for g in range(G):
          reasons[g].append(Dependence(
              "unlisted", f"output {o}{name(slot)}", o, kernel.source,
              "has block positions that depend on scalar-prefetch data", certain=False))
      continue
    for g in range(G):
      moves[g] |= bool(np.any(table != np.take(table, [0], axis=g)))
    if not writes:
      continue
    flat = table.reshape(math.prod(grid), table.shape[-1])
    windows = _overlap_runs(flat, mapping)
    block_id = _row_ids(windows) if flat.shape[1] else np.zeros(len(flat), np.int64)
    if block_id.max(initial=-1) + 1 == len(block_id):
      continue     # every step has its own block
    order = np.argsort(block_id, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(block_id[order]) != 0])
    ends = np.r_[starts[1:], len(order)]
    atomic_only = all(a.kind == "atomic" for a in accesses if a.kind != "read")
    fixed = all(a.fixed for a in accesses)
    how = ("updates it with atomics only" if atomic_only else
           "writes it at the same positions in every program" if fixed else
           "writes it at positions that may differ per program")
    for g in range(G):
      c = coords[g][order]
      shared = np.flatnonzero(np.minimum.reduceat(c, starts) != np.maximum.reduceat(c, starts))
      if not shared.size:
        continue
      members = order[starts[shared[0]]:ends[shared[0]]]
      one, other, overlap = _sharing_pair(flat, members, coords[g], mapping)
      steps = _steps([one, other], grid)
      first, second = (tuple(int(v) for v in flat[m]) for m in (one, other))
      where = (f"block {first} is visited by steps {steps[0]} and {steps[1]}"
               if first == second else
               f"the pl.Element windows at {first} and {second} (steps {steps[0]} and "
               f"{steps[1]}) {'overlap' if overlap else 'may overlap'}")
      reasons[g].append(Dependence(
          "output", f"output {o}{name(slot)}", o, _line(accesses[0].eqn, kernel),
          f"{where}, which differ along axis {g}; the kernel {how}",
          certain=fixed and not atomic_only and overlap))
  return moves


def _row_ids(rows: np.ndarray) -> np.ndarray:
  """`np.unique(rows, axis=0, return_inverse=True)[1]`: each row's rank among the
  distinct rows. Integer rows become one integer key each, in the same order (mixed
  radix over the columns' ranges), where the keys fit: a 1-D sort, where sorting
  whole rows took milliseconds for grids of a few thousand steps."""
  if rows.dtype.kind in "iu" and len(rows):
    low = rows.min(axis=0).astype(object)
    spans = [int(s) for s in rows.max(axis=0).astype(object) - low + 1]
    if math.prod(spans) < 2 ** 62:
      keys = np.zeros(len(rows), np.int64)
      for c, span in enumerate(spans):
        keys = keys * span + (rows[:, c].astype(np.int64) - int(low[c]))
      return np.unique(keys, return_inverse=True)[1].reshape(-1)
  return np.unique(rows, axis=0, return_inverse=True)[1].reshape(-1)


def _overlap_runs(flat: np.ndarray, mapping: BlockMapping) -> np.ndarray:
  """Block positions (one row per step) with each `pl.Element` offset replaced by its
  run of overlapping windows, so that steps whose windows may share an element get the
  same position: distinct offsets closer than the window size overlap, and a chain of
  such offsets is one run (sound: two windows of a run may not overlap after all)."""
  out = flat.copy()
  for d, dim in enumerate(mapping.dims):
    if dim.kind != "element":
      continue
    offsets = np.unique(flat[:, d])
    run = np.concatenate([[0], np.cumsum(np.diff(offsets) >= dim.size)])
    out[:, d] = run[np.searchsorted(offsets, flat[:, d])]
  return out


def _sharing_pair(flat: np.ndarray, members: np.ndarray, along: np.ndarray,
                  mapping: BlockMapping) -> tuple[int, int, bool]:
  """Two steps of one overlap run that differ in `along` (grid coordinates), with
  whether their windows certainly share an element; pairs that do are preferred."""
  element = np.array([d.kind == "element" for d in mapping.dims], bool)
  sizes = np.array([d.size for d in mapping.dims], np.int64)
  for m in members[:64]:
    diff = np.abs(flat[members] - flat[m])
    shares = np.all(np.where(element, diff < sizes, diff == 0), axis=1)
    hits = np.flatnonzero(shares & (along[members] != along[m]))
    if hits.size:
      return int(m), int(members[hits[0]]), True
  other = next(m for m in members if along[m] != along[members[0]])
  return int(members[0]), int(other), False


def writes_prefetch(kernel: KernelDescription) -> bool:
  """Whether the kernel writes a scalar-prefetch ref (SMEM on a TPU: paged attention
  keeps flags there), state that then carries from one grid step to the next."""
  gm = kernel.grid_mapping
  n_ids = len(gm.grid) + len(gm.dynamic_axes)
  invars = kernel.jaxpr.jaxpr.invars
  prefetch = set(range(n_ids, n_ids + len(gm.prefetch_avals)))
  # an effect names its ref by input position or by variable, depending on the jaxpr
  written = {e.input if isinstance(e.input, int) else invars.index(e.input)
             for e in kernel.jaxpr.effects if isinstance(e, internals.WriteEffect)}
  return bool(written & prefetch)


def block_table(mapping: BlockMapping, grid: tuple[int, ...]) -> np.ndarray | None:
  """The index map's results at every grid step (shape grid + (ndim,)), or None when
  they depend on scalar-prefetch data. The one block table of the planner, the
  accumulator rewrites and the checking mode."""
  im = mapping.index_map
  ndim = len(mapping.array_shape)
  n_prefetch = len(im.jaxpr.invars) - len(grid)
  if n_prefetch and _reads_inputs(im.jaxpr, len(grid)):
    return None
  n = math.prod(grid)
  if n == 0 or ndim == 0:
    return np.zeros((*grid, ndim), np.int64)
  values = grid_eval.values_over_grid(im.jaxpr, im.consts, im.jaxpr.outvars[:ndim], grid)
  if values is not None:
    return np.stack([v.astype(np.int64) for v in values], -1)
  pure = discharge.discharge_state(im) if n_prefetch else im
  avals = [getattr(v.aval, "inner_aval", v.aval) for v in im.jaxpr.invars[len(grid):]]
  dummies = [jnp.zeros(a.shape, a.dtype) for a in avals]
  coords = np.indices(grid).reshape(len(grid), n).astype(np.int32)
  at = lambda *ids: jax.core.eval_jaxpr(pure.jaxpr, pure.consts, *ids, *dummies)[:ndim]
  with internals.eval_context():
    outs = jax.vmap(at)(*[jax.device_put(c) for c in coords]) if grid else at()
    outs = [np.broadcast_to(np.asarray(o, np.int64), (n,)) for o in outs]
  return np.stack(outs, -1).reshape(*grid, ndim)


def _reads_inputs(jaxpr: Any, first: int) -> bool:
  """Whether the outputs of `jaxpr` depend on its inputs from `first` on."""
  tainted = set(jaxpr.invars[first:])
  for eqn in jaxpr.eqns:
    if any(is_var(v) and v in tainted for v in eqn.invars):
      tainted.update(eqn.outvars)
  return any(is_var(v) and v in tainted for v in jaxpr.outvars)


# (step, step) pairs `window_overlaps` compares at most
MAX_WINDOW_PAIRS = 1 << 24


def window_overlaps(starts_a: np.ndarray, sizes_a: np.ndarray, starts_b: np.ndarray,
                    sizes_b: np.ndarray) -> np.ndarray | None:
  """(n_a, n_b) bool: whether window p of `a` and window q of `b` share an element
  (per window, a start and a size for each array dimension); None where there are
  more than MAX_WINDOW_PAIRS pairs to compare."""
  if len(starts_a) * len(starts_b) > MAX_WINDOW_PAIRS:
    return None
  return np.all((starts_a[:, None, :] < starts_b[None, :, :] + sizes_b[None, :, :])
                & (starts_b[None, :, :] < starts_a[:, None, :] + sizes_a[:, None, :]), axis=-1)
