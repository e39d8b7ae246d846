"""pallet.triton with JAX 0.12's `plgpu` signatures, on the backend under test, and
how compiler params, `pallet.default_backend` and PALLET_BACKEND pick a backend."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallet as pl
import pallet.tpu as pltpu
import pallet.triton as plgpu
from pallet import backends
from helpers import (assert_close, current_test_backend, pallas_call, poisoned, random_array,
                     runs_on_gpu, sds)

f32, i32 = jnp.float32, jnp.int32
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ load / store
def test_load_and_store_with_masks_and_hints():
  x = random_array((100,))

  def kernel(x_ref, o_ref):
    idx = jnp.arange(128)
    mask = idx < 100
    v = plgpu.load(x_ref.at[idx], mask=mask, other=-3.0, cache_modifier=".cg",
                   eviction_policy="evict_last", volatile=False)
    plgpu.store(o_ref.at[idx], v * 2, mask=mask & (idx % 3 != 0),
                eviction_policy="evict_first")

  out = pallas_call(kernel, out_shape=sds(x), input_output_aliases={})(x)
  keep = jnp.arange(100) % 3 != 0
  assert_close(jnp.where(keep, out, 0), jnp.where(keep, x * 2, 0))


def test_masked_load_fills_other_and_store_skips_masked_elements():
  x = random_array((4, 24))

  def kernel(x_ref, o_in_ref, o_ref):
    del o_in_ref
    cols = jnp.arange(32)[None, :]
    v = plgpu.load(x_ref, mask=jnp.ones((4, 24), bool)) + 1
    w = plgpu.load(x_ref.at[:, pl.ds(0, 24)], mask=cols[:, :24] < 10, other=7.0)
    plgpu.store(o_ref, v + w, mask=cols[:, :24] >= 5)

  base = poisoned((4, 24))
  out = pallas_call(kernel, out_shape=sds(x), input_output_aliases={1: 0})(x, base)
  cols = jnp.arange(24)[None, :]
  expected = x + 1 + jnp.where(cols < 10, x, 7.0)
  assert_close(out[:, 5:], expected[:, 5:])
  assert np.isnan(np.asarray(out[:, :5])).all()


@pytest.mark.cpu_only
def test_masked_load_and_store_of_a_whole_ref_discharge_to_selects():
  """`plgpu.load(x_ref, mask=...)` of the whole ref is the ref and a select, not a
  gather at flat offsets that the XLA backend's passes would have to see through."""
  from pallet.backends.xla import body_analysis
  x = random_array((4, 24))

  def kernel(x_ref, o_ref):
    keep = (jnp.arange(24) < 20)[None, :]
    plgpu.store(o_ref, plgpu.load(x_ref, mask=keep, other=1.0) * 2, mask=keep)

  call = pl.pallas_call(kernel, out_shape=sds(x))
  eqns = jax.make_jaxpr(call)(x).eqns
  kernel_description = next(e for e in eqns if e.primitive.name == "pallas_call").params["kernel"]
  body = body_analysis.discharged(kernel_description)
  names = {e.primitive.name for e in body.jaxpr.eqns}
  assert "select_n" in names
  assert not names & {"gather", "scatter", "dynamic_slice", "dynamic_update_slice", "reshape"}
  out = np.asarray(jax.jit(call)(x))
  assert_close(out[:, :20], x[:, :20] * 2)


def test_load_and_store_with_an_index_still_work():
  x = random_array((8, 16))

  def kernel(x_ref, o_ref):
    rows = pl.ds(0, 4)
    plgpu.store(o_ref, (rows, slice(None)), plgpu.load(x_ref, (rows, slice(None))) * 3)
    plgpu.store(o_ref, (pl.ds(4, 4), slice(None)), -x_ref[4:, :])
    pl.store(o_ref, (pl.ds(0, 2), slice(None)), pl.load(x_ref, (pl.ds(0, 2), slice(None))))

  out = pallas_call(kernel, out_shape=sds(x))(x)
  assert_close(out, jnp.concatenate([x[:2], x[2:4] * 3, -x[4:]]))


