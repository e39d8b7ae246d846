"""pallet.ops flash attention against a jax.numpy reference: forward and VJP, with
causal masks, segment ids, GQA/MQA, sliding windows, soft-caps and ragged lengths."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_array
from pallet import PalletError, ops
from ops_testing import DTYPES, check_op

DTYPE_IDS = lambda d: jnp.dtype(d).name  # noqa: E731

CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window_softcap": dict(causal=True, window=9, softcap=5.0),
    "window_not_causal": dict(window=12),
    "segments": dict(causal=True, segments=True),
}


def _qkv(b, h, hkv, t, s, d, dtype):
  return random_array((b, h, t, d), dtype), random_array((b, hkv, s, d), dtype), \
      random_array((b, hkv, s, d), dtype)


def _segments(b, n, seed):
  cuts = np.sort(np.random.default_rng(seed).integers(0, n, (b, 2)), axis=1)
  ids = (np.arange(n)[None, :] >= cuts[:, :1]).astype(np.int32) + \
      (np.arange(n)[None, :] >= cuts[:, 1:]).astype(np.int32)
  return jnp.asarray(ids)


@pytest.mark.parametrize("dtype", [DTYPES[0], pytest.param(DTYPES[1], marks=pytest.mark.slow)],
                         ids=DTYPE_IDS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 1)], ids=["gqa", "mqa"])
def test_flash_attention(case, heads, kv_heads, dtype):
  kwargs = dict(CASES[case])
  b, t, d = 2, 37, 16
  q, k, v = _qkv(b, heads, kv_heads, t, t, d, dtype)
  if kwargs.pop("segments", False):
    ids = _segments(b, t, seed=heads)
    kwargs.update(q_segment_ids=ids, kv_segment_ids=ids)
  check_op(ops.flash_attention, ops.attention_reference, (q, k, v), argnums=(0, 1, 2),
           blocks=dict(block_q=16, block_k=16), **kwargs)


@pytest.mark.parametrize("block_q,block_k", [(32, 16), (16, 32)])
def test_flash_attention_cross_lengths_and_block_shapes(block_q, block_k):
  q, k, v = _qkv(1, 2, 2, 20, 45, 32, jnp.float32)
  check_op(ops.flash_attention, ops.attention_reference, (q, k, v), argnums=(0, 1, 2),
           blocks=dict(block_q=block_q, block_k=block_k), causal=True)


def test_rows_that_see_no_key_give_zero_output_and_gradient():
  q, k, v = _qkv(1, 1, 1, 16, 16, 16, jnp.float32)
  q_ids = jnp.zeros((1, 16), jnp.int32).at[0, 5].set(7)   # row 5: no key has segment 7
  kv_ids = jnp.zeros((1, 16), jnp.int32)
  check_op(ops.flash_attention, ops.attention_reference, (q, k, v), argnums=(0, 1, 2),
           blocks=dict(block_q=16, block_k=16), q_segment_ids=q_ids, kv_segment_ids=kv_ids)
  out = ops.flash_attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                            block_q=16, block_k=16)
  assert float(jnp.abs(out[0, 0, 5]).max()) == 0.0


def test_errors_name_the_op_and_argument():
  q, k, v = _qkv(1, 3, 2, 8, 8, 16, jnp.float32)
  with pytest.raises(PalletError, match="flash_attention: q's 3 heads are not a multiple"):
    ops.flash_attention(q, k, v)
  with pytest.raises(PalletError, match="give both q_segment_ids and kv_segment_ids"):
    ops.flash_attention(q[:, :2], k, v, q_segment_ids=jnp.zeros((1, 8), jnp.int32))
  with pytest.raises(PalletError, match="window must be a positive int"):
    ops.flash_attention(q[:, :2], k, v, window=0)
