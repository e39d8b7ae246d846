"""Turns a kernel description and its `ExecutionPlan` into one pure JAX function.

The kernel body runs in its discharged form (refs become values in, values out),
so `pl.when` becomes a select under vmap and XLA sees ordinary array code. Per
loop step, each input is cut as one slab holding the blocks of every vectorized
program and only reshaped: its vmap axes stay where the array has them, so no
transpose is paid per step. Output blocks live in batch-first slabs (the loop
carry), moved back into their arrays once per outer step. Buffers are padded, so
blocks that overhang an array edge read padding and their writes are dropped.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallet.core import array_ops, checks, discharge
from pallet.backends.xla.plan import (ExecutionPlan, OperandPlan, element_scale, make_plan,
                                      overhang)
from pallet.backends.xla import (body_analysis, bounded_loops, literal_folding,
                                 padded_lanes, replicated_scratch, self_updates,
                                 widening, window_ranges)
from pallet.backends.xla.static_indices import fold_static_indices
from pallet.backends.xla.widening import Widening
from pallet.core.specs import MemorySpace
from pallet.core.tracing import KernelDescription

Body = Callable[..., tuple[list[Any], list[Any]]]


def discharged_body(kernel: KernelDescription, widened: Widening | None = None,
                    vectorized: Sequence[int] = (),
                    bounded: bool = False,
                    overhangs: Sequence[tuple[int, int] | None] = ()
                    ) -> tuple[Body, list[tuple[int, ...]], list[str]]:
  """`body(ids, prefetch, ins, outs, state) -> (outs, state)`, a pure function, the
  shape each scratch buffer is carried in, and notes for `debug=True` on how the
  body was rewritten; `ids` holds the grid indices, then the traced grid sizes if any.

  `state` is what persists from one grid step to the next: the scalar-prefetch
  operands (kernels may write them, as SMEM on a TPU: ragged paged attention
  keeps its buffer index there), then the scratch buffers. The `prefetch`
  argument is unused once the prefetch values travel in `state`. With `widened`,
  the blocks of that axis arrive side by side and the body runs on all of them;
  with `bounded`, its while loops run as masked fixed-length loops. `overhangs` gives,
  for each input then output block, the (axis, real width) past which it always lies
  beyond its array (`plan.overhang`): lanes the body may leave uncomputed. A scratch
  buffer proven constant along some axes is carried one element wide along them
  (`replicated_scratch`): the scratch buffers start as zeros, which are.
  """
  gm = kernel.grid_mapping
  n_pre, n_in, n_out = len(gm.prefetch_avals), len(gm.inputs), len(gm.outputs)
  n_scratch = len(gm.scratch_avals)
  narrowed = [replicated_scratch.Axes()] * n_scratch
  notes = []
  if widened is not None:
    pure = widened.pure
    evaluate = lambda *args: widening.evaluate(pure.jaxpr, pure.consts, args, widened.tags)
  else:
    pure = body_analysis.discharged(kernel)
    if bounded:
      pure = bounded_loops.bounded_body(kernel)
    pure = literal_folding.fold_literals(pure)
    # what differs between the programs vmapped together: their ids and every block
    G = len(gm.grid) + len(gm.dynamic_axes)
    varying = [g in vectorized for g in range(G)] + [True] * (len(pure.jaxpr.invars) - G)
    pure = fold_static_indices(pure, varying if vectorized else None,
                               {g: 0 for g, n in enumerate(gm.grid) if n == 1})
    # grid indices run from 0 to the axis size - 1 (chunks divide the axes, plan.py)
    ids = [(0, n - 1) if isinstance(n, int) and n > 0 else None for n in gm.grid]
    inside = window_ranges.drop_window_padding(pure, ids)
    if inside is not pure:
      notes.append("window padding dropped: windows at run-time starts that loop counters "
                   "and grid indices keep inside their refs read them unpadded")
    pure = inside
    refs = len(pure.jaxpr.invars) - n_pre - n_in - n_out - n_scratch   # ids come first
    boundary = padded_lanes.Boundary(
        seeds={refs + n_pre + k: o for k, o in enumerate(overhangs) if o is not None},
        sinks={n_pre + k: refs + n_pre + k for k, o in enumerate(overhangs) if o is not None})
    unpadded = padded_lanes.narrow(pure, boundary)
    if unpadded is not pure:
      notes.append("padded lanes dropped: values padded past a ref's end (masked loads of a "
                   "power-of-two block), and blocks past their array's end, computed on "
                   "their real lanes only")
    pure = unpadded
    pure = self_updates.guard(pure)
    narrowed = replicated_scratch.narrowable_scratch(pure, n_scratch)
    evaluate = lambda *args: (replicated_scratch.evaluate if any(narrowed) else
                              literal_folding.evaluate)(pure.jaxpr, pure.consts, args)
  full = [a.shape for a in gm.scratch_avals]

  def body(ids, prefetch, ins, outs, state):
    del prefetch
    scratch = [replicated_scratch.Wide(x, axes, shape) if axes else x
               for x, axes, shape in zip(state[n_pre:], narrowed, full)]
    finals = list(evaluate(*ids, *state[:n_pre], *ins, *outs, *scratch))
    finals[:n_pre + n_in + n_out] = map(replicated_scratch.whole, finals[:n_pre + n_in + n_out])
    if widened is not None:   # outputs constant along the rows: stretched to the block
      for o, (p, out) in enumerate(zip(widened.out_dims, outs)):
        k = n_pre + n_in + o
        finals[k] = widening.widen_output(finals[k], p, jnp.shape(out)[p])
    scratch = [replicated_scratch.narrow(x, axes)
               for x, axes in zip(finals[n_pre + n_in + n_out:], narrowed)]
    return list(finals[n_pre + n_in:n_pre + n_in + n_out]), list(finals[:n_pre]) + scratch
  return body, [replicated_scratch.narrow_shape(shape, axes)
                for shape, axes in zip(full, narrowed)], notes


# ------------------------------------------------------------------ slabs
class _Slab:
  """How one operand's slab is cut, viewed per program, and written back."""

  def __init__(self, op: OperandPlan, plan: ExecutionPlan):
    self.op = op
    self.gathered = op.gathered
    self.block = [d.size for d in op.mapping.dims]
    self.gathered_view = (tuple(plan.chunk[g] for g in plan.vectorized)
                          + tuple(d.size for d in op.mapping.dims if d.kind != "squeezed"))
    axis_of = {} if op.gathered else {d: g for g, d in op.tiled_by.items()}
    self.sizes, view, self.batch_pos = [], [], {}
    for d, dim in enumerate(op.mapping.dims):
      g = axis_of.get(d)
      if g in plan.merged:    # widened block, no batch axis (at most the padded extent)
        size = min(plan.chunk[g] * dim.size, op.mapping.array_shape[d] + sum(op.pad[d]))
        self.sizes.append(size)
        view.append(size)
        continue
      if g is not None:
        self.sizes.append(plan.chunk[g] * dim.size)
        self.batch_pos[g] = len(view)
        view.append(plan.chunk[g])
      else:
        self.sizes.append(dim.size)
      if dim.kind != "squeezed":
        view.append(dim.size)
    self.view = tuple(view)
    # batch axes in vmap-level order, for the batch-first layout of outputs
    self.levels = [g for g in plan.vectorized if g in self.batch_pos]
    self.vectorized = plan.vectorized

  def raw(self, x: jax.Array, start: Any) -> jax.Array:
    """The slab at `start`, in the array's own layout."""
    if tuple(self.sizes) == x.shape:
      return x
    if isinstance(start, tuple):
      return lax.slice(x, start, tuple(s + n for s, n in zip(start, self.sizes)))
    return lax.dynamic_slice(x, list(start), self.sizes)

  def cut(self, x: jax.Array, start: Any) -> jax.Array:
    """The slab at `start`, reshaped so each vmapped axis is its own dimension;
    for gathered operands, `start` holds every program's block start."""
    if self.gathered:
      blocks = jax.vmap(lambda st: lax.dynamic_slice(x, [st[d] for d in range(x.ndim)],
                                                     self.block))(start)
      return blocks.reshape(self.gathered_view)
    return self.raw(x, start).reshape(self.view)

  def batch_first_shape(self, plan: ExecutionPlan) -> tuple[int, ...]:
    batch = set(self.batch_pos.values())   # the rest: kernel dimensions (widened ones too)
    kernel = tuple(n for k, n in enumerate(self.view) if k not in batch)
    return tuple(plan.chunk[g] for g in self.levels) + kernel

  def summed_raw(self, partial: jax.Array, n_summed: int, dtype: Any) -> jax.Array:
    """Per-program results (summed axes, then batch-first) summed into raw layout.

    The sum runs over a 2-D view: XLA's CPU reductions are slow over split
    dimensions."""
    dst = [n_summed + self.batch_pos[g] for g in self.levels]
    if dst:
      partial = array_ops.moveaxis(partial, list(range(n_summed, n_summed + len(dst))), dst)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
      partial = partial.astype(jnp.float32)
    flat = partial.reshape(math.prod(partial.shape[:n_summed]), math.prod(self.sizes))
    return jnp.sum(flat, axis=0).reshape(self.sizes).astype(dtype)

  def put(self, buf: jax.Array, raw: jax.Array, start: Any) -> jax.Array:
    """Writes a raw-layout slab back into `buf` at `start`."""
    raw = raw.astype(buf.dtype)
    if raw.shape == buf.shape:
      return raw
    if isinstance(start, tuple):
      start = [jnp.int32(s) for s in start]
    return lax.dynamic_update_slice(buf, raw, list(start))

  def axis_at_level(self, level: int) -> int | None:
    """Where vmap level `level` finds its batch axis, once outer levels took theirs."""
    if self.gathered:      # batch-first over every vmap level
      return 0
    g = self.vectorized[level]
    if g not in self.batch_pos:
      return None
    pos = self.batch_pos[g]
    return pos - sum(1 for h in self.vectorized[:level]
                     if h in self.batch_pos and self.batch_pos[h] < pos)

  def batch_first(self, view: jax.Array) -> jax.Array:
    src = [self.batch_pos[g] for g in self.levels]
    return array_ops.moveaxis(view, src, list(range(len(src)))) if src else view

  def merge(self, buf: jax.Array, slab: jax.Array, start: Any) -> jax.Array:
    """Writes a batch-first slab back into `buf` at `start`."""
    dst = [self.batch_pos[g] for g in self.levels]
    if dst:
      slab = array_ops.moveaxis(slab, list(range(len(dst))), dst)
    return self.put(buf, slab.reshape(self.sizes), start)


