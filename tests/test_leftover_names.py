"""The less common public names of `pl` and `pltpu`: memory types (HOST, MemoryRef,
ACC, CMEM, VMEM_SHARED), block-dim and pipeline types (Indirect, RevisitMode,
BlockDim), ref selection, masked TPU load/store, bit packing, convolution,
lowering helpers, and the names that are clear errors (get_global, Indirect blocks).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
import pallet.tpu as pltpu
from helpers import assert_close, current_test_backend, pallas_call, random_array, sds

f32 = jnp.float32
i32 = jnp.int32
cpu_only = pytest.mark.cpu_only
_THIS_FILE = __file__.rsplit("/", 1)[-1]


def _copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


# ------------------------------------------------------------------ pl: memory types
def test_host_memory_space_runs_like_any():
  x = random_array((8, 16))
  out = pallas_call(_copy_kernel, out_shape=sds(x),
                    in_specs=[pl.BlockSpec(memory_space=pl.HOST)])(x)
  assert_close(out, x)
  assert pl.HOST is pl.MemorySpace.HOST


def test_tpu_host_is_pl_host_for_kernels_written_before_jax_0_12():
  # JAX 0.12 removed pltpu.HOST (deprecated for pl.HOST since 0.10); pallet keeps it,
  # as it keeps pltpu.TPUCompilerParams, so older kernels run as written.
  assert pltpu.HOST is pl.HOST
  x = random_array((8, 16))
  out = pallas_call(_copy_kernel, out_shape=sds(x),
                    in_specs=[pl.BlockSpec(memory_space=pltpu.HOST)])(x)
  assert_close(out, x)


def test_memory_ref_as_scratch_and_in_run_scoped():
  aval = jax.core.ShapedArray((8, 16), f32)
  scratch = pl.MemoryRef(aval, pltpu.VMEM)
  assert (scratch.shape, scratch.dtype, scratch.memory_space) == ((8, 16), f32, pltpu.VMEM)
  assert isinstance(pltpu.VMEM((8, 16), f32), pl.MemoryRef)
  assert pltpu.VMEM.from_type(aval) == scratch
  assert pltpu.SMEM.like(jnp.zeros((3,), i32)) == pl.MemoryRef(
      jax.core.ShapedArray((3,), i32), pltpu.SMEM)

  def kernel(x_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += x_ref[...]

    def body(tmp_ref):
      tmp_ref[...] = acc_ref[...] * 2
      o_ref[...] = tmp_ref[...]
    pl.run_scoped(body, pl.MemoryRef(aval, pltpu.VMEM))

  x = random_array((4, 8, 16))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 16), f32), grid=(4,),
                    in_specs=[pl.BlockSpec((None, 8, 16), lambda k: (k, 0, 0))],
                    out_specs=pl.BlockSpec((8, 16), lambda k: (0, 0)),
                    scratch_shapes=[scratch],
                    compiler_params=pltpu.CompilerParams(
                        dimension_semantics=("arbitrary",)))(x)
  assert_close(out, 2 * x.sum(0), rtol=1e-5, atol=1e-4)


def test_memory_ref_needs_a_type():
  with pytest.raises(TypeError, match="MemoryRef needs an aval"):
    pl.MemoryRef()


def test_indirect_block_dimension_is_a_clear_error():
  x = random_array((16, 8))

  def indirect_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  with pytest.raises(pl.PalletError, match=r"indirect_kernel.*Indirect\(4\)"):
    pallas_call(indirect_kernel, out_shape=jax.ShapeDtypeStruct((4, 8), f32), grid=(1,),
                in_specs=[pl.BlockSpec((pl.Indirect(4), 8), lambda i: (0, 0))],
                out_specs=pl.BlockSpec((4, 8), lambda i: (0, 0)))(x)


def test_block_dim_is_the_union_of_block_dimension_types():
  for dim in (4, None, pl.Squeezed(), pl.Element(4), pl.Blocked(4), pl.Indirect(4)):
    assert isinstance(dim, pl.BlockDim)
  assert not isinstance("4", pl.BlockDim)


def test_revisit_mode_is_accepted_in_buffered_pipeline_modes():
  x = random_array((16, 8))
  mode = pl.Buffered(buffer_count=2, revisit=pl.RevisitMode.ANY)
  assert {m.name for m in pl.RevisitMode} == {"IMMEDIATE", "ANY"}

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

  out = pallas_call(kernel, out_shape=sds(x), grid=(4,),
                    in_specs=[pl.BlockSpec((4, 8), lambda i: (i, 0))],
                    out_specs=pl.BlockSpec((4, 8), lambda i: (i, 0), pipeline_mode=mode))(x)
  assert_close(out, x + 1)


def test_semaphore_and_device_id_type():
  assert pl.semaphore is pltpu.SEMAPHORE
  assert {m.name for m in pl.DeviceIdType} == {"MESH", "LOGICAL"}


# ------------------------------------------------------------------ pl: in-kernel ops
def test_delay_is_a_no_op():
  def kernel(x_ref, o_ref):
    pl.delay(100)
    o_ref[...] = x_ref[...] * 3

  x = random_array((8, 8))
  assert_close(pallas_call(kernel, out_shape=sds(x))(x), x * 3)


def test_get_global_is_a_clear_error_naming_kernel_and_line():
  def global_kernel(x_ref, o_ref):
    sem = pl.get_global(pltpu.SemaphoreType.REGULAR)
    o_ref[...] = x_ref[...] + sem[...]

  x = random_array((8,))
  with pytest.raises(pl.PalletError,
                     match=rf"pl\.get_global.*'global_kernel'.*{_THIS_FILE}:\d+"):
    pallas_call(global_kernel, out_shape=sds(x))(x)


def test_select_ref_reads_and_writes_the_chosen_ref():
  # Each grid step reads refs[choice[i]] (a runtime scalar) and writes its result
  # through a selection of the outputs, also by a runtime index.
  def kernel(choice_ref, a_ref, b_ref, c_ref, o0_ref, o1_ref):
    i = pl.program_id(0)
    src = pl.select_ref(choice_ref[i], a_ref, b_ref, c_ref)
    dst = pl.select_ref(i % 2, o0_ref, o1_ref)
    row = src[...] * 2
    o0_ref[...] = jnp.zeros_like(o0_ref)
    o1_ref[...] = jnp.zeros_like(o1_ref)
    dst[...] = row
    dst.at[0:1][...] += src.at[pl.ds(1, 1)][...]

  a, b, c = random_array((2, 8)), random_array((2, 8)), random_array((2, 8))
  choice = jnp.array([2, 0, 1, 2], i32)
  gs = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(4,),
      in_specs=[pl.BlockSpec((2, 8), lambda i, ch: (0, 0))] * 3,
      out_specs=[pl.BlockSpec((None, 2, 8), lambda i, ch: (i, 0, 0))] * 2)
  outs = pallas_call(kernel, out_shape=[jax.ShapeDtypeStruct((4, 2, 8), f32)] * 2,
                     grid_spec=gs)(choice, a, b, c)
  srcs = np.stack([np.asarray(v) for v in (a, b, c)])[np.asarray(choice)]
  picked = srcs * 2
  picked[:, 0] += srcs[:, 1]
  expected = [np.where((np.arange(4) % 2 == k)[:, None, None], picked, 0) for k in (0, 1)]
  assert_close(outs, tuple(jnp.asarray(e) for e in expected))


def test_select_ref_over_ref_views():
  # Candidates may be views (ref.at[...]): the selection reads and writes through them.
  def kernel(k_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...]
    sel = pl.select_ref(k_ref[0], o_ref.at[0:2], o_ref.at[pl.ds(4, 2)], o_ref.at[6:8])
    sel[...] = sel[...] * 10 + x_ref[2:4]

  x = random_array((8, 16))
  for k in (0, 1, 2, 5):   # 5 is clamped to the last candidate
    gs = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(1,))
    out = pallas_call(kernel, out_shape=sds(x), grid_spec=gs)(jnp.array([k], i32), x)
    start = (0, 4, 6)[min(k, 2)]
    expected = np.array(x)
    expected[start:start + 2] = expected[start:start + 2] * 10 + np.asarray(x)[2:4]
    assert_close(out, jnp.asarray(expected))


def test_select_ref_with_a_static_index_is_the_ref_itself_and_checks_its_inputs():
  refs = [jax.new_ref(jnp.zeros((4,), f32)), jax.new_ref(jnp.ones((4,), f32))]
  assert pl.select_ref(1, *refs) is refs[1]
  with pytest.raises(ValueError, match="at least two refs"):
    pl.select_ref(0, refs[0])
  with pytest.raises(TypeError, match="share shape and dtype"):
    pl.select_ref(jnp.int32(0), refs[0], jax.new_ref(jnp.zeros((5,), f32)))


# ------------------------------------------------------------------ pl: lowering helpers
def test_lower_as_mlir_returns_the_stablehlo_of_a_kernel_call():
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.sin(x_ref[...])

  x = random_array((8, 16))
  f = lambda x: pl.pallas_call(kernel, out_shape=sds(x), backend="xla")(x)
  text = pl.lower_as_mlir(f, x)
  assert "func.func public @main" in text and "stablehlo.sine" in text
  assert pl.lower_as_mlir(f, x, platforms=["cpu"]) == text
  with pl.pallas_export_experimental(dynamic_shapes=False):
    assert_close(f(x), jnp.sin(x))


def test_lower_as_mlir_honours_static_argnames():
  def f(x, *, scale):
    return pl.pallas_call(functools.partial(_scaled, scale=scale), out_shape=sds(x),
                          backend="xla")(x)

  text = pl.lower_as_mlir(f, random_array((4,)), scale=3.0, static_argnames=("scale",))
  assert "3.000000e+00" in text


def _scaled(x_ref, o_ref, *, scale):
  o_ref[...] = x_ref[...] * scale


# ------------------------------------------------------------------ pltpu: memory spaces
def test_acc_cmem_and_vmem_shared_scratch_buffers():
  assert pltpu.CMEM is pl.MemorySpace.CMEM and pltpu.VMEM_SHARED is pl.MemorySpace.VMEM_SHARED
  acc = pltpu.ACC(mxu_id=0)((8, 16), f32)
  assert isinstance(acc, pl.MemoryRef) and str(acc.memory_space) == "ACC(mxu_id=0)"

  def kernel(x_ref, y_ref, o_ref, acc_ref, c_ref, s_ref):
    acc_ref[...] = x_ref[...] @ y_ref[...]
    c_ref[...] = acc_ref[...] + 1
    s_ref[...] = c_ref[...] * 2
    o_ref[...] = s_ref[...]

  x, y = random_array((8, 32)), random_array((32, 16))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 16), f32),
                    scratch_shapes=[acc, pltpu.CMEM((8, 16), f32),
                                    pltpu.VMEM_SHARED((8, 16), f32)])(x, y)
  assert_close(out, (x @ y + 1) * 2, matmul=True)


def test_acc_checks_its_shape_and_dtype():
  with pytest.raises(ValueError, match="at least 2-D"):
    pltpu.ACC(0)((128,), f32)
  with pytest.raises(ValueError, match="float32 or int32"):
    pltpu.ACC(0)((8, 128), jnp.bfloat16)


def test_has_memory_space_answers_as_for_an_operand_in_hbm():
  def kernel(x_ref, o_ref):
    in_vmem = pltpu.has_memory_space(x_ref, pltpu.VMEM)
    in_hbm = pltpu.has_memory_space(x_ref, pltpu.HBM)

    # A real kernel would copy with a DMA from HBM and read VMEM directly; here the
    # branches differ so that the test sees which one ran.
    @pl.when(in_vmem)
    def _():
      o_ref[...] = jnp.full_like(o_ref, jnp.nan)

    @pl.when(in_hbm)
    def _():
      o_ref[...] = x_ref[...]

  x = random_array((8, 16))
  out = pallas_call(kernel, out_shape=sds(x),
                    in_specs=[pl.BlockSpec(memory_space=pl.ANY)])(x)
  assert_close(out, x)
  ref = jax.new_ref(x)
  assert bool(pltpu.has_memory_space(ref, pltpu.HBM))
  assert not bool(pltpu.has_memory_space(ref, pltpu.SMEM))
  with pytest.raises(ValueError, match="concrete memory space"):
    pltpu.has_memory_space(ref, pl.ANY)


def test_with_memory_space_constraint_keeps_the_value():
  x = random_array((8, 16))
  y = pltpu.with_memory_space_constraint(x, pltpu.HBM)
  out = pallas_call(_copy_kernel, out_shape=sds(x))(y)
  assert_close(out, x)


def test_core_namespace_holds_the_tpu_types():
  assert pltpu.core.MemorySpace is pltpu.MemorySpace
  assert pltpu.core.CompilerParams is pltpu.CompilerParams
  assert pltpu.core.SideEffectType is pltpu.SideEffectType
  assert pltpu.core.AccMemorySpace is pltpu.ACC


def test_side_effect_type_is_accepted_in_compiler_params():
  x = random_array((8,))
  params = pltpu.CompilerParams(has_side_effects=pltpu.SideEffectType.SIDE_EFFECTING)
  out = pallas_call(_copy_kernel, out_shape=sds(x), compiler_params=params)(x)
  assert_close(out, x)


def test_an_invalid_side_effect_type_is_a_value_error():
  with pytest.raises(ValueError, match=r"Invalid side effect type: 'sometimes'.*SideEffectType"):
    pltpu.CompilerParams(has_side_effects="sometimes")


def test_buffered_ref_base_is_a_clear_error():
  with pytest.raises(pl.PalletError, match=r"BufferedRef is not supported.*emit_pipeline"):
    pltpu.BufferedRefBase()


def test_lowering_exception_is_an_exception_class():
  assert issubclass(pltpu.LoweringException, Exception)
  with pytest.raises(pltpu.LoweringException):
    raise pltpu.LoweringException("cannot lower")


# ------------------------------------------------------------------ pltpu: load/store
def test_tpu_masked_load_and_store():
  def kernel(x_ref, o_ref):
    iota = jax.lax.broadcasted_iota(i32, (8, 16), 1)
    keep = iota < 10
    o_ref[...] = jnp.full((8, 16), -1.0, f32)
    v = pltpu.load(x_ref.at[:, :], mask=keep)
    pltpu.store(o_ref, jnp.where(keep, v, 0.0) * 2, mask=iota >= 3)
    pltpu.store(o_ref.at[0], pltpu.load(x_ref.at[1]))

  x = random_array((8, 16))
  out = pallas_call(kernel, out_shape=sds(x))(x)
  xn = np.asarray(x)
  cols = np.arange(16)
  expected = np.where(cols < 3, -1.0, np.where(cols < 10, xn * 2, 0.0)).astype(np.float32)
  expected[0] = xn[1]
  assert_close(out, jnp.asarray(expected))


def test_tpu_load_and_store_through_a_selected_ref():
  def kernel(k_ref, a_ref, b_ref, o_ref):
    sel = pl.select_ref(k_ref[0], a_ref, b_ref)
    mask = jax.lax.broadcasted_iota(i32, (4, 8), 0) < 2
    pltpu.store(sel, jnp.full((4, 8), 7.0, f32), mask=mask)
    o_ref[...] = pltpu.load(sel) + a_ref[...] * 0 + b_ref[...] * 0

  a, b = random_array((4, 8)), random_array((4, 8))
  for k in (0, 1):
    gs = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(1,))
    out = pallas_call(kernel, out_shape=sds(a), grid_spec=gs)(jnp.array([k], i32), a, b)
    chosen = np.array(a if k == 0 else b)
    chosen[:2] = 7.0
    assert_close(out, jnp.asarray(chosen))


# ------------------------------------------------------------------ pltpu: bit packing
@pytest.mark.parametrize("unpacked, packed", [
    (jnp.int32, jnp.int8), (jnp.int32, jnp.int16), (jnp.int16, jnp.int4),
    (jnp.int8, jnp.int4), (jnp.uint32, jnp.uint8)])
def test_pack_and_unpack_elementwise_integers_in_a_kernel(unpacked, packed):
  bits_in = jnp.iinfo(unpacked).bits
  bits_out = jnp.iinfo(packed).bits
  n = bits_in // bits_out
  xs = [random_array((8, 16), unpacked, low=-300, high=300) for _ in range(n)]
  word = np.dtype(f"uint{bits_in}")

  def kernel(*refs):
    x_refs, p_ref, u_ref = refs[:n], refs[n], refs[n + 1]
    packed_val = pltpu.pack_elementwise([r[...] for r in x_refs], packed_dtype=packed)
    p_ref[...] = packed_val
    for k in range(n):
      u_ref[k] = pltpu.unpack_elementwise(packed_val, index=k, packed_dtype=packed,
                                          unpacked_dtype=unpacked)

  p, u = pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((8, 16), word),
                                        jax.ShapeDtypeStruct((n, 8, 16), unpacked)))(*xs)
  mask = (1 << bits_out) - 1
  fields = [np.asarray(x).astype(np.int64) & mask for x in xs]
  expected_p = sum(f << (k * bits_out) for k, f in enumerate(fields)).astype(word)
  if jnp.issubdtype(packed, jnp.signedinteger):
    fields = [np.where(f >= 1 << (bits_out - 1), f - (1 << bits_out), f) for f in fields]
  assert_close(p, jnp.asarray(expected_p))
  assert_close(u, jnp.asarray(np.stack(fields).astype(np.dtype(unpacked))))


def test_pack_and_unpack_elementwise_float32_as_bfloat16():
  a, b = random_array((8, 16)), random_array((8, 16))

  def kernel(a_ref, b_ref, p_ref, u_ref):
    p = pltpu.pack_elementwise([a_ref[...], b_ref[...]], packed_dtype=jnp.bfloat16)
    p_ref[...] = p
    u_ref[0] = pltpu.unpack_elementwise(p, index=0, packed_dtype=jnp.bfloat16,
                                        unpacked_dtype=f32)
    u_ref[1] = pltpu.unpack_elementwise(p, index=1, packed_dtype=jnp.bfloat16,
                                        unpacked_dtype=f32)

  p, u = pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((8, 16), jnp.uint32),
                                        jax.ShapeDtypeStruct((2, 8, 16), f32)))(a, b)
  as_bits = lambda v: np.asarray(v.astype(jnp.bfloat16)).view(np.uint16).astype(np.uint32)
  assert_close(p, jnp.asarray(as_bits(a) | (as_bits(b) << 16)))
  assert_close(u, jnp.stack([a, b]).astype(jnp.bfloat16).astype(f32), rtol=0, atol=0)


def test_pack_elementwise_errors():
  x = jnp.zeros((4,), f32)
  with pytest.raises(ValueError, match="float32 -> bfloat16 and integer"):
    pltpu.pack_elementwise([x, x], packed_dtype=jnp.int16)
  with pytest.raises(ValueError, match="packs 2 values"):
    pltpu.pack_elementwise([x], packed_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="out of range"):
    pltpu.unpack_elementwise(jnp.zeros((4,), i32), index=4, packed_dtype=jnp.int8,
                             unpacked_dtype=i32)


def _signed(v: np.ndarray, width: int) -> np.ndarray:
  v = v.astype(np.int16)
  return np.where(v >= 1 << (width - 1), v - (1 << width), v)


@pytest.mark.skipif(current_test_backend() != "xla",
                    reason="int4 / int2 values (split_bits' results) have no Triton type")
def test_split_and_join_bits_in_a_kernel():
  x = random_array((8, 32), jnp.int8, low=-128, high=127)

  def kernel(x_ref, lo_ref, mid_ref, joined_ref):
    four, two = pltpu.split_bits(x_ref[...], (4, 2))
    assert (four.dtype, two.dtype) == (jnp.int4, jnp.int2)
    lo_ref[...] = four.astype(jnp.int8)
    mid_ref[...] = two.astype(jnp.int8)
    joined_ref[...] = pltpu.join_bits(two_bits=two, four_bits=four)

  outs = pallas_call(kernel, out_shape=[sds(x)] * 3)(x)
  xb = np.asarray(x).view(np.uint8)
  assert_close(outs[0], jnp.asarray(_signed(xb & 15, 4).astype(np.int8)))
  assert_close(outs[1], jnp.asarray(_signed((xb >> 4) & 3, 2).astype(np.int8)))
  assert_close(outs[2], jnp.asarray((xb & 63).astype(np.int8)))


def test_join_bits_single_segments_and_split_bits_fields():
  x = random_array((64,), jnp.uint8, low=0, high=255)
  xb = np.asarray(x)
  a, b, c = pltpu.split_bits(x, (2, 4, 2))
  assert_close(a.astype(jnp.int8), jnp.asarray(_signed(xb & 3, 2).astype(np.int8)))
  assert_close(b.astype(jnp.int8), jnp.asarray(_signed((xb >> 2) & 15, 4).astype(np.int8)))
  assert_close(c.astype(jnp.int8), jnp.asarray(_signed(xb >> 6, 2).astype(np.int8)))
  assert_close(pltpu.join_bits(four_bits=b), jnp.asarray(((xb >> 2) & 15).astype(np.int8)))
  assert_close(pltpu.join_bits(two_bits=c), jnp.asarray((xb >> 6).astype(np.int8)))
  with pytest.raises(ValueError, match="give two_bits, four_bits or both"):
    pltpu.join_bits()
  with pytest.raises(ValueError, match="only 2- and 4-bit"):
    pltpu.split_bits(x, (3,))
  with pytest.raises(ValueError, match="8-bit"):
    pltpu.split_bits(x.astype(i32), (4,))


# ------------------------------------------------------------------ pltpu: conv
def _conv_nhwc_reference(x, w, stride, pad):
  """Direct loop convolution (NHWC activations, HWIO kernel)."""
  x = np.pad(np.asarray(x, np.float64), ((0, 0), pad[0], pad[1], (0, 0)))
  w = np.asarray(w, np.float64)
  kh, kw = w.shape[:2]
  oh = (x.shape[1] - kh) // stride[0] + 1
  ow = (x.shape[2] - kw) // stride[1] + 1
  out = np.zeros((x.shape[0], oh, ow, w.shape[3]))
  for i in range(oh):
    for j in range(ow):
      patch = x[:, i * stride[0]:i * stride[0] + kh, j * stride[1]:j * stride[1] + kw, :]
      out[:, i, j, :] = np.einsum("nhwc,hwco->no", patch, w)
  return out


@pytest.mark.skipif(current_test_backend() != "xla",
                    reason="convolutions run on the XLA backend only")
def test_conv_with_window_reversal_and_accumulator_in_a_kernel():
  x, w = random_array((2, 9, 9, 3)), random_array((3, 2, 3, 4))
  acc = random_array((2, 4, 8, 4))

  def kernel(x_ref, w_ref, acc_ref, o_ref, plain_ref):
    o_ref[...] = pltpu.conv(x_ref[...], w_ref[...], acc_ref[...],
                            dimension_numbers=("NHWC", "HWIO", "NHWC"),
                            window_strides=(2, 1), padding=((0, 0), (0, 0)),
                            window_reversal=(True, False))
    plain_ref[...] = pltpu.conv(x_ref[...], w_ref[...],
                                dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                padding="SAME")

  out, plain = pallas_call(kernel, out_shape=(sds(acc),
                                              jax.ShapeDtypeStruct((2, 9, 9, 4), f32)))(
                                                  x, w, acc)
  reversed_w = np.asarray(w)[::-1]
  expected = np.asarray(acc) + _conv_nhwc_reference(x, reversed_w, (2, 1), ((0, 0), (0, 0)))
  assert_close(out, jnp.asarray(expected, f32), rtol=1e-4, atol=1e-4)
  same = _conv_nhwc_reference(x, w, (1, 1), ((1, 1), (0, 1)))
  assert_close(plain, jnp.asarray(same, f32), rtol=1e-4, atol=1e-4)
