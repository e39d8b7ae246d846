"""TPU-flavoured names (`jax.experimental.pallas.tpu`), so TPU-style kernels run on any backend."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from pallet.specs import CompilerParams as _BaseCompilerParams
from pallet.specs import GridSpec, MemorySpace, no_block_spec
from pallet.dma import (AsyncCopyDescriptor, SemaphoreType, async_copy, dma_semaphore,
                        make_async_copy, make_async_remote_copy, semaphore_read,
                        semaphore_signal, semaphore_wait, sync_copy)
from pallet.pipeline import (BufferedRef, BufferType, PipelineStep, emit_pipeline,
                             emit_pipeline_with_allocations, emit_pipeline_with_async_prefetch)
from pallet.pipeline import BufferedRef as BufferedRefBase  # deprecated in JAX
from pallet.bits import join_bits, pack_elementwise, split_bits, unpack_elementwise
from pallet.tpu_conv import conv
from pallet.memory_spaces import AccMemorySpace as ACC
from pallet.memory_spaces import has_memory_space
from pallet.tpu_load_store import load, store
from pallet.lowering_errors import LoweringException
from pallet import tpu_core as core

VMEM = MemorySpace.VMEM
SMEM = MemorySpace.SMEM
ANY = MemorySpace.ANY
HBM = MemorySpace.HBM
SEMAPHORE = MemorySpace.SEMAPHORE


class TPUMemorySpace:
  """Namespace mirroring `pltpu.TPUMemorySpace` (`pltpu.TPUMemorySpace.VMEM`)."""
  VMEM = VMEM
  SMEM = SMEM
  ANY = ANY
  HBM = HBM
  SEMAPHORE = SEMAPHORE


@dataclasses.dataclass(frozen=True)
class CompilerParams(_BaseCompilerParams):
  """`dimension_semantics` ("parallel" / "arbitrary") is honoured by the CPU backend."""
  allow_input_fusion: Sequence[bool] | None = None
  vmem_limit_bytes: int | None = None
  collective_id: int | None = None


TPUCompilerParams = CompilerParams


class PrefetchScalarGridSpec(GridSpec):
  """A grid spec whose first `num_scalar_prefetch` operands are scalars given to the
  index maps and the kernel (as refs), enabling data-dependent block selection."""

  def __init__(self, num_scalar_prefetch: int, grid: Any = (),
               in_specs: Any = no_block_spec, out_specs: Any = no_block_spec,
               scratch_shapes: Sequence[Any] = ()):
    super().__init__(grid=grid, in_specs=in_specs, out_specs=out_specs,
                     scratch_shapes=tuple(scratch_shapes),
                     num_scalar_prefetch=num_scalar_prefetch)
