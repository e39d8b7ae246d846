"""Launching a compiled kernel from XLA: the `triton_kernel_call_ffi` custom call.

jaxlib's GPU plugins (jax-cuda12-plugin, jax-rocm plugin) ship the runtime that
jax-triton uses: a `TritonKernel` (compiled binary + launch metadata), wrapped in
a `TritonKernelCall` (grid and parameters), serialized into the custom call's
`opaque` attribute. pallet builds these objects itself, so it needs neither
jax-triton nor torch. Kernels compile at lowering time for the device's target
(or the compute capability given in `pallet.triton.CompilerParams`).
"""
from __future__ import annotations

import os
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from pallet import _internals

from pallet.core import checks
from pallet.backends.triton import compiler
from pallet.errors import TritonLoweringError
from pallet.core.tracing import KernelDescription

CUSTOM_CALL_TARGET = "triton_kernel_call_ffi"


def _kernel_call_library(kernel: KernelDescription, platform: str) -> Any:
  gpu_triton = _internals.jaxlib_triton_kernel_call()
  if gpu_triton is None:
    plugin = "jax-cuda12-plugin" if platform == "cuda" else "the jax ROCm plugin"
    raise TritonLoweringError(
        f"pallet Triton backend: kernel '{kernel.name}' ({kernel.source}): launching Triton "
        f"kernels from JAX needs jaxlib's Triton kernel-call support for {platform}, which "
        f"comes with {plugin}; install it (e.g. pip install 'jax[cuda12]')")
  return gpu_triton


def target_for(kernel: KernelDescription, platform: str, library: Any) -> Any:
  """The GPUTarget to compile for: the compute capability/arch the user gave,
  else the one of device 0."""
  from triton.backends.compiler import GPUTarget
  params = kernel.compiler_params
  if platform == "cuda":
    cc = getattr(params, "compute_capability", None) or os.environ.get(
        "PALLET_TRITON_COMPUTE_CAPABILITY")
    if cc is None:
      try:
        cc = library.get_compute_capability(0)
      except Exception as e:
        raise TritonLoweringError(
            f"pallet Triton backend: kernel '{kernel.name}' ({kernel.source}): no CUDA device "
            f"to read the compute capability from ({e}); pass "
            f"pallet.triton.CompilerParams(compute_capability=80) to compile ahead of time"
        ) from None
    return GPUTarget("cuda", int(cc), 32)
  arch = getattr(params, "gpu_arch", None) or os.environ.get("PALLET_TRITON_GPU_ARCH")
  if arch is None:
    arch = library.get_arch_details(0).split(":")[0]
  return GPUTarget("hip", arch, 64)


def lower_gpu(ctx: Any, *args: Any, kernel: KernelDescription, platform: str) -> list:
  from pallet.backends.triton import generated
  gm = kernel.grid_mapping
  gen = generated(kernel)
  if gen.schedule.num_programs == 0 or 0 in gm.grid:
    return _no_programs(ctx, *args, kernel=kernel)
  library = _kernel_call_library(kernel, platform)
  target = target_for(kernel, platform, library)
  compiled = compiler.compile_kernel(gen, target)
  meta = compiled.metadata
  binary = compiled.asm["ptx"] if platform == "cuda" else _hsaco_path(compiled)
  kernel_args = [meta.name, meta.num_warps, meta.num_ctas, meta.shared, binary,
                 compiled.asm["ttir"], target.arch if isinstance(target.arch, int) else 0]
  scratch = getattr(meta, "global_scratch_size", 0) or 0
  if scratch:
    kernel_args += [scratch, getattr(meta, "global_scratch_align", 1)]
  triton_kernel = library.TritonKernel(*kernel_args)

  n_operands = len(args) + len(gen.constants)
  n_results = len(gm.outputs) + (1 if gen.workspace_bytes else 0)
  params = [library.create_array_parameter(0, 16) for _ in range(n_operands + n_results)]
  if gen.check_messages:   # the check flags start at zero (jaxlib clears them)
    params.append(library.create_array_parameter(4 * len(gen.check_messages), 16))
  params += [library.create_array_parameter(0, 16) for _ in gen.written_inputs]
  grid = gen.launch_grid
  call = library.TritonKernelCall(triton_kernel, grid[0], grid[1], grid[2], params)
  opaque = zlib.compress(call.to_proto(kernel.name, b""))

  # Operands: prefetch, inputs, closed-over constants; results: outputs, workspace,
  # check flags, then one result aliased to each input the kernel writes into, so
  # that XLA gives the kernel a buffer of its own (a copy where the input is still
  # needed).
  operands = list(args) + [mlir.ir_constant(np.asarray(c)) for c in gen.constants]
  out_avals = list(ctx.avals_out)
  if gen.workspace_bytes:
    out_avals.append(jax.core.ShapedArray(
        (gen.workspace_bytes * gen.schedule.num_programs,), jnp.int8))
  if gen.check_messages:
    out_avals.append(jax.core.ShapedArray((len(gen.check_messages),), jnp.int32))
  in_avals = list(ctx.avals_in) + [jax.core.ShapedArray(c.shape, c.dtype)
                                   for c in gen.constants]
  n_pre = len(gm.dynamic_axes) + len(gm.prefetch_avals)   # operands before the inputs
  aliases = {n_pre + i: o for i, o in kernel.input_output_aliases}
  for j in gen.written_inputs:
    aliases[n_pre + j] = len(out_avals)
    out_avals.append(ctx.avals_in[n_pre + j])
  rule = jax.ffi.ffi_lowering(CUSTOM_CALL_TARGET, api_version=4,
                              operand_output_aliases=aliases, has_side_effect=False)
  sub_ctx = ctx.replace(avals_in=in_avals, avals_out=out_avals)
  results = list(rule(sub_ctx, *operands, opaque=opaque))
  if gen.check_messages:
    flags = results[len(gm.outputs) + (1 if gen.workspace_bytes else 0)]
    _raise_failed_checks(ctx, flags, kernel, gen.check_messages)
  return results[:len(gm.outputs)]


