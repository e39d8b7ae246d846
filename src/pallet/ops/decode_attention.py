"""Decode attention: one new query token per sequence against a KV cache filled up to
a per-sequence length, with grouped-query heads.

q (batch, heads, d); k, v (batch, kv_heads, max_len, d); lengths (batch,) ints: keys at
positions >= lengths[b] are ignored. One program per (batch, kv head) takes the
group's heads // kv_heads query rows together (so the scores are a matrix product)
and loops over only the key blocks below the sequence's length (online softmax).
Inference only: no VJP.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

import pallet as pl
from pallet.ops import launch_table
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


def _kernel(scale: float, block_k: int, max_len: int):
  def kernel(len_ref, q_ref, k_ref, v_ref, o_ref):
    length = jnp.minimum(len_ref[0], max_len)
    q = q_ref[...]
    g, d = q.shape

    def step(j, carry):
      keys = pl.ds(j * block_k, block_k)
      s = lax.dot_general(q, k_ref[keys, :], (((1,), (1,)), ((), ())),
                          preferred_element_type=F32) * scale
      pos = j * block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)
      s = jnp.where(pos < length, s, -jnp.inf)
      return online_softmax_step(carry, s, v_ref[keys, :])

    _, l, acc = lax.fori_loop(0, (length + block_k - 1) // block_k, step,
                              online_softmax_start(g, d))
    o_ref[...] = (acc / jnp.where(l == 0, 1.0, l)[:, None]).astype(o_ref.dtype)

  return kernel


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                     scale: float | None = None, block_k: int | None = None) -> jax.Array:
  """Attention of one query per sequence over its first `lengths[b]` cached keys.

  q (batch, heads, d); k, v (batch, kv_heads, max_len, d), heads a multiple of
  kv_heads; lengths (batch,) ints. `block_k` keys per loop step (default 256 on the
  CPU; on Triton from the GPU's launch table, pallet.ops.launch_table). Default scale
  1/sqrt(d).
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
  launch = launch_table.lookup(op, head_dim=d, groups=groups,
                               itemsize=jnp.dtype(q.dtype).itemsize)
  params = launch.compiler_params("fwd", explicit=block_k is not None)
  block_k = block_k or launch.get("fwd", "block_k", 256)
  check_block(op, "block_k", block_k)
  padded = cdiv(max_len, block_k) * block_k
  if padded != max_len:
    widths = ((0, 0), (0, 0), (0, padded - max_len), (0, 0))
    k, v = jnp.pad(k, widths), jnp.pad(v, widths)
  qg = q.reshape(b, hkv, groups, d)
  kv_spec = pl.BlockSpec((None, None, padded, d), lambda bi, hi: (bi, hi, 0, 0))
  q_spec = pl.BlockSpec((None, None, groups, d), lambda bi, hi: (bi, hi, 0, 0))
  out = pl.pallas_call(
      _kernel(float(1.0 / math.sqrt(d) if scale is None else scale), block_k, max_len),
      out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype), grid=(b, hkv),
      in_specs=[pl.BlockSpec((1,), lambda bi, hi: (bi,)), q_spec, kv_spec, kv_spec],
      out_specs=q_spec, name="decode_attention",
      compiler_params=params)(lengths.astype(jnp.int32), qg, k, v)
  return out.reshape(b, h, d)