# ------------------------------------------------------------------ start tables
class _Starts:
  """Element offsets of an operand's slab for each (outer, inner) loop step."""

  def __init__(self, op: OperandPlan, plan: ExecutionPlan, runtime_table: Any = None,
               per_step: Callable | None = None):
    self.per_step = per_step
    if per_step is not None:   # traced grid sizes: index maps run at every step
      return
    self.n_outer = math.prod(plan.loop_size(g) for g in plan.outer)
    self.n_inner = math.prod(plan.loop_size(g) for g in plan.inner)
    self.known = None   # the table in NumPy: unrolled steps read their starts from it
    if runtime_table is not None:   # block positions are data: computed at run time
      table = runtime_table.reshape(*plan.grid, runtime_table.shape[-1])
      self.table = _gather_table(table, plan) if op.gathered else _loop_table(table, plan)
      self.static = None
      return
    if op.gathered:
      self.static = None
      self.known = _gather_table(op.table, plan).astype(np.int32)
      self.table = jnp.asarray(self.known)
      return
    t = _loop_table(op.table, plan)
    ndim = t.shape[-1]
    flat = t.reshape(self.n_outer * self.n_inner, ndim)
    self.static = tuple(int(v) for v in flat[0]) if len(flat) and np.all(flat == flat[0]) else None
    self.known = t
    self.table = jnp.asarray(t, jnp.int32)

  def at(self, s: Any, r: Any, ids: Sequence[Any] = ()) -> Any:
    if self.per_step is not None:
      return self.per_step(*ids)
    if self.static is not None:
      return self.static
    if self.known is not None and isinstance(s, int) and isinstance(r, int):
      row = self.known[s, r]   # an unrolled step: starts known at trace time
      return tuple(int(v) for v in row) if row.ndim == 1 else jnp.asarray(row, jnp.int32)
    row = self.table[s, r]
    return row if row.ndim == 2 else [row[d] for d in range(row.shape[0])]


