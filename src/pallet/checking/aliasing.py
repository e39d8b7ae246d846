"""In-place aliasing hazards: `input_output_aliases` makes an input and an output one
buffer on a TPU or GPU. pallet runs blocked pairs as a TPU does
(backends/xla/aliased_reads.py): an input block is fetched from the shared buffer when
its position changes, and an output block reaches the buffer when it stops being
resident. A kernel can build on that (splash attention adds to blocks an earlier head
wrote); what it cannot rely on is reported, naming the reading program, the input
and its read:

* a program reads a block of the input that a program before it (in grid order)
  writes in the output while that output block is still resident, or with the input
  block fetched before that write (the read sees the old values on a TPU, the new
  ones where writes land at once, as in JAX's generic interpreter);
* a program reads a block that a later program of another parallel program writes
  (where the two run at once, the write may come first).

Blocked inputs and outputs are checked when the call is made, from the index maps
and the reads and writes the kernel surely makes at each step (coverage.py). Inputs
and outputs seen whole (`pl.ANY`, no BlockSpec), indexed by the kernel itself, are
checked while it runs (the instrumentation's alias shadows).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from pallet.core import checks, grid_analysis
from pallet import _internals as internals
from pallet.checking import coverage
from pallet.core.tracing import KernelDescription

def whole_pairs(kernel: KernelDescription) -> tuple[tuple[int, int], ...]:
  """(input, output) aliased pairs that the kernel sees whole on both sides."""
  gm = kernel.grid_mapping
  return tuple((i, o) for i, o in kernel.input_output_aliases
               if gm.inputs[i].whole and gm.outputs[o].whole)


def static_hazard(kernel: KernelDescription, names: Sequence[str], parallel: Sequence[int],
                  block_table: Any) -> checks.KernelCheckError | None:
  """The KernelCheckError of the first hazard between blocked aliased operands, or
  None; `block_table(mapping)` gives a mapping's index-map results over the grid."""
  gm = kernel.grid_mapping
  if not kernel.input_output_aliases:
    return None
  facts = coverage.sure_accesses(kernel)
  if facts is None:
    return None
  n_pre = len(gm.prefetch_avals)
  first_out = n_pre + len(gm.inputs)
  for i, o in kernel.input_output_aliases:
    bi, bo = gm.inputs[i], gm.outputs[o]
    reads, writes = facts.reads.get(n_pre + i), facts.writes.get(first_out + o)
    if bi.whole or bo.whole or reads is None or writes is None:
      continue
    ti, to = block_table(bi), block_table(bo)
    if ti is None or to is None:
      continue
    hazard = _first_hazard(bi, bo, ti.reshape(gm.num_steps, -1), to.reshape(gm.num_steps, -1),
                           reads, writes, gm.grid, tuple(parallel))
    if hazard is None:
      continue
    reader, writer = hazard
    grid = tuple(gm.grid)
    at = lambda s: tuple(int(x) for x in np.unravel_index(s, grid)) if grid else ()
    name, out_name = names[n_pre + i], names[first_out + o]
    src = internals.equation_source(facts.read_at[n_pre + i])
    line = f"{src[0]}:{src[1]}" if src else kernel.source
    when = ("before it in grid order" if writer < reader else
            "of another parallel program (the parallel grid axes "
            f"{tuple(parallel)}), which may run first on a TPU or GPU")
    info = checks.CheckInfo(kind="aliasing", kernel=kernel.name, ref=name, line=line,
                            grid=grid)
    return info.error(
        f"reads '{name}', which input_output_aliases makes one buffer with output "
        f"'{out_name}', in a block that program {at(writer)} writes into '{out_name}' "
        f"{when}: where the buffer is shared this read sees the new values, not the "
        f"originals pallet gives it (read the block in the program that writes it, or "
        f"do not alias)", at(reader))
  return None


def _windows(mapping: Any, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(first element, size) per step and dimension of the array."""
  starts, sizes = [], []
  for d, dim in enumerate(mapping.dims):
    idx = table[:, d].astype(np.int64)
    if dim.kind == "element":
      starts.append(idx - dim.padding[0])
    else:
      starts.append(idx * dim.size)
    sizes.append(np.full(idx.shape, dim.size, np.int64))
  return np.stack(starts, 1), np.stack(sizes, 1)


def _first_hazard(bi, bo, ti, to, reads, writes, grid, parallel) -> tuple[int, int] | None:
  """(reading step, writing step) of the first read in grid order that a hazard hits."""
  n = len(reads)
  par = _parallel_index(grid, parallel, n)
  if bi.block_shape == bo.block_shape and all(d.kind != "element" for d in bi.dims + bo.dims):
    writers: dict[tuple, list[int]] = {}
    for p in np.flatnonzero(writes):
      writers.setdefault(tuple(to[p]), []).append(int(p))
    for q in np.flatnonzero(reads):
      for p in writers.get(tuple(ti[q]), ()):
        if p != q and ((p < q and _stale(p, int(q), ti, to)) or par[p] != par[q]):
          return int(q), p
    return None
  overlap = grid_analysis.window_overlaps(*_windows(bi, ti), *_windows(bo, to))
  if overlap is None:
    return None
  q_ids, p_ids = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
  hazard = (overlap & reads[:, None] & writes[None, :] & (q_ids != p_ids)
            & ((p_ids < q_ids) | (par[p_ids] != par[q_ids])))
  for q, p in zip(*np.nonzero(hazard)):   # row-major: the first read in grid order
    if p > q or par[p] != par[q] or _stale(int(p), int(q), ti, to):
      return int(q), int(p)
  return None


def _stale(p: int, q: int, ti: np.ndarray, to: np.ndarray) -> bool:
  """Whether step q's read of what step p < q wrote depends on when writes land: the
  output block p wrote is still resident at q, or q's input block was fetched at or
  before p (its position unchanged since)."""
  resident = np.all(to[p:q] == to[p])
  unfetched = np.all(ti[p:q + 1] == ti[q])
  return bool(resident or unfetched)


def _parallel_index(grid: Sequence[int], parallel: Sequence[int], n: int) -> np.ndarray:
  coords = np.indices(grid).reshape(len(grid), n) if grid else np.zeros((0, n), np.int64)
  index = np.zeros(n, np.int64)
  for a in parallel:
    index = index * grid[a] + coords[a]
  return index
