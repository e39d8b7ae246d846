"""Plain jax.numpy references for the ops of JAX's Pallas kernel library.

Written here from the ops' documented meaning (never from the kernels or their own
`*_reference` functions), so that tests/test_jax_ops.py compares every kernel with
an independent computation. Everything is computed in float32 at full precision.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

HIGHEST = jax.lax.Precision.HIGHEST
# A finite "minus infinity" for masked logits: rows that keep at least one entry
# are unaffected, and nothing overflows.
_MASKED = -1e30


def _f32(x: jax.Array) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


# ------------------------------------------------------------------ row-wise ops
def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
  """exp(x - max) / sum(exp(x - max)) along `axis`, in the input dtype."""
  y = _f32(x)
  e = jnp.exp(y - jnp.max(y, axis=axis, keepdims=True))
  return (e / jnp.sum(e, axis=axis, keepdims=True)).astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array,
               eps: float = 1e-5) -> jax.Array:
  """(x - mean) / sqrt(var + eps) * weight + bias over the last axis."""
  y = _f32(x)
  mean = jnp.mean(y, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(y - mean), axis=-1, keepdims=True)
  out = (y - mean) / jnp.sqrt(var + eps) * _f32(weight) + _f32(bias)
  return out.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, bias: jax.Array,
             eps: float = 1e-5) -> jax.Array:
  """x / sqrt(mean(x**2) + eps) * weight + bias over the last axis."""
  y = _f32(x)
  rms = jnp.sqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + eps)
  return (y / rms * _f32(weight) + _f32(bias)).astype(x.dtype)


# ------------------------------------------------------------------ masks
def causal_mask(q_len: int, kv_len: int, offset: int = 0) -> jax.Array:
  """bool [q_len, kv_len]: query i sees keys j <= i + offset."""
  return jnp.arange(q_len)[:, None] + offset >= jnp.arange(kv_len)[None, :]


def local_mask(q_len: int, kv_len: int, left: int | None, right: int | None,
               offset: int = 0) -> jax.Array:
  """bool [q_len, kv_len]: query i sees keys in [i + offset - left, i + offset + right]."""
  q = jnp.arange(q_len)[:, None] + offset
  kv = jnp.arange(kv_len)[None, :]
  mask = jnp.ones((q_len, kv_len), bool)
  if left is not None:
    mask &= kv >= q - left
  if right is not None:
    mask &= kv <= q + right
  return mask


def segment_mask(q_segments: jax.Array, kv_segments: jax.Array) -> jax.Array:
  """bool [..., q_len, kv_len]: tokens attend only within their own segment."""
  return q_segments[..., :, None] == kv_segments[..., None, :]


def position_mask(kv_len: int, start: jax.Array | None, stop: jax.Array | None) -> jax.Array:
  """bool [batch, kv_len]: key positions in [start, stop) per batch row."""
  pos = jnp.arange(kv_len)[None, :]
  mask = jnp.ones((1, kv_len), bool)
  if start is not None:
    mask = mask & (pos >= jnp.asarray(start).reshape(-1, 1))
  if stop is not None:
    mask = mask & (pos < jnp.asarray(stop).reshape(-1, 1))
  return mask


# ------------------------------------------------------------------ attention
def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None = None,
              bias: jax.Array | None = None, sm_scale: float = 1.0,
              soft_cap: float | None = None, with_stats: bool = False):
  """Softmax attention with heads before positions: q [..., Hq, T, D], k/v [..., Hkv, S, D].

  Grouped-query attention when Hq is a multiple of Hkv (query head h uses kv head
  h // (Hq // Hkv)). `mask` (True = attend) and `bias` broadcast against the logits
  [..., Hq, T, S]; the bias is added before scaling. `with_stats` also returns the
  row max `m` and the row sum `l` of exp(logits - m) over the attended keys.
  """
  groups = q.shape[-3] // k.shape[-3]
  k = jnp.repeat(_f32(k), groups, axis=-3)
  v = jnp.repeat(_f32(v), groups, axis=-3)
  logits = jnp.einsum("...td,...sd->...ts", _f32(q), k, precision=HIGHEST)
  if bias is not None:
    logits = logits + _f32(bias)
  logits = logits * sm_scale
  if soft_cap is not None:
    logits = jnp.tanh(logits / soft_cap) * soft_cap
  if mask is not None:
    logits = jnp.where(mask, logits, _MASKED)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - m)
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("...ts,...sd->...td", p / l, v, precision=HIGHEST).astype(q.dtype)
  if with_stats:
    return out, m[..., 0], l[..., 0]
  return out


def mha_btHd(q, k, v, *, segment_ids=None, causal=False, sm_scale=1.0):
  """Attention in the [batch, seq, heads, head_dim] layout of gpu/attention.mha."""
  t, s = q.shape[1], k.shape[1]
  mask = causal_mask(t, s) if causal else None
  if segment_ids is not None:
    seg = segment_mask(segment_ids, segment_ids)[:, None]
    mask = seg if mask is None else mask & seg
  to_heads = lambda x: jnp.swapaxes(x, 1, 2)
  out = attention(to_heads(q), to_heads(k), to_heads(v), mask=mask, sm_scale=sm_scale)
  return to_heads(out)


def decode_attention(q, k, v, *, start_idx=None, kv_seq_len=None, sm_scale=None,
                     with_stats=False):
  """One query token per sequence: q [B, Hq, D], k/v [B, S, Hkv, D] (or [B, S, D] for MQA).

  Keys at positions outside [start_idx, kv_seq_len) (per batch row) are ignored.
  """
  if k.ndim == 3:
    k, v = k[:, :, None], v[:, :, None]
  sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
  mask = position_mask(k.shape[1], start_idx, kv_seq_len)[:, None, None, :]
  res = attention(q[:, :, None], jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), mask=mask,
                  sm_scale=sm_scale, with_stats=with_stats)
  if with_stats:
    out, m, l = res
    return out[:, :, 0], (l[:, :, 0], m[:, :, 0])
  return res[:, :, 0]


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
  """[Hkv, P, page, D] pages and [B, pages_per_seq] tables -> [B, Hkv, pages_per_seq*page, D]."""
  h, _, page, d = pages.shape
  b, n = block_tables.shape
  seq = pages[:, block_tables]                         # [Hkv, B, n, page, D]
  return jnp.swapaxes(seq.reshape(h, b, n * page, d), 0, 1)


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, k_scales=None,
                    v_scales=None, soft_cap=None):
  """Decode attention over a paged KV cache: q [B, Hq, D]; keys at positions >= length ignored.

  `k_scales`/`v_scales` ([Hkv, P, page] or broadcastable) dequantize int8 pages.
  """
  k = _f32(k_pages) if k_scales is None else _f32(k_pages) * _f32(k_scales)
  v = _f32(v_pages) if v_scales is None else _f32(v_pages) * _f32(v_scales)
  k, v = gather_pages(k, block_tables), gather_pages(v, block_tables)
  mask = None if lengths is None else position_mask(k.shape[2], None, lengths)[:, None, None, :]
  out = attention(q[:, :, None], k, v, mask=mask, soft_cap=soft_cap)
  return out[:, :, 0]


# ------------------------------------------------------------------ matrix products
def matmul(x: jax.Array, y: jax.Array, out_dtype=None) -> jax.Array:
  acc = jnp.int32 if jnp.issubdtype(x.dtype, jnp.integer) else jnp.float32
  out = jnp.matmul(x.astype(acc), y.astype(acc), precision=HIGHEST)
  return out.astype(out_dtype or x.dtype)


def _group_bounds(group_sizes: Sequence[int]) -> list[tuple[int, int]]:
  ends = np.cumsum(np.asarray(group_sizes))
  return [(int(e - s), int(e)) for s, e in zip(np.asarray(group_sizes), ends)]


def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, out_dtype=jnp.float32):
  """Row group g of lhs [m, k] times rhs[g] ([G, k, n], or [G, n, k] if transposed).

  `group_sizes` must be concrete (the groups are sliced in Python); rows past the
  last group are zero.
  """
  out = jnp.zeros((lhs.shape[0], rhs.shape[1] if transpose_rhs else rhs.shape[2]), jnp.float32)
  for g, (start, end) in enumerate(_group_bounds(group_sizes)):
    w = _f32(rhs[g]).T if transpose_rhs else _f32(rhs[g])
    out = out.at[start:end].set(jnp.matmul(_f32(lhs[start:end]), w, precision=HIGHEST))
  return out.astype(out_dtype)


def tgmm(lhs, rhs, group_sizes, *, out_dtype=jnp.float32):
  """[G, k, n]: columns of group g of lhs [k, m] times the same rows of rhs [m, n]."""
  outs = [jnp.matmul(_f32(lhs[:, start:end]), _f32(rhs[start:end]), precision=HIGHEST)
          for start, end in _group_bounds(group_sizes)]
  return jnp.stack(outs).astype(out_dtype)


# ------------------------------------------------------------------ random bits
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32(counter: Sequence[np.ndarray], key: Sequence[int], rounds: int = 10):
  """Philox-4x32 (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3", 2011).

  counter: four uint32 arrays (c0, c1, c2, c3); key: two uint32. Returns the four
  output words. Plain numpy on uint64 so the 32x32->64 products are exact.
  """
  mask = np.uint64(0xFFFFFFFF)
  c = [np.asarray(x, np.uint64) for x in counter]
  k0, k1 = np.uint64(key[0]), np.uint64(key[1])
  for r in range(rounds):
    p0 = np.uint64(_PHILOX_M[0]) * c[0]
    p1 = np.uint64(_PHILOX_M[1]) * c[2]
    c = [((p1 >> np.uint64(32)) ^ c[1] ^ k0) & mask, p1 & mask,
         ((p0 >> np.uint64(32)) ^ c[3] ^ k1) & mask, p0 & mask]
    k0 = (k0 + np.uint64(_PHILOX_W[0])) & mask
    k1 = (k1 + np.uint64(_PHILOX_W[1])) & mask
  return [x.astype(np.uint32) for x in c]
