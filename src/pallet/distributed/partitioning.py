"""Automatic partitioning: a kernel on sharded operands under `jax.jit` runs shard-locally.

When `pallas_call` is lowered for several devices (a `jax.jit` over sharded arrays),
the call becomes a `jax.experimental.custom_partitioning` op. Its partition
callback sees the operands' shardings and, for each parallel grid axis along
which every operand's block index *is* the grid index (or stays put), and
whose tiled array dimensions are sharded into whole runs of blocks, runs the
same kernel on each device with that grid axis shrunk to the local number of
blocks: no operand is gathered. Everything else (sequential axes, blocks
straddling shards, kernels reading `program_id` of the axis, scalar prefetch,
DMAs, grids sized at run time) keeps the axis whole and lets the partitioner
gather, with a `debug=True` note saying why. On one device nothing changes.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np
from jax.experimental.custom_partitioning import (ArrayMapping, SdyShardingRule,
                                                  custom_partitioning)
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from pallet.backends.xla import plan_of
from pallet.backends.xla.plan import make_plan
from pallet.core.tracing import KernelDescription


@dataclasses.dataclass(frozen=True)
class SplitAxis:
  """A grid axis that may be split across devices: operand index -> the array
  dimension whose block index equals the grid index (operands: inputs, then outputs)."""
  axis: int
  dims: dict[int, int]


def multi_device(ctx: Any) -> bool:
  """Whether the lowering is for a jit over several devices whose partitioner still
  decides the layout (not a fully manual `shard_map` body, not one device)."""
  context = ctx.module_context.axis_context
  devices = getattr(context, "device_assignment", None)
  return (devices is not None and len(devices) > 1
          and getattr(context, "abstract_mesh", None) is not None)


def lower(ctx: Any, args: tuple, bind: Callable[[KernelDescription, tuple], list],
          kernel: KernelDescription, backend: str) -> list | None:
  """Lowers the kernel as a custom-partitioned op; None when no grid axis could ever be
  split, or when XLA's own partitioner already keeps the XLA backend's program
  shard-local (the caller lowers it plainly)."""
  axes, notes = split_candidates(kernel)
  if axes and backend == "xla" and not _loops_or_gathers(kernel):
    # The vectorized plan is a reshape and one batched body: XLA's partitioner keeps
    # it sharded, and where it cannot split it picks cheaper collectives (an
    # all-reduce over a sharded contraction) than the gathers of a fallback.
    notes.append("plain lowering: the XLA plan vectorizes every parallel axis, which "
                 "XLA's partitioner keeps shard-local")
    axes = []
  if kernel.debug:
    _print_notes(kernel, notes)
  if not axes:
    return None
  fn = _partitioned(kernel, axes, bind)
  return mlir.lower_fun(lambda *a: fn(*a), multiple_results=True)(ctx, *args)


def _loops_or_gathers(kernel: KernelDescription) -> bool:
  """Whether the XLA plan loops over a parallel axis (or chunks it) or gathers input
  blocks per program: programs XLA's partitioner gathers whole operands for."""
  plan = plan_of(kernel)
  return bool(plan.outer) or any(op.gathered for op in plan.inputs)


def split_candidates(kernel: KernelDescription) -> tuple[list[SplitAxis], list[str]]:
  """The grid axes that a sharding could split (before the shardings are known), and
  notes on why the others cannot be. Reuses the XLA plan's analysis
  (which axes are parallel, each operand's table of block positions)."""
  gm = kernel.grid_mapping
  if gm.dynamic_axes or gm.prefetch_avals:
    return [], ["scalar prefetch or a grid sized at run time: block positions are data, "
                "no grid axis is split (operands are gathered)"]
  plan = make_plan(kernel)
  not_parallel = set(plan.inner) | set(plan.summed) | set(plan.merged)
  parallel = [g for g in range(len(gm.grid)) if g not in not_parallel]
  notes = [f"axis {g} not split: sequential in the XLA plan" for g in sorted(not_parallel)]
  if not parallel and plan.reasons:
    notes.append(f"no parallel axis ({plan.reasons[0]})")
  used = _program_ids_read(kernel)
  ops = [*plan.inputs, *plan.outputs]
  n_in = len(plan.inputs)
  axes = []
  for g in parallel:
    if g in used:
      notes.append(f"axis {g} not split: the kernel reads program_id({g}), which would "
                   f"count from 0 on every shard")
      continue
    dims, why = {}, None
    coord = np.indices(gm.grid)[g]
    for i, op in enumerate(ops):
      moving = [d for d in range(op.table.shape[-1])
                if op.table.shape[g] > 1 and
                not np.all(op.table[..., d] == np.take(op.table[..., d], [0], axis=g))]
      if not moving:
        if i >= n_in:
          why = f"{op.mapping.origin} does not move along it"
        continue
      dim = op.mapping.dims[moving[0]]
      d = moving[0]
      exact = (len(moving) == 1 and dim.kind != "element" and op.pad[d] == (0, 0)
               and np.array_equal(op.table[..., d], coord * dim.size)
               and op.mapping.array_shape[d] == gm.grid[g] * dim.size)
      if not exact:
        why = (f"the blocks of {op.mapping.origin} do not follow the grid index "
               f"(block index = program_id({g}), blocks covering the dimension exactly)")
        break
      dims[i] = d
    sizes = {ops[i].mapping.array_shape[d] for i, d in dims.items()}
    if why is None and len(sizes) > 1:
      why = f"the dimensions it tiles differ in size {sorted(sizes)}"
    if why is not None:
      notes.append(f"axis {g} not split: {why}")
      continue
    axes.append(SplitAxis(g, dims))
  return axes, notes


