"""Grid analysis for the XLA backend: which grid axes to vectorize and which to loop.

The plan is made at trace time from the `GridMapping` and the kernel body. Index
maps are evaluated over the whole grid with concrete numbers, giving each operand
a table of block positions. From the tables and `body_analysis`:

* parallel axes: those `grid_analysis` lets run out of order (programs proven
  independent and some output block moving along them, or declared "parallel" and
  not proven to carry state); the others are sequential axes, run in grid order;
* vectorized axes: parallel axes along which every output tiles one dimension
  exactly (block index = grid index + const, so programs write disjoint blocks)
  and every input stays put or tiles: the blocks of all programs are a reshape
  of one slab and the body runs once under `vmap`. Inputs that move otherwise
  (strided, permuted, overlapping blocks) have their blocks gathered per program.
  Axes that feed a while-loop trip count stay looped (under vmap every program
  would run the longest loop);
* merged axes: a sequential axis of proven accumulators (`o = maybe_zeroed(o) +
  f(inputs)`, zeroed exactly on the first step or never) whose term is a
  block-wide sum (a column sum, or a matrix product contracting along the axis)
  runs at once on input blocks widened along it: one plain reduction or product;
* summed axes: otherwise, sequential axes of proven accumulators whose body
  multiplies matrices are vectorized too: the body runs with `o = 0` and the
  per-step results are summed;
* looped axes: the remaining parallel axes (outer loop) and sequential axes
  (inner loop). Output blocks stay resident across the inner loop when they do
  not move along it;
* chunks: when vectorizing a whole axis would create intermediates far larger
  than the kernel's operands, only a divisor of it is vectorized and the rest
  looped, so memory stays a small multiple of the operands' size;
* scalar prefetch: index maps that read it give block positions only at run time
  (evaluated over the grid on the data, once per call). Such inputs are gathered per
  program on vectorized axes; prefetch values are read unbatched; sequential axes
  loop (the data may decide the accumulation);
* everything looped: grid sizes computed at run time (one loop with a traced
  trip count, index maps run per step), scalar prefetch the kernel writes or that
  places output blocks, DMAs/semaphores (exact grid order), and
  bodies that do not run under vmap (a primitive without a batching rule, one known
  to mis-batch, or a rule that failed when traced).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxprs_in_params, subjaxprs
from jax.interpreters import batching

from pallet.core import grid_analysis, grid_eval
from pallet.core.dma import uses_dmas
from pallet.backends.xla import aliased_reads, bounded_loops
from pallet.backends.xla.body_analysis import (BodyFacts, analyse_body, itemsize,
                                                blocks_merge_along, discharged,
                                                evaluate_resets, max_intermediate_bytes,
                                                trip_count_axes)
from pallet.core.grid_mapping import BlockMapping, GridMapping
from pallet.core.tracing import KernelDescription

# Primitives whose batching rule is known to give wrong shapes for the operands
# kernels give them (found only when lowering, too late to re-plan): their kernels
# never run under vmap. threefry2x32's broadcasting rule mis-shapes its result when
# unbatched (1, 1) keys meet a batched block of counts.
KNOWN_UNBATCHABLE = ("threefry2x32",)
# Vectorized programs may together create at most this many times the bytes of
# the kernel's operands (but always this floor), before axes are chunked.
# A pl.when around a matrix product, decided by program ids alone, that this share of
# the grid's steps skip keeps the axes deciding it looped (see _skipping_axes).
SKIPPED_WORK_TO_LOOP = 0.25
# Loops with a static trip-count bound run as masked fixed-length loops, and the axes
# feeding their trip counts are vectorized, when looping those axes would leave each
# grid step less arithmetic than this (bounded_loops.py; measured in
# docs/performance.md: below it a step's launches cost more than its work).
LOOP_STEP_FLOPS = 4e6
# Grid loops of at most this many steps in all are unrolled (executor._loop); so are
# loops in which pl.when on program ids alone skips the body's matrix products on some
# steps, when at most GRID_UNROLL_PRODUCT_STEPS steps compute them and at most
# GRID_UNROLL_MAX_STEPS steps run in all (measured in docs/performance.md).
GRID_UNROLL_STEPS = 4
GRID_UNROLL_PRODUCT_STEPS = 16
GRID_UNROLL_MAX_STEPS = 64
MEMORY_MULTIPLE = 4
MEMORY_FLOOR_BYTES = 32 << 20


@dataclasses.dataclass
class OperandPlan:
  """How one operand is cut at each loop step."""
  mapping: BlockMapping
  pad: tuple[tuple[int, int], ...]          # padding added to each array dimension
  table: np.ndarray | None                  # grid + (ndim,) element starts, after padding
  tiled_by: dict[int, int]                  # vectorized axis -> array dimension it tiles
  gathered: bool = False                    # blocks gathered per program (do not tile)


@dataclasses.dataclass
class ExecutionPlan:
  """The schedule of one kernel on the XLA backend."""
  grid: tuple[int, ...]
  vectorized: list[int]      # vmap levels, outermost first: summed axes, then parallel ones
  chunk: dict[int, int]      # vectorized axis -> programs per vmap (its size unless chunked)
  summed: list[int]          # sequential axes vectorized, outputs summed over them
  merged: list[int]          # sequential axes run at once by widening input blocks
  outer: list[int]           # looped outside: parallel axes (chunked ones by chunk)
  inner: list[int]           # looped inside: sequential axes (chunked summed ones by chunk)
  inputs: list[OperandPlan]
  outputs: list[OperandPlan]
  resident_outputs: bool     # outputs carried across the inner loop
  keep_initial: list[bool]   # summed plans: output starts from its initial value (no reset)
  reasons: list[str]
  bounded_loops: bool = False   # while loops run as masked fixed-length loops (bounded_loops.py)
  unrolled: bool = False        # the grid loops are unrolled (GRID_UNROLL_STEPS)
  # (input, output) aliased pairs whose input blocks are read from the output's buffer
  # as it stands at each step (aliased_reads.py); only fully looped plans have them
  shared_reads: tuple[tuple[int, int], ...] = ()

  def loop_size(self, g: int) -> int | None:
    """Iterations axis `g` contributes to the loop it belongs to (None: traced)."""
    return None if self.grid[g] is None else self.grid[g] // self.chunk.get(g, 1)

  def describe(self) -> str:
    chunked = {g: b for g, b in self.chunk.items() if b != self.grid[g]}
    head = (f"grid {self.grid}: vectorized axes {self.vectorized}"
            + (f" (summed {self.summed})" if self.summed else "")
            + (f", merged into blocks {self.merged}" if self.merged else "")
            + (f", chunks {chunked}" if chunked else "")
            + f", outer loop {self.outer}, inner loop {self.inner}, outputs "
            + ("resident across the inner loop" if self.resident_outputs
               else "loaded/stored every step"))
    return "\n".join([head] + [f"  - {r}" for r in self.reasons])


# ------------------------------------------------------------------ index tables
def element_scale(mapping: BlockMapping) -> tuple[np.ndarray, np.ndarray]:
  """(factor, shift) turning index-map results into element offsets of the unpadded
  array: block index * block size, or an Element offset, which counts in the array
  padded by `Element(n, padding=(lo, hi))` (as in Pallas), minus lo."""
  factor = np.array([1 if d.kind == "element" else d.size for d in mapping.dims], np.int64)
  shift = np.array([d.padding[0] if d.kind == "element" else 0 for d in mapping.dims], np.int64)
  return factor, shift


def _element_starts(mapping: BlockMapping, table: np.ndarray) -> np.ndarray:
  factor, shift = element_scale(mapping)
  return table * factor - shift


def _padding(mapping: BlockMapping, starts: np.ndarray | None) -> tuple[tuple[int, int], ...]:
  """Padding that makes every block of the grid lie inside the array."""
  pads = []
  for d, (n, dim) in enumerate(zip(mapping.array_shape, mapping.dims)):
    if starts is None or starts.size == 0:
      # Data-dependent block positions: allow a last partial block and Element padding
      # (an offset in [0, n + lo + hi - size] of the padded array starts at offset - lo).
      lo = dim.padding[0] if dim.kind == "element" else 0
      hi = (-n) % dim.size if dim.kind != "element" else max(dim.padding[1], dim.size)
      pads.append((lo, hi))
      continue
    s = starts[..., d]
    pads.append((int(max(0, -s.min())), int(max(0, s.max() + dim.size - n))))
  return tuple(pads)


def overhang(op: OperandPlan) -> tuple[int, int] | None:
  """(axis of the kernel's block, real width) where every block of `op` starts at the
  same position along that array dimension and runs past the array's end there: its
  lanes from the width on are padding at every step (a Triton-style head dimension of
  72 in a block of 128). The last such dimension; None where there is none."""
  if op.table is None or op.table.size == 0:
    return None
  kept = [d for d, dim in enumerate(op.mapping.dims) if dim.kind != "squeezed"]
  for d in reversed(kept):
    column = op.table[..., d]
    start, lo = int(column.flat[0]), op.pad[d][0]
    width = lo + op.mapping.array_shape[d] - start
    if np.all(column == start) and start >= lo and 0 < width < op.mapping.dims[d].size:
      return kept.index(d), width
  return None


def _varies(table: np.ndarray, axis: int) -> bool:
  return table.shape[axis] > 1 and not np.all(table == np.take(table, [0], axis=axis))


def _tiled_dim(op: OperandPlan, axis: int) -> int | None | bool:
  """The one dimension `op` tiles exactly along grid `axis`; None if it stays put,
  False if its movement along `axis` is anything else."""
  table = op.table
  if table is None:   # block positions are data (scalar prefetch)
    return False
  moving = [d for d in range(table.shape[-1]) if _varies(table[..., d], axis)]
  if not moving:
    return None
  if len(moving) > 1:
    return False
  d = moving[0]
  dim = op.mapping.dims[d]
  step = np.diff(table[..., d], axis=axis)
  if not np.all(step == dim.size):   # blocked or element offsets, contiguous blocks
    return False
  return d


def _tiling(ops: list[OperandPlan], outputs: list[OperandPlan], g: int,
            outputs_move: bool, gather: set[int] | None = None) -> dict[int, int] | str:
  """Operand index -> dimension tiled along axis `g`, or why `g` cannot be vmapped.

  `outputs_move`: every output must tile along `g` (parallel axes, so that the
  programs write disjoint blocks) or must stay put (summed axes). With `gather`,
  inputs that do not tile are added to it instead of failing.
  """
  tiled = {}
  for i, op in enumerate(ops + outputs):
    if op.gathered:
      continue
    d = _tiled_dim(op, g)
    is_output = i >= len(ops)
    if gather is not None and not is_output and (
        d is False or (d is not None and d in op.tiled_by.values())):
      gather.add(i)
      continue
    if d is False:
      return f"{op.mapping.origin} does not tile a single dimension exactly"
    if is_output and outputs_move and d is None:
      return f"{op.mapping.origin} does not move along it"
    if is_output and not outputs_move and d is not None:
      return f"{op.mapping.origin} moves along it"
    if d is not None and d in op.tiled_by.values():
      return f"{op.mapping.origin} is tiled along dimension {d} by two axes"
    if d is not None:
      tiled[i] = d
  return tiled


def _uses_primitive(jaxpr: Any, names: tuple[str, ...]) -> bool:
  """Whether `jaxpr` or any jaxpr nested in it binds one of the named primitives."""
  return has_equation(jaxpr, lambda eqn: eqn.primitive.name in names)


def has_equation(jaxpr: Any, predicate: Callable[[Any], bool]) -> bool:
  """Whether an equation of `jaxpr`, or of a jaxpr nested in it, satisfies `predicate`."""
  if any(predicate(eqn) for eqn in jaxpr.eqns):
    return True
  return any(has_equation(sub, predicate) for sub in subjaxprs(jaxpr))


# ------------------------------------------------------------------ the planner
def make_plan(kernel: KernelDescription, unbatchable: str | None = None) -> ExecutionPlan:
  """Decides, per grid axis, how the kernel runs on XLA (see the module docstring).

  `unbatchable` says why the body cannot run under vmap (a batching rule failed
  when the vectorized plan was traced, see `vectorization_failure`): then no axis
  is vectorized, summed or merged."""
  plan = _axes_plan(kernel, unbatchable)
  steps = [plan.loop_size(g) for g in plan.outer + plan.inner]
  # Effects (checking mode's checks, debug prints) run in grid order in a loop; unrolled,
  # XLA may run their callbacks in any order, and the first failure reported could differ.
  if None in steps or math.prod(steps) <= 1 or discharged(kernel).jaxpr.effects:
    return plan
  total = math.prod(steps)
  if total <= GRID_UNROLL_STEPS:
    plan.unrolled = True
    plan.reasons.append(f"grid loops unrolled: {total} steps, each traced with its grid "
                        f"indices and block starts as constants")
  elif total <= GRID_UNROLL_MAX_STEPS:
    computing = _steps_computing_products(kernel, plan)
    if computing is not None and computing <= GRID_UNROLL_PRODUCT_STEPS:
      plan.unrolled = True
      plan.reasons.append(
          f"grid loops unrolled: {total} steps, of which {computing} compute the body's "
          f"matrix products (pl.when on program ids skips them on the others, resolved "
          f"at trace time)")
  return plan


def _axes_plan(kernel: KernelDescription, unbatchable: str | None) -> ExecutionPlan:
  gm: GridMapping = kernel.grid_mapping
  grid, G = gm.grid, len(gm.grid)
  reasons: list[str] = []
  grid_facts = grid_analysis.analyse(kernel)   # warns where a declaration is overridden

  def operand(mapping: BlockMapping) -> OperandPlan:
    table = None if gm.dynamic_axes else grid_analysis.block_table(mapping, grid)
    if table is None:   # block positions are data: index maps run at run time
      return OperandPlan(mapping, _padding(mapping, None), None, {})
    starts = _element_starts(mapping, table)
    pad = _padding(mapping, starts)
    return OperandPlan(mapping, pad, starts + np.array([lo for lo, _ in pad], np.int64), {})

  inputs = [operand(m) for m in gm.inputs]
  outputs = [operand(m) for m in gm.outputs]

  def looped(order: list[int], resident: bool) -> ExecutionPlan:
    return ExecutionPlan(grid, [], {}, [], [], [], order, inputs, outputs, resident,
                         [True] * len(outputs), reasons)

  unpadded = lambda op: None if op.table is None else op.table - np.array(
      [lo for lo, _ in op.pad], np.int64)
  shared = aliased_reads.shared_pairs(kernel, [unpadded(op) for op in inputs],
                                      [unpadded(op) for op in outputs])
  if gm.dynamic_axes:
    reasons.append(f"axes {list(gm.dynamic_axes)} have sizes computed at run time: the grid "
                   f"runs as one loop with a traced trip count, index maps evaluated per step")
  if shared:
    reasons.append(f"aliased (input, output) pairs {list(shared)} share one buffer and a "
                   f"step may read an input block an earlier step wrote as output: every "
                   f"axis runs as one loop in grid order, outputs stored every step, those "
                   f"inputs read from the outputs' buffers")
  if gm.dynamic_axes or shared:
    plan = looped(list(range(G)), resident=False)
    plan.shared_reads = shared
    return plan
  data_blocks = _data_blocks_loop_everything(kernel, outputs)
  if data_blocks is not None:
    reasons.append(f"index maps read scalar-prefetch operands and {data_blocks}: "
                   f"every axis runs as a loop")
    return looped(list(range(G)), resident=False)

  if uses_dmas(kernel.jaxpr.jaxpr):
    reasons.append("kernel uses DMAs or semaphores, whose state carries from one grid "
                   "step to the next: running the grid in exact row-major order")
    return looped(list(range(G)), _resident(outputs, list(range(G))))

  # Which axes may run out of order: the analysis every backend shares (grid_analysis).
  if gm.dimension_semantics is not None:
    reasons.append(f"dimension_semantics {gm.dimension_semantics} given")
  parallel, sequential = list(grid_facts.parallel), list(grid_facts.sequential)
  reasons.extend(grid_facts.describe())
  trusted = [g for g in parallel if not grid_facts.axes[g].independent]
  if trusted and sequential and min(sequential) < max(parallel):
    reasons.append(f"axes {trusted} are declared parallel without a proof of independence "
                   f"and a sequential axis precedes a parallel one: running the grid in "
                   f"exact row-major order")
    return looped(list(range(G)), _resident(outputs, list(range(G))))

  if unbatchable is None and parallel + sequential:
    unbatchable = _unbatchable_body(kernel)
  if unbatchable is not None:
    reasons.append(f"axes {parallel} looped: {unbatchable}")
    return ExecutionPlan(grid, [], {}, [], [], parallel, sequential, inputs, outputs,
                         _resident(outputs, sequential), [True] * len(outputs), reasons)

  facts = analyse_body(kernel)
  bounded = _bound_loops(kernel, facts, parallel, reasons)
  if bounded:
    body = bounded_loops.bounded_body(kernel).jaxpr
    facts = dataclasses.replace(facts, trip_count_axes=trip_count_axes(body, G),
                                intermediate_bytes=max_intermediate_bytes(body))
  skipping = _skipping_axes(kernel)
  vectorized = []
  for g in parallel:
    if g in facts.trip_count_axes:
      reasons.append(f"axis {g} looped: it feeds a while-loop trip count (vectorized, "
                     f"every program would run the longest loop)")
      continue
    if g in skipping:
      reasons.append(f"axis {g} looped: its program_id decides a pl.when around a matrix "
                     f"product that {skipping[g]:.0%} of the grid's steps skip (vectorized, "
                     f"every program would compute it)")
      continue
    gather: set[int] = set()
    tiled = _tiling(inputs, outputs, g, outputs_move=True, gather=gather)
    if isinstance(tiled, str):
      reasons.append(f"axis {g} looped: {tiled}")
      continue
    _record_tiling(inputs + outputs, g, tiled)
    for i in gather:
      inputs[i].gathered = True
    vectorized.append(g)
    gathered = [inputs[i].mapping.origin for i in sorted(gather)]
    reasons.append(f"axis {g} vectorized (blocks tile their arrays exactly)" if not gathered else
                   f"axis {g} vectorized (outputs tile exactly; blocks of {gathered} "
                   f"gathered per program)")

  if gm.prefetch_avals and sequential:
    reasons.append(f"sequential axes {sequential} looped: the kernel reads scalar-prefetch "
                   f"data, which may decide its accumulation")
    summed, merged, keep_initial = [], [], [True] * len(outputs)
  else:
    summed, merged, keep_initial = _reduction_axes(kernel, facts, sequential, inputs, outputs,
                                                   reasons)
  chunk = {g: grid[g] for g in summed + merged + vectorized}
  _bound_memory(gm, facts, inputs, summed + vectorized, chunk, reasons)
  for g in [g for g in vectorized if chunk[g] == 1]:
    vectorized.remove(g)
    for op in inputs + outputs:
      op.tiled_by.pop(g, None)
    del chunk[g]
  outer = [g for g in parallel if g not in vectorized or chunk[g] < grid[g]]
  inner = [g for g in sequential if g not in summed + merged or chunk[g] < grid[g]]
  return ExecutionPlan(grid, summed + vectorized, chunk, summed, merged, outer, inner, inputs,
                       outputs, _resident(outputs, inner), keep_initial, reasons, bounded)


def _data_blocks_loop_everything(kernel: KernelDescription,
                                 outputs: list[OperandPlan]) -> str | None:
  """Why a kernel with scalar prefetch must run its whole grid as one loop, or None.

  Its inputs' block positions may be data: vectorized programs then gather their
  blocks at positions the index maps compute at run time, and read the prefetch
  operands unbatched. That needs the outputs' positions known at trace time (the
  programs' disjoint blocks are proven from them) and prefetch operands that stay
  as given (a kernel writing them, as SMEM on a TPU, carries state step to step)."""
  gm = kernel.grid_mapping
  if not gm.prefetch_avals:
    return None
  if uses_dmas(kernel.jaxpr.jaxpr):
    return "the kernel uses DMAs or semaphores"
  if grid_analysis.writes_prefetch(kernel):
    return "the kernel writes a scalar-prefetch ref (state carried from step to step)"
  data = [op.mapping.origin for op in outputs if op.table is None]
  if data:
    return f"the block positions of {data[0]} are data"
  return None


def _bound_loops(kernel: KernelDescription, facts: BodyFacts, parallel: list[int],
                 reasons: list[str]) -> bool:
  """Whether to run the body's while loops as masked fixed-length loops, so that the
  parallel axes feeding their trip counts can be vectorized (see bounded_loops.py)."""
  feeding = [g for g in parallel if g in facts.trip_count_axes]
  if not feeding:
    return False
  loops = bounded_loops.bounds(kernel)
  if not loops.bounded and not loops.unbounded:
    return False
  looped_steps = math.prod(kernel.grid_mapping.grid[g] for g in feeding)
  step_flops = sum(b.steps * b.flops for b in loops.bounded) / looped_steps
  if loops.unbounded:
    why = f"{loops.unbounded[0]} has no static bound on its trip count"
  elif any(b.effects for b in loops.bounded):
    why = "a loop body has effects (checks, prints), which a masked step would run"
  elif any(b.gathers for b in loops.bounded):
    why = "a loop gathers at indices read from data (batched, a gather per element)"
  elif step_flops > LOOP_STEP_FLOPS:
    why = (f"looped, each step of axes {feeding} computes about {step_flops:.3g} flops, "
           f"more than the {LOOP_STEP_FLOPS:.3g} below which launching a step costs more")
  else:
    why = None
  if why is not None:
    reasons.append(f"while loops kept: {why}")
    return False
  reasons.append(f"while loops run as masked fixed-length loops ({loops.describe()}): "
                 f"looped, each step of axes {feeding} would compute only about "
                 f"{step_flops:.3g} flops")
  return True


def _skipping_axes(kernel: KernelDescription) -> dict[int, float]:
  """Axes whose program_id decides a top-level `pl.when` (cond) that skips a branch
  holding a matrix product on at least SKIPPED_WORK_TO_LOOP of the grid's steps
  (causal attention's blocks above the diagonal), with that share. Under vmap the
  cond becomes a select and every program computes the product: looping the axis
  (measured: TPU flash attention, causal, 2x faster) lets the skipped steps cost
  nothing. Predicates that read data are not counted."""
  gm = kernel.grid_mapping
  grid = gm.grid
  if not grid or None in grid:
    return {}
  pure = discharged(kernel)
  jaxpr = pure.jaxpr
  ids = jaxpr.invars[:len(grid)]
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  found: dict[int, float] = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name != "cond":
      continue
    heavy = _product_branches(eqn)
    if not heavy or len(heavy) == len(eqn.params["branches"]):
      continue
    table = grid_eval.value_over_grid(jaxpr, pure.consts, eqn.invars[0], grid)
    if table is None:
      continue
    skipped = float(np.mean(~np.isin(table, heavy)))
    if skipped < SKIPPED_WORK_TO_LOOP:
      continue
    for g in _id_dependencies(eqn.invars[0], producer, ids):
      found[g] = max(found.get(g, 0.0), skipped)
  return found


def _steps_computing_products(kernel: KernelDescription, plan: ExecutionPlan) -> int | None:
  """How many steps of the plan's grid loops run a matrix product, where top-level
  `pl.when`s decided by program ids alone skip every product of the body on some steps
  (causal attention's blocks above the diagonal); None where no step skips them all.
  Unrolled, a skipped step traces to nothing; looped, each step pays for the conds."""
  grid = kernel.grid_mapping.grid
  if not grid or any(plan.chunk[g] != grid[g] for g in plan.chunk):
    return None
  pure = discharged(kernel)
  jaxpr = pure.jaxpr
  computes = np.zeros(grid, bool)
  for eqn in jaxpr.eqns:
    if eqn.primitive.name != "cond":
      if eqn.primitive.name == "dot_general" or any(
          _uses_primitive(sub, ("dot_general",)) for sub in jaxprs_in_params(eqn.params)):
        return None   # a product outside any pl.when: every step computes one
      continue
    heavy = _product_branches(eqn)
    if not heavy:
      continue
    table = grid_eval.value_over_grid(jaxpr, pure.consts, eqn.invars[0], grid)
    if table is None:
      return None     # decided by data: any step may compute
    computes |= np.isin(table, heavy)
  looped = plan.outer + plan.inner
  per_step = computes.any(axis=tuple(g for g in range(len(grid)) if g not in looped))
  if per_step.all() or not per_step.any():   # no step skips, or no products at all
    return None
  return int(per_step.sum())


def _product_branches(cond: Any) -> list[int]:
  """The indices of the branches of a `cond` equation that run a matrix product."""
  return [i for i, b in enumerate(cond.params["branches"])
          if _uses_primitive(b.jaxpr, ("dot_general",))]


def _id_dependencies(var: Any, producer: dict, ids: list) -> set[int]:
  seen, stack, axes = set(), [var], set()
  while stack:
    v = stack.pop()
    if isinstance(v, Literal) or v in seen:
      continue
    seen.add(v)
    if v in ids:
      axes.add(ids.index(v))
    elif v in producer:
      stack.extend(producer[v].invars)
  return axes


def _unbatchable_body(kernel: KernelDescription) -> str | None:
  """Why the discharged body cannot run under vmap, if a primitive in it says so."""
  known = [p for p in KNOWN_UNBATCHABLE if _uses_primitive(kernel.jaxpr.jaxpr, (p,))]
  if known:
    return (f"the kernel uses {', '.join(known)}, whose batching rule gives wrong shapes "
            f"for kernel operands, so the body never runs under vmap")
  missing = sorted(_without_batching_rule(discharged(kernel).jaxpr))
  if missing:
    return (f"the kernel uses {', '.join(missing)}, which has no batching rule, so the body "
            f"cannot run under vmap")
  return None


def _without_batching_rule(jaxpr: Any) -> set[str]:
  """Primitives applied to values that vary per program (anything derived from the
  jaxpr's inputs) that have no batching rule; nested jaxprs count as varying.
  Primitives holding jaxprs (calls, control flow, custom derivatives) are batched
  by JAX's tracing machinery in some versions: only their contents are checked."""
  rules = [t for t in (batching.primitive_batchers, batching.fancy_primitive_batchers,
                       batching.axis_primitive_batchers) if isinstance(t, dict)]
  varying = set(jaxpr.invars)
  names = set()
  for e in jaxpr.eqns:
    if any(v in varying for v in e.invars if not isinstance(v, Literal)):
      varying.update(e.outvars)
      if not any(e.primitive in r for r in rules) and not _holds_jaxpr(e):
        names.add(e.primitive.name)
  for sub in subjaxprs(jaxpr):
    names |= _without_batching_rule(sub)
  return names


def _holds_jaxpr(eqn: Any) -> bool:
  values = [x for v in eqn.params.values() for x in (v if isinstance(v, (tuple, list)) else (v,))]
  return any(isinstance(x, (Jaxpr, ClosedJaxpr)) for x in values)


def vectorization_failure(error: Exception) -> str:
  """Why the body failed under vmap, for the plan description."""
  first_line = (str(error).strip().splitlines() or [""])[0][:200]
  return (f"the kernel body does not run under vmap (a primitive in it has no working "
          f"batching rule; {type(error).__name__}: {first_line})")


def _record_tiling(ops: list[OperandPlan], g: int, tiled: dict[int, int]) -> None:
  for i, d in tiled.items():
    ops[i].tiled_by[g] = d


def _reduction_axes(kernel: KernelDescription, facts: BodyFacts, sequential: list[int],
                    inputs: list[OperandPlan], outputs: list[OperandPlan],
                    reasons: list[str]) -> tuple[list[int], list[int], list[bool]]:
  """(summed axes, merged axes, keep_initial): how the sequential axes avoid a loop."""
  keep_all = [True] * len(outputs)
  if not sequential:
    return [], [], keep_all
  if facts.not_accumulators:
    o, why = next(iter(facts.not_accumulators.items()))
    reasons.append(f"sequential axes {sequential} looped: {outputs[o].mapping.origin} "
                   f"is not an accumulator ({why})")
    return [], [], keep_all
  feeding = [g for g in sequential if g in facts.trip_count_axes]
  if feeding:
    reasons.append(f"sequential axes looped: {feeding} feed a while-loop trip count")
    return [], [], keep_all
  grid = kernel.grid_mapping.grid
  coords = np.indices(grid)
  first_step = np.all([coords[g] == 0 for g in sequential], axis=0)
  keep_initial = []
  for o, resets in sorted(facts.accumulators.items()):
    zeroed = evaluate_resets(resets, grid)
    if zeroed is None:
      reasons.append(f"sequential axes looped: {outputs[o].mapping.origin} is zeroed "
                     f"under a condition that depends on data")
      return [], [], keep_all
    if not zeroed.any():
      keep_initial.append(True)
    elif np.array_equal(zeroed, first_step):
      keep_initial.append(False)
    else:
      reasons.append(f"sequential axes looped: {outputs[o].mapping.origin} is zeroed at "
                     f"steps other than the first of the reduction")
      return [], [], keep_all
  tilings = []
  for g in sequential:
    tiled = _tiling(inputs, outputs, g, outputs_move=False)
    if isinstance(tiled, str):
      reasons.append(f"sequential axes looped: along axis {g}, {tiled}")
      return [], [], keep_all
    tilings.append((g, tiled))
  form = f"o = {'o' if all(keep_initial) else 'zeroed-at-first-step(o)'} + f(inputs)"
  why = (f"{len(sequential)} sequential axes" if len(sequential) > 1 else
         "some input blocks are gathered" if any(op.gathered for op in inputs) else
         blocks_merge_along(kernel, tilings[0][1]))
  if why is None:
    # Widening the blocks leaves one plain reduction / matrix product for XLA.
    g, tiled = tilings[0]
    _record_tiling(inputs + outputs, g, tiled)
    reasons.append(f"sequential axis {g} merged into the blocks: every output is "
                   f"{form} with f a block-wide sum (reduce_sum or a matrix product over "
                   f"the widened dimension), so one run on the widened blocks sums every step")
    return [], [g], keep_initial
  if facts.has_matrix_product:
    for g, tiled in tilings:
      _record_tiling(inputs + outputs, g, tiled)
    reasons.append(f"sequential axes {sequential} vectorized and summed: every output is an "
                   f"accumulator ({form}), proven from the kernel body (not mergeable: {why})")
    return list(sequential), [], keep_initial
  # Memory-bound bodies: a vectorized sum becomes a reduction over split dimensions,
  # which XLA CPU runs several times slower than a loop.
  reasons.append(f"sequential axes {sequential} looped: the outputs are accumulators but the "
                 f"body has no matrix product (a vectorized sum is slow there) and the "
                 f"blocks cannot be merged ({why})")
  return [], [], keep_all


def _bound_memory(gm: GridMapping, facts: BodyFacts, inputs: list[OperandPlan], axes: list[int],
                  chunk: dict[int, int], reasons: list[str]) -> None:
  """Shrinks chunks (outermost axes first) until the vectorized programs' largest
  intermediate fits the budget."""
  operand_bytes = sum(math.prod(b.array_shape) * itemsize(b.dtype)
                      for b in (*gm.inputs, *gm.outputs))
  budget = max(MEMORY_MULTIPLE * operand_bytes, MEMORY_FLOOR_BYTES)
  gathered = sum(math.prod(b.block_shape) * itemsize(b.dtype)
                 for b, op in zip(gm.inputs, inputs) if op.gathered)
  per_program = max(facts.intermediate_bytes + gathered, 1)
  for g in axes:
    others = math.prod(chunk[a] for a in axes if a != g)
    if per_program * others * chunk[g] <= budget:
      return
    allowed = max(1, budget // (per_program * others))
    chunk[g] = max(b for b in range(1, gm.grid[g] + 1) if gm.grid[g] % b == 0 and b <= allowed)
    reasons.append(f"axis {g} chunked: {chunk[g]} of its {gm.grid[g]} programs at a time "
                   f"(each program creates up to {per_program} bytes; budget {int(budget)})")


def _resident(outputs: list[OperandPlan], inner: list[int]) -> bool:
  return all(not _varies(o.table, g) for o in outputs for g in inner)
