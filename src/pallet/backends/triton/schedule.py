"""Which grid axes become the launch grid and which become loops in the program.

A grid axis is parallel when `grid_analysis` lets its programs run at once (proven
independent with some output block moving along it, or declared "parallel" and not
proven to carry state): it joins the launch grid (all parallel axes flattened into
launch axis 0, whose limit is 2**31 - 1). Every other axis is sequential: it becomes
a `for` loop inside each program, in grid order, so a program that accumulates into a
resident output block or carries scratch over a reduction axis sees every step.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from pallet import grid_analysis
from pallet.grid_mapping import BlockMapping
from pallet.tracing import KernelDescription


def _depends_on(closed_jaxpr: Any, n_inputs: int) -> list[set[int]]:
  """For each output of a jaxpr, the set of its first `n_inputs` inputs it depends on."""
  jaxpr = closed_jaxpr.jaxpr
  deps: dict[Any, set[int]] = {v: {i} for i, v in enumerate(jaxpr.invars[:n_inputs])}
  for v in jaxpr.invars[n_inputs:]:
    deps[v] = set()
  for eqn in jaxpr.eqns:
    found: set[int] = set()
    for v in eqn.invars:
      if hasattr(v, "aval") and not hasattr(v, "val"):
        found |= deps.get(v, set())
    for v in eqn.outvars:
      deps[v] = found
  return [deps.get(v, set()) if not hasattr(v, "val") else set() for v in jaxpr.outvars]


def moving_axes(mapping: BlockMapping, num_axes: int) -> set[int]:
  """Grid axes the block's position can depend on."""
  out: set[int] = set()
  for d in _depends_on(mapping.index_map, num_axes):
    out |= d
  return out


@dataclasses.dataclass(frozen=True)
class Schedule:
  grid: tuple[int, ...]
  parallel: tuple[int, ...]      # launch grid axes, in grid order
  sequential: tuple[int, ...]    # loop axes, outermost first
  resident_outputs: tuple[bool, ...]   # output block fixed across all loop axes
  reasons: tuple[str, ...] = ()        # per axis, why it runs as it does (grid_analysis)

  @property
  def num_programs(self) -> int:
    return math.prod(self.grid[a] for a in self.parallel)

  def describe(self) -> str:
    par = ", ".join(f"{a} (size {self.grid[a]})" for a in self.parallel) or "none"
    seq = ", ".join(f"{a} (size {self.grid[a]})" for a in self.sequential) or "none"
    return (f"grid {self.grid}: parallel axes {par} -> {self.num_programs} programs; "
            f"sequential axes {seq} -> loops in each program")


def make_schedule(kernel: KernelDescription) -> Schedule:
  gm = kernel.grid_mapping
  g = len(gm.grid)
  moves = [moving_axes(o, g) for o in gm.outputs]
  facts = grid_analysis.analyse(kernel)
  parallel = list(facts.parallel)
  sequential = [a for a in range(g) if a not in parallel]
  resident = tuple(not (m & set(sequential)) for m in moves)
  return Schedule(tuple(gm.grid), tuple(parallel), tuple(sequential), resident,
                  tuple(facts.describe()))


_MAX_EVALUATED_STEPS = 1 << 20


def block_start_range(mapping: BlockMapping, grid: tuple[int, ...],
                      has_prefetch: bool) -> list[tuple[int, int]] | None:
  """(lowest, highest) element offset at which the block starts along each array
  dimension over the whole grid, or None when that is data-dependent (scalar
  prefetch) or the grid is too large to enumerate. Lets the code generator drop
  edge masks that can never be false."""
  steps = math.prod(grid) if grid else 1
  if has_prefetch or steps == 0 or steps > _MAX_EVALUATED_STEPS:
    return None
  import jax
  import jax.numpy as jnp
  import numpy as np
  im = mapping.index_map
  with jax.ensure_compile_time_eval():
    if grid:
      ids = [jnp.asarray(c.reshape(-1)) for c in np.indices(grid, dtype=np.int32)]
      outs = jax.vmap(lambda *i: jax.core.eval_jaxpr(im.jaxpr, im.consts, *i))(*ids)
    else:
      outs = jax.core.eval_jaxpr(im.jaxpr, im.consts)
  ranges = []
  for dim, out in zip(mapping.dims, outs):
    scale, shift = (1, dim.padding[0]) if dim.kind == "element" else (dim.size, 0)
    starts = np.asarray(out, np.int64) * scale - shift
    ranges.append((int(starts.min()), int(starts.max())))
  return ranges