def _raise_failed_checks(ctx: Any, flags: Any, kernel: KernelDescription,
                         messages: tuple[str, ...]) -> None:
  """After the kernel: each set flag fails the call with its check's message."""
  def check_all(flags):
    # Checking-mode flags hold 2**31 - 1 - (first failing step), see
    # codegen._pallet_check: only the check failing at the first step reports.
    with_info = [k for k, m in enumerate(messages) if getattr(m, "info", None) is not None]
    if with_info:
      steps = flags[jnp.asarray(with_info)]
      winner = jnp.argmax(steps == jnp.max(steps))
    for k, message in enumerate(messages):
      info = getattr(message, "info", None)
      if info is None:
        checks.check(flags[k] == 0, message)
        continue
      step, ids = 2147483647 - flags[k], []
      for n in reversed(info.grid):
        ids.insert(0, step % n)
        step = step // n
      fails = (flags[k] != 0) & (winner == with_info.index(k))
      checks.check(~fails, message, info, (*ids, -2**31))
    return []

  aval = jax.core.ShapedArray((len(messages),), jnp.int32)
  try:
    mlir.lower_fun(check_all, multiple_results=True)(
        ctx.replace(avals_in=[aval], avals_out=[]), flags)
  except ValueError as e:    # a host callback for a platform this process does not run
    raise TritonLoweringError(
        f"pallet Triton backend: kernel '{kernel.name}' ({kernel.source}) has run-time "
        f"checks (pl.debug_check), which report failures through a host callback; JAX "
        f"lowers those only for the platform this process runs on ({e}). Lower on the "
        f"GPU machine, or trace the kernel with pl.enable_debug_checks(False)") from None


def _hsaco_path(compiled: Any) -> str:
  """jaxlib takes AMD binaries by file path."""
  import hashlib
  data = compiled.asm["hsaco"]
  path = os.path.join(compiler.cache_dir(), hashlib.sha256(data).hexdigest()[:16] + ".hsaco")
  if not os.path.exists(path):
    with open(path, "wb") as f:
      f.write(data)
  return path


def _no_programs(ctx: Any, *args: Any, kernel: KernelDescription) -> list:
  """A grid with no steps writes nothing: outputs are their aliased inputs or zeros."""
  gm = kernel.grid_mapping
  n_pre = len(gm.dynamic_axes) + len(gm.prefetch_avals)
  by_output = {o: i for i, o in kernel.input_output_aliases}

  def empty(*operands):
    return [operands[n_pre + by_output[k]] if k in by_output else
            jnp.zeros(b.array_shape, b.dtype) for k, b in enumerate(gm.outputs)]

  return mlir.lower_fun(empty, multiple_results=True)(ctx, *args)
