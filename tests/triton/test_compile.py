"""Compiling generated kernels for GPU targets, without a GPU: coverage, static
performance checks on the compiled code, and the backend's error messages."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import pallet as pl
import pallet.triton as plt
from cases import CASES, DMA_CASES, DYNAMIC_GRID_CASES, MIXED_DOT_CASES, call
from compiled import TARGETS, compile_for, kernels_of, spill_bytes
from helpers import random_array, sds
import pallet.tpu as pltpu
from pallet.backends.triton import DUMP_DIR_ENV, TritonLoweringError
from pallet.ops import launch_table


def _kernel(name):
  fn, args, _ = CASES[name].make(False)
  (kernel,) = kernels_of(fn, *args)
  return kernel


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.bf16))
def test_bf16_cases_compile(name, target):
  # The interpreter computes bf16 wrongly, so bf16 kernels are checked by compiling.
  compiled = compile_for(_kernel(name), target)
  assert compiled.asm["ttir"]


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_bf16_math_is_computed_in_float32(target):
  compiled = compile_for(_kernel("bf16_exp_is_upcast"), target)
  ttir = compiled.asm["ttir"]
  assert re.search(r"math\.exp .*f32", ttir), "exp should run on f32 values"


def _matmul_kernel(block_m=128, block_n=128, block_k=32, m=512, n=512, k=512):
  x, y = random_array((m, k)), random_array((k, n))

  def kernel(x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

  f = call(kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), False,
           grid=(m // block_m, n // block_n, k // block_k),
           in_specs=[pl.BlockSpec((block_m, block_k), lambda i, j, kk: (i, kk)),
                     pl.BlockSpec((block_k, block_n), lambda i, j, kk: (kk, j))],
           out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk: (i, j)))
  (kd,) = kernels_of(f, x, y)
  return kd


def test_matmul_uses_tensor_cores_mma_on_sm80():
  ptx = compile_for(_matmul_kernel(), "sm80").asm["ptx"]
  assert "mma.sync" in ptx


def test_matmul_uses_wgmma_on_sm90():
  ptx = compile_for(_matmul_kernel(), "sm90").asm["ptx"]
  assert "wgmma.mma_async" in ptx


def test_matmul_accumulates_in_registers_across_the_reduction_axis():
  # The output block is stored once per program, after the k loop, not in it.
  ttir = compile_for(_matmul_kernel(), "sm80").asm["ttir"]
  loop = ttir[ttir.index("scf.for"):]
  loop_body = loop[:loop.index("scf.yield")]
  assert "tt.dot" in loop_body and "tt.store" not in loop_body
  assert "tt.store" in loop


def test_contiguous_f32_blocks_load_and_store_vectorized():
  x = random_array((8192,))

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2 + 1

  f = call(kernel, sds(x), False, grid=(8,), in_specs=[pl.BlockSpec((1024,), lambda i: (i,))],
           out_specs=pl.BlockSpec((1024,), lambda i: (i,)))
  ptx = compile_for(kernels_of(f, x)[0], "sm80").asm["ptx"]
  assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx), "expected 128-bit loads"
  assert re.search(r"st\.global(\.\w+)*\.v4\.b32", ptx), "expected 128-bit stores"


def test_2d_blocks_with_row_offsets_load_vectorized():
  x = random_array((256, 512))

  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.exp(x_ref[...])

  f = call(kernel, sds(x), False, grid=(4, 4),
           in_specs=[pl.BlockSpec((64, 128), lambda i, j: (i, j))],
           out_specs=pl.BlockSpec((64, 128), lambda i, j: (i, j)))
  ptx = compile_for(kernels_of(f, x)[0], "sm80").asm["ptx"]
  assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx)


def test_fori_loop_with_a_traced_trip_count_compiles_to_a_for_loop():
  # scf.while keeps more values live than scf.for (causal flash attention spilled).
  ttir = compile_for(_kernel("fori_loop_traced_trip_count"), "sm80").asm["ttir"]
  assert "scf.for" in ttir and "scf.while" not in ttir


def test_data_dependent_while_loop_stays_a_while_loop():
  ttir = compile_for(_kernel("while_data_dependent"), "sm80").asm["ttir"]
  assert "scf.while" in ttir


# Blocks too large for one program's registers (measured spills on sm_80 noted).
_KNOWN_SPILLS = {
    "vadd_b65536": "a 65536-element f32 block per operand is 64 values per thread even at "
                   "the 1024-thread maximum; 392 bytes spill (GPU runs should use <=16K blocks)",
    "stencil5": "a (32, 2048) f32 block (65536 elements) per operand; 392 bytes spill",
}
# A CPU-shaped user kernel: every program holds both whole weight matrices, which
# needs 4.3 MB of shared memory on sm_80 (164 KB); pallet refuses it with a clear error.
for _name in ("user_mlp_grad", "user_mlp_jvp", "user_mlp_vmap_grad"):
  _KNOWN_SPILLS[_name] = "whole (cols, hidden) weights per program exceed sm_80's shared memory"
_KNOWN_SPILLS["user_gated_delta"] = (
    "a CPU-shaped TPU kernel: whole-chunk (64 x 64) state and triangular scratch matrices "
    "in one program; 75936 bytes spill")
_KNOWN_SPILLS["op_ragged_dot_grad-1"] = (
    "the CPU suite's float32 ragged_dot backward (dlhs pass) spills 16 bytes on sm_80's "
    "float32 entry; the issue-24 bf16 shapes are spill-free (docs/performance.md)")


def _benchmark_kernels():
  from pallet.bench.gpu import gpu_benchmarks
  out = []
  for bench in gpu_benchmarks("full"):
    # As on an sm_80 GPU, where code that picks block sizes per backend and GPU
    # (pallet.ops) sees Triton and sm_80's launch table.
    with pl.default_backend("triton"), launch_table.using_device("sm_80"):
      program = bench.build_pallas(pl, backend="triton")
      inputs = bench.make_inputs(jax.random.key(0))
      kernels = kernels_of(program, *inputs)
    for k, kd in enumerate(kernels):
      # Known by benchmark (every kernel) or by one kernel's id.
      reason = _KNOWN_SPILLS.get(f"{bench.name}-{k}", _KNOWN_SPILLS.get(bench.name))
      marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
      out.append(pytest.param(kd, id=f"{bench.name}-{k}", marks=marks))
  return out


@pytest.mark.parametrize("kernel", _benchmark_kernels())
def test_benchmark_kernels_do_not_spill_registers_on_sm80(kernel, monkeypatch):
  # These CPU-sized kernels are checked here, their known misfits listed above; they are
  # not recorded for the compile suite (test_compile_suite.py), which has no such list.
  monkeypatch.delenv(DUMP_DIR_ENV, raising=False)
  ptx = compile_for(kernel, "sm80").asm["ptx"]
  assert spill_bytes(ptx) == 0


def test_compiler_params_set_warps_and_stages():
  compiled = compile_for(_kernel("compiler_params_warps_stages"), "sm80")
  assert compiled.metadata.num_warps == 8
  assert compiled.metadata.num_stages == 2


def test_each_signature_compiles_once():
  kd = _kernel("unary_exp")
  assert compile_for(kd, "sm80") is compile_for(kd, "sm80")


# ------------------------------------------------------------------ the generated source
def test_source_is_readable_and_maps_back_to_kernel_lines():
  x = random_array((8, 100))

  def kernel(x_ref, o_ref):
    y = jnp.exp(x_ref[...])
    o_ref[...] = y / jnp.sum(y, axis=1, keepdims=True)

  f = call(kernel, sds(x), False, grid=(2,), in_specs=[pl.BlockSpec((4, 100), lambda i: (i, 0))],
           out_specs=pl.BlockSpec((4, 100), lambda i: (i, 0)))
  src = plt.source(f, x)
  assert "@triton.jit\ndef kernel(x_ref_ptr, o_ref_ptr):" in src
  assert "# test_compile.py:" in src and "y = jnp.exp(x_ref[...])" in src
  assert re.search(r"^    exp_\d+ = tl\.exp\(x_ref_load_\d+\)$", src, re.M)
  # 100 columns are padded to 128 with a mask
  assert "tl.arange(0, 128)" in src and "< 100" in src


def test_debug_true_prints_the_generated_source(capsys):
  x = random_array((16,))

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

  f = call(kernel, sds(x), False, debug=True)
  plt.source(f, x)
  out = capsys.readouterr().out
  assert "--- pallet Triton source for 'kernel' ---" in out and "@triton.jit" in out


# ------------------------------------------------------------------ errors
def test_unsupported_primitive_names_primitive_and_kernel_line():
  x = random_array((16,))

  def sorting_kernel(x_ref, o_ref):
    o_ref[...] = jnp.sort(x_ref[...])

  f = call(sorting_kernel, sds(x), False)
  with pytest.raises(TritonLoweringError, match=r"kernel 'sorting_kernel'.*test_compile\.py:\d+"
                                                 r".*primitive 'sort'"):
    plt.source(f, x)
  with pytest.raises(pltpu.LoweringException):   # as code written for JAX's Pallas catches it
    plt.source(f, x)


def test_interpret_without_triton_interpret_env_is_a_clear_error():
  x = random_array((16,))

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  f = call(kernel, sds(x), True)
  with pytest.raises(Exception, match="TRITON_INTERPRET=1"):
    jax.block_until_ready(f(x))


def test_compiling_for_the_cpu_is_a_clear_error():
  x = random_array((16,))

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  f = call(kernel, sds(x), False)
  with pytest.raises(TritonLoweringError, match="runs on CUDA and ROCm GPUs.*backend='xla'"):
    jax.jit(f).trace(x).lower(lowering_platforms=("cpu",))


def test_arrays_of_2_to_the_31_elements_get_64_bit_offsets():
  x = jax.ShapeDtypeStruct((65536, 65536), jnp.bfloat16)   # traced only, never allocated

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  f = call(kernel, x, False, grid=(512, 64),
           in_specs=[pl.BlockSpec((128, 1024), lambda i, j: (i, j))],
           out_specs=pl.BlockSpec((128, 1024), lambda i, j: (i, j)))
  src = plt.source(f, x)
  assert re.search(r"x_ref_offsets_\d+ = \(.*\)\.to\(tl\.int64\) \* 65536", src)
  compiled = compile_for(kernels_of(f, x)[0], "sm80")
  assert re.search(r"\.s64|mul\.wide", compiled.asm["ptx"])


def test_interpreter_source_differs_only_in_holding_bf16_as_float32():
  from pallet.backends.triton import generated, generated_for_interpreter
  kernel = _kernel("bf16_exp_is_upcast")
  gpu, interpreted = generated(kernel).source, generated_for_interpreter(kernel).source
  assert ".to(tl.bfloat16)" in gpu and "bfloat16" not in interpreted
  assert gpu.replace("tl.bfloat16", "tl.float32") == interpreted


# ------------------------------------------------------------------ JAX 0.12 names
_NEW_PRIMITIVE_CASES = ("stack_and_unstack_of_padded_pieces", "tile_power_of_two_and_padded",
                        "threefry2x32_random_bits", "debug_barrier_and_a_check_that_holds",
                        "split_pad_and_dynamic_update_slice", "reshape_across_padding",
                        "bitcast_between_widths", "int8_dot_below_the_tensor_core_k")


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", _NEW_PRIMITIVE_CASES)
def test_new_primitive_rules_compile(name, target):
  assert compile_for(_kernel(name), target).asm["ttir"]


def test_checks_and_barriers_reach_the_gpu_code():
  fn, args, _ = CASES["debug_barrier_and_a_check_that_holds"].make(False)
  (kernel,) = kernels_of(fn, *args)
  src = plt.source(fn, *args)
  assert "tl.debug_barrier()" in src and "tl.store(checks_ptr + 0, 1)" in src
  assert "bar.sync" in compile_for(kernel, "sm80").asm["ptx"]


def test_inline_assembly_is_passed_to_triton():
  x = random_array((64,))

  def asm_kernel(x_ref, o_ref):
    (o_ref[...],) = plt.elementwise_inline_asm(
        "tanh.approx.f32 $0, $1;", args=[x_ref[...]], constraints="=f,f", pack=1,
        result_shape_dtypes=[sds(x)])

  f = call(asm_kernel, sds(x), False)
  assert "tl.inline_asm_elementwise('tanh.approx.f32 $0, $1;', '=f,f'" in plt.source(f, x)
  assert "tanh.approx.f32" in compile_for(kernels_of(f, x)[0], "sm80").asm["ptx"]


def _k_loop_matmul(block: int, **call_kwargs):
  """128x128 float32 tiles loaded in an in-kernel k loop: Triton pipelines these loads."""
  m = n = k = 512
  x, y = random_array((m, k)), random_array((k, n))

  def kernel(x_ref, y_ref, o_ref):
    def step(kk, acc):
      return acc + jnp.dot(x_ref[:, pl.ds(kk * block, block)], y_ref[pl.ds(kk * block, block), :],
                           preferred_element_type=jnp.float32)
    o_ref[...] = jax.lax.fori_loop(0, k // block, step, jnp.zeros(o_ref.shape, jnp.float32))

  f = call(kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), False, grid=(m // block, n // block),
           in_specs=[pl.BlockSpec((block, k), lambda i, j: (i, 0)),
                     pl.BlockSpec((k, block), lambda i, j: (0, j))],
           out_specs=pl.BlockSpec((block, block), lambda i, j: (i, j)), **call_kwargs)
  (kd,) = kernels_of(f, x, y)
  return kd


@pytest.mark.parametrize("target", ["sm80", "sm90"])
def test_default_pipeline_depth_shrinks_to_fit_shared_memory(target):
  # Found on an H100: 3 stages of 128x128 float32 tile pairs ask for 384 KiB.
  from pallet.backends.triton import compiler
  compiled = compile_for(_k_loop_matmul(128), target)
  arch = TARGETS[target][1]
  assert 0 < compiled.metadata.shared <= compiler.SHARED_MEMORY_LIMITS[("cuda", arch)]


@pytest.mark.parametrize("target", ["sm80", "sm90"])
def test_a_tables_num_stages_shrinks_to_fit_shared_memory(target):
  # pallet.ops' launch tables serve a family of GPUs with less shared memory than its
  # reference part: their num_stages is an upper bound, not an error
  from pallet.backends.triton import compiler
  from pallet.triton.gpu_target import TableCompilerParams
  kd = _k_loop_matmul(128, compiler_params=TableCompilerParams(num_stages=3))
  compiled = compile_for(kd, target)
  arch = TARGETS[target][1]
  assert 0 < compiled.metadata.shared <= compiler.SHARED_MEMORY_LIMITS[("cuda", arch)]
  assert compiled.metadata.num_stages < 3


def test_num_stages_the_user_chose_that_does_not_fit_is_a_clear_error():
  kd = _k_loop_matmul(128, compiler_params=plt.CompilerParams(num_stages=3))
  with pytest.raises(TritonLoweringError,
                     match=r"kernel 'kernel' \(.*test_compile.py:\d+\) needs \d+ bytes of shared "
                           r"memory with num_stages=3.*smaller num_stages"):
    compile_for(kd, "sm90")


@pytest.mark.parametrize("src", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.float8_e5m2])
@pytest.mark.parametrize("dst", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_float8_conversions_compile_from_sm89_and_are_a_clear_error_before(src, dst):
  """Triton converts to float8 (and holds float8_e4m3fn at all) only on sm_89 and newer
  NVIDIA GPUs; integers and the other float8 type go through float32."""
  if src == dst:
    pytest.skip("no conversion")

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...].astype(o_ref.dtype)
  x = random_array((16, 128)).astype(src)
  (kd,) = kernels_of(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, dst),
                                    backend="triton"), x)
  for target in ("sm90", "gfx942"):
    assert compile_for(kd, target).asm["ttir"]
  with pytest.raises(TritonLoweringError,
                     match=r"kernel 'kernel' \(.*test_compile.py:\d+\) converts to float8, "
                           r"which Triton compiles for CUDA compute capability 8.9 and newer; "
                           r"this GPU is sm_80.*backend='xla'"):
    compile_for(kd, "sm80")


def test_unsigned_integer_dot_is_a_clear_error():
  # Triton's dot takes floats and signed int8; the interpreter asserted deep inside Triton.
  def dot_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = plt.dot(x_ref[...], y_ref[...])
  x, y = jnp.ones((32, 128), jnp.uint8), jnp.ones((128, 64), jnp.uint8)
  f = pl.pallas_call(dot_kernel, out_shape=jax.ShapeDtypeStruct((32, 64), jnp.int32),
                     backend="triton")
  with pytest.raises(TritonLoweringError, match=r"kernel 'dot_kernel'.*primitive "
                                                r"'dot_general': a dot of unsigned integers"):
    plt.source(f, x, y)


# ------------------------------------------------------------------ dots of mixed dtypes
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", MIXED_DOT_CASES + ("float8_reductions_of_padded_rows",))
def test_mixed_dtype_dots_and_float8_compile(name, target):
  kernel = _kernel(name)
  needs_sm89 = "e4m3" in name or "e5m2_by_int8" in name or "float8" in name
  if needs_sm89 and target == "sm80":
    with pytest.raises(TritonLoweringError, match=r"compute capability 8\.9"):
      compile_for(kernel, target)
    return
  ttir = compile_for(kernel, target).asm["ttir"]
  assert "tt.dot" in ttir or "float8" in name


@pytest.mark.parametrize("target,instruction", [("sm80", "mma.sync"), ("sm90", "wgmma")])
def test_bf16_by_int8_weights_multiply_on_bf16_tensor_cores(target, instruction):
  # int8 weights convert to bf16 exactly, so the product runs on bf16 tensor cores
  # (XLA's float32 dot of the converted operands gives the same products).
  def quantized_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
  x, w = jnp.ones((128, 64), jnp.bfloat16), jnp.ones((64, 128), jnp.int8)
  f = call(quantized_kernel, jax.ShapeDtypeStruct((128, 128), jnp.float32), False)
  compiled = compile_for(kernels_of(f, x, w)[0], target)
  assert re.search(r"tt\.dot .*bf16", compiled.asm["ttir"])
  assert instruction in compiled.asm["ptx"]


def _mixed_dot(a_dtype, b_dtype, precision=None, pet=None):
  def mixed_dot_kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jax.lax.dot_general(a_ref[...], b_ref[...], (((1,), (0,)), ((), ())),
                                     precision=precision, preferred_element_type=pet)
  a, b = jnp.ones((32, 64), a_dtype), jnp.ones((64, 32), b_dtype)
  out = jax.eval_shape(lambda a, b: jax.lax.dot_general(
      a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=pet), a, b)
  return pl.pallas_call(mixed_dot_kernel, out_shape=out, backend="triton"), a, b


def test_dot_of_dtypes_tensor_cores_cannot_take_is_a_clear_error():
  f, a, b = _mixed_dot(jnp.int8, jnp.int16, pet=jnp.int32)
  with pytest.raises(TritonLoweringError,
                     match=r"kernel 'mixed_dot_kernel'.*test_compile\.py:\d+.*primitive "
                           r"'dot_general': a dot of int8 by int16 giving int32 \(multiplied "
                           r"as int32 by int32.*int8, float16, bfloat16, float32 and float8"):
    plt.source(f, a, b)


def test_dot_algorithm_other_than_a_float32_precision_is_a_clear_error():
  f, a, b = _mixed_dot(jnp.float32, jnp.float32,
                       precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32)
  with pytest.raises(TritonLoweringError,
                     match=r"kernel 'mixed_dot_kernel'.*test_compile\.py:\d+.*algorithm "
                           r"BF16_BF16_F32"):
    plt.source(f, a, b)
  f, a, b = _mixed_dot(jnp.float32, jnp.float32,
                       precision=jax.lax.DotAlgorithmPreset.F32_F32_F32)
  assert 'input_precision="ieee"' in plt.source(f, a, b)


@pytest.mark.parametrize("dtype,preset", [(jnp.bfloat16, "BF16_BF16_F32"),
                                          (jnp.float16, "F16_F16_F32"),
                                          (jnp.bfloat16, "BF16_BF16_BF16")])
def test_sixteen_bit_dot_algorithms_on_operands_of_that_dtype_are_plain_dots(dtype, preset):
  """GPU kernels (tokamax's and axlearn's attention) name the 16-bit algorithm of their
  bf16 / fp16 operands: the dot Triton makes of them anyway."""
  precision = getattr(jax.lax.DotAlgorithmPreset, preset)
  f, a, b = _mixed_dot(dtype, dtype, precision=precision, pet=jnp.float32)
  assert "tl.dot(" in plt.source(f, a, b)


# ------------------------------------------------------------------ grid sizes known at run time
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", DYNAMIC_GRID_CASES)
def test_grids_of_run_time_size_compile(name, target):
  assert compile_for(_kernel(name), target).asm["ttir"]


def test_a_parallel_axis_of_run_time_size_launches_its_bound_and_strides():
  from pallet.backends.triton import generated
  kernel = _kernel("dynamic_grid_parallel_axis_past_its_bound")
  gen = generated(kernel)
  assert gen.launch_grid == (3 * 2, 1, 1)          # the bound times the static axis
  assert gen.parameters[0] == "grid_size0_ptr"     # the size: the first operand
  assert re.search(r"for i0 in range\(lane0_\d+, n0_\d+, 3\):", gen.source)
  ttir = compile_for(kernel, "sm80").asm["ttir"]
  assert "scf.for" in ttir


def test_a_sequential_axis_of_run_time_size_is_a_loop_with_that_trip_count():
  from pallet.backends.triton import generated
  gen = generated(_kernel("dynamic_grid_sequential_reduction_axis"))
  assert gen.launch_grid == (4, 1, 1)
  assert re.search(r"for i1 in range\(n1_\d+\):  # grid axis 1 \(sequential\)", gen.source)


# ------------------------------------------------------------------ DMAs
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", DMA_CASES)
def test_dma_kernels_compile(name, target):
  assert compile_for(_kernel(name), target).asm["ttir"]


def test_a_copy_is_a_load_and_a_store_between_barriers():
  fn, args, _ = CASES["dma_parallel_grid_axis"].make(False)
  src = plt.source(fn, *args)
  copy = re.search(r"tl\.debug_barrier\(\)\n\s+x_hbm_offsets_\d+ = .*\n\s+x_hbm_load_\d+ = "
                   r"tl\.load\(.*\n\s+scratch0_offsets_\d+ = .*\n\s+tl\.store\(scratch0_ptr_\d+ "
                   r"\+ scratch0_offsets_\d+, x_hbm_load_\d+\)\n\s+tl\.debug_barrier\(\)", src)
  assert copy, src
  assert "-> 4 programs" in src       # a declared parallel axis: one program per step
