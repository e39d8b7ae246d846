"""`pltpu.core`: the module that JAX's TPU types live in, for kernels that reach
them as `pltpu.core.X`. The same objects as `pallet.tpu` exports."""
from __future__ import annotations

from pallet.core.dma import SemaphoreType
from pallet.tpu.memory_spaces import AccMemorySpace
from pallet.core.specs import MemoryRef, MemorySpace, no_block_spec
from pallet.tpu.params import (ARBITRARY, CORE_PARALLEL, PARALLEL, SUBCORE_PARALLEL,
                               CompilerParams, CoreType, GridDimensionSemantics,
                               PrefetchScalarGridSpec, SideEffectType)
from pallet.tpu.mesh import TensorCoreMesh, create_tensorcore_mesh
