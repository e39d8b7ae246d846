"""pallet.ops decode attention (one query per sequence, per-sequence KV lengths, GQA)
against its jax.numpy reference, and its flash-decoding plan on a GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallet as pl
from helpers import current_test_backend, random_array
from pallet import PalletError, ops
from pallet.ops import flash_decoding, launch_table
from pallet.pallas_call import pallas_call_p
from ops_testing import DTYPES, check_op

DTYPE_IDS = lambda d: jnp.dtype(d).name  # noqa: E731


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads,kv_heads,max_len,block_k,splits", [
    (8, 2, 100, 32, None), (4, 1, 64, 16, 3), (2, 2, 37, 64, None), (8, 2, 100, 16, 4),
    (6, 2, 50, 8, 2)])
def test_decode_attention(heads, kv_heads, max_len, block_k, splits, dtype):
  b, d = 4, 32
  q = random_array((b, heads, d), dtype)
  k, v = random_array((b, kv_heads, max_len, d), dtype), random_array((b, kv_heads, max_len, d),
                                                                       dtype)
  # full, partial, empty and a single key
  lengths = jnp.asarray([max_len, max_len // 3, 0, 1], jnp.int32)
  check_op(ops.decode_attention, ops.decode_attention_reference, (q, k, v, lengths),
           grad=False, blocks=dict(block_k=block_k, k_splits=splits))


def test_more_splits_than_a_sequence_has_blocks_and_an_empty_cache():
  q = random_array((2, 4, 16))
  k, v = random_array((2, 2, 40, 16)), random_array((2, 2, 40, 16))
  lengths = jnp.asarray([40, 9], jnp.int32)    # 9 keys: one block of 16, split 5 ways
  check_op(ops.decode_attention, ops.decode_attention_reference, (q, k, v, lengths),
           grad=False, blocks=dict(block_k=16, k_splits=5))
  out = ops.decode_attention(q, k[:, :, :0], v[:, :, :0], jnp.zeros(2, jnp.int32))
  assert out.shape == q.shape and float(jnp.abs(out).max()) == 0.0


@pytest.mark.parametrize("lengths", [[600, 301, 0, 1], [250, 7, 0, 299]],
                         ids=["one_block", "key_blocks"])
def test_cpu_default_runs_either_form_by_the_longest_sequence(lengths):
  """The CPU default picks at run time: the whole cache as one masked block when the
  longest sequence fills at least half of it, else 256-key blocks in a loop."""
  q = random_array((4, 8, 32))
  k, v = random_array((4, 2, 600, 32)), random_array((4, 2, 600, 32))
  check_op(ops.decode_attention, ops.decode_attention_reference,
           (q, k, v, jnp.asarray(lengths, jnp.int32)), grad=False)


def _kernel_loops(fn, *args) -> list[bool]:
  """Per decode_attention kernel fn(*args) launches: whether its body has a loop."""
  def has_while(jaxpr):
    return any(eqn.primitive.name == "while" or any(
        has_while(sub.jaxpr if hasattr(sub, "jaxpr") else sub)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params)) for eqn in jaxpr.eqns)

  found = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive is pallas_call_p and eqn.params["kernel"].name == "decode_attention":
        found.append(has_while(eqn.params["kernel"].jaxpr.jaxpr))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub.jaxpr if hasattr(sub, "jaxpr") else sub)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.skipif(current_test_backend() != "xla", reason="the CPU/XLA backend's form")
def test_cpu_runs_a_cache_of_one_block_without_a_loop():
  """Batched over the programs, a loop with per-sequence trip counts gathers its key
  blocks element by element on XLA:CPU (issue 26): one block needs no loop. The
  default compiles both forms and picks one at run time."""
  q = random_array((2, 4, 16))
  k = random_array((2, 2, 600, 16))
  lengths = jnp.asarray([600, 5], jnp.int32)
  assert _kernel_loops(lambda *a: ops.decode_attention(*a, block_k=600), q, k, k,
                       lengths) == [False]
  assert _kernel_loops(lambda *a: ops.decode_attention(*a, block_k=64), q, k, k,
                       lengths) == [True]
  assert sorted(_kernel_loops(ops.decode_attention, q, k, k, lengths)) == [False, True]
  assert _kernel_loops(ops.decode_attention, q, k[:, :, :200], k[:, :, :200],
                       lengths) == [False]


def _launched(fn, *args):
  """(kernel name, grid) of each pallas_call fn(*args) launches (traced only)."""
  found = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive is pallas_call_p:
        kd = eqn.params["kernel"]
        found.append((kd.name, kd.grid_mapping.grid))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub.jaxpr if hasattr(sub, "jaxpr") else sub)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.parametrize("device,splits", [("sm_90", 3), ("sm_80", 2), ("gfx942", 5)])
def test_gpu_plan_splits_the_cache_to_fill_the_gpu(device, splits):
  # b32 h32/8 s8192: 256 (sequence, kv head) pairs; 4 programs per SM of the device's
  # reference part (132, 108, 304) need 3, 2, 5 splits; then a combine kernel.
  q = jax.ShapeDtypeStruct((32, 32, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((32, 8, 8192, 128), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((32,), jnp.int32)
  with pl.default_backend("triton"), launch_table.using_device(device):
    launched = _launched(ops.decode_attention, q, kv, kv, lengths)
  assert launched == [("decode_attention", (32, 8, splits)),
                      ("flash_decoding_combine", (32, 8))]


def test_split_count_fills_the_gpu_but_keeps_splits_long():
  with pl.default_backend("triton"), launch_table.using_device("sm_90"):
    launch = launch_table.lookup("decode_attention", head_dim=128, groups=4, itemsize=2)
    assert launch_table.multiprocessors() == 132
    per_sm, least = launch.get("fwd", "programs_per_sm"), launch.get("fwd", "split_keys")
    target = per_sm * 132
    assert flash_decoding.split_count(launch, 8, 1 << 20) == -(-target // 8)
    assert flash_decoding.split_count(launch, 8, 3 * least) == 3     # splits stay long
    assert flash_decoding.split_count(launch, 10 * target, 1 << 20) == 1
  with pl.default_backend("xla"):   # the CPU runs one program per pair
    cpu = launch_table.lookup("decode_attention", head_dim=128, groups=4, itemsize=2)
    assert flash_decoding.split_count(cpu, 8, 1 << 20) == 1


def test_errors_name_the_op_and_argument():
  q, k = random_array((2, 3, 16)), random_array((2, 2, 8, 16))
  with pytest.raises(PalletError, match="decode_attention: k .* heads must be a multiple"):
    ops.decode_attention(q, k, k, jnp.zeros(2, jnp.int32))
  with pytest.raises(PalletError, match=r"lengths must be \(2,\) ints"):
    ops.decode_attention(q[:, :2], k, k, jnp.zeros(2))
  with pytest.raises(PalletError, match="k_splits must be a positive int"):
    ops.decode_attention(q[:, :2], k, k, jnp.zeros(2, jnp.int32), k_splits=0)