def _loop_table(table: Any, plan: ExecutionPlan) -> Any:
  """Block starts per loop step, (outer steps, inner steps, ndim), from a table over
  the grid (NumPy, or traced where positions are data): the first program of each
  chunk along vectorized axes, every program along looped ones."""
  xp = np if isinstance(table, np.ndarray) else jnp
  G = len(plan.grid)
  if any(plan.chunk.get(g, 1) != 1 for g in range(G)):
    table = table[tuple(slice(None, None, plan.chunk.get(g, 1)) for g in range(G))]
  loop_axes = plan.outer + plan.inner
  rest = [g for g in range(G) if g not in loop_axes]
  n_outer = math.prod(plan.loop_size(g) for g in plan.outer)
  n_inner = math.prod(plan.loop_size(g) for g in plan.inner)
  return xp.transpose(table, loop_axes + rest + [G]).reshape(n_outer, n_inner, table.shape[-1])


def _gather_table(table: Any, plan: ExecutionPlan) -> Any:
  """Block starts of every vectorized program, per loop step:
  (outer steps, inner steps, programs in vmap order, ndim); NumPy or traced."""
  xp = np if isinstance(table, np.ndarray) else jnp
  G = len(plan.grid)
  split, loop_dim, vec_dim = [], {}, {}
  for g in range(G):
    loop_dim[g] = len(split)
    split.append(plan.loop_size(g) if g in plan.chunk else plan.grid[g])
    if g in plan.chunk:
      vec_dim[g] = len(split)
      split.append(plan.chunk[g])
  t = table.reshape(*split, table.shape[-1])
  loops = [loop_dim[g] for g in plan.outer + plan.inner]
  rest = [loop_dim[g] for g in range(G) if g not in plan.outer + plan.inner]
  order = loops + rest + [vec_dim[g] for g in plan.vectorized] + [len(split)]
  n_outer = math.prod(plan.loop_size(g) for g in plan.outer)
  n_inner = math.prod(plan.loop_size(g) for g in plan.inner)
  return xp.transpose(t, order).reshape(n_outer, n_inner, -1, table.shape[-1])


