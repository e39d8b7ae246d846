"""Turns a kernel description and its `ExecutionPlan` into one pure JAX function.

The kernel body runs in its discharged form (refs become values in, values out),
so `pl.when` becomes a select under vmap and XLA sees ordinary array code. Per
loop step, operands are cut as slabs: one dynamic slice that holds the blocks
of every vectorized grid point, reshaped so the vectorized grid axes come first.
Outputs live in padded buffers updated in place with dynamic_update_slice, so
blocks that overhang an array edge read padding and their writes are dropped.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallet import _internals as internals
from pallet.backends.xla.plan import ExecutionPlan, OperandPlan, make_plan
from pallet.tracing import KernelDescription

Body = Callable[..., tuple[list[Any], list[Any]]]


def discharged_body(kernel: KernelDescription) -> Body:
  """`body(ids, prefetch, ins, outs, scratch) -> (outs, scratch)`, a pure function."""
  gm = kernel.grid_mapping
  n_pre, n_in, n_out = len(gm.prefetch_avals), len(gm.inputs), len(gm.outputs)
  pure = internals.discharge_state(kernel.jaxpr)

  def body(ids, prefetch, ins, outs, scratch):
    finals = jax.core.eval_jaxpr(pure.jaxpr, pure.consts, *ids, *prefetch, *ins, *outs,
                                 *scratch)
    return (list(finals[n_pre + n_in:n_pre + n_in + n_out]),
            list(finals[n_pre + n_in + n_out:]))
  return body


# ------------------------------------------------------------------ slabs
def _tiled_axis_of(op: OperandPlan) -> dict[int, int]:
  return {d: g for g, d in op.tiled_by.items()}


def _slab_sizes(op: OperandPlan, grid: Sequence[int]) -> list[int]:
  axis_of = _tiled_axis_of(op)
  return [grid[axis_of[d]] * dim.size if d in axis_of else dim.size
          for d, dim in enumerate(op.mapping.dims)]


def _cut(x: jax.Array, op: OperandPlan, start: Any, plan: ExecutionPlan) -> jax.Array:
  """The slab of `x` at `start`, shaped (*vectorized grid axes, *kernel block)."""
  sizes = _slab_sizes(op, plan.grid)
  if tuple(sizes) == x.shape:
    y = x
  elif isinstance(start, tuple):
    y = lax.slice(x, start, tuple(s + n for s, n in zip(start, sizes)))
  else:
    y = lax.dynamic_slice(x, list(start), sizes)
  axis_of = _tiled_axis_of(op)
  shape, batch_pos = [], {}
  for d, dim in enumerate(op.mapping.dims):
    if d in axis_of:
      batch_pos[axis_of[d]] = len(shape)
      shape.append(plan.grid[axis_of[d]])
    if dim.kind != "squeezed":
      shape.append(dim.size)
  y = y.reshape(shape)
  present = [g for g in plan.vectorized if g in batch_pos]
  return jnp.moveaxis(y, [batch_pos[g] for g in present], list(range(len(present))))


def _merge(buf: jax.Array, slab: jax.Array, op: OperandPlan, start: Any,
           plan: ExecutionPlan) -> jax.Array:
  """Writes a slab produced by `_cut`'s layout back into `buf` at `start`."""
  axis_of = _tiled_axis_of(op)
  positions, shape = [], []
  for d, dim in enumerate(op.mapping.dims):
    if d in axis_of:
      positions.append((axis_of[d], len(shape)))
      shape.append(plan.grid[axis_of[d]])
    if dim.kind != "squeezed":
      shape.append(dim.size)
  present = [g for g in plan.vectorized if g in dict(positions)]
  where = dict(positions)
  slab = jnp.moveaxis(slab, list(range(len(present))), [where[g] for g in present])
  slab = slab.reshape(_slab_sizes(op, plan.grid))
  if slab.shape == buf.shape:
    return slab
  if isinstance(start, tuple):
    start = [jnp.int32(s) for s in start]
  return lax.dynamic_update_slice(buf, slab.astype(buf.dtype), list(start))


