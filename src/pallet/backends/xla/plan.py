"""Grid analysis for the XLA backend: which grid axes to vectorize and which to loop.

The plan is made at trace time from the `GridMapping` alone. Index maps are
evaluated over the whole grid with concrete numbers, giving each operand a table
of block positions. From the tables:

* parallel axes: some output block moves along them (or the user said
  "parallel"); the others are sequential (reduction) axes;
* vectorized axes (V): parallel axes along which every operand either stays put
  or tiles one dimension exactly (block index = grid index + const), so the
  blocks of all V points are a reshape of one slab, and the kernel body runs
  once under `vmap`;
* looped axes: the remaining parallel axes (S, outer loop) and the sequential
  axes (R, inner loop). Output blocks stay resident across R when they do not
  move along it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import subjaxprs

from pallet.grid_mapping import BlockMapping, GridMapping
from pallet.tracing import KernelDescription

_SIDE_EFFECT_PRIMITIVES = ("atomic_rmw", "atomic_cas")


@dataclasses.dataclass
class OperandPlan:
  """How one operand is cut at each loop step."""
  mapping: BlockMapping
  pad: tuple[tuple[int, int], ...]          # padding added to each array dimension
  table: np.ndarray | None                  # grid + (ndim,) element starts, after padding
  tiled_by: dict[int, int]                  # V axis -> array dimension it tiles

  @property
  def padded_shape(self) -> tuple[int, ...]:
    return tuple(n + lo + hi for n, (lo, hi) in zip(self.mapping.array_shape, self.pad))

  @property
  def dynamic(self) -> bool:
    return self.table is None


@dataclasses.dataclass
class ExecutionPlan:
  """The schedule of one kernel on the XLA backend."""
  grid: tuple[int, ...]
  vectorized: list[int]      # V: run at once under vmap
  outer: list[int]           # S: parallel axes looped outside
  inner: list[int]           # R: sequential axes looped inside
  inputs: list[OperandPlan]
  outputs: list[OperandPlan]
  resident_outputs: bool     # outputs carried across the inner loop
  reasons: list[str]

  def describe(self) -> str:
    lines = [f"grid {self.grid}: vectorized axes {self.vectorized}, "
             f"outer loop {self.outer}, inner loop {self.inner}, "
             f"outputs {'resident across the inner loop' if self.resident_outputs else 'loaded/stored every step'}"]
    lines += [f"  - {r}" for r in self.reasons]
    return "\n".join(lines)


def _index_table(mapping: BlockMapping, grid: tuple[int, ...]) -> np.ndarray:
  """Evaluates the index map at every grid point: array of shape grid + (ndim,)."""
  ndim = len(mapping.array_shape)
  n = int(np.prod(grid, dtype=np.int64))
  if n == 0 or ndim == 0:
    return np.zeros((*grid, ndim), np.int64)
  coords = np.indices(grid).reshape(len(grid), n).astype(np.int32)
  im = mapping.index_map
  with jax.ensure_compile_time_eval():
    outs = jax.vmap(lambda *ids: jax.core.eval_jaxpr(im.jaxpr, im.consts, *ids))(
        *[jnp.asarray(c) for c in coords]) if grid else \
        jax.core.eval_jaxpr(im.jaxpr, im.consts)
    outs = [np.broadcast_to(np.asarray(o, np.int64), (n,)) for o in outs]
  return np.stack(outs, -1).reshape(*grid, ndim)


def _element_starts(mapping: BlockMapping, table: np.ndarray) -> np.ndarray:
  sizes = np.array([1 if d.kind == "element" else d.size for d in mapping.dims], np.int64)
  return table * sizes


def _padding(mapping: BlockMapping, starts: np.ndarray | None) -> tuple[tuple[int, int], ...]:
  """Padding that makes every block of the grid lie inside the array."""
  pads = []
  for d, (n, dim) in enumerate(zip(mapping.array_shape, mapping.dims)):
    if starts is None or starts.size == 0:
      # Data-dependent block positions: allow a last partial block and Element padding.
      lo = dim.padding[0] if dim.kind == "element" else 0
      hi = (-n) % dim.size if dim.kind != "element" else max(dim.padding[1], dim.size)
      pads.append((lo, hi))
      continue
    s = starts[..., d]
    pads.append((int(max(0, -s.min())), int(max(0, s.max() + dim.size - n))))
  return tuple(pads)


def _varies(table: np.ndarray, axis: int) -> bool:
  return table.shape[axis] > 1 and not np.all(table == np.take(table, [0], axis=axis))


def _tiled_dim(op: OperandPlan, axis: int, grid: tuple[int, ...]) -> int | None | bool:
  """The one dimension `op` tiles exactly along grid `axis`; None if it stays put,
  False if its movement along `axis` is anything else."""
  table = op.table
  moving = [d for d in range(table.shape[-1]) if _varies(table[..., d], axis)]
  if not moving:
    return None
  if len(moving) > 1:
    return False
  d = moving[0]
  dim = op.mapping.dims[d]
  step = np.diff(table[..., d], axis=axis)
  if dim.kind == "element" or not np.all(step == dim.size):
    return False
  return d


def _uses_primitive(jaxpr: Any, names: tuple[str, ...]) -> bool:
  """Whether `jaxpr` or any jaxpr nested in it binds one of the named primitives."""
  if any(eqn.primitive.name in names for eqn in jaxpr.eqns):
    return True
  return any(_uses_primitive(sub, names) for sub in subjaxprs(jaxpr))


def make_plan(kernel: KernelDescription) -> ExecutionPlan:
  gm: GridMapping = kernel.grid_mapping
  grid, G = gm.grid, len(gm.grid)
  dynamic = bool(gm.prefetch_avals)
  reasons = []

  def operand(mapping: BlockMapping) -> OperandPlan:
    if dynamic:
      return OperandPlan(mapping, _padding(mapping, None), None, {})
    starts = _element_starts(mapping, _index_table(mapping, grid))
    pad = _padding(mapping, starts)
    return OperandPlan(mapping, pad, starts + np.array([lo for lo, _ in pad], np.int64), {})

  inputs = [operand(m) for m in gm.inputs]
  outputs = [operand(m) for m in gm.outputs]
  if dynamic:
    reasons.append("index maps read scalar-prefetch operands: block positions are data, "
                   "every axis runs as a loop")
    return ExecutionPlan(grid, [], [], list(range(G)), inputs, outputs, False, reasons)

  if gm.dimension_semantics is not None:
    parallel = [g for g in range(G) if gm.dimension_semantics[g] == "parallel"]
    reasons.append(f"dimension_semantics {gm.dimension_semantics} given")
  else:
    parallel = [g for g in range(G) if any(_varies(o.table, g) for o in outputs)]
  sequential = [g for g in range(G) if g not in parallel]
  for g in sequential:
    reasons.append(f"axis {g} sequential: no output block moves along it")

  side_effects = _uses_primitive(kernel.jaxpr.jaxpr, _SIDE_EFFECT_PRIMITIVES) or bool(gm.scratch_avals)
  if side_effects and parallel and sequential and min(sequential) < max(parallel):
    reasons.append("kernel has scratch or atomics and a sequential axis precedes a "
                   "parallel one: running the grid in exact row-major order")
    return ExecutionPlan(grid, [], [], list(range(G)), inputs, outputs,
                         _resident(outputs, list(range(G))), reasons)

  vectorized = []
  for g in parallel:
    tiles = [(op, _tiled_dim(op, g, grid)) for op in inputs + outputs]
    bad = [op.mapping.origin for op, d in tiles if d is False]
    static_out = [op.mapping.origin for op, d in tiles[len(inputs):] if d is None]
    taken = [op.mapping.origin for op, d in tiles
             if d not in (None, False) and d in op.tiled_by.values()]
    if bad or static_out or taken:
      why = (f"{bad} do not tile a single dimension" if bad else
             f"{static_out} do not move along it" if static_out else
             f"{taken} are tiled twice")
      reasons.append(f"axis {g} looped: {why}")
      continue
    for op, d in tiles:
      if d is not None:
        op.tiled_by[g] = d
    vectorized.append(g)
    reasons.append(f"axis {g} vectorized (blocks tile their arrays exactly)")
  outer = [g for g in parallel if g not in vectorized]
  return ExecutionPlan(grid, vectorized, outer, sequential, inputs, outputs,
                       _resident(outputs, sequential), reasons)


def _resident(outputs: list[OperandPlan], inner: list[int]) -> bool:
  return all(not _varies(o.table, g) for o in outputs for g in inner)
