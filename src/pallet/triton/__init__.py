"""`jax.experimental.pallas.triton` (JAX 0.12), usable on every backend: masked
loads/stores, dot, atomics and compiler hints (primitives.py), compiler
params and GPU info (gpu_target.py); and `source`, the Triton code the Triton
backend generates for a kernel call."""
from pallet.backends.triton import source
from pallet.backends.triton.launch import CUSTOM_CALL_TARGET as CUSTOM_CALL_TARGET_NAME
from pallet.triton.gpu_target import (CompilerParams, GpuInfo, GpuVersion, get_gpu_info,
                                      get_gpu_info_from_version, is_gpu_device)
from pallet.core.primitives import (atomic_add, atomic_and, atomic_max, atomic_min, atomic_or,
                                    atomic_xchg, atomic_xor, max_contiguous)
from pallet.triton.primitives import (approx_tanh, atomic_cas, debug_barrier, dot,
                                      elementwise_inline_asm, load, store)

TritonCompilerParams = CompilerParams