def _unravel(flat: Any, axes: Sequence[int], sizes: Sequence[int]) -> dict[int, Any]:
  """Grid indices of loop step `flat` (>= 0: truncating division is floor division,
  two operations where jnp's `%` and `//` emit a call with sign fix-ups each)."""
  ids = {}
  for g, n in zip(reversed(axes), reversed(sizes)):
    if isinstance(n, int) and n == 1:
      ids[g] = 0
      continue
    if isinstance(flat, int) and isinstance(n, int):   # an unrolled step
      flat, ids[g] = divmod(flat, n)
      continue
    n = np.int32(n) if isinstance(n, int) else n
    ids[g], flat = lax.rem(flat, n), lax.div(flat, n)
  return ids


def _start_fn(op: OperandPlan, prefetch: Sequence[Any]) -> Callable:
  """`ids -> (ndim,) int32` element starts in the padded array, index map run on data."""
  m = op.mapping
  pure = discharge.discharge_state(m.index_map)
  ndim = len(m.array_shape)
  factor, shift = element_scale(m)
  offset = np.array([lo for lo, _ in op.pad], np.int64) - shift

  def starts(*ids):
    if not ndim:
      return jnp.zeros((0,), jnp.int32)
    idx = jnp.stack(jax.core.eval_jaxpr(pure.jaxpr, pure.consts, *ids, *prefetch)[:ndim])
    return idx * jnp.asarray(factor, jnp.int32) + jnp.asarray(offset, jnp.int32)
  return starts


