"""Which grid axes become the launch grid and which become loops in the program.

A grid axis is parallel when `grid_analysis` lets its programs run at once (proven
independent with some output block moving along it, or declared "parallel" and not
proven to carry state): it joins the launch grid (all parallel axes flattened into
launch axis 0, whose limit is 2**31 - 1). Every other axis is sequential: it becomes
a `for` loop inside each program, in grid order, so a program that accumulates into a
resident output block or carries scratch over a reduction axis sees every step.

Grid sizes computed at run time arrive as kernel operands. A sequential axis of such
a size is a loop with that trip count. A parallel one cannot size the launch (jaxlib's
Triton kernel call takes the grid when the program is lowered), so a fixed number of
programs is launched along it, `grid_bounds` from `pallet.triton.CompilerParams` or
`DEFAULT_DYNAMIC_PROGRAMS` shared out: program p takes indices p, p + programs, ...
below the size (a strided loop), so programs past the size exit at once and a size
past the bound still runs every index.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from pallet.core import grid_analysis
from pallet.errors import TritonLoweringError
from pallet.core.grid_mapping import BlockMapping
from pallet.core.tracing import KernelDescription


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


# Programs launched along the grid axes of run-time size that run in parallel, when
# `grid_bounds` gives no bound: enough to keep a large GPU busy (an H100 has 132 SMs),
# shared out among those axes after the static parallel axes' programs.
DEFAULT_DYNAMIC_PROGRAMS = 1024


@dataclasses.dataclass(frozen=True)
class Schedule:
  grid: tuple[int | None, ...]   # None: a size computed at run time
  parallel: tuple[int, ...]      # launch grid axes, in grid order
  sequential: tuple[int, ...]    # loop axes, outermost first
  resident_outputs: tuple[bool, ...]   # output block fixed across all loop axes
  reasons: tuple[str, ...] = ()        # per axis, why it runs as it does (grid_analysis)
  # programs launched along each parallel axis of run-time size (a strided loop in each)
  strided: tuple[tuple[int, int], ...] = ()

  def programs_along(self, axis: int) -> int:
    """Programs launched along a parallel axis."""
    return dict(self.strided).get(axis) or self.grid[axis]

  @property
  def num_programs(self) -> int:
    return math.prod(self.programs_along(a) for a in self.parallel)

  def describe(self) -> str:
    def size(a):
      if self.grid[a] is not None:
        return f"{a} (size {self.grid[a]})"
      if a in dict(self.strided):
        n = dict(self.strided)[a]
        return f"{a} (size at run time: {n} programs p, each taking indices p, p + {n}, ...)"
      return f"{a} (size at run time)"
    par = ", ".join(size(a) for a in self.parallel) or "none"
    seq = ", ".join(size(a) for a in self.sequential) or "none"
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
                  tuple(facts.describe()), _strided(kernel, parallel))


def _strided(kernel: KernelDescription, parallel: list[int]) -> tuple[tuple[int, int], ...]:
  """(axis, programs) for the parallel axes whose size is computed at run time."""
  grid = kernel.grid_mapping.grid
  bounds = grid_bounds(kernel)
  dynamic = [a for a in parallel if grid[a] is None]
  unbounded = [a for a in dynamic if bounds[a] is None]
  static_programs = math.prod(grid[a] for a in parallel if grid[a] is not None)
  budget = max(1, DEFAULT_DYNAMIC_PROGRAMS // max(1, static_programs))
  share = max(1, int(budget ** (1 / len(unbounded)))) if unbounded else 1
  return tuple((a, bounds[a] if bounds[a] is not None else share) for a in dynamic)


def grid_bounds(kernel: KernelDescription) -> tuple[int | None, ...]:
  """Per grid axis, the bound `pallet.triton.CompilerParams(grid_bounds=...)` gives its
  run-time size (None: no bound, or a static axis). vmap adds leading axes, so a
  shorter tuple lines up with the last axes."""
  gm = kernel.grid_mapping
  given = getattr(kernel.compiler_params, "grid_bounds", None)
  if given is None:
    return (None,) * len(gm.grid)
  where = f"kernel '{kernel.name}' ({kernel.source})"
  try:
    given = tuple(given)
  except TypeError:
    given = None
  if given is None or len(given) > len(gm.grid):
    raise TritonLoweringError(
        f"pallet Triton backend: {where}: grid_bounds must be a tuple with one entry per "
        f"grid axis (None, or the largest size an axis computed at run time takes), got "
        f"{getattr(kernel.compiler_params, 'grid_bounds', None)!r} for grid {gm.grid}")
  bounds = (None,) * (len(gm.grid) - len(given)) + given
  for a, (b, n) in enumerate(zip(bounds, gm.grid)):
    if b is None:
      continue
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
      raise TritonLoweringError(
          f"pallet Triton backend: {where}: grid_bounds[{a}] must be None or a positive "
          f"int, got {b!r}")
    if n is not None and b != n:
      raise TritonLoweringError(
          f"pallet Triton backend: {where}: grid_bounds[{a}] is {b}, but grid axis {a} has "
          f"the static size {n}; bounds are for sizes computed at run time (give None)")
  return tuple(None if n is not None else (None if b is None else int(b))
               for b, n in zip(bounds, gm.grid))


_MAX_EVALUATED_STEPS = 1 << 20


def block_start_range(mapping: BlockMapping, grid: tuple[int, ...],
                      has_prefetch: bool) -> list[tuple[int, int]] | None:
  """(lowest, highest) element offset at which the block starts along each array
  dimension over the whole grid, or None when that is data-dependent (scalar
  prefetch) or the grid is too large to enumerate. Lets the code generator drop
  edge masks that can never be false."""
  if any(n is None for n in grid):     # sizes computed at run time
    return None
  steps = math.prod(grid) if grid else 1
  if has_prefetch or steps == 0 or steps > _MAX_EVALUATED_STEPS:
    return None
  import jax
  import jax.numpy as jnp
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
