"""Decode attention: one new query token per sequence against a KV cache filled up to
a per-sequence length, with grouped-query heads.

q (batch, heads, d); k, v (batch, kv_heads, max_len, d); lengths (batch,) ints: keys at
positions >= lengths[b] are ignored. One program per (batch, kv head, split) takes the
group's heads // kv_heads query rows together (so the scores are a matrix product,
padded to a tensor-core tile on a GPU) and loops over its share of the key blocks
below the sequence's length (online softmax; only the block holding the last key is
masked); the splits are combined by a second kernel (flash decoding, see
pallet.ops.flash_decoding). Reads K and V once: 4 * heads * length * d FLOPs and
2 * kv_heads * length * d * itemsize bytes per sequence.
Inference only: no VJP.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

import pallet as pl
from pallet.ops import flash_decoding, launch_table
from pallet.ops._common import (F32, cdiv, check_block, check_float, fail,
                                online_softmax_start, online_softmax_step)

__all__ = ["decode_attention", "decode_attention_reference"]


def decode_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                               scale: float | None = None) -> jax.Array:
  """jax.numpy twin (float32 math, q's dtype out; 0 for a sequence of length 0)."""
  b, h, d = q.shape
  groups = h // k.shape[1]
  scale = 1.0 / math.sqrt(d) if scale is None else scale
  kf = jnp.repeat(k.astype(F32), groups, axis=1)
  vf = jnp.repeat(v.astype(F32), groups, axis=1)
  s = jnp.einsum("bhd,bhsd->bhs", q.astype(F32), kf, precision=lax.Precision.HIGHEST) * scale
  valid = jnp.arange(k.shape[2])[None, None, :] < lengths[:, None, None]
  p = jnp.where(valid, jnp.exp(s - jnp.max(jnp.where(valid, s, -jnp.inf), -1, keepdims=True)), 0)
  l = jnp.sum(p, -1, keepdims=True)
  o = jnp.einsum("bhs,bhsd->bhd", p, vf, precision=lax.Precision.HIGHEST)
  return (o / jnp.where(l == 0, 1.0, l)).astype(q.dtype)


def _kernel(scale: float, block_k: int, max_len: int, splits: int):
  def kernel(len_ref, q_ref, k_ref, v_ref, *out_refs):
    length = jnp.minimum(len_ref[0], max_len)
    q = q_ref[...]
    rows, d = q.shape

    def step(masked):
      def body(j, carry):
        keys = pl.ds(j * block_k, block_k)
        s = lax.dot_general(q, k_ref[keys, :], (((1,), (1,)), ((), ())),
                            preferred_element_type=F32) * scale
        if masked:
          pos = j * block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)
          s = jnp.where(pos < length, s, -jnp.inf)
        return online_softmax_step(carry, s, v_ref[keys, :])
      return body

    first, last = flash_decoding.split_blocks((length + block_k - 1) // block_k, splits)
    carry = flash_decoding.masked_blocks(first, last, length // block_k, step,
                                         online_softmax_start(rows, d))
    flash_decoding.write(out_refs, carry, splits)

  return kernel


# Keys per loop step on the CPU, where the cache is not one block (see decode_attention).
CPU_BLOCK_K = 256


def _one_block_kernel(scale: float, max_len: int):
  """The whole cache as one masked key block, without a loop: on the CPU, a loop
  whose trip count is a per-sequence length runs batched over the vectorized
  programs, its key blocks gathered at per-program offsets (docs/performance.md,
  issue 26); one block is the plain masked softmax, as jax.numpy computes it."""
  def kernel(len_ref, q_ref, k_ref, v_ref, o_ref):
    length = jnp.minimum(len_ref[0], max_len)
    q = q_ref[...]
    s = lax.dot_general(q, k_ref[...], (((1,), (1,)), ((), ())),
                        preferred_element_type=F32) * scale
    s = jnp.where(lax.broadcasted_iota(jnp.int32, s.shape, 1) < length, s, -jnp.inf)
    m = jnp.max(s, axis=1)
    p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m)[:, None])   # 0 where masked
    acc = jnp.dot(p.astype(v_ref.dtype), v_ref[...], preferred_element_type=F32)
    flash_decoding.write([o_ref], (m, jnp.sum(p, axis=1), acc), 1)
  return kernel


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                     scale: float | None = None, block_k: int | None = None,
                     k_splits: int | None = None) -> jax.Array:
  """Attention of one query per sequence over its first `lengths[b]` cached keys.

  q (batch, heads, d); k, v (batch, kv_heads, max_len, d), heads a multiple of
  kv_heads; lengths (batch,) ints. `block_k` keys per loop step (on Triton from the
  GPU's launch table, pallet.ops.launch_table; on the CPU by default the whole cache
  as one masked block, or 256-key blocks when the longest sequence fills less than
  half of the cache, chosen at run time). `k_splits`:
  programs that share one sequence's keys, their partial softmaxes combined by a
  second kernel (default: 1 on the CPU; on Triton enough to fill the GPU, see
  pallet.ops.flash_decoding). Default scale 1/sqrt(d).
  """
  op = "decode_attention"
  for name, x in (("q", q), ("k", k), ("v", v)):
    check_float(op, name, x)
  if q.ndim != 3 or k.ndim != 4 or k.shape != v.shape:
    raise fail(op, f"expected q (batch, heads, d) and k, v (batch, kv_heads, max_len, d), "
                   f"got {q.shape}, {k.shape}, {v.shape}")
  b, h, d = q.shape
  if k.shape[0] != b or k.shape[3] != d or h % k.shape[1]:
    raise fail(op, f"k {k.shape} does not fit q {q.shape}: batch and head_dim must match "
                   f"and heads must be a multiple of kv_heads")
  if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise fail(op, f"lengths must be ({b},) ints, got {lengths.shape} {lengths.dtype}")
  hkv, max_len = k.shape[1], k.shape[2]
  groups = h // hkv
  if max_len == 0:   # an empty cache attends to nothing
    return jnp.zeros(q.shape, q.dtype)
  launch = launch_table.lookup(op, head_dim=d, groups=groups,
                               itemsize=jnp.dtype(q.dtype).itemsize)
  scale = float(1.0 / math.sqrt(d) if scale is None else scale)
  if block_k is not None:
    check_block(op, "block_k", block_k)
  if k_splits is not None:
    check_block(op, "k_splits", k_splits)
  run = lambda block: _launch(q, k, v, lengths, scale, block, k_splits, launch,  # noqa: E731
                              explicit=block_k is not None)
  if block_k is not None or launch.on_gpu or max_len <= CPU_BLOCK_K:
    return run(block_k or launch.get("fwd", "block_k", CPU_BLOCK_K))
  # The CPU default: the whole cache as one masked block unless the longest sequence
  # fills less than half of it (then its key blocks, in a loop).
  longest = jnp.max(jnp.minimum(lengths, max_len))
  return lax.cond(2 * longest >= max_len, lambda: run(max_len), lambda: run(CPU_BLOCK_K))


