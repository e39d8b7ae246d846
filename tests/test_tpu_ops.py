"""pltpu vector ops (roll, bitcast, repeat, einshape, stochastic_round) inside kernels,
against jax.numpy / NumPy references, plus their errors."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
import pallet.tpu as pltpu
from helpers import assert_close, pallas_call, random_array


def _run(fn, x, out_shape):
  def kernel(x_ref, o_ref):
    o_ref[...] = fn(x_ref[...])
  return pallas_call(kernel, out_shape)(x)


@pytest.mark.parametrize("shift,axis", [(0, 0), (3, 1), (17, 1), (5, 0)])
def test_roll_matches_jnp_roll(shift, axis):
  x = random_array((8, 16))
  out = _run(lambda v: pltpu.roll(v, shift, axis), x, jax.ShapeDtypeStruct(x.shape, x.dtype))
  assert_close(out, jnp.roll(x, shift, axis))


def test_roll_with_traced_shift():
  x = random_array((8, 128))
  shift = jnp.array([37], jnp.int32)

  def kernel(s_ref, x_ref, o_ref):
    o_ref[...] = pltpu.roll(x_ref[...], s_ref[0], 1)
  out = pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype))(shift, x)
  assert_close(out, jnp.roll(x, 37, 1))


def test_roll_strided():
  x = random_array((4, 16))
  out = _run(lambda v: pltpu.roll(v, 2, 1, stride=3, stride_axis=0), x,
             jax.ShapeDtypeStruct(x.shape, x.dtype))
  expected = jnp.stack([jnp.roll(x[i], 2 + 3 * i) for i in range(4)])
  assert_close(out, expected)


def test_roll_errors():
  x = jnp.zeros((4, 8))
  with pytest.raises(pl.PalletError, match="non-negative"):
    pltpu.roll(x, -1, 0)
  with pytest.raises(pl.PalletError, match="stride_axis"):
    pltpu.roll(x, 1, 0, stride=1)


@pytest.mark.parametrize("src,dst,dim", [
    (jnp.float32, jnp.int32, -2), (jnp.float32, jnp.bfloat16, -2),
    (jnp.int8, jnp.int32, -2), (jnp.uint16, jnp.uint32, -1), (jnp.int32, jnp.int8, -1)])
def test_bitcast_repacks_along_dim(src, dst, dim):
  x = random_array((8, 16), src)
  ratio_num, ratio_den = jnp.dtype(src).itemsize, jnp.dtype(dst).itemsize
  shape = list(x.shape)
  shape[dim] = shape[dim] * ratio_num // ratio_den
  out = _run(lambda v: pltpu.bitcast(v, dst, dim), x, jax.ShapeDtypeStruct(shape, dst))
  # NumPy reference: pack consecutive elements along `dim`, lowest bits first.
  moved = np.moveaxis(np.asarray(x), dim, -1).copy()
  expected = np.moveaxis(moved.view(jnp.dtype(dst)), -1, dim)
  np.testing.assert_array_equal(np.ascontiguousarray(out).view(np.uint8),
                                np.ascontiguousarray(expected).view(np.uint8))


@pytest.mark.cpu_only   # Triton has no int4 type: there it is a clear TritonLoweringError
@pytest.mark.parametrize("dim", [-2, -1])
def test_bitcast_splits_bytes_into_int4_and_back(dim):
  # Sub-byte types count 4 bits, not the byte NumPy stores them in: an int8 splits
  # into two int4s along `dim`, low nibble first (sign-extended), and packs back.
  x = random_array((8, 16), jnp.int8)
  shape = list(x.shape)
  shape[dim] *= 2
  nibbles = _run(lambda v: pltpu.bitcast(v, jnp.int4, dim), x,
                 jax.ShapeDtypeStruct(tuple(shape), jnp.int4))
  moved = np.moveaxis(np.asarray(x), dim, -1)
  low, high = (moved.astype(np.int8) << 4) >> 4, moved.astype(np.int8) >> 4
  expected = np.moveaxis(np.stack([low, high], -1).reshape(*moved.shape[:-1], -1), -1, dim)
  np.testing.assert_array_equal(np.asarray(nibbles).astype(np.int8), expected)
  back = _run(lambda v: pltpu.bitcast(v, jnp.int8, dim), nibbles,
              jax.ShapeDtypeStruct(x.shape, jnp.int8))
  np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


def test_bitcast_errors():
  with pytest.raises(pl.PalletError, match="second-minor"):
    pltpu.bitcast(jnp.zeros((8,), jnp.float32), jnp.int32)
  with pytest.raises(pl.PalletError, match="cannot be repacked"):
    pltpu.bitcast(jnp.zeros((3, 8), jnp.int8), jnp.int32)


def test_repeat_tiles_along_axis():
  x = random_array((8, 128))
  out = _run(lambda v: pltpu.repeat(v, 3, 1), x, jax.ShapeDtypeStruct((8, 384), x.dtype))
  assert_close(out, jnp.tile(x, (1, 3)))


@pytest.mark.parametrize("equation,shape,sizes,reference", [
    ("ab->ba", (8, 16), {}, lambda x: x.T),
    ("m(nk)->mnk", (8, 12), {"n": 3}, lambda x: x.reshape(8, 3, 4)),
    ("abc->(ab)c", (2, 4, 8), {}, lambda x: x.reshape(8, 8)),
    ("a(bc)->(ba)c", (4, 12), {"b": 2}, lambda x: x.reshape(4, 2, 6).transpose(1, 0, 2)
     .reshape(8, 6)),
])
def test_einshape(equation, shape, sizes, reference):
  x = random_array(shape)
  expected = reference(x)
  out = _run(lambda v: pltpu.einshape(equation, v, **sizes), x,
             jax.ShapeDtypeStruct(expected.shape, x.dtype))
  assert_close(out, expected)


def test_einshape_errors():
  x = jnp.zeros((8, 12))
  with pytest.raises(pl.PalletError, match="all but one"):
    pltpu.einshape("a(bc)->abc", x)
  with pytest.raises(pl.PalletError, match="once on each side"):
    pltpu.einshape("ab->a", x)
  with pytest.raises(pl.PalletError, match="does not split"):
    pltpu.einshape("a(bc)->abc", x, b=5)


def test_stochastic_round_brackets_and_is_exact_on_representable():
  x = random_array((8, 128))
  bits = jax.random.bits(jax.random.key(0), x.shape, jnp.uint32)

  def kernel(x_ref, b_ref, o_ref):
    o_ref[...] = pltpu.stochastic_round(x_ref[...], b_ref[...], target_dtype=jnp.bfloat16)
  out = pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, jnp.bfloat16))(x, bits)
  down = jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000), jnp.float32)
  up = jnp.nextafter(down.astype(jnp.bfloat16), jnp.where(x < 0, -jnp.inf, jnp.inf)
                     .astype(jnp.bfloat16)).astype(jnp.float32)
  out32 = out.astype(jnp.float32)
  assert bool(jnp.all((out32 == down) | (out32 == up)))
  # Both directions occur, and values already in bfloat16 stay put.
  assert 0 < int(jnp.sum(out32 == up)) < x.size
  exact = x.astype(jnp.bfloat16).astype(jnp.float32)
  again = pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, jnp.bfloat16))(exact, bits)
  assert_close(again.astype(jnp.float32), exact)


def test_hints_are_value_neutral():
  x = random_array((8, 128))

  def kernel(x_ref, o_ref):
    pltpu.trace_value("x0", x_ref[0, 0])
    pltpu.touch(x_ref)
    pltpu.delay(10)
    o_ref[...] = pltpu.annotate(x_ref, no_store=True)[...] + 1
  out = pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
  assert_close(out, x + 1)


def test_tpu_info_stand_in():
  info = pltpu.get_tpu_info()
  assert info.chip_version is pltpu.ChipVersion.TPU_V5E
  assert (info.num_sublanes, info.num_lanes) == pltpu.Tiling.COMPACT.shape == (8, 128)
  assert info.vmem_capacity_bytes > 0 and not info.is_megacore
  assert pltpu.is_tpu_device() is False
  assert pltpu.get_tpu_info_for_chip(pltpu.ChipVersion.TPU_V5P, 2).is_megacore


@pytest.mark.parametrize("semantics", [pltpu.PARALLEL, pltpu.CORE_PARALLEL,
                                       pltpu.SUBCORE_PARALLEL, pltpu.ARBITRARY])
def test_grid_dimension_semantics_and_interpret_params(semantics):
  x = random_array((4, 8, 128))

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
      in_specs=[pl.BlockSpec((1, 8, 128), lambda i: (i, 0, 0))],
      out_specs=pl.BlockSpec((1, 8, 128), lambda i: (i, 0, 0)),
      compiler_params=pltpu.CompilerParams(dimension_semantics=[semantics],
                                           vmem_limit_bytes=2 ** 25),
      interpret=pltpu.InterpretParams(detect_races=True))(x)
  assert_close(out, x * 2)
  with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
    pltpu.reset_tpu_interpret_mode_state()
