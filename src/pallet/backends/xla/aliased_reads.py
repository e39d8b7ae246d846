"""Blocked inputs that share their buffer with an output: reads see earlier writes.

`input_output_aliases={i: o}` makes input i and output o one buffer. Where both are
blocked, each grid step reads its input block from that buffer as it stands, so a
step that reads a block an earlier step wrote as output sees the new values: Pallas
runs it so on a TPU (the block is fetched from the shared HBM buffer) and so do JAX's
interpreters. Kernels build on it: splash attention's backward pass adds each query
head's dK/dV to the blocks the head before it wrote, through an aliased input.

Only such kernels change how they run: `shared_pairs` finds the aliased pairs where
some step reads an input block that overlaps an output block of an earlier step (or
where the block positions are data), and the planner then runs every grid axis as
one loop in grid order, each step loading its output blocks and storing them back,
with the input read from the output's buffer (executor.py). Where no step reads what
an earlier one wrote, reading the original input gives the same values and the plan
is unchanged.
"""
from __future__ import annotations

import numpy as np

from pallet import _internals as internals
from pallet.core import grid_analysis
from pallet.core.grid_mapping import BlockMapping
from pallet.core.tracing import KernelDescription

def shared_pairs(kernel: KernelDescription, in_tables: list[np.ndarray | None],
                 out_tables: list[np.ndarray | None]) -> tuple[tuple[int, int], ...]:
  """The (input, output) aliased pairs, both blocked and the input read by the
  kernel, where a step may read what an earlier step wrote; `*_tables` are each
  operand's element starts per step (grid + (ndim,), None where they are data)."""
  gm = kernel.grid_mapping
  n_lead = len(gm.grid) + len(gm.dynamic_axes) + len(gm.prefetch_avals)
  read = {e.input for e in internals.input_effects(kernel.jaxpr.jaxpr)
          if isinstance(e, internals.ReadEffect)}
  pairs = []
  for i, o in kernel.input_output_aliases:
    bi, bo = gm.inputs[i], gm.outputs[o]
    if bi.whole or bo.whole or n_lead + i not in read:
      continue
    ti, to = in_tables[i], out_tables[o]
    if ti is None or to is None or _reads_earlier_writes(bi, bo, ti, to):
      pairs.append((i, o))
  return tuple(pairs)


def _reads_earlier_writes(bi: BlockMapping, bo: BlockMapping, ti: np.ndarray,
                          to: np.ndarray) -> bool:
  """Whether some step's input block overlaps the output block of an earlier step
  (element starts `ti`, `to` of shape grid + (ndim,))."""
  n = int(np.prod(ti.shape[:-1], dtype=np.int64))
  si, so = ti.reshape(n, -1), to.reshape(n, -1)
  if bi.block_shape == bo.block_shape:
    first_write: dict[tuple, int] = {}
    for t in range(n):
      first_write.setdefault(tuple(so[t]), t)
    return any(first_write.get(tuple(si[s]), n) < s for s in range(n))
  sizes = lambda m: np.broadcast_to(np.array([d.size for d in m.dims], np.int64),
                                    (n, len(m.dims)))
  overlap = grid_analysis.window_overlaps(si, sizes(bi), so, sizes(bo))
  if overlap is None:
    return True   # too many to compare: assume it does (the plan stays correct)
  return bool(np.any(np.tril(overlap, k=-1)))
