"""More of sgl-project/sglang-jax's Pallas kernels (python/sgl_jax/srt/kernels), run on pallet:
MLA v2 ragged paged attention and the expert-parallel fused MoE (v1).

The kernels are read from a checkout (PALLET_SGLANG_JAX_SOURCE) at test time; nothing of
sglang-jax is copied here. Each test compares with the project's own reference
(`mla.v1.ref.ref_mla_ragged_paged_attention`, `fused_moe.v1.kernel.ref_moe`) and, for MLA,
with a float64 numpy reference written here. Block sizes are passed explicitly.
Tests that take a minute or more on a 2-core CPU are marked slow (run with -m slow).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from tests.foreign import projects

K = "sgl_jax.srt.kernels."


def _cdiv(a, b):
  return -(-a // b)


# ----------------------------------------------------------------------------------
# MLA v2: absorbed multi-head latent attention over a paged latent cache (+ cache update)
# ----------------------------------------------------------------------------------

def _mla_case(seqs, *, heads, lkv, rope, page, dtype, seed):
  """Inputs for `seqs` = [(q_len, kv_len), ...] (decode-only first). The cache holds
  random values everywhere (prefixes and garbage); pages are a random permutation.
  Returns kernel args (ragged page indices, page-aligned cu_kv_lens) and the padded
  page table the v1 reference takes."""
  rng = np.random.default_rng(seed)
  s = len(seqs)
  packing = 4 // jnp.dtype(dtype).itemsize
  npages = [_cdiv(kv, page) for _, kv in seqs]
  pps = max(npages)
  total_pages = sum(npages) + 3
  ragged = rng.permutation(total_pages)[:sum(npages)].astype(np.int32)
  padded = np.zeros(s * pps, np.int32)
  start = 0
  for i, n in enumerate(npages):
    padded[i * pps:i * pps + n] = ragged[start:start + n]
    start += n
  tokens = sum(q for q, _ in seqs) + 3                  # 3 padding rows
  cast = lambda a: jnp.asarray(a).astype(dtype)
  ql = cast(rng.standard_normal((tokens, heads, lkv)))
  qp = cast(rng.standard_normal((tokens, heads, rope)))
  kc = cast(rng.standard_normal((tokens, lkv)))
  kp = cast(rng.standard_normal((tokens, rope)))
  width = _cdiv(lkv, 128) * 128 + _cdiv(rope, 128) * 128
  cache = cast(rng.standard_normal((total_pages, page // packing, packing, width)))
  kv_lens = np.array([kv for _, kv in seqs], np.int32)
  cu_q = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
  cu_kv = np.concatenate([[0], np.cumsum([n * page for n in npages])]).astype(np.int32)
  decode = sum(q == 1 for q, _ in seqs)
  return dict(ql=ql, qp=qp, kc=kc, kp=kp, cache=cache, kv_lens=kv_lens, ragged=ragged,
              padded=padded, cu_q=cu_q, cu_kv=cu_kv, pps=pps,
              distribution=np.array([decode, decode, s], np.int32))


def _mla_reference(c, seqs, lkv, page, scale):
  """Each sequence's new tokens attend causally to its prefix (from the cache) and its
  new latent K/V (float64); returns outputs and the cache with new tokens written."""
  f = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  ql, qp, kc, kp, cache = (f(c[k]) for k in ("ql", "qp", "kc", "kp", "cache"))
  pages, rows, packing, width = cache.shape
  flat = cache.reshape(pages * page, width).copy()
  lk = _cdiv(lkv, 128) * 128
  out = []
  for i, (q_len, kv_len) in enumerate(seqs):
    table = c["padded"][i * c["pps"]:(i + 1) * c["pps"]]
    slots = (table[:, None] * page + np.arange(page)[None, :]).reshape(-1)[:kv_len]
    q0 = c["cu_q"][i]
    new = slots[kv_len - q_len:]
    flat[new] = 0   # new rows are written whole, zero-padded to 128 lanes per part
    flat[new, :kc.shape[1]] = kc[q0:q0 + q_len]
    flat[new, lk:lk + kp.shape[1]] = kp[q0:q0 + q_len]
    k_c, k_p = flat[slots, :kc.shape[1]], flat[slots, lk:lk + kp.shape[1]]
    s = (np.einsum("qhl,kl->hqk", ql[q0:q0 + q_len], k_c)
         + np.einsum("qhr,kr->hqk", qp[q0:q0 + q_len], k_p)) * scale
    pos_q = kv_len - q_len + np.arange(q_len)[:, None]
    s = np.where(np.arange(kv_len)[None, :] <= pos_q, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    out.append(np.einsum("hqk,kl->qhl", p / p.sum(-1, keepdims=True), k_c))
  return np.concatenate(out), flat.reshape(cache.shape)


def _written_slots_mask(c, seqs, page, shape):
  """True for cache entries the comparison covers: every slot except those past a
  sequence's kv_len on its pages (the kernel stores whole packed 32-bit words, so with
  bf16 the slot sharing a word with the last new token gets a copy of a new row)."""
  pages, rows, packing, _ = shape
  keep = np.ones((pages * page,), bool)
  for i, (_, kv_len) in enumerate(seqs):
    table = c["padded"][i * c["pps"]:(i + 1) * c["pps"]][:_cdiv(kv_len, page)]
    slots = (table[:, None] * page + np.arange(page)[None, :]).reshape(-1)
    keep[slots[kv_len:]] = False
  return keep.reshape(pages, rows, packing)


def _run_mla(dtype, decode_batch_size, tol):
  kernel = projects.load(K + "mla.v2.kernel")
  ref = projects.load(K + "mla.v1.ref")
  seqs = [(1, 20), (1, 37), (5, 40), (20, 20), (13, 50)]
  lkv, rope, page, scale = 128, 64, 16, 0.1
  c = _mla_case(seqs, heads=4, lkv=lkv, rope=rope, page=page, dtype=dtype, seed=3)
  i32 = lambda a: jnp.asarray(a, jnp.int32)
  copy = lambda a: jnp.array(a, copy=True)   # the kernel donates the cache (and aliases q)
  out, cache = kernel.mla_ragged_paged_attention(
      copy(c["ql"]), copy(c["qp"]), c["kc"], c["kp"], copy(c["cache"]), i32(c["kv_lens"]),
      i32(c["ragged"]), i32(c["cu_q"]), i32(c["cu_kv"]), i32(c["distribution"]),
      sm_scale=scale, num_kv_pages_per_block=(2, 1, 2), num_queries_per_block=(1, 1, 8),
      decode_batch_size=decode_batch_size)
  n = int(c["cu_q"][-1])
  expected, expected_cache = ref.ref_mla_ragged_paged_attention(
      c["ql"], c["qp"], c["kc"], c["kp"], copy(c["cache"]), i32(c["kv_lens"]),
      i32(c["padded"]), i32(c["cu_q"]), i32(c["distribution"]), sm_scale=scale)
  mine, my_cache = _mla_reference(c, seqs, lkv, page, scale)
  f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))
  np.testing.assert_allclose(f32(out[:n]), f32(expected[:n, :, :lkv]), atol=tol, rtol=tol)
  np.testing.assert_allclose(f32(out[:n]), mine, atol=tol, rtol=tol)
  keep = _written_slots_mask(c, seqs, page, cache.shape)
  np.testing.assert_array_equal(f32(cache)[keep], f32(expected_cache)[keep])
  np.testing.assert_array_equal(f32(cache)[keep], my_cache.astype(np.float32)[keep])


def test_mla_ragged_paged_attention_f32():
  """2 decode + 3 mixed sequences, one decode kernel call per sequence (~10 s here)."""
  _run_mla(jnp.float32, decode_batch_size=1, tol=2e-5)


@pytest.mark.slow
def test_mla_ragged_paged_attention_bf16_batched_decode():
  """bf16 (2 tokens per cache word: misaligned new-token packing), decodes batched by 2."""
  _run_mla(jnp.bfloat16, decode_batch_size=2, tol=5e-2)   # bf16 output, float32 softmax


# ----------------------------------------------------------------------------------
# fused_moe v1: expert-parallel fused MoE on a 1x1 mesh (top-k given, silu gate)
# ----------------------------------------------------------------------------------

def _moe_reference(a, w1, w2, w3, weights, ids):
  """sum_k w_k * (silu(x w1[e_k]) * (x w3[e_k])) w2[e_k] (float64)."""
  a, w1, w2, w3 = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (a, w1, w2, w3))
  out = np.zeros_like(a)
  for t in range(a.shape[0]):
    for w, e in zip(np.asarray(weights[t], np.float64), np.asarray(ids[t])):
      g, u = a[t] @ w1[e], a[t] @ w3[e]
      out[t] += w * ((g / (1 + np.exp(-g)) * u) @ w2[e])
  return out


@pytest.mark.slow
def test_fused_ep_moe():
  """f32, 4 experts, hidden = intermediate = 128, 16 tokens, top-2 (~7 min here)."""
  moe = projects.load(K + "fused_moe.v1.kernel")
  experts, hidden, inter, tokens, top_k = 4, 128, 128, 16, 2
  keys = jax.random.split(jax.random.key(0), 5)
  a = jax.random.normal(keys[0], (tokens, hidden)) / 10
  w1 = jax.random.normal(keys[1], (experts, hidden, inter)) / 10
  w2 = jax.random.normal(keys[2], (experts, inter, hidden)) / 10
  w3 = jax.random.normal(keys[4], (experts, hidden, inter)) / 10
  gating = jax.random.normal(keys[3], (tokens, experts), jnp.float32)
  weights, ids = jax.lax.top_k(gating, top_k)
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
  config = moe.FusedMoEBlockConfig(bt=8, bf=128, bd1=128, bd2=128, btc=8, bfc=128, bd1c=128,
                                   bd2c=128, bse=128)
  out = moe.fused_ep_moe(mesh=mesh, tokens=a, w1=w1, w2=w2, w3=w3, topk_weights=weights,
                         topk_ids=ids.astype(jnp.int32), top_k=top_k, block_config=config)
  np.testing.assert_allclose(out, moe.ref_moe(a, w1, w2, w3, gating, top_k), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(out, _moe_reference(a, w1, w2, w3, weights, ids), atol=1e-5,
                             rtol=1e-5)
