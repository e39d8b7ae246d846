"""pallet.ops ragged dot / grouped matmul (forward, and gradients w.r.t. lhs and rhs)
against `jax.lax.ragged_dot`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers import random_array
from pallet import PalletError, ops
from ops_testing import DTYPES, check_op, on_test_backend, assert_close_scaled

DTYPE_IDS = lambda d: jnp.dtype(d).name  # noqa: E731


def _check(m, k, n, sizes, dtype=jnp.float32, blocks=(None, None, None), **kwargs):
  lhs, rhs = random_array((m, k), dtype), random_array((len(sizes), k, n), dtype)
  check_op(ops.ragged_dot, ops.ragged_dot_reference,
           (lhs, rhs, jnp.asarray(sizes, jnp.int32)), argnums=(0, 1),
           blocks=dict(block_m=blocks[0], block_k=blocks[1], block_n=blocks[2]), **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m,k,n,sizes,blocks", [
    # empty groups, a sum below m, tiles dividing none of m, k, n
    (37, 20, 12, [5, 0, 13, 7, 3], (8, 8, 5)),
    # one group
    (64, 32, 16, [64], (None, None, None)),
    # groups that are no multiple of the row tile, first and middle groups empty
    (100, 48, 40, [0, 30, 37, 0, 20, 13], (16, 16, 16)),
    # default tiles, rows no multiple of them
    (300, 70, 40, [120, 0, 90, 41], (None, None, None)),
    # no rows in any group: all zeros (and zero gradients)
    (20, 8, 8, [0, 0], (8, 8, 8)),
])
def test_ragged_dot(m, k, n, sizes, blocks, dtype):
  _check(m, k, n, sizes, dtype, blocks)


def test_preferred_element_type():
  _check(40, 24, 16, [10, 25, 5], jnp.bfloat16, (16, 8, 8),
         preferred_element_type=jnp.float32)


def test_mixed_input_dtypes_promote_as_lax_does():
  lhs, rhs = random_array((30, 16), jnp.bfloat16), random_array((2, 16, 8))
  check_op(ops.ragged_dot, ops.ragged_dot_reference,
           (lhs, rhs, jnp.asarray([12, 18], jnp.int32)), argnums=(0, 1),
           blocks=dict(block_m=8))


def test_sizes_summing_past_m_are_clipped_as_lax_ragged_dot_does():
  _check(40, 16, 8, [20, 30, 10], blocks=(16, 16, 8))


def test_grouped_matmul_is_ragged_dot_under_jit():
  assert ops.grouped_matmul is ops.ragged_dot
  lhs, rhs = random_array((50, 16)), random_array((3, 16, 8))
  sizes = jnp.asarray([20, 0, 25], jnp.int32)
  with on_test_backend():
    out = jax.jit(lambda a, b, s: ops.grouped_matmul(a, b, s, block_m=16))(lhs, rhs, sizes)
  assert_close_scaled(out, ops.ragged_dot_reference(lhs, rhs, sizes))
  assert float(jnp.abs(out[45:]).max()) == 0.0     # rows past the groups


def test_group_sizes_get_no_gradient_as_in_lax():
  lhs, rhs = random_array((24, 8)), random_array((2, 8, 4))
  sizes = jnp.asarray([10, 14], jnp.int32)
  with on_test_backend():
    out, pullback = jax.vjp(ops.ragged_dot, lhs, rhs, sizes)
    d_sizes = pullback(random_array(out.shape))[2]
  assert d_sizes.dtype == jax.dtypes.float0 and d_sizes.shape == (2,)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 6), min_size=4, max_size=4), st.integers(0, 8))
def test_random_group_sizes(cuts, tail):
  # 4 groups over 30 rows, any split (empty groups, a tail of rows in no group); one
  # shape, so the kernels trace once and only the sizes change.
  bounds = np.minimum(np.cumsum(cuts) * (30 - tail) // max(1, sum(cuts)), 30 - tail)
  sizes = np.diff(np.concatenate([[0], bounds]))
  _check(30, 12, 8, sizes.tolist(), blocks=(8, 8, 8))


def test_errors_name_the_op_and_argument():
  lhs, rhs = random_array((8, 4)), random_array((2, 4, 3))
  sizes = jnp.asarray([3, 5], jnp.int32)
  with pytest.raises(PalletError, match=r"ragged_dot: rhs \(2, 5, 3\) does not fit lhs"):
    ops.ragged_dot(lhs, random_array((2, 5, 3)), sizes)
  with pytest.raises(PalletError, match=r"expected lhs \(m, k\) and rhs \(num_groups, k, n\)"):
    ops.ragged_dot(lhs[None], rhs, sizes)
  with pytest.raises(PalletError, match="group_sizes must be integers, got float32"):
    ops.ragged_dot(lhs, rhs, sizes.astype(jnp.float32))
  with pytest.raises(PalletError, match=r"group_sizes must have shape \(2,\)"):
    ops.ragged_dot(lhs, rhs, jnp.asarray([8], jnp.int32))
  with pytest.raises(PalletError, match="lhs must be a floating-point array, got int32"):
    ops.ragged_dot(jnp.ones((8, 4), jnp.int32), rhs, sizes)
  with pytest.raises(PalletError, match="block_m must be a positive int"):
    ops.ragged_dot(lhs, rhs, sizes, block_m=-4)
  with pytest.raises(PalletError, match="preferred_element_type must be a floating-point"):
    ops.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.int32)


def _module():
  import sys
  return sys.modules["pallet.ops.ragged_dot"]


@pytest.mark.parametrize("sizes,m,block_m", [([5, 0, 13, 7, 3], 37, 8), ([0, 30, 37, 0, 20, 13], 100, 16),
                                             ([20, 30, 10], 40, 16), ([64], 64, 64), ([0, 0], 20, 8),
                                             ([129, 1, 0, 126], 256, 128)])
def test_tile_table_cuts_each_group_into_its_own_tiles(sizes, m, block_m):
  rd = _module()
  ends = np.minimum(np.cumsum(sizes), m)
  offsets = np.concatenate([[0], ends])
  table = np.asarray(rd.tile_table(jnp.asarray(offsets, jnp.int32), m, block_m))
  assert table.shape == (-(-m // block_m) + len(sizes), 3)
  owner = np.full(m, -2)
  for group, first, end in table:
    assert end - first <= block_m
    if end <= first:
      continue
    assert (owner[first:end] == -2).all(), "a row in two tiles"
    owner[first:end] = group
  expected = np.full(m, -1)          # rows after the last group: tiles of zeros
  for g in range(len(sizes)):
    expected[offsets[g]:offsets[g + 1]] = g
  np.testing.assert_array_equal(owner, expected)
  # rows computed: each group's rows rounded up to whole tiles, never another group's
  live = table[table[:, 2] > table[:, 1]]
  groups = live[live[:, 0] >= 0]
  assert len(groups) == sum(-(-(e - s) // block_m) for s, e in zip(offsets[:-1], offsets[1:]))


@pytest.mark.parametrize("m,k,n,sizes,blocks", [(37, 20, 12, [5, 0, 13, 7, 3], (8, 8, 5)),
                                                (100, 48, 40, [0, 30, 37, 0, 20, 13], (16, 16, 16)),
                                                (40, 16, 8, [20, 30, 10], (16, 16, 8))])
def test_tile_table_kernels_on_the_backend_under_test(m, k, n, sizes, blocks):
  # The GPU form of gmm (a tile table, masked stores) forced on whichever backend runs
  # the tests, forward and both gradients against lax.ragged_dot.
  rd = _module()
  lhs, rhs = random_array((m, k)), random_array((len(sizes), k, n))
  group_sizes = jnp.asarray(sizes, jnp.int32)
  offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                             jnp.clip(jnp.cumsum(group_sizes), 0, m)])
  tiles = rd._Tiles(*blocks)
  config = rd._Config(jnp.dtype(jnp.float32), tiles, tiles, tiles, tile_table=True)
  cot = random_array((m, n))
  with on_test_backend():
    out, pull = jax.vjp(lambda a, b: rd._ragged_dot(a, b, offsets, config), lhs, rhs)
    grads = pull(cot)
  expected, expected_pull = jax.vjp(
      lambda a, b: ops.ragged_dot_reference(a, b, group_sizes), lhs, rhs)
  assert_close_scaled((out, *grads), (expected, *expected_pull(cot)))