def test_bad_hints_name_the_kernel():
  x = random_array((8,))

  def hinted_kernel(x_ref, o_ref):
    o_ref[...] = plgpu.load(x_ref, cache_modifier=".bogus")

  with pytest.raises(ValueError, match=r"hinted_kernel.*cache_modifier='\.bogus'"):
    pallas_call(hinted_kernel, out_shape=sds(x))(x)


# ------------------------------------------------------------------ dot
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_dot_transposes_and_accumulates_in_float32(trans_a, trans_b):
  a, b = random_array((32, 16)), random_array((16, 32))
  a_in = a.T if trans_a else a
  b_in = b.T if trans_b else b

  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = plgpu.dot(a_ref[...], b_ref[...], trans_a, trans_b, allow_tf32=False)

  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((32, 32), f32))(a_in, b_in)
  assert_close(out, jnp.dot(a, b, precision="highest"), rtol=1e-4, atol=1e-4)


def test_dot_of_bf16_and_int8_blocks():
  a, b = random_array((16, 32), jnp.bfloat16), random_array((32, 16), jnp.bfloat16)
  ia, ib = random_array((16, 16), jnp.int8, low=-8, high=8), \
      random_array((16, 16), jnp.int8, low=-8, high=8)

  def kernel(a_ref, b_ref, ia_ref, ib_ref, o_ref, io_ref):
    o_ref[...] = plgpu.dot(a_ref[...], b_ref[...])
    io_ref[...] = plgpu.dot(ia_ref[...], ib_ref[...])

  out, iout = pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((16, 16), f32),
                                             jax.ShapeDtypeStruct((16, 16), i32)))(a, b, ia, ib)
  assert_close(out, jnp.dot(a, b, preferred_element_type=f32), rtol=1e-3, atol=1e-3)
  assert_close(iout, jnp.dot(ia, ib, preferred_element_type=i32))


@pytest.mark.parametrize("x_dtype,w_dtype,tol", [
    (jnp.bfloat16, jnp.int8, dict(rtol=2e-2, atol=0.5)),
    (jnp.float16, jnp.int8, dict(rtol=2e-3, atol=0.25)),
    (jnp.int8, jnp.int8, dict(rtol=0, atol=0))])
def test_dot_of_quantized_weights(x_dtype, w_dtype, tol):
  """Activations by int8 weights, as quantized matmuls write them: the mixed pair
  multiplied as XLA multiplies it (both operands converted to the result dtype)."""
  x, w = random_array((32, 64), x_dtype), random_array((64, 48), w_dtype)
  scale = random_array((1, 48))

  def kernel(x_ref, w_ref, s_ref, o_ref, acc_ref, direct_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...].astype(x_ref.dtype))
    acc_ref[...] = plgpu.dot(x_ref[...], w_ref[...]) * s_ref[...]
    direct_ref[...] = jnp.dot(x_ref[...], w_ref[...])

  out_dtype = jnp.dot(x, w).dtype
  out, acc, direct = pallas_call(kernel, out_shape=(
      jax.ShapeDtypeStruct((32, 48), x_dtype), jax.ShapeDtypeStruct((32, 48), f32),
      jax.ShapeDtypeStruct((32, 48), out_dtype)))(x, w, scale)
  assert_close(out, jnp.dot(x, w.astype(x_dtype)), **tol)
  wide = i32 if x_dtype == jnp.int8 else f32
  expected = jnp.dot(x, w, preferred_element_type=wide).astype(f32) * scale
  assert_close(acc, expected, rtol=1e-5, atol=1e-3)
  assert_close(direct, jnp.dot(x, w), **tol)


def test_dot_argument_errors():
  x = jnp.ones((16, 16), f32)
  with pytest.raises(ValueError, match="2-d blocks"):
    plgpu.dot(jnp.ones((2, 16, 16)), x)
  with pytest.raises(ValueError, match="allow_tf32 or precision"):
    plgpu.dot(x, x, allow_tf32=True, precision=lax.Precision.HIGHEST)