def _runtime_tables(plan: ExecutionPlan, prefetch: Sequence[Any]) -> list[Any]:
  """Index maps evaluated on data (scalar prefetch): one (steps, ndim) table for each
  operand whose block positions are data, None for those the plan knows."""
  steps = math.prod(plan.grid)
  coords = np.indices(plan.grid).reshape(len(plan.grid), steps).astype(np.int32)
  # axis_size: a grid of no axes (grid=()) still has its one step to evaluate
  return [None if op.table is not None else
          jax.vmap(_start_fn(op, prefetch), axis_size=steps)(*[jnp.asarray(c) for c in coords])
          for op in (*plan.inputs, *plan.outputs)]


# ------------------------------------------------------------------ vectorized body
def _vectorized_body(body: Body, plan: ExecutionPlan, in_slabs: list[_Slab],
                     n_outputs: int, n_prefetch: int, n_scratch: int) -> Callable:
  """`f(base_ids, prefetch, ins, outs, state)` running every vectorized program.

  Inputs come in their slab layout; outputs and scratch batch-first over the
  parallel vectorized axes (unbatched over summed ones, which are outermost).
  Results are batch-first over all vectorized axes. `state` starts with the
  `n_prefetch` scalar-prefetch values, which every program reads unbatched: a plan
  vectorizes only kernels that never write them, so they come back as given.
  """
  V, G = plan.vectorized, len(plan.grid)

  def at(b, vid):
    return vid if isinstance(b, int) and b == 0 else b + vid

  def point(vids, base, prefetch, ins, outs, fixed, scratch):
    ids = [at(base[g], vids[V.index(g)]) if g in V else base[g] for g in range(G)]
    outs, state = body(ids + list(base[G:]), prefetch, ins, outs, list(fixed) + list(scratch))
    return outs, state[len(fixed):]

  fn = point
  for level in reversed(range(len(V))):
    in_axes = [s.axis_at_level(level) for s in in_slabs]
    carried = None if V[level] in plan.summed else 0

    def wrap(inner, level=level, in_axes=in_axes, carried=carried):
      mapped = jax.vmap(
          lambda vid, vids, base, pre, ins, outs, fixed, scr: inner(
              vids + (vid,), base, pre, ins, outs, fixed, scr),
          in_axes=(0, None, None, None, in_axes, [carried] * n_outputs, None,
                   [carried] * n_scratch),
          out_axes=0)
      n = plan.chunk[V[level]]
      return lambda vids, base, pre, ins, outs, fixed, scr: mapped(
          jnp.arange(n, dtype=jnp.int32), vids, base, pre, ins, outs, fixed, scr)
    fn = wrap(fn)
  # Looped only (no vmap level), a kernel may write its prefetch refs: carried as state.
  k = n_prefetch if V else 0

  def run(base, pre, ins, outs, state):
    outs, rest = fn((), base, pre, ins, outs, state[:k], state[k:])
    return outs, list(state[:k]) + list(rest)
  return run


