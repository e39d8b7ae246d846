"""pallet.ops flash attention against a jax.numpy reference: forward and VJP, with
causal masks, segment ids, GQA/MQA, sliding windows, soft-caps and ragged lengths."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close, current_test_backend, random_array
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


def _config(causal, window, q_len, kv_len, block_q, block_k):
  from pallet.ops import attention
  return attention._Config(scale=1.0, causal=causal, window=window, softcap=None, q_len=q_len,
                           kv_len=kv_len, groups=1, block_q=block_q, block_k=block_k,
                           segments=False, fwd=None, dq=None, dkv=None)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 5), (False, 7),
                                           (True, 40)])
@pytest.mark.parametrize("q_len,kv_len,block_q,block_k", [
    (37, 37, 16, 16), (20, 45, 32, 16), (45, 20, 16, 32), (64, 64, 16, 32), (50, 70, 8, 16)])
def test_visited_blocks_are_the_visible_ones_and_unmasked_blocks_fully_visible(
    causal, window, q_len, kv_len, block_q, block_k):
  """The loop bounds of every pass against a brute-force mask: a block with any visible
  (query, key) pair is visited, one visited without a mask has every pair visible, and
  one visited with a mask has not (only the blocks on a mask's edge are masked)."""
  from pallet.ops import attention
  c = _config(causal, window, q_len, kv_len, block_q, block_k)
  nq, nk = -(-q_len // block_q) + 1, -(-kv_len // block_k) + 1   # one block of padding
  q_pos = np.arange(nq * block_q)[:, None]
  k_pos = np.arange(nk * block_k)[None, :]
  visible = np.asarray(attention._mask(q_pos, k_pos, causal, window)) & (k_pos < kv_len)

  def block(i, j):
    return visible[i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k]

  for i in range(nq):
    lo, full_lo, full_hi, hi = attention._key_ranges(c, i, nk)
    assert lo <= full_lo <= full_hi <= hi
    for j in range(nk):
      if block(i, j).any():
        assert lo <= j < hi, (i, j)
      if full_lo <= j < full_hi:
        assert block(i, j).all(), (i, j)
      elif lo <= j < hi:
        assert not block(i, j).all(), (i, j)
  for j in range(nk):
    lo, full_lo, full_hi, hi = (int(x) for x in attention._query_ranges(c, j, nq, nk))
    assert lo <= full_lo <= full_hi <= hi
    for i in range(nq):
      if block(i, j)[:max(0, q_len - i * block_q)].any():   # rows past q_len add nothing
        assert lo <= i < hi, (i, j)
      if full_lo <= i < full_hi:
        assert block(i, j).all(), (i, j)
      elif lo <= i < hi:
        assert not block(i, j).all(), (i, j)


@pytest.mark.skipif(current_test_backend() != "triton",
                    reason="per-pass blocks come from the launch table, read on Triton only")
@pytest.mark.parametrize("kwargs", [dict(), dict(causal=True), dict(causal=True, window=20)],
                         ids=["plain", "causal", "window"])
def test_passes_with_different_blocks(kwargs):
  # Every pass pads to whole blocks of every pass: the forward's last key block and
  # the dk/dv pass's last query block lie wholly in padding and are skipped.
  from pallet.ops import launch_table
  q, k, v = _qkv(1, 4, 2, 40, 70, 16, jnp.float32)
  sections = {"fwd": dict(block_q=16, block_k=32), "dq": dict(block_q=32, block_k=16),
              "dkv": dict(block_q=16, block_k=64)}
  with launch_table.overriding("flash_attention", sections):
    check_op(ops.flash_attention, ops.attention_reference, (q, k, v), argnums=(0, 1, 2),
             **kwargs)


def test_windowed_flash_attention_runs_under_checking_mode(monkeypatch):
  """PALLET_CHECKS=1 on a sliding-window attention: the checked kernel's loop bounds
  take a select of intervals of different shapes (a crash in bounded_loops once)."""
  monkeypatch.setenv("PALLET_CHECKS", "1")
  q, k, v = _qkv(2, 4, 1, 37, 37, 16, jnp.float32)
  w = random_array(q.shape)
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * w)
  kernel = loss(lambda q, k, v: ops.flash_attention(q, k, v, window=12, block_q=16, block_k=16))
  reference = loss(lambda q, k, v: ops.attention_reference(q, k, v, window=12))
  got = jax.grad(kernel, argnums=(0, 1, 2))(q, k, v)
  assert_close(got, jax.grad(reference, argnums=(0, 1, 2))(q, k, v), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("t,s", [(37, 37), (20, 45), (400, 400)])
def test_default_blocks_on_the_cpu(t, s):
  """On the CPU a sequence of up to 384 rows is one block, a longer one 128-row blocks
  (padded): both agree with the reference, forward and VJP, causal and not."""
  from pallet.ops import attention
  expected = [n if n <= 384 else 128 for n in (t, s)]
  assert [attention.cpu_block(t), attention.cpu_block(s)] == expected
  q, k, v = _qkv(1, 2, 1, t, s, 16, jnp.float32)
  for causal in (False, True):
    check_op(ops.flash_attention, ops.attention_reference, (q, k, v), argnums=(0, 1, 2),
             causal=causal)
