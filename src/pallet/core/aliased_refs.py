"""An aliased input and output held whole in memory are one ref.

`input_output_aliases={i: o}` makes input i and output o one buffer. A kernel that sees
both whole in memory (`pl.ANY`, `pltpu.HBM`, GPU global memory: no copy into a block
buffer) works on that buffer itself, through either ref: a DMA into the input's ref lands
in the output (JAX's `test_dynamic_dma_on_2nd_minor` writes through the input), and a
read of the input sees what the output's ref wrote. Blocked operands are copied into
buffers of their own on a TPU, so there input and output stay apart, as pallet runs them.

pallet's backends start an aliased output from its input; `merge` makes the kernel's
uses of such an input ref uses of the output ref, so every backend sees one ref.
"""
from __future__ import annotations

from typing import Any

import jax

from pallet.core import grid_mapping as gm_lib
from pallet.core.specs import MemorySpace
from pallet.core.tracing import KernelDescription

# memory spaces whose refs are the operand's own buffer, not a copy of a block
_IN_PLACE = (MemorySpace.ANY, MemorySpace.HBM, MemorySpace.GMEM)


def _in_place(mapping: gm_lib.BlockMapping) -> bool:
  return mapping.memory_space in _IN_PLACE


def merge(kernel: KernelDescription) -> KernelDescription:
  """The kernel with each in-place aliased input ref replaced by its output ref (the
  input stays an operand, unused: the output's buffer starts as its value)."""
  gm = kernel.grid_mapping
  pairs = [(i, o) for i, o in kernel.input_output_aliases
           if _in_place(gm.inputs[i]) and _in_place(gm.outputs[o])]
  if not pairs:
    return kernel
  n_lead = len(gm.grid) + len(gm.dynamic_axes) + len(gm.prefetch_avals)
  n_in = len(gm.inputs)
  old = kernel.jaxpr

  def body(*args: Any) -> list:
    args = list(args)
    for i, o in pairs:
      args[n_lead + i] = args[n_lead + n_in + o]
    jax.core.eval_jaxpr(old.jaxpr, old.consts, *args)
    return []

  jaxpr = jax.make_jaxpr(body)(*[v.aval for v in old.jaxpr.invars])
  return kernel.replace(jaxpr=jaxpr)