# ------------------------------------------------------------------ start tables
class _Starts:
  """Element offsets of an operand's slab for each (outer, inner) loop step."""

  def __init__(self, op: OperandPlan, plan: ExecutionPlan, runtime_table: Any = None):
    grid, V = plan.grid, plan.vectorized
    loop_axes = plan.outer + plan.inner
    self.n_outer = math.prod(grid[g] for g in plan.outer)
    self.n_inner = math.prod(grid[g] for g in plan.inner)
    if runtime_table is not None:
      self.table = runtime_table.reshape(self.n_outer, self.n_inner, runtime_table.shape[-1])
      self.static = None
      return
    t = op.table[tuple(0 if g in V else slice(None) for g in range(len(grid)))]
    rest = [g for g in range(len(grid)) if g not in V]
    t = np.transpose(t, [rest.index(g) for g in loop_axes] + [len(rest)])
    t = t.reshape(self.n_outer, self.n_inner, t.shape[-1])
    flat = t.reshape(self.n_outer * self.n_inner, t.shape[-1])
    self.static = tuple(int(v) for v in flat[0]) if len(flat) and np.all(flat == flat[0]) else None
    self.table = jnp.asarray(t, jnp.int32)

  def at(self, s: Any, r: Any) -> Any:
    if self.static is not None:
      return self.static
    row = self.table[s, r]
    return [row[d] for d in range(row.shape[0])]


def _unravel(flat: Any, axes: Sequence[int], grid: Sequence[int]) -> dict[int, Any]:
  ids = {}
  for g in reversed(axes):
    ids[g] = flat % grid[g]
    flat = flat // grid[g]
  return ids


def _runtime_tables(plan: ExecutionPlan, prefetch: Sequence[Any]) -> list[Any]:
  """Index maps evaluated on data (scalar prefetch): one (steps, ndim) table each."""
  coords = np.indices(plan.grid).reshape(len(plan.grid), math.prod(plan.grid)).astype(np.int32)
  tables = []
  for op in (*plan.inputs, *plan.outputs):
    m = op.mapping
    pure = internals.discharge_state(m.index_map)
    ndim = len(m.array_shape)
    fn = lambda *ids: jnp.stack(
        jax.core.eval_jaxpr(pure.jaxpr, pure.consts, *ids, *prefetch)[:ndim]) \
        if ndim else jnp.zeros((0,), jnp.int32)
    idx = jax.vmap(fn)(*[jnp.asarray(c) for c in coords])
    sizes = jnp.array([1 if d.kind == "element" else d.size for d in m.dims], jnp.int32)
    pads = jnp.array([lo for lo, _ in op.pad], jnp.int32)
    tables.append(idx * sizes + pads)
  return tables


