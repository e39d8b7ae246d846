"""Lowering a jitted pallet Triton call for CUDA on a machine without a GPU.

Needs jaxlib's Triton kernel-call support, which comes with jax-cuda12-plugin
(`pip install --no-deps jax-cuda12-plugin==<jax version>` is enough to lower).
"""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import pytest
from jax.interpreters.mlir import ir

import pallet as pl
import pallet.triton as plt
from cases import CASES
from helpers import random_array, sds
from pallet.backends.triton import TritonLoweringError

pytest.importorskip("jax_cuda12_plugin")

SM80 = plt.CompilerParams(compute_capability=80)


def _custom_calls(lowered) -> list:
  module = lowered.compiler_ir("stablehlo")
  found = []

  def visit(op):
    if op.operation.name == "stablehlo.custom_call":
      found.append(op.operation)
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          visit(inner)

  for op in module.body.operations:
    visit(op)
  return found


def _opaque(call) -> bytes:
  config = ir.DictAttr(call.attributes["mhlo.backend_config"])
  return zlib.decompress(ir.StringAttr(config["opaque"]).value_bytes)


def _matmul(m=128, n=128, k=64, block=64, **kw):
  def kernel(x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), backend="triton",
      grid=(m // block, n // block, k // block),
      in_specs=[pl.BlockSpec((block, block), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((block, block), lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec((block, block), lambda i, j, kk: (i, j)), **kw)


def test_jitted_call_lowers_to_a_triton_kernel_custom_call():
  f = _matmul(compiler_params=SM80)
  x, y = random_array((128, 64)), random_array((64, 128))
  lowered = jax.jit(f).trace(x, y).lower(lowering_platforms=("cuda",))
  (call,) = _custom_calls(lowered)
  assert ir.StringAttr(call.attributes["call_target_name"]).value == "triton_kernel_call_ffi"
  payload = _opaque(call)
  assert b"kernel" in payload                # the kernel's name
  assert b".target sm_80" in payload         # its PTX, compiled for sm_80
  assert b"mma.sync" in payload              # with tensor-core instructions


def test_vmap_and_aliases_lower():
  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] += y_ref[...] * 2

  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32), backend="triton",
                     input_output_aliases={0: 0}, compiler_params=SM80)
  xs, ys = random_array((3, 8, 128)), random_array((3, 8, 128))
  lowered = jax.jit(jax.vmap(f)).trace(xs, ys).lower(lowering_platforms=("cuda",))
  (call,) = _custom_calls(lowered)
  assert "output_operand_aliases" in str(call)
  assert b".target sm_80" in _opaque(call)


# One case per launch feature: workspace output, prefetch and constant operands,
# aliases, atomics, several outputs.
_LOWERING_CASES = ("scratch_indexed_in_memory_and_run_scoped", "scalar_prefetch_selects_blocks",
                   "threefry2x32_random_bits",
                   "closed_over_constant_array", "input_output_aliases_add_in_place",
                   "atomic_add_float_from_parallel_programs", "atomic_cas_scalar",
                   "squeezed_and_element_dims", "dynamic_grid_parallel_axis_past_its_bound",
                   "dynamic_grid_grouped_matmul_over_active_tiles", "dma_parallel_grid_axis")


@pytest.mark.parametrize("name", _LOWERING_CASES)
def test_cases_lower_for_cuda(name, monkeypatch):
  monkeypatch.setenv("PALLET_TRITON_COMPUTE_CAPABILITY", "90")
  fn, args, _ = CASES[name].make(False)
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  calls = _custom_calls(lowered)
  assert calls and all(b".target sm_90" in _opaque(c) for c in calls)


def test_lowering_without_a_gpu_or_compute_capability_is_a_clear_error():
  x = random_array((16,))

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  f = pl.pallas_call(kernel, sds(x), backend="triton")
  with pytest.raises(TritonLoweringError, match="compute_capability=80"):
    jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))


def test_checks_cannot_be_lowered_for_a_gpu_from_a_cpu_process(monkeypatch):
  # Failed checks are raised by a host callback after the launch, and JAX lowers
  # callbacks only for the platform the process runs on: say so, never drop them.
  monkeypatch.setenv("PALLET_TRITON_COMPUTE_CAPABILITY", "80")
  fn, args, _ = CASES["debug_barrier_and_a_check_that_holds"].make(False)
  with pytest.raises(TritonLoweringError, match=r"kernel 'kernel'.*pl.debug_check.*host "
                                                r"callback"):
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
