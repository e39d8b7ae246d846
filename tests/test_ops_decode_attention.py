"""pallet.ops decode attention (one query per sequence, per-sequence KV lengths, GQA)
against its jax.numpy reference."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from helpers import random_array
from pallet import PalletError, ops
from ops_testing import DTYPES, check_op

DTYPE_IDS = lambda d: jnp.dtype(d).name  # noqa: E731


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads,kv_heads,max_len,block_k", [(8, 2, 100, 32), (4, 1, 64, 16),
                                                            (2, 2, 37, 64)])
def test_decode_attention(heads, kv_heads, max_len, block_k, dtype):
  b, d = 3, 32
  q = random_array((b, heads, d), dtype)
  k, v = random_array((b, kv_heads, max_len, d), dtype), random_array((b, kv_heads, max_len, d),
                                                                       dtype)
  lengths = jnp.asarray([max_len, max_len // 3, 0], jnp.int32)
  check_op(ops.decode_attention, ops.decode_attention_reference, (q, k, v, lengths),
           grad=False, blocks=dict(block_k=block_k))


def test_errors_name_the_op_and_argument():
  q, k = random_array((2, 3, 16)), random_array((2, 2, 8, 16))
  with pytest.raises(PalletError, match="decode_attention: k .* heads must be a multiple"):
    ops.decode_attention(q, k, k, jnp.zeros(2, jnp.int32))
  with pytest.raises(PalletError, match=r"lengths must be \(2,\) ints"):
    ops.decode_attention(q[:, :2], k, k, jnp.zeros(2))