# ------------------------------------------------------------------ math and hints
@pytest.mark.parametrize("dtype", [f32, jnp.bfloat16, jnp.float16])
def test_approx_tanh_matches_tanh(dtype):
  x = random_array((8, 32), dtype) * 3

  def kernel(x_ref, o_ref):
    o_ref[...] = plgpu.approx_tanh(x_ref[...])

  out = pallas_call(kernel, out_shape=sds(x))(x)
  assert_close(out, jnp.tanh(x), rtol=1e-2 if dtype != f32 else 1e-5, atol=1e-2)


def test_approx_tanh_rejects_integers():
  with pytest.raises(TypeError, match="approx_tanh"):
    plgpu.approx_tanh(jnp.ones((4,), i32))


def test_debug_barrier_between_scratch_writes_and_reads():
  x = random_array((16, 32))

  def kernel(x_ref, o_ref, s_ref):
    s_ref[...] = x_ref[...] * 2
    plgpu.debug_barrier()
    o_ref[:8, :] = s_ref[8:, :] + 1
    o_ref[8:, :] = s_ref[:8, :] + 1

  out = pallas_call(kernel, out_shape=sds(x), scratch_shapes=[pltpu.VMEM((16, 32), f32)])(x)
  assert_close(out, jnp.concatenate([x[8:], x[:8]]) * 2 + 1)


def test_max_contiguous_is_a_hint():
  x = random_array((64,))

  def kernel(x_ref, o_ref):
    idx = plgpu.max_contiguous(pl.multiple_of(jnp.arange(64), 16), 16)
    o_ref[...] = plgpu.load(x_ref.at[idx]) + 1

  assert_close(pallas_call(kernel, out_shape=sds(x))(x), x + 1)


def test_elementwise_inline_asm_runs_on_the_gpu_and_is_a_clear_error_elsewhere():
  x = random_array((32,))

  def asm_kernel(x_ref, o_ref):
    (y,) = plgpu.elementwise_inline_asm(
        "tanh.approx.f32 $0, $1;", args=[x_ref[...]], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct((32,), f32)])
    o_ref[...] = y

  if current_test_backend() == "triton" and runs_on_gpu():
    assert_close(pallas_call(asm_kernel, out_shape=sds(x))(x), jnp.tanh(x), rtol=2e-3, atol=2e-3)
    return
  with pytest.raises(Exception, match=r"asm_kernel.*test_plgpu.py:\d+") as info:
    pallas_call(asm_kernel, out_shape=sds(x))(x)
  assert "assembly" in str(info.value)


def test_elementwise_inline_asm_checks_shapes():
  def kernel(x_ref, o_ref):
    plgpu.elementwise_inline_asm("mov.b32 $0, $1;", args=[x_ref[...]], constraints="=r,r",
                                 pack=1, result_shape_dtypes=[sds(jnp.ones((4,), f32))])

  with pytest.raises(ValueError, match="one shape"):
    pallas_call(kernel, out_shape=sds(jnp.ones((8,))))(jnp.ones((8,)))


def test_elementwise_inline_asm_batches_and_has_no_derivative():
  xs = random_array((3, 64))

  def mov(x):
    (y,) = plgpu.elementwise_inline_asm("mov.b32 $0, $1;", args=[x], constraints="=r,r",
                                        pack=1, result_shape_dtypes=[sds(x)])
    return y

  assert jax.make_jaxpr(jax.vmap(mov))(xs).out_avals[0].shape == (3, 64)
  with pytest.raises(pl.PalletError, match="has no derivative"):
    jax.jvp(mov, (xs[0],), (xs[0],))


