"""TPU-flavoured names (`jax.experimental.pallas.tpu`), so TPU-style kernels run on any backend."""
from __future__ import annotations

from pallet.core.specs import MemorySpace
from pallet.core.interpret_params import (InterpretParams, force_tpu_interpret_mode,
                                          reset_tpu_interpret_mode_state, set_tpu_interpret_mode)
from pallet.tpu.info import (ChipVersion, Tiling, TpuInfo, get_tpu_info,
                             get_tpu_info_for_chip, is_tpu_device)
from pallet.tpu.ops import (annotate, bitcast, delay, einshape, repeat, roll,
                            stochastic_round, touch, trace_value,
                            with_memory_space_constraint)
from pallet.tpu.random import (prng_random_bits, prng_seed, sample_block,
                               stateful_bernoulli, stateful_bits, stateful_normal,
                               stateful_uniform, to_pallas_key)
from pallet.tpu.mesh import (TensorCoreMesh, core_barrier, create_tensorcore_mesh,
                             run_on_first_core)
from pallet.core.unsupported import (matmul_acc_lhs, matmul_lhs_fifo, matmul_pop,
                                     matmul_pop_fifo, matmul_push_rhs, pack_fp6, unpack_fp6)
from pallet.tpu.bits import join_bits, pack_elementwise, split_bits, unpack_elementwise
from pallet.tpu.convolution import conv
from pallet.tpu.memory_spaces import AccMemorySpace as ACC
from pallet.tpu.memory_spaces import has_memory_space
from pallet.tpu.load_store import load, store
from pallet.errors import LoweringException
from pallet.tpu import core
from pallet.core.helpers import reciprocal
from pallet.tpu.params import (ARBITRARY, CORE_PARALLEL, PARALLEL, SUBCORE_PARALLEL,
                               CompilerParams, CoreType, GridDimensionSemantics,
                               PrefetchScalarGridSpec, SideEffectType)
from pallet.core.dma import (AsyncCopyDescriptor, SemaphoreType, async_copy, dma_semaphore,
                             make_async_copy, semaphore_read, semaphore_signal, semaphore_wait,
                             sync_copy)
from pallet.distributed.remote import (async_remote_copy, get_barrier_semaphore,
                                       make_async_remote_copy)
from pallet.tpu.pipeline import (BufferedRef, BufferType, PipelineStep, emit_pipeline,
                                 emit_pipeline_with_allocations, emit_pipeline_with_async_prefetch)
from pallet.tpu.pipeline import BufferedRef as BufferedRefBase  # deprecated in JAX

VMEM = MemorySpace.VMEM
SMEM = MemorySpace.SMEM
ANY = MemorySpace.ANY
HBM = MemorySpace.HBM
SEMAPHORE = MemorySpace.SEMAPHORE
CMEM = MemorySpace.CMEM
VMEM_SHARED = MemorySpace.VMEM_SHARED
HOST = MemorySpace.HOST  # `pl.HOST` since JAX 0.10; kernels written before still say pltpu.HOST


class TPUMemorySpace:
  """Namespace mirroring `pltpu.TPUMemorySpace` (`pltpu.TPUMemorySpace.VMEM`)."""
  VMEM = VMEM
  SMEM = SMEM
  ANY = ANY
  HBM = HBM
  SEMAPHORE = SEMAPHORE


TPUCompilerParams = CompilerParams