# ------------------------------------------------------------------ the function
def build(kernel: KernelDescription, plan: ExecutionPlan | None = None) -> Callable:
  """A pure function `(*prefetch, *inputs) -> outputs` computing the kernel's result."""
  plan = plan or make_plan(kernel)
  gm = kernel.grid_mapping
  body, scratch_shapes, notes = discharged_body(
      kernel, widening.of_plan(kernel, plan), plan.vectorized, plan.bounded_loops,
      [overhang(op) for op in plan.inputs + plan.outputs])
  plan.reasons.extend(n for n in notes if n not in plan.reasons)
  narrowed = [(s, a.shape, shape) for s, (a, shape)
              in enumerate(zip(gm.scratch_avals, scratch_shapes)) if tuple(a.shape) != shape]
  if narrowed:
    plan.reasons.append("scratch carried narrow, proven the same along the dropped axes at "
                        "every step: " + ", ".join(f"{s} {full} as {shape}"
                                                   for s, full, shape in narrowed))
  grid = plan.grid
  n_dyn, n_pre = len(gm.dynamic_axes), len(gm.prefetch_avals)
  aliases = dict((o, i) for i, o in kernel.input_output_aliases)
  shared = dict(plan.shared_reads)   # input -> output whose buffer it is read from
  in_slabs = [_Slab(op, plan) for op in plan.inputs]
  out_slabs = [_Slab(op, plan) for op in plan.outputs]
  vbody = _vectorized_body(body, plan, in_slabs, len(plan.outputs), n_pre,
                           len(gm.scratch_avals))
  parallel_chunks = tuple(plan.chunk[g] for g in plan.vectorized if g not in plan.summed)
  out_shapes = [tuple(plan.chunk[g] for g in plan.summed) + sl.batch_first_shape(plan)
                for sl in out_slabs]

  def run(*args):
    sizes, args = list(args[:n_dyn]), args[n_dyn:]
    prefetch, inputs = list(args[:n_pre]), list(args[n_pre:])
    # traced sizes: plans for them loop every axis (chunk 1), in the order of `inner`
    loop_size = lambda g: sizes[gm.dynamic_axes.index(g)] if grid[g] is None else plan.loop_size(g)
    outer_sizes = [loop_size(g) for g in plan.outer]
    inner_sizes = [loop_size(g) for g in plan.inner]
    n_outer, n_inner = math.prod(outer_sizes), math.prod(inner_sizes)
    bufs = []
    for o, op in enumerate(plan.outputs):
      m = op.mapping
      # a semaphore output is a counter the kernel's DMAs and signals add to: it starts
      # at zero even with poisoned buffers, as scratch semaphores do
      counter = m.memory_space is MemorySpace.SEMAPHORE
      init = inputs[aliases[o]] if o in aliases else checks.uninitialized(
          m.array_shape, m.dtype, poison=False if counter else kernel.poison_buffers)
      bufs.append(_pad(init, op, kernel.poison_buffers))
    if 0 in grid:
      return _unpad(bufs, plan)
    if n_dyn:
      in_starts = [_Starts(op, plan, per_step=_start_fn(op, prefetch)) for op in plan.inputs]
      out_starts = [_Starts(op, plan, per_step=_start_fn(op, prefetch)) for op in plan.outputs]
    else:
      runtime = _runtime_tables(plan, prefetch) if n_pre else [None] * (
          len(plan.inputs) + len(plan.outputs))
      in_starts = [_Starts(op, plan, runtime[i]) for i, op in enumerate(plan.inputs)]
      out_starts = [_Starts(op, plan, runtime[len(inputs) + i])
                    for i, op in enumerate(plan.outputs)]
    padded_in = [_pad(x, op, kernel.poison_buffers) for x, op in zip(inputs, plan.inputs)]
    # Scalar prefetch first, unbatched (vectorized plans only where the kernel never
    # writes it, see plan.py), then scratch, one buffer per vectorized program. Zeros:
    # constant along every axis, as the narrowed buffers' proof assumes.
    scratch = prefetch + [jnp.zeros(parallel_chunks + shape, a.dtype)
                          for shape, a in zip(scratch_shapes, gm.scratch_avals)]

    def base_ids(s, r):
      loop = {**_unravel(s, plan.outer, outer_sizes), **_unravel(r, plan.inner, inner_sizes)}
      return [loop[g] * plan.chunk.get(g, 1) if g in loop else 0 for g in range(len(grid))]

    def step(s, r, outs, scratch, ids=None, held=None):
      ids = base_ids(s, r) if ids is None else ids
      ins = [held[i] if held and i in held else sl.cut(x, st.at(s, r, ids))
             for i, (x, sl, st) in enumerate(zip(padded_in, in_slabs, in_starts))]
      results, scratch = vbody(ids + sizes, prefetch, ins, outs, scratch)
      for x, shape in zip(results, out_shapes):
        if x.shape != shape:   # a batching rule gave wrong shapes: the plan must loop
          raise TypeError(f"vectorized body gave a block of shape {x.shape}, expected {shape}")
      return results, scratch

    def load(bufs, s, r, ids=None):
      ids = (base_ids(s, r) if n_dyn else ()) if ids is None else ids
      return [sl.batch_first(sl.cut(b, st.at(s, r, ids)))
              for b, sl, st in zip(bufs, out_slabs, out_starts)]

    def store(bufs, slabs, s, r, ids=None):
      ids = (base_ids(s, r) if n_dyn else ()) if ids is None else ids
      return [sl.merge(b, x, st.at(s, r, ids))
              for b, x, sl, st in zip(bufs, slabs, out_slabs, out_starts)]

    def outer_step(s, carry):
      bufs, scratch = carry
      if plan.summed:  # accumulators: slabs stay in raw layout, summed per step
        slabs = [sl.raw(b, st.at(s, 0)) if keep else jnp.zeros(sl.sizes, b.dtype)
                 for b, sl, st, keep in zip(bufs, out_slabs, out_starts, plan.keep_initial)]
        zeros = [jnp.zeros(sl.batch_first_shape(plan), b.dtype) for b, sl in zip(bufs, out_slabs)]

        def inner_step(r, slabs):
          partials, _ = step(s, r, zeros, [])
          return [x + sl.summed_raw(p, len(plan.summed), x.dtype)
                  for x, p, sl in zip(slabs, partials, out_slabs)]
        slabs = _loop(n_inner, inner_step, slabs, plan.unrolled)
        return [sl.put(b, x, st.at(s, 0))
                for b, x, sl, st in zip(bufs, slabs, out_slabs, out_starts)], scratch
      if plan.resident_outputs:
        slabs, scratch = _loop(n_inner, lambda r, c: step(s, r, *c),
                               (load(bufs, s, 0), scratch), plan.unrolled)
        return store(bufs, slabs, s, 0), scratch

      if shared:
        return shared_loop(s, bufs, scratch)

      def inner_step(r, c):
        bufs, scratch = c
        ids = base_ids(s, r)   # once per step: load, body and store share it
        slabs, scratch = step(s, r, load(bufs, s, r, ids), scratch, ids)
        return store(bufs, slabs, s, r, ids), scratch
      return _loop(n_inner, inner_step, (bufs, scratch), plan.unrolled)

    def shared_loop(s, bufs, scratch):
      """The grid in order where aliased inputs share their outputs' buffers
      (aliased_reads.py), as a TPU runs it: `memory` is each shared output's buffer
      as the inputs see it, which gets an output block when the block stops being
      resident (the next step's block is elsewhere); an input block is fetched from
      it when its position changes, and kept while it stays."""
      memory = {o: bufs[o] for o in set(shared.values())}
      held = {i: in_slabs[i].cut(_shared_input(memory[o], plan.outputs[o], plan.inputs[i],
                                               kernel.poison_buffers),
                                 in_starts[i].at(s, 0, base_ids(s, 0) if n_dyn else ()))
              for i, o in shared.items()}   # replaced at step 0: a block of the right shape

      def inner_step(r, c):
        bufs, scratch, memory, held = c
        ids = base_ids(s, r)
        before = base_ids(s, _previous(r)) if n_dyn else ()
        first = _is_first(r)
        memory = dict(memory)
        for o in memory:   # the block resident until the previous step is written back
          sl, st = out_slabs[o], out_starts[o]
          ended = st.at(s, _previous(r), before)
          moved = jnp.logical_and(jnp.logical_not(first), _differ(st.at(s, r, ids), ended))
          memory[o] = jnp.where(moved, sl.put(memory[o], sl.raw(bufs[o], ended), ended),
                                memory[o])
        held = dict(held)
        for i, o in shared.items():
          st = in_starts[i]
          now = st.at(s, r, ids)
          fetch = jnp.logical_or(first, _differ(now, st.at(s, _previous(r), before)))
          source = _shared_input(memory[o], plan.outputs[o], plan.inputs[i],
                                 kernel.poison_buffers)
          held[i] = jnp.where(fetch, in_slabs[i].cut(source, now), held[i])
        slabs, scratch = step(s, r, load(bufs, s, r, ids), scratch, ids, held)
        return store(bufs, slabs, s, r, ids), scratch, memory, held
      bufs, scratch, _, _ = _loop(n_inner, inner_step, (bufs, scratch, memory, held),
                                  plan.unrolled)
      return bufs, scratch

    bufs, _ = _loop(n_outer, outer_step, (bufs, scratch), plan.unrolled)
    return _unpad(bufs, plan)

  return run


