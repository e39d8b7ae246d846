"""pltpu's in-kernel generator (prng_seed / prng_random_bits / stateful_*) and
JAX's TPU random kernels (philox, threefry) against independent references."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
import pallet.tpu as pltpu
from pallet.tpu import random as tpu_random
from helpers import current_test_backend, pallas_call


def _run(draw, dtype, seed=7):
  def kernel(seed_ref, o_ref):
    pltpu.prng_seed(seed_ref[0], pl.program_id(0))
    o_ref[...] = draw()
  return pallas_call(kernel, jax.ShapeDtypeStruct((16, 128), dtype), grid=(2,),
                     in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
                     out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))(
                         jnp.array([seed], jnp.int32))


def _reference_bits(seed_words, counter, shape):
  """The documented generator, computed with NumPy-driven calls of the hash."""
  key = tpu_random._INITIAL_KEY
  for pos, w in enumerate(seed_words):
    key = tpu_random.threefry2x32(key, (np.uint32(w), np.uint32(pos)))
  idx = jnp.arange(int(np.prod(shape)), dtype=jnp.uint32).reshape(shape)
  return tpu_random.threefry2x32(key, (np.uint32(counter), idx))[0]


def test_hash_is_jax_threefry():
  from jax._src.random import threefry2x32 as jax_threefry   # the peer implementation
  key = jnp.array([0x12345678, 0x9ABCDEF0], jnp.uint32)
  counts = jax.random.bits(jax.random.key(1), (2, 64), jnp.uint32)
  expected = jax_threefry.threefry_2x32(key, counts.reshape(-1)).reshape(2, 64)
  got = tpu_random.threefry2x32((key[0], key[1]), (counts[0], counts[1]))
  np.testing.assert_array_equal(np.stack(got), np.asarray(expected))


def test_prng_random_bits_follows_documented_generator():
  out = _run(lambda: pltpu.prng_random_bits((8, 128)), jnp.uint32, seed=7)
  for step in range(2):
    np.testing.assert_array_equal(out[8 * step:8 * (step + 1)],
                                  _reference_bits([7, step], 0, (8, 128)))
  again = _run(lambda: pltpu.prng_random_bits((8, 128)), jnp.uint32, seed=7)
  other = _run(lambda: pltpu.prng_random_bits((8, 128)), jnp.uint32, seed=8)
  np.testing.assert_array_equal(out, again)
  assert np.mean(np.asarray(out) == np.asarray(other)) < 0.01


def test_successive_draws_differ():
  def draw():
    a = pltpu.prng_random_bits((8, 128))
    b = pltpu.prng_random_bits((8, 128))
    return a ^ b
  out = _run(draw, jnp.uint32)
  expected = _reference_bits([7, 0], 0, (8, 128)) ^ _reference_bits([7, 0], 1, (8, 128))
  np.testing.assert_array_equal(out[:8], expected)


def test_stateful_samplers_have_the_right_distribution():
  u = np.asarray(_run(lambda: pltpu.stateful_uniform((8, 128), minval=-2.0, maxval=3.0),
                      jnp.float32))
  assert u.min() >= -2.0 and u.max() < 3.0 and abs(u.mean() - 0.5) < 0.15
  n = np.asarray(_run(lambda: pltpu.stateful_normal((8, 128)), jnp.float32))
  assert abs(n.mean()) < 0.1 and abs(n.std() - 1.0) < 0.1
  b = np.asarray(_run(lambda: pltpu.stateful_bernoulli(0.25, (8, 128)).astype(jnp.int32),
                      jnp.int32))
  assert abs(b.mean() - 0.25) < 0.05
  bits = _run(lambda: pltpu.stateful_bits((8, 128), jnp.uint8), jnp.uint8)
  np.testing.assert_array_equal(bits[:8], _reference_bits([7, 0], 0, (8, 128)).astype(jnp.uint8))


def test_to_pallas_key_is_a_typed_key_that_seeds_the_generator():
  key = jax.random.key(3)
  pallas_key = pltpu.to_pallas_key(key)
  assert pallas_key.shape == () and jax.dtypes.issubdtype(pallas_key.dtype, jax.dtypes.prng_key)
  data = jax.random.key_data(pallas_key)
  np.testing.assert_array_equal(data, jax.random.bits(key, (1, 2), jnp.uint32))
  expected = _reference_bits(list(np.asarray(data).ravel()), 0, (8, 128))

  def seeded(k_ref, o_ref):
    pltpu.prng_seed(k_ref[...])
    o_ref[...] = pltpu.prng_random_bits((8, 128))

  def keyed(k_ref, o_ref):   # jax.random on the key: one draw of the seeded generator
    o_ref[...] = jax.random.bits(k_ref[...], (8, 128), jnp.uint32)
  # the Triton backend cannot hold typed keys: it seeds from the key data
  typed = current_test_backend() == "xla"
  for kernel in (seeded, keyed) if typed else (seeded,):
    out = pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.uint32),
                      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)])(
                          pallas_key if typed else data)
    np.testing.assert_array_equal(out, expected)
  np.testing.assert_array_equal(jax.random.bits(pallas_key, (8, 128), jnp.uint32), expected)
  # a batch of keys (legacy uint32 keys too), and keys derived from a pallas key
  batch = pltpu.to_pallas_key(jax.random.split(jax.random.PRNGKey(4), 3))
  assert batch.shape == (3,) and jax.random.key_data(batch).shape == (3, 1, 2)
  derived = [jax.random.fold_in(pallas_key, 1), jax.random.fold_in(pallas_key, 2),
             *jax.random.split(pallas_key, 2)]
  bits = [np.asarray(jax.random.bits(k, (64,), jnp.uint32)) for k in (pallas_key, *derived)]
  assert len({b.tobytes() for b in bits}) == len(bits)


@pytest.mark.skipif(current_test_backend() == "triton",
                    reason="the Triton backend cannot hold typed keys (tests/test_errors.py)")
def test_typed_keys_as_blocked_inputs_and_outputs():
  """Keys are cut into blocks like any operand (the last block overhanging), and a
  kernel may return keys."""
  keys = jax.random.split(jax.random.key(5), 5)
  draw = jax.vmap(lambda k: jax.random.uniform(k, (16,)))

  def sample(k_ref, o_ref):
    o_ref[...] = draw(k_ref[...])
  out = pallas_call(sample, jax.ShapeDtypeStruct((5, 16), jnp.float32), grid=(3,),
                    in_specs=[pl.BlockSpec((2,), lambda i: (i,))],
                    out_specs=pl.BlockSpec((2, 16), lambda i: (i, 0)))(keys)
  np.testing.assert_array_equal(out, draw(keys))

  def fold(k_ref, o_ref):
    o_ref[...] = jax.vmap(lambda k: jax.random.fold_in(k, 3))(k_ref[...])
  folded = jax.jit(pallas_call(fold, jax.ShapeDtypeStruct(keys.shape, keys.dtype)))(keys)
  assert folded.dtype == keys.dtype
  np.testing.assert_array_equal(
      jax.random.key_data(folded),
      jax.random.key_data(jax.vmap(lambda k: jax.random.fold_in(k, 3))(keys)))

  def one(k_ref, o_ref):
    o_ref[...] = jax.random.uniform(k_ref[...], o_ref.shape)
  per_key = jax.vmap(pallas_call(one, jax.ShapeDtypeStruct((8, 128), jnp.float32)))(keys)
  np.testing.assert_array_equal(per_key, jax.vmap(lambda k: jax.random.uniform(k, (8, 128)))(keys))


def test_errors():
  with pytest.raises(pl.PalletError, match="only be called inside a kernel"):
    pltpu.prng_random_bits((8,))

  def unseeded(o_ref):
    o_ref[...] = pltpu.prng_random_bits((8, 128))
  with pytest.raises(pl.PalletError, match="before pltpu.prng_seed.*unseeded"):
    pallas_call(unseeded, jax.ShapeDtypeStruct((8, 128), jnp.uint32))()

  def in_loop(o_ref):
    pltpu.prng_seed(1)

    def body(i, acc):
      return acc ^ pltpu.prng_random_bits((8, 128))
    o_ref[...] = jax.lax.fori_loop(0, 3, body, jnp.zeros((8, 128), jnp.uint32))
  with pytest.raises(pl.PalletError, match="inside a loop body.*in_loop"):
    pallas_call(in_loop, jax.ShapeDtypeStruct((8, 128), jnp.uint32))()


def test_seeding_inside_the_loop_is_allowed():
  def kernel(o_ref):
    def body(i, acc):
      pltpu.prng_seed(5, i)
      return acc ^ pltpu.prng_random_bits((8, 128))
    o_ref[...] = jax.lax.fori_loop(0, 3, body, jnp.zeros((8, 128), jnp.uint32))
  out = pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.uint32))()
  expected = (_reference_bits([5, 0], 0, (8, 128)) ^ _reference_bits([5, 1], 0, (8, 128))
              ^ _reference_bits([5, 2], 0, (8, 128)))
  np.testing.assert_array_equal(out, expected)


def _philox_reference(key, shape):
  """Philox-4x32-10 on counters (0, i, 0, 0) as the kernel documents, in NumPy uint64."""
  mask = np.uint64(0xFFFFFFFF)
  n = int(np.prod(shape))
  hi0 = np.zeros(n, np.uint64); lo0 = np.arange(n, dtype=np.uint64)
  hi1 = np.zeros(n, np.uint64); lo1 = np.zeros(n, np.uint64)
  k_hi, k_lo = np.uint64(key[0]), np.uint64(key[1])
  for r in range(10):
    p0 = np.uint64(0xCD9E8D57) * hi1
    p1 = np.uint64(0xD2511F53) * hi0
    hi0, lo0, hi1, lo1 = ((p0 >> np.uint64(32)) ^ lo0 ^ k_hi, p0 & mask,
                          (p1 >> np.uint64(32)) ^ lo1 ^ k_lo, p1 & mask)
    if r != 9:
      k_hi = (k_hi + np.uint64(0x9E3779B9)) & mask
      k_lo = (k_lo + np.uint64(0xBB67AE85)) & mask
  return ((hi0 ^ lo0) & mask).astype(np.uint32).reshape(shape)


def test_jax_tpu_philox_kernel():
  from pallet.bench import jax_ops
  if not jax_ops.available("tpu/random/philox"):
    pytest.skip("this jax ships no ops/tpu/random/philox.py")
  philox = jax_ops.load("tpu/random/philox")
  key = np.array([0x1234, 0xBEEF], np.uint32)
  out = philox.philox_4x32_count(jnp.asarray(key), (300, 260))
  np.testing.assert_array_equal(out, _philox_reference(key, (300, 260)))


def test_jax_tpu_threefry_kernel_matches_jax_random():
  from pallet.bench import jax_ops
  if not jax_ops.available("tpu/random/threefry"):
    pytest.skip("this jax ships no ops/tpu/random/threefry.py")
  threefry = jax_ops.load("tpu/random/threefry")
  key = jax.random.key(11, impl="threefry2x32")
  # The kernel fuses jax.random's counter layout with the hash: same bits as jax.random.
  out = threefry.plthreefry_random_bits(jax.random.key_data(key), 32, (300, 260))
  np.testing.assert_array_equal(out, jax.random.bits(key, (300, 260), jnp.uint32))


@pytest.mark.skipif(current_test_backend() == "triton",
                    reason="typed PRNG keys (key<fry>), which jax.random samplers create in a "
                    "kernel: the Triton backend has no rule for random_wrap (a lowering error "
                    "naming the primitive)")
def test_sample_block_is_invariant_to_block_size():
  key = pltpu.to_pallas_key(jax.random.key(2))

  def sampled(block):
    def kernel(k_ref, o_ref):
      o_ref[...] = pltpu.sample_block(jax.random.uniform, k_ref[...], block, (8, 128),
                                      (16, 256))
    grid = (16 // block[0], 256 // block[1])
    return pallas_call(kernel, jax.ShapeDtypeStruct((16, 256), jnp.float32), grid=grid,
                       in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
                       out_specs=pl.BlockSpec(block, lambda i, j: (i, j)))(key)
  small, large = sampled((8, 128)), sampled((16, 256))
  np.testing.assert_array_equal(small, large)
  assert 0.0 <= float(small.min()) and float(small.max()) < 1.0
  assert len(np.unique(np.asarray(small))) > 16 * 256 * 0.99   # tiles differ
  with pytest.raises(pl.PalletError, match="must divide"):
    pltpu.sample_block(jax.random.uniform, key, (8, 100), (8, 128), (16, 256), (0, 0))