def _launch(q, k, v, lengths, scale: float, block_k: int, k_splits: int | None,
            launch: launch_table.Launch, explicit: bool) -> jax.Array:
  """The decoding kernel (one masked block on the CPU when `block_k` covers the
  cache) and, with several splits, the combine."""
  b, h, d = q.shape
  hkv, max_len = k.shape[1], k.shape[2]
  groups = h // hkv
  params = launch.compiler_params("fwd", explicit=explicit)
  if k_splits is None:
    k_splits = flash_decoding.split_count(launch, b * hkv, max_len)
  splits = min(k_splits, cdiv(max_len, block_k))
  padded = cdiv(max_len, block_k) * block_k
  if padded != max_len:
    widths = ((0, 0), (0, 0), (0, padded - max_len), (0, 0))
    k, v = jnp.pad(k, widths), jnp.pad(v, widths)
  rows = flash_decoding.query_rows(launch, groups)
  qg = flash_decoding.pad_rows(q.reshape(b, hkv, groups, d), rows)
  grid = (b, hkv, splits) if splits > 1 else (b, hkv)
  kv_spec = pl.BlockSpec((None, None, padded, d), lambda bi, hi, *_: (bi, hi, 0, 0))
  q_spec = pl.BlockSpec((None, None, rows, d), lambda bi, hi, *_: (bi, hi, 0, 0))
  out_shape, out_specs = flash_decoding.outputs(b, hkv, splits, rows, d, q.dtype)
  one_block = padded == block_k and not launch.on_gpu
  out = pl.pallas_call(
      _one_block_kernel(scale, max_len) if one_block else
      _kernel(scale, block_k, max_len, splits),
      out_shape=out_shape, grid=grid,
      in_specs=[pl.BlockSpec((1,), lambda bi, *_: (bi,)), q_spec, kv_spec, kv_spec],
      out_specs=out_specs, name="decode_attention",
      compiler_params=params)(lengths.astype(jnp.int32), qg, k, v)
  if splits > 1:
    out = flash_decoding.combine(*out, q.dtype, launch.compiler_params("combine"))
  return out[:, :, :groups].reshape(b, h, d)