def _program_ids_read(kernel: KernelDescription) -> set[int]:
  """Grid axes whose program id the kernel body uses (its leading jaxpr inputs)."""
  jaxpr = kernel.jaxpr.jaxpr
  ids = jaxpr.invars[:len(kernel.grid_mapping.grid)]
  read = [v for e in jaxpr.eqns for v in e.invars] + list(jaxpr.outvars)
  return {g for g, v in enumerate(ids) if any(r is v for r in read)}


def _partitioned(kernel: KernelDescription, axes: list[SplitAxis],
                 bind: Callable[[KernelDescription, tuple], list]) -> Any:
  gm = kernel.grid_mapping
  n_in = len(gm.inputs)
  mappings = (*gm.inputs, *gm.outputs)
  factor = {(i, d): f"g{a.axis}" for a in axes for i, d in a.dims.items()}

  def array_mapping(i):
    return ArrayMapping(*[factor.get((i, d), f"o{i}d{d}")
                          for d in range(len(mappings[i].array_shape))])

  rule = SdyShardingRule(operand_mappings=tuple(array_mapping(i) for i in range(n_in)),
                         result_mappings=tuple(array_mapping(n_in + o)
                                               for o in range(len(gm.outputs))))
  fn = custom_partitioning(lambda *args: tuple(bind(kernel, args)))

  def partition(mesh, arg_shapes, result_shape):
    shardings = [getattr(s, "sharding", None) for s in (*arg_shapes, *result_shape)]
    local, specs, notes = shard_local(kernel, axes, mesh, shardings)
    if kernel.debug:
      _print_notes(kernel, notes)
    named = [NamedSharding(mesh, PartitionSpec(*s)) for s in specs]
    return mesh, lambda *args: tuple(bind(local, args)), tuple(named[n_in:]), tuple(named[:n_in])

  fn.def_partition(partition, sharding_rule=rule)
  return fn


def _mesh_axes(sharding: Any, d: int) -> tuple[str, ...] | None:
  """The mesh axes dimension `d` is split over; None if unknown (not a NamedSharding)."""
  if not isinstance(sharding, NamedSharding):
    return None
  spec = tuple(sharding.spec)
  entry = spec[d] if d < len(spec) else None
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def shard_local(kernel: KernelDescription, axes: list[SplitAxis], mesh: Any,
                shardings: list[Any]) -> tuple[KernelDescription, list[list[Any]], list[str]]:
  """The per-shard kernel for the operands' shardings, each operand's partition spec
  (dimensions of split axes keep their mesh axes, everything else is gathered), and
  notes on what was not split."""
  gm = kernel.grid_mapping
  mappings = (*gm.inputs, *gm.outputs)
  specs: list[list[Any]] = [[None] * len(m.array_shape) for m in mappings]
  grid = list(gm.grid)
  local_shapes = [list(m.array_shape) for m in mappings]
  taken: set[str] = set()
  notes = []
  for a in axes:
    # The mesh axes of the first operand (inputs first) that is sharded along this axis.
    found = [_mesh_axes(shardings[i], d) for i, d in a.dims.items()]
    if any(f is None for f in found):
      notes.append(f"axis {a.axis} not split: an operand's sharding is not given over "
                   f"a named mesh")
      continue
    mesh_axes = next((f for f in found if f), ())
    if not mesh_axes:
      continue
    n = math.prod(mesh.shape[m] for m in mesh_axes)
    if grid[a.axis] % n or taken & set(mesh_axes):
      notes.append(f"axis {a.axis} not split: its {grid[a.axis]} blocks do not divide "
                   f"evenly over mesh axes {mesh_axes} ({n} shards), so blocks would "
                   f"straddle shards (operands are gathered)" if grid[a.axis] % n else
                   f"axis {a.axis} not split: mesh axes {mesh_axes} already split another "
                   f"grid axis")
      continue
    taken |= set(mesh_axes)
    grid[a.axis] //= n
    entry = mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes
    for i, d in a.dims.items():
      specs[i][d] = entry
      local_shapes[i][d] //= n
    notes.append(f"axis {a.axis} split over mesh axes {mesh_axes}: {grid[a.axis]} "
                 f"blocks per shard, operands stay shard-local")
  for i, (m, s) in enumerate(zip(mappings, shardings)):
    for d in range(len(m.array_shape)):
      if specs[i][d] is None and _mesh_axes(s, d):
        notes.append(f"{m.origin} is sharded along dimension {d}, which no split grid "
                     f"axis tiles: it is gathered")
  n_in = len(gm.inputs)
  blocks = [m.replace(array_shape=tuple(shape)) for m, shape in zip(mappings, local_shapes)]
  local_gm = gm.replace(grid=tuple(grid), inputs=tuple(blocks[:n_in]),
                        outputs=tuple(blocks[n_in:]))
  return kernel.replace(grid_mapping=local_gm), specs, notes


def _print_notes(kernel: KernelDescription, notes: list[str]) -> None:
  print(f"--- pallet partitioning of '{kernel.name}' ---")
  for n in notes:
    print(f"  - {n}")
