"""pallet.ops paged attention (one query per sequence, KV pages addressed through block
tables, per-sequence lengths, GQA) against its jax.numpy reference."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_array
from pallet import PalletError, ops
from ops_testing import DTYPES, check_op, on_test_backend

DTYPE_IDS = lambda d: jnp.dtype(d).name  # noqa: E731


def _problem(heads, kv_heads, page_size, pages_per_sequence, dtype, batch=3, d=32, spare=5):
  """Random q and pages; each sequence's pages are distinct and in shuffled order, with
  `spare` pages that no sequence uses."""
  total = batch * pages_per_sequence + spare
  q = random_array((batch, heads, d), dtype)
  k = random_array((kv_heads, total, page_size, d), dtype)
  v = random_array((kv_heads, total, page_size, d), dtype)
  order = np.random.default_rng(total).permutation(total)[:batch * pages_per_sequence]
  return q, k, v, jnp.asarray(order.reshape(batch, pages_per_sequence), jnp.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads,kv_heads,page_size,pages_per_sequence,block,splits", [
    (8, 2, 4, 10, 3, 2),          # GQA; 3 pages per step do not divide 10; 2 splits of 2 steps
    (4, 1, 16, 4, None, None),    # MQA, default block and splits
    (2, 2, 8, 5, 2, 1),           # MHA, one program per sequence
    (6, 2, 6, 7, 2, 3),           # group, page size, 12-token block not powers of two; 3 splits
])
def test_paged_attention(heads, kv_heads, page_size, pages_per_sequence, block, splits, dtype):
  q, k, v, table = _problem(heads, kv_heads, page_size, pages_per_sequence, dtype, batch=4)
  capacity = page_size * pages_per_sequence
  # full, a partial page, empty, one token
  lengths = jnp.asarray([capacity, capacity // 3 + 1, 0, 1], jnp.int32)
  check_op(ops.paged_attention, ops.paged_attention_reference, (q, k, v, lengths, table),
           grad=False, blocks=dict(pages_per_compute_block=block, k_splits=splits))


def test_softcap_scale_and_lengths_past_the_table():
  q, k, v, table = _problem(4, 2, 4, 6, jnp.float32)
  lengths = jnp.asarray([100, 7, 24], jnp.int32)   # 100 > 24 tokens: clamped to the table
  check_op(ops.paged_attention, ops.paged_attention_reference, (q, k, v, lengths, table),
           grad=False, blocks=dict(pages_per_compute_block=1, k_splits=4), softcap=2.0,
           scale=0.3)


def test_unused_entries_are_ignored_and_bad_pages_give_nan():
  q, k, v, table = _problem(4, 2, 4, 6, jnp.float32)
  lengths = jnp.asarray([9, 24, 5], jnp.int32)
  table = table.at[0, 3:].set(-1)       # sequence 0 uses pages 0-2 only: padding ignored
  table = table.at[1, 5].set(10 ** 6)   # sequence 1 uses all six: no such page
  table = table.at[2, 1].set(-7)        # sequence 2 uses entries 0 and 1
  with on_test_backend():
    out = np.asarray(ops.paged_attention(q, k, v, lengths, table, pages_per_compute_block=2))
  expected = np.asarray(ops.paged_attention_reference(q, k, v, lengths, table))
  assert np.isnan(out[1:]).all() and np.isnan(expected[1:]).all()
  np.testing.assert_allclose(out[0], expected[0], rtol=1e-5, atol=1e-5)
  assert np.isfinite(out[0]).all()


def test_errors_name_the_op_and_argument():
  q, k = random_array((2, 3, 16)), random_array((2, 5, 4, 16))
  lengths, table = jnp.zeros(2, jnp.int32), jnp.zeros((2, 3), jnp.int32)
  with pytest.raises(PalletError, match="paged_attention: k_pages .* heads must be a multiple"):
    ops.paged_attention(q, k, k, lengths, table)
  q = q[:, :2]
  with pytest.raises(PalletError, match=r"paged_attention: lengths must be \(2,\) ints"):
    ops.paged_attention(q, k, k, jnp.zeros(2), table)
  with pytest.raises(PalletError, match=r"page_indices must be \(2, pages_per_sequence >= 1\)"):
    ops.paged_attention(q, k, k, lengths, jnp.zeros((3, 3), jnp.int32))
  with pytest.raises(PalletError, match=r"page_indices must be .* got \(2, 0\) int32"):
    ops.paged_attention(q, k, k, lengths, jnp.zeros((2, 0), jnp.int32))
  with pytest.raises(PalletError, match=r"page_indices must be .* ints, got \(2, 3\) float32"):
    ops.paged_attention(q, k, k, lengths, jnp.zeros((2, 3)))
  with pytest.raises(PalletError, match="v_pages must be a floating-point array"):
    ops.paged_attention(q, k, jnp.zeros(k.shape, jnp.int32), lengths, table)
  with pytest.raises(PalletError, match=r"of one shape, got .*\(2, 5, 4, 8\)"):
    ops.paged_attention(q, k, k[..., :8], lengths, table)
  with pytest.raises(PalletError, match="softcap must be positive"):
    ops.paged_attention(q, k, k, lengths, table, softcap=0.0)
  with pytest.raises(PalletError, match="pages_per_compute_block must be a positive int"):
    ops.paged_attention(q, k, k, lengths, table, pages_per_compute_block=0)
  with pytest.raises(PalletError, match="k_splits must be a positive int"):
    ops.paged_attention(q, k, k, lengths, table, k_splits=1.5)


@pytest.mark.cpu_only
def test_tuned_paged_attention_matches_the_reference(tmp_path, monkeypatch):
  from pallet.ops import tuned
  monkeypatch.setenv("PALLET_CACHE_DIR", str(tmp_path))
  q, k, v, table = _problem(4, 2, 4, 6, jnp.float32)
  lengths = jnp.asarray([24, 10, 1], jnp.int32)
  out = tuned.paged_attention(q, k, v, lengths, table)
  np.testing.assert_allclose(out, ops.paged_attention_reference(q, k, v, lengths, table),
                             rtol=1e-5, atol=1e-5)
  assert tuned.paged_attention.last_choice.source == "tuned"