def _previous(r: Any) -> Any:
  """The previous loop step (step 0 for step 0: its results are masked by _is_first)."""
  return max(r - 1, 0) if isinstance(r, int) else jnp.maximum(r - 1, 0)


def _is_first(r: Any) -> Any:
  return jnp.asarray(r == 0) if isinstance(r, int) else r == 0


def _differ(a: Any, b: Any) -> jax.Array:
  """Whether two block starts (tuples, lists of scalars or arrays) differ."""
  as_vector = lambda x: jnp.stack([jnp.asarray(v, jnp.int32) for v in x]) if isinstance(
      x, (tuple, list)) else jnp.asarray(x, jnp.int32)
  return jnp.any(as_vector(a) != as_vector(b))


def _shared_input(buf: jax.Array, out: OperandPlan, inp: OperandPlan,
                  poison: bool) -> jax.Array:
  """An aliased output's buffer as it stands, in its input's padded layout: what the
  input's blocks are read from where the two share one buffer (aliased_reads.py)."""
  if out.pad == inp.pad:
    return buf
  return _pad(_unpad_one(buf, out), inp, poison)


def _pad(x: jax.Array, op: OperandPlan, poison: bool) -> jax.Array:
  """`x` padded for blocks past its edges; the padding is poisoned (NaN) with the
  kernel's buffers, so a kernel that mixes it into its results shows it."""
  if all(p == (0, 0) for p in op.pad):
    return x
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
    return _pad_by_concatenation(x, op.pad)
  return jnp.pad(x, op.pad, constant_values=checks.fill_value(x.dtype, poison=poison))


