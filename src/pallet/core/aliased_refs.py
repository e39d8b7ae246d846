"""An aliased input held whole in memory that the kernel writes is its output's ref.

`input_output_aliases={i: o}` makes input i and output o one buffer. A kernel that sees
both whole in memory (`pl.ANY`, `pltpu.HBM`, GPU global memory: no copy into a block
buffer) works on that buffer itself, through either ref: a DMA into the input's ref lands
in the output (JAX's `test_dynamic_dma_on_2nd_minor` writes only through the input).
pallet otherwise keeps an aliased input's values apart from its output (the output starts
as a copy), so such a write reached no result. Blocked operands are copies of their
blocks on a TPU: writing an input block changes no output, and the XLA backend fetches
an aliased input's blocks from the output's buffer as a TPU does
(backends/xla/aliased_reads.py).

`merge` makes every use of an in-place aliased input ref that the kernel writes a use of
the output's ref, so every backend sees one buffer. An input the kernel only reads keeps
its values.
"""
from __future__ import annotations

from typing import Any

import jax

from pallet import _internals as internals
from pallet.core import grid_mapping as gm_lib
from pallet.core.specs import MemorySpace
from pallet.core.tracing import KernelDescription

# memory spaces whose refs are the operand's own buffer, not a copy of a block
_IN_PLACE = (MemorySpace.ANY, MemorySpace.HBM, MemorySpace.GMEM)


def _in_place(mapping: gm_lib.BlockMapping) -> bool:
  return mapping.memory_space in _IN_PLACE


def merge(kernel: KernelDescription) -> KernelDescription:
  """The kernel with each in-place aliased input ref that it writes replaced by its
  output ref (the input stays an operand, unused: the output's buffer starts as its
  value)."""
  gm = kernel.grid_mapping
  n_lead = len(gm.grid) + len(gm.dynamic_axes) + len(gm.prefetch_avals)
  n_in = len(gm.inputs)
  old = kernel.jaxpr
  written = {e.input for e in internals.input_effects(old.jaxpr)
             if isinstance(e, internals.WriteEffect)}
  pairs = [(i, o) for i, o in kernel.input_output_aliases
           if _in_place(gm.inputs[i]) and _in_place(gm.outputs[o]) and n_lead + i in written]
  if not pairs:
    return kernel

  def body(*args: Any) -> list:
    args = list(args)
    for i, o in pairs:
      args[n_lead + i] = args[n_lead + n_in + o]
    jax.core.eval_jaxpr(old.jaxpr, old.consts, *args)
    return []

  jaxpr = internals.trace_jaxpr(body, [v.aval for v in old.jaxpr.invars], "aliased refs")
  return kernel.replace(jaxpr=jaxpr)