# ------------------------------------------------------------------ atomics
def test_atomics_with_plgpu_signatures():
  vals = random_array((16,), i32)

  def kernel(v_ref, sum_ref, max_ref, cas_ref, old_ref):
    sum_ref[...] = jnp.zeros_like(sum_ref)
    max_ref[...] = jnp.full_like(max_ref, -100)
    cas_ref[...] = jnp.arange(4, dtype=i32)
    plgpu.atomic_add(sum_ref, (0,), jnp.sum(v_ref[...]))
    plgpu.atomic_max(max_ref, (pl.ds(0, 16),), v_ref[...], mask=v_ref[...] > 0)
    old_ref[0] = plgpu.atomic_cas(cas_ref.at[2], jnp.int32(2), jnp.int32(-9))
    old_ref[1] = plgpu.atomic_cas(cas_ref, (1,), jnp.int32(5), jnp.int32(-9))

  outs = pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((1,), i32),
                                        jax.ShapeDtypeStruct((16,), i32),
                                        jax.ShapeDtypeStruct((4,), i32),
                                        jax.ShapeDtypeStruct((2,), i32)))(vals)
  total, maxes, cas, old = outs
  assert int(total[0]) == int(jnp.sum(vals))
  assert_close(maxes, jnp.where(vals > 0, vals, -100))
  assert_close(cas, jnp.array([0, 1, -9, 3], i32))
  assert_close(old, jnp.array([2, 1], i32))


# ------------------------------------------------------------------ params and gpu info
def test_compiler_params_have_pallas_fields_first():
  params = plgpu.CompilerParams(8, 3)
  assert (params.num_warps, params.num_stages) == (8, 3)
  assert plgpu.TritonCompilerParams is plgpu.CompilerParams


def test_compiler_params_are_accepted_on_every_backend():
  x = random_array((16, 8))

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

  out = pallas_call(kernel, out_shape=sds(x), grid=(2,),
                    in_specs=[pl.BlockSpec((8, 8), lambda i: (i, 0))],
                    out_specs=pl.BlockSpec((8, 8), lambda i: (i, 0)),
                    compiler_params=plgpu.CompilerParams(num_warps=2, num_stages=1))(x)
  assert_close(out, x + 1)


def test_gpu_info_on_this_machine():
  assert plgpu.get_gpu_info_from_version(plgpu.GpuVersion.H100).compute_capability == 90
  info = plgpu.get_gpu_info_from_version(plgpu.GpuVersion.A100)
  assert (info.arch_name, info.compute_capability) == ("8.0", 80)
  from pallet.triton.gpu_target import gpu_version_of
  assert gpu_version_of("NVIDIA A100-SXM4-80GB") is plgpu.GpuVersion.A100
  assert gpu_version_of("NVIDIA A10") is plgpu.GpuVersion.A10
  assert gpu_version_of("cpu") is None
  if not backends.gpu_present():
    assert not plgpu.is_gpu_device()
    with pytest.raises(ValueError, match="not a GPU"):
      plgpu.get_gpu_info()


# ------------------------------------------------------------------ backend selection
@pytest.fixture
def no_override():
  with pl.default_backend(None):
    yield


def test_compiler_params_pick_the_backend(monkeypatch, no_override):
  triton_params = plgpu.CompilerParams(num_warps=4)
  monkeypatch.setattr(backends, "gpu_present", lambda: False)
  assert backends.resolve(None, False, triton_params) == ("xla", False)
  monkeypatch.setattr(backends, "gpu_present", lambda: True)
  assert backends.resolve(None, False, triton_params) == ("triton", False)
  assert backends.resolve(None, False, None) == ("triton", False)
  # A kernel written for a TPU runs on the XLA backend, which has its DMAs.
  assert backends.resolve(None, False, pltpu.CompilerParams()) == ("xla", False)
  assert backends.resolve(None, True, triton_params) == ("xla", True)
  assert backends.resolve("xla", False, triton_params) == ("xla", False)


def test_default_backend_overrides_all_but_an_explicit_backend(monkeypatch, no_override):
  monkeypatch.setattr(backends, "gpu_present", lambda: False)
  with pl.default_backend("triton"):
    assert backends.resolve(None, False, None) == ("triton", True)
    assert backends.resolve("xla", False, None) == ("xla", False)
    with pl.default_backend("gpu", interpret=False):
      assert backends.resolve(None, False, None) == ("triton", False)
    with pl.default_backend(None):
      assert backends.resolve(None, False, None) == ("xla", False)
  monkeypatch.setattr(backends, "gpu_present", lambda: True)
  with pl.default_backend("triton"):
    assert backends.resolve(None, False, None) == ("triton", False)
    assert backends.resolve(None, True, None) == ("triton", True)
  with pl.default_backend("xla"):
    assert backends.resolve(None, False, plgpu.CompilerParams()) == ("xla", False)
  with pytest.raises(ValueError, match="unknown pallet backend 'tpu'"):
    with pl.default_backend("tpu"):
      pass