def _pad_by_concatenation(x: jax.Array, pad: Sequence[tuple[int, int]]) -> jax.Array:
  """`x` (typed PRNG keys, which XLA's pad does not take) padded with what unwritten
  memory of its dtype holds (`checks.uninitialized`: zero keys)."""
  for d, (low, high) in enumerate(pad):
    if low or high:
      fill = lambda n: checks.uninitialized(x.shape[:d] + (n,) + x.shape[d + 1:], x.dtype)
      x = jnp.concatenate([fill(low), x, fill(high)], axis=d)
  return x


def _loop(n: Any, step: Callable, carry: Any, unrolled: bool = False) -> Any:
  """`step` over range(n); n may be traced (a grid size computed at run time).
  `unrolled`: the steps are traced one by one with their index a Python int, so
  their grid indices and block starts are constants (pl.when on them resolves)."""
  as_tuple = lambda c: tuple(c) if isinstance(c, (list, tuple)) else c
  if unrolled and isinstance(n, int):
    for i in range(n):
      carry = as_tuple(step(i, carry))
    return as_tuple(carry)
  if isinstance(n, int) and n == 1:
    return as_tuple(step(jnp.int32(0), carry))
  # Grid indices are int32, also under jax_enable_x64, where fori_loop counts in int64.
  index = lambda i: i if i.dtype == np.int32 else lax.convert_element_type(i, np.int32)
  return lax.fori_loop(0, n, lambda i, c: as_tuple(step(index(i), c)), as_tuple(carry))


def _unpad(bufs: list[jax.Array], plan: ExecutionPlan) -> list[jax.Array]:
  return [_unpad_one(b, op) for b, op in zip(bufs, plan.outputs)]


def _unpad_one(b: jax.Array, op: OperandPlan) -> jax.Array:
  """`b` without the padding `op`'s blocks past the array's edges needed."""
  if all(p == (0, 0) for p in op.pad):
    return b
  return lax.slice(b, [lo for lo, _ in op.pad],
                   [lo + n for (lo, _), n in zip(op.pad, op.mapping.array_shape)])
