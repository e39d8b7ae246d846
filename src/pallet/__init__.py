"""pallet: Pallas-style kernels on JAX, with a compiled CPU/XLA backend and a Triton backend.

`import pallet as pl` gives the `jax.experimental.pallas` API; see README.md.
"""
from pallet.core.specs import (ANY, BlockSpec, Blocked, Buffered, CompilerParams, CostEstimate,
                               Element, GridSpec, MemorySpace, ScratchShape, Squeezed,
                               no_block_spec, squeezed)
from pallet.core.specs import (HOST, BlockDim, BoundedSlice, Indirect, MemoryRef, RevisitMode,
                               semaphore)
from pallet.errors import PalletError
from pallet.core.primitives import (Slice, atomic_add, atomic_and, atomic_cas, atomic_max,
                                    atomic_min, atomic_or, atomic_xchg, atomic_xor,
                                    broadcast_to, cdiv, debug_print, ds, dslice, load,
                                    max_contiguous, multiple_of, num_programs, program_id,
                                    run_scoped, store, swap, when)
from pallet.pallas_call import pallas_call, pallas_call_p
from pallet.triton.primitives import dot  # JAX < 0.12's pl.dot is plgpu.dot
from pallet.backends import default_backend
from pallet.core.helpers import (align_to, empty, empty_like, empty_ref_like, estimate_cost, loop,
                                 next_power_of_2, reciprocal, run_state, strides_from_shape,
                                 with_scoped)
from pallet.core.checks import (allow_unwritten_outputs, debug_check, enable_debug_checks,
                                enable_poison_buffers)
from pallet.errors import KernelCheckError
from pallet.core.interpret_params import InterpretParams
from pallet.core.dma import semaphore_read, semaphore_signal, semaphore_wait
from pallet.errors import GridOrderWarning, IndexBoundsWarning
from pallet.tpu.mesh import core_map, kernel
from pallet.core.refs_select import select_ref
from pallet.export import lower_as_mlir, pallas_export_experimental
from pallet.core.global_refs import get_global
from pallet.core.device_ids import DeviceIdType
from pallet.tpu.ops import delay
from pallet.autotune import autotune
from pallet import named

__version__ = "0.1.0"