def test_default_backend_retraces_jitted_functions(no_override):
  seen = []

  @jax.jit
  def f(x):
    seen.append(backends.override())
    return x + 1

  f(1.0)
  with pl.default_backend("xla"):
    f(1.0)
  f(1.0)
  assert seen == [None, ("xla", None)]


def test_default_backend_runs_kernels_on_that_backend(no_override):
  x = random_array((8, 16))

  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.exp(x_ref[...])

  with pl.default_backend("xla"):
    jaxpr = jax.make_jaxpr(pl.pallas_call(kernel, out_shape=sds(x)))(x)
    out = pl.pallas_call(kernel, out_shape=sds(x))(x)
  (eqn,) = [e for e in jaxpr.eqns if e.primitive is pl.pallas_call_p]
  assert eqn.params["backend"] == "xla"
  assert_close(out, jnp.exp(x))


def test_backend_environment_variable():
  code = ("import pallet as pl; from pallet import backends; "
          "print(backends.resolve(None, False, None))")
  env = {**os.environ, "PALLET_BACKEND": "xla", "PYTHONPATH": os.path.join(REPO, "src")}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
  assert out.stdout.strip() == "('xla', False)", out.stderr
  env["PALLET_BACKEND"] = "bogus"
  code = ("import jax, jax.numpy as jnp, pallet as pl\n"
          "def k(x_ref, o_ref): o_ref[...] = x_ref[...]\n"
          "x = jnp.ones(4)\n"
          "pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)\n")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode != 0
  assert "PALLET_BACKEND='bogus'" in out.stderr and "kernel 'k'" in out.stderr


# ------------------------------------------------------------------ the jax.numpy meaning
def test_threefry_random_bits_inside_a_kernel():
  from jax.extend.random import threefry2x32_p
  key = jnp.array([0x12345678, 42], jnp.uint32)
  counts = jnp.arange(2 * 8 * 24, dtype=jnp.uint32).reshape(2, 8, 24)

  def kernel(k_ref, c_ref, o_ref):
    k = k_ref[...]
    c = c_ref[...]
    hi, lo = threefry2x32_p.bind(jnp.broadcast_to(k[0], (8, 24)),
                                 jnp.broadcast_to(k[1], (8, 24)), c[0], c[1])
    o_ref[...] = jnp.stack([hi, lo])

  out = pallas_call(kernel, out_shape=sds(counts))(key, counts)
  expected = jnp.stack(threefry2x32_p.bind(key[0], key[1], counts[0], counts[1]))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def test_tile_inside_a_kernel():
  x = random_array((4, 6))

  def kernel(x_ref, o_ref, p_ref):
    o_ref[...] = jnp.tile(x_ref[...], (2, 3))
    p_ref[...] = jnp.tile(x_ref[:, :4], (1, 2))

  out, p = pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((8, 18), f32),
                                          jax.ShapeDtypeStruct((4, 8), f32)))(x)
  assert_close(out, jnp.tile(x, (2, 3)))
  assert_close(p, jnp.tile(x[:, :4], (1, 2)))


def test_gpu_versions_match_pallas():
  jax_plgpu = pytest.importorskip("jax.experimental.pallas.triton")
  if not hasattr(jax_plgpu, "GpuVersion"):
    pytest.skip(f"jax {jax.__version__} has no plgpu.GpuVersion (added in 0.12)")
  for version in jax_plgpu.GpuVersion:
    ours = plgpu.GpuVersion[version.name]
    assert ours.value == version.value
    theirs = jax_plgpu.get_gpu_info_from_version(version)
    info = plgpu.get_gpu_info_from_version(ours)
    assert (info.arch_name, info.compute_capability) == (theirs.arch_name,
                                                          theirs.compute_capability)
