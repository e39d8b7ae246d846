"""The Triton GPU backend: kernels compiled by Triton for NVIDIA and AMD GPUs.

Pipeline, one file per stage:
  schedule.py     grid axes -> launch grid (parallel) and in-program loops (sequential)
  codegen.py      kernel description -> Python source of a `@triton.jit` function
  ops.py, refs.py the rules codegen uses for array operations and for refs
  dmas.py         DMAs as loads and stores, semaphores counted while generating
  compiler.py     source -> module -> `triton.compile` for a GPUTarget (cached)
  launch.py       the XLA custom call that launches the compiled kernel (CUDA, ROCm)
  interpreter.py  `interpret=True`: the same source under Triton's CPU interpreter
"""
from __future__ import annotations

import os
from typing import Any, Callable

import jax
import numpy as np
from jax.interpreters import mlir

from pallet.backends.triton import compiler
from pallet.backends.triton.codegen import GeneratedKernel, generate
from pallet.backends.triton.values import for_interpreter
from pallet.errors import TritonLoweringError
from pallet.core import trace_cache
from pallet.core.tracing import KernelDescription

NAME = "triton"
# Set to a directory to record every generated kernel there (see compiler.dump).
DUMP_DIR_ENV = "PALLET_TRITON_DUMP_DIR"


def generated(kernel: KernelDescription) -> GeneratedKernel:
  """The generated kernel for a description (generated once per description and
  default matmul precision, which decides how float32 dots round their inputs)."""
  return _generated(kernel, jax.config.jax_default_matmul_precision)


@trace_cache.kernel_cache
def _generated(kernel: KernelDescription, matmul_precision: Any) -> GeneratedKernel:
  result = generate(kernel)
  if kernel.debug:
    print(f"--- pallet Triton source for '{kernel.name}' ---\n{result.source}")
  if os.environ.get(DUMP_DIR_ENV):
    compiler.dump(result, os.environ[DUMP_DIR_ENV])
  return result


def generated_for_interpreter(kernel: KernelDescription) -> GeneratedKernel:
  """The kernel as generated for Triton's interpreter: the same program, except
  that bf16 values are held in float32 (the interpreter's bf16 is broken)."""
  return _generated_for_interpreter(kernel, jax.config.jax_default_matmul_precision)


@trace_cache.kernel_cache
def _generated_for_interpreter(kernel: KernelDescription,
                               matmul_precision: Any) -> GeneratedKernel:
  with for_interpreter():
    result = generate(kernel)
  if kernel.debug:
    print(f"--- pallet Triton source for '{kernel.name}' (interpreter) ---\n{result.source}")
  if os.environ.get(DUMP_DIR_ENV):
    compiler.dump(generated(kernel), os.environ[DUMP_DIR_ENV])
  return result


def lower(ctx: Any, *args: Any, kernel: KernelDescription, interpret: bool) -> list:
  if interpret:
    return _lower_interpreted(ctx, *args, kernel=kernel)
  platforms = tuple(ctx.module_context.platforms)
  if not any(p in ("cuda", "rocm") for p in platforms):
    raise TritonLoweringError(
        f"pallet Triton backend: kernel '{kernel.name}' ({kernel.source}) is being compiled "
        f"for {platforms}; the Triton backend runs on CUDA and ROCm GPUs. Use "
        f"backend='xla' on the CPU, or interpret=True to run the generated Triton code "
        f"under Triton's interpreter")
  from pallet.backends.triton import launch
  return launch.lower_gpu(ctx, *args, kernel=kernel, platform=platforms[0])


def _lower_interpreted(ctx: Any, *args: Any, kernel: KernelDescription) -> list:
  gen = generated_for_interpreter(kernel)
  out_shapes = [jax.ShapeDtypeStruct(b.array_shape, b.dtype)
                for b in kernel.grid_mapping.outputs]
  aliases = dict(kernel.input_output_aliases)

  def host(*arrays):
    from pallet.backends.triton import interpreter
    return interpreter.run(gen, [np.asarray(a) for a in arrays], aliases)

  def run(*arrays):
    return jax.pure_callback(host, out_shapes, *arrays)

  return mlir.lower_fun(run, multiple_results=True)(ctx, *args)


def source(kernel_call: Callable[..., Any], *args: Any) -> str:
  """The Triton source generated for `kernel_call(*args)`, a `pallas_call(...)` result
  (or any function that launches some).

  Works on any machine (nothing is compiled or run). With several pallas_calls
  inside `kernel_call`, their sources are concatenated in call order.
  """
  from jax.extend.core import jaxprs_in_params
  from pallet.pallas_call import pallas_call_p

  kernels = []

  def collect(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive is pallas_call_p:
        kernels.append(eqn.params["kernel"])
        continue
      for sub in jaxprs_in_params(eqn.params):
        collect(sub.jaxpr if hasattr(sub, "jaxpr") else sub)

  collect(jax.make_jaxpr(kernel_call)(*args).jaxpr)
  if not kernels:
    raise ValueError("pallet.triton.source: the function launches no pallas_call")
  return "\n\n".join(generated(k).source for k in kernels)
