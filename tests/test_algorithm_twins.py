"""pallet.bench.algorithm_twins: each twin computes its row's result by the kernel's algorithm."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from pallet.bench import algorithm_twins

ROWS = algorithm_twins.rows("tiny")   # empty before JAX 0.12 (no kernel library to run)


@pytest.mark.skipif(not ROWS, reason="the rows are JAX 0.12's kernel library (jax_op_cases)")
@pytest.mark.parametrize("bench", ROWS, ids=lambda b: b.name)
def test_algorithm_twin_computes_the_rows_result(bench):
  args = bench.make_inputs(jax.random.key(7))
  got = jax.jit(algorithm_twins.ALGORITHM_TWINS[bench.name]("tiny"))(*args)
  np.testing.assert_allclose(got, jax.jit(bench.reference)(*args), rtol=1e-5, atol=1e-5)


def test_split_decode_attention_is_softmax_attention_for_any_split_and_padding():
  kq, kk, kv = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(kq, (2, 3, 5, 16))          # batch, kv heads, heads per kv head, d
  k = jax.random.normal(kk, (2, 3, 64, 16))
  v = jax.random.normal(kv, (2, 3, 64, 16))
  lengths = jax.numpy.array([64, 23])
  logits = jax.numpy.einsum("bghd,bgsd->bghs", q, k, precision="highest") * 0.25
  logits = jax.numpy.where(jax.numpy.arange(64) < lengths[:, None, None, None], logits, -1e30)
  want = jax.numpy.einsum("bghs,bgsd->bghd", jax.nn.softmax(logits, -1), v, precision="highest")
  for block_h, splits in ((8, 4), (5, 16), (16, 1)):
    got = algorithm_twins.split_decode_attention(q, k, v, lengths, block_h=block_h,
                                                 k_splits=splits, sm_scale=0.25)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{block_h=} {splits=}")


@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_attention_is_softmax_attention_for_any_blocks(causal):
  kq, kk, kv = jax.random.split(jax.random.key(5), 3)
  q, k, v = (jax.random.normal(key, (2, 3, 96, 16)) for key in (kq, kk, kv))
  logits = jax.numpy.einsum("...td,...sd->...ts", q, k, precision="highest") * 0.25
  if causal:
    logits = jax.numpy.where(jax.numpy.tri(96, dtype=bool), logits, -1e30)
  want = jax.numpy.einsum("...ts,...sd->...td", jax.nn.softmax(logits, -1), v,
                          precision="highest")
  for block_q, block_k in ((32, 32), (16, 48), (48, 16), (96, 96)):
    got = algorithm_twins.blockwise_attention(q, k, v, block_q=block_q, block_k=block_k,
                                              scale=0.25, causal=causal)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5,
                               err_msg=f"{block_q=} {block_k=} {causal=}")


def test_blockwise_attention_with_segment_ids_is_masked_softmax_attention():
  kq, kk, kv, ki = jax.random.split(jax.random.key(9), 4)
  q, k, v = (jax.random.normal(key, (2, 3, 96, 16)) for key in (kq, kk, kv))
  ids = jax.numpy.sort(jax.random.randint(ki, (2, 96), 0, 3), axis=1)   # runs of segments
  same = (ids[:, :, None] == ids[:, None, :])[:, None]
  logits = jax.numpy.einsum("...td,...sd->...ts", q, k, precision="highest") * 0.25
  want = jax.numpy.einsum("...ts,...sd->...td", jax.nn.softmax(
      jax.numpy.where(same, logits, -1e30), -1), v, precision="highest")
  for block_q, block_k in ((32, 32), (16, 48), (48, 16)):
    got = algorithm_twins.blockwise_attention(q, k, v, block_q=block_q, block_k=block_k,
                                              scale=0.25, causal=False, segment_ids=ids)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{block_q=} {block_k=}")


def test_padded_blockwise_attention_is_softmax_attention_for_any_block_and_padded_width():
  kq, kk, kv, km = jax.random.split(jax.random.key(5), 4)
  q, k, v = (jax.random.normal(key, (2, 48, 3, 40)) for key in (kq, kk, kv))   # b, t, h, d
  mask = jax.random.bernoulli(km, 0.6, (2, 1, 48, 48)).at[..., 0].set(True)
  heads = lambda x: jax.numpy.swapaxes(x, 1, 2)
  for masked in (None, mask):
    logits = jax.numpy.einsum("bhqd,bhkd->bhqk", heads(q), heads(k), precision="highest") * 0.3
    if masked is not None:
      logits = jax.numpy.where(masked, logits, -1e30)
    want = heads(jax.numpy.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(logits, -1), heads(v),
                                  precision="highest"))
    for block_k in (8, 16, 48):
      got = algorithm_twins.padded_blockwise_attention(q, k, v, masked, sm_scale=0.3,
                                                     block_k=block_k)
      assert got.shape == want.shape
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5,
                                 err_msg=f"{block_k=} masked={masked is not None}")


def test_causal_padded_blockwise_attention_is_causal_softmax_attention():
  kq, kk, kv = jax.random.split(jax.random.key(11), 3)
  q, k, v = (jax.random.normal(key, (2, 96, 3, 40)) for key in (kq, kk, kv))   # b, t, h, d
  heads = lambda x: jax.numpy.swapaxes(x, 1, 2)
  logits = jax.numpy.einsum("bhqd,bhkd->bhqk", heads(q), heads(k), precision="highest") * 0.3
  logits = jax.numpy.where(jax.numpy.tri(96, dtype=bool), logits, -1e30)
  want = heads(jax.numpy.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(logits, -1), heads(v),
                                precision="highest"))
  for block_q, block_k in ((32, 32), (16, 48), (48, 16)):
    got = algorithm_twins.causal_padded_blockwise_attention(q, k, v, sm_scale=0.3,
                                                            block_q=block_q, block_k=block_k)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{block_q=} {block_k=}")