# ------------------------------------------------------------------ the function
def build(kernel: KernelDescription, plan: ExecutionPlan | None = None) -> Callable:
  """A pure function `(*prefetch, *inputs) -> outputs` computing the kernel's result."""
  plan = plan or make_plan(kernel)
  gm = kernel.grid_mapping
  body = discharged_body(kernel)
  grid, V = plan.grid, plan.vectorized
  n_pre = len(gm.prefetch_avals)
  aliases = dict((o, i) for i, o in kernel.input_output_aliases)
  v_shape = tuple(grid[g] for g in V)

  def point(v_ids, loop_ids, prefetch, ins, outs, scratch):
    ids = dict(loop_ids)
    ids.update(zip(V, v_ids))
    return body([ids[g] for g in range(len(grid))], prefetch, ins, outs, scratch)

  vbody = point
  for level in reversed(range(len(V))):
    in_axes = [0 if V[level] in op.tiled_by else None for op in plan.inputs]

    def wrap(inner, level=level, in_axes=in_axes):
      mapped = jax.vmap(
          lambda vid, vids, lids, pre, ins, outs, scr: inner(vids + (vid,), lids, pre, ins,
                                                             outs, scr),
          in_axes=(0, None, None, None, in_axes, 0, 0), out_axes=(0, 0))
      n = grid[V[level]]
      return lambda vids, lids, pre, ins, outs, scr: mapped(
          jnp.arange(n, dtype=jnp.int32), vids, lids, pre, ins, outs, scr)
    vbody = wrap(vbody)

  def run(*args):
    prefetch, inputs = list(args[:n_pre]), list(args[n_pre:])
    runtime = _runtime_tables(plan, prefetch) if n_pre else None
    in_starts = [_Starts(op, plan, runtime[i] if runtime else None)
                 for i, op in enumerate(plan.inputs)]
    out_starts = [_Starts(op, plan, runtime[len(inputs) + i] if runtime else None)
                  for i, op in enumerate(plan.outputs)]
    padded_in = [jnp.pad(x, op.pad) if any(op.pad[d] != (0, 0) for d in range(x.ndim))
                 else x for x, op in zip(inputs, plan.inputs)]
    bufs = []
    for o, op in enumerate(plan.outputs):
      m = op.mapping
      init = (inputs[aliases[o]] if o in aliases else jnp.zeros(m.array_shape, m.dtype))
      bufs.append(jnp.pad(init, op.pad) if any(p != (0, 0) for p in op.pad) else init)
    scratch = [jnp.zeros(v_shape + a.shape, a.dtype) for a in gm.scratch_avals]
    n_outer, n_inner = math.prod(grid[g] for g in plan.outer), math.prod(
        grid[g] for g in plan.inner)
    if math.prod(grid) == 0:
      return _unpad(bufs, plan)

    def step(s, r, outs, scratch):
      ids = {**_unravel(s, plan.outer, grid), **_unravel(r, plan.inner, grid)}
      ins = [_cut(x, op, st.at(s, r), plan)
             for x, op, st in zip(padded_in, plan.inputs, in_starts)]
      return vbody((), ids, prefetch, ins, outs, scratch)

    def outer_step(s, carry):
      bufs, scratch = carry
      if plan.resident_outputs:
        slabs = [_cut(b, op, st.at(s, 0), plan)
                 for b, op, st in zip(bufs, plan.outputs, out_starts)]

        def inner_step(r, c):
          return tuple(step(s, r, *c))
        slabs, scratch = _loop(n_inner, inner_step, (slabs, scratch))
        bufs = [_merge(b, sl, op, st.at(s, 0), plan)
                for b, sl, op, st in zip(bufs, slabs, plan.outputs, out_starts)]
        return bufs, scratch

      def inner_step(r, c):
        bufs, scratch = c
        slabs = [_cut(b, op, st.at(s, r), plan)
                 for b, op, st in zip(bufs, plan.outputs, out_starts)]
        slabs, scratch = step(s, r, slabs, scratch)
        return ([_merge(b, sl, op, st.at(s, r), plan)
                 for b, sl, op, st in zip(bufs, slabs, plan.outputs, out_starts)], scratch)
      return _loop(n_inner, inner_step, (bufs, scratch))

    bufs, _ = _loop(n_outer, outer_step, (bufs, scratch))
    return _unpad(bufs, plan)

  return run


def _loop(n: int, step: Callable, carry: Any) -> Any:
  if n == 1:
    return tuple(step(jnp.int32(0), carry))
  return tuple(lax.fori_loop(0, n, lambda i, c: tuple(step(i, c)), tuple(carry)))


def _unpad(bufs: list[jax.Array], plan: ExecutionPlan) -> list[jax.Array]:
  outs = []
  for b, op in zip(bufs, plan.outputs):
    if any(p != (0, 0) for p in op.pad):
      b = lax.slice(b, [lo for lo, _ in op.pad],
                    [lo + n for (lo, _), n in zip(op.pad, op.mapping.array_shape)])
    outs.append(b)
  return outs
