"""sgl-project/sglang-jax's Pallas kernels (python/sgl_jax/srt/kernels), run on pallet.

The kernels are read from a checkout (PALLET_SGLANG_JAX_SOURCE) at test time; nothing of
sglang-jax is copied here. Each test compares a kernel with the project's own reference
(where it has one) and with a jax.numpy reference written here, on random inputs.
Block sizes are passed explicitly: the defaults read TPU-generation tables.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.foreign import projects

K = "sgl_jax.srt.kernels."


# ----------------------------------------------------------------------------------
# ragged_paged_attention v3 (mixed prefill / decode, fused K/V cache, cache update)
# ----------------------------------------------------------------------------------

def _cdiv(a, b):
  return -(-a // b)


def _rpa_case(seqs, *, hq, hkv, d, page_size, dtype, seed):
  """Inputs for `seqs` = [(q_len, kv_len), ...] (decode-only sequences first).

  Returns the kernel's arguments (its cache holds each sequence's prefix only; the new
  tokens come in k, v), the cache expected after the call, and the reference's
  arguments (separate K and V pages holding whole sequences, 2-D page table)."""
  rng = np.random.default_rng(seed)
  s = len(seqs)
  pages_per_seq = max(_cdiv(kv, page_size) for _, kv in seqs)
  tokens = sum(q for q, _ in seqs) + 3            # padded: 3 unused rows
  num_pages = sum(_cdiv(kv, page_size) for _, kv in seqs) + 2
  page_indices = np.zeros(s * pages_per_seq, np.int32)
  used = sum(_cdiv(kv, page_size) for _, kv in seqs)
  page_indices[:used] = rng.permutation(num_pages)[:used]
  kv_lens = np.array([kv for _, kv in seqs], np.int32)
  cu_q = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
  cu_kv = np.concatenate([[0], np.cumsum([_cdiv(kv, page_size) * page_size
                                          for _, kv in seqs])]).astype(np.int32)
  decode = sum(q == 1 for q, _ in seqs)
  distribution = np.array([decode, decode, s], np.int32)
  q = rng.standard_normal((tokens, hq, d)).astype(np.float32)
  k = rng.standard_normal((tokens, hkv, d)).astype(np.float32)
  v = rng.standard_normal((tokens, hkv, d)).astype(np.float32)
  k_pages = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)
  v_pages = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)
  k_before, v_before = k_pages.copy(), v_pages.copy()
  for i, (q_len, kv_len) in enumerate(seqs):
    first = cu_kv[i] // page_size
    for t in range(kv_len - q_len, kv_len):
      page, offset = page_indices[first + t // page_size], t % page_size
      row = cu_q[i] + t - (kv_len - q_len)
      k_pages[page, offset], v_pages[page, offset] = k[row], v[row]
  packing = 4 // jnp.dtype(dtype).itemsize

  def fused(kp, vp):   # heads interleaved K0, V0, K1, V1, ...; packed as the kernel wants
    x = np.stack([kp, vp], axis=3).reshape(num_pages, page_size, 2 * hkv, d)
    return jnp.asarray(x).astype(dtype).reshape(num_pages, page_size, 2 * hkv // packing,
                                                packing, d)

  table = np.stack([page_indices[cu_kv[i] // page_size:][:pages_per_seq] for i in range(s)])
  q, k, v = (jnp.asarray(a).astype(dtype) for a in (q, k, v))
  kernel_args = (q, k, v, fused(k_before, v_before), jnp.asarray(kv_lens),
                 jnp.asarray(page_indices), jnp.asarray(cu_q), jnp.asarray(cu_kv),
                 jnp.asarray(distribution), None)
  reference_args = (q, jnp.asarray(k_pages).astype(dtype), jnp.asarray(v_pages).astype(dtype),
                    jnp.asarray(kv_lens), jnp.asarray(table), jnp.asarray(cu_q),
                    jnp.asarray([s], jnp.int32))
  return kernel_args, fused(k_pages, v_pages), reference_args, int(cu_q[-1])


def _attention_reference(q, k_pages, v_pages, kv_lens, table, cu_q, sm_scale,
                         sliding_window=None):
  """Causal attention of each sequence's new tokens over its whole K/V (float64)."""
  q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
  group = q.shape[1] // k_pages.shape[2]
  out = []
  for i, kv_len in enumerate(np.asarray(kv_lens)):
    qs = q[cu_q[i]:cu_q[i + 1]]
    k = k_pages[np.asarray(table[i])].reshape(-1, *k_pages.shape[2:])[:kv_len]
    v = v_pages[np.asarray(table[i])].reshape(-1, *v_pages.shape[2:])[:kv_len]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("qhd,khd->hqk", qs, k) * sm_scale
    pos_q = kv_len - len(qs) + np.arange(len(qs))[:, None]
    pos_k = np.arange(kv_len)[None, :]
    mask = pos_k <= pos_q
    if sliding_window is not None:
      mask &= pos_q - sliding_window < pos_k
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    out.append(np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v))
  return np.concatenate(out)


@pytest.mark.parametrize("seqs,hq,hkv,sliding_window", [
    ([(1, 20), (1, 37), (5, 40), (20, 20), (13, 50)], 4, 2, None),
    ([(1, 64), (7, 33), (16, 70)], 2, 1, 24),
])
def test_ragged_paged_attention_v3(seqs, hq, hkv, sliding_window):
  rpa = projects.load(K + "ragged_paged_attention.ragged_paged_attention_v3")
  d, page_size = 128, 16
  kernel_args, cache_expected, ref_args, n = _rpa_case(
      seqs, hq=hq, hkv=hkv, d=d, page_size=page_size, dtype=jnp.float32, seed=len(seqs))
  sm_scale = d ** -0.5
  # the kernel donates queries, keys, values and the cache: give it copies
  kernel_args = tuple(jnp.array(a, copy=True) if a is not None else None for a in kernel_args)
  out, cache = rpa.ragged_paged_attention(
      *kernel_args, sm_scale=sm_scale, sliding_window=sliding_window,
      d_block_sizes=(1, 32, 1, 32), m_block_sizes=(8, 32, 8, 16),
      vmem_limit_bytes=64 * 1024 * 1024)
  expected = rpa.ref_ragged_paged_attention(*ref_args, sm_scale=sm_scale,
                                            sliding_window=sliding_window)
  np.testing.assert_allclose(out[:n], expected[:n], atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(out[:n], _attention_reference(
      *ref_args[:6], sm_scale, sliding_window)[:n], atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(cache, cache_expected)


# ----------------------------------------------------------------------------------
# simple_gla: fused decode kernel and the chunked varlen prefill kernels
# ----------------------------------------------------------------------------------

def _gla_decode_reference(q, k, v, gamma, h0, scale):
  """h1 = exp(gamma) h0 + k v^T; o = scale * q h1 (float64)."""
  q, k, v, h0 = (np.asarray(a, np.float64) for a in (q, k, v, h0))
  h1 = np.exp(np.asarray(gamma, np.float64))[None, :, None, None] * h0 + np.einsum(
      "bhk,bhv->bhkv", k, v)
  return scale * np.einsum("bhk,bhkv->bhv", q, h1), h1


@pytest.mark.parametrize("heads,indices,has_init", [
    (2, (1, 2, 3, 4), (True, True, True, True)),
    (4, (2, 0, 5, 1, 0, 6), (True, True, False, True, False, False)),
])
def test_simple_gla_decode_fused(heads, indices, has_init):
  fused = projects.load(K + "simple_gla.simple_gla_fused")
  native = projects.load(K + "simple_gla.native")
  rng = np.random.default_rng(len(indices))
  d, slots, n = 128, 8, len(indices)
  q, k, v = (jnp.asarray(rng.normal(size=(n, heads, d)) * 0.1, jnp.float32) for _ in range(3))
  buffer = rng.normal(size=(slots, heads, d, d)).astype(np.float32)
  buffer[0] = 0   # slot 0 is the dummy slot, zero by the state pool's convention
  gamma = jnp.asarray(rng.uniform(-0.1, -0.01, size=(heads,)), jnp.float32)
  indices = jnp.asarray(indices, jnp.int32)
  has_init = jnp.asarray(has_init)
  out, new_buffer = fused.decode_simple_gla_fused(
      q, k, v, recurrent_buffer=jnp.asarray(buffer), recurrent_indices=indices,
      has_initial_state=has_init, g_gamma=gamma, scale=None)
  h0 = np.where(np.asarray(has_init)[:, None, None, None], buffer[np.asarray(indices)], 0.0)
  o_ref, h_ref = _gla_decode_reference(q, k, v, gamma, h0, d ** -0.5)
  o_native, h_native = native.naive_gla_decode(q[:, None], k[:, None], v[:, None], gamma,
                                               jnp.asarray(h0))
  np.testing.assert_allclose(out, o_ref, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(out, o_native[:, 0], atol=1e-5, rtol=1e-5)
  expected_buffer = buffer.copy()
  for i, slot in enumerate(np.asarray(indices)):
    if slot != 0:   # the dummy slot is never written
      expected_buffer[slot] = h_ref[i]
  np.testing.assert_allclose(new_buffer, expected_buffer, atol=1e-5, rtol=1e-5)


def _gla_prefill_reference(q, k, v, gamma, h0, cu, scale):
  """Per-sequence recurrence h_t = exp(gamma) h_{t-1} + k_t v_t^T, o_t = scale q_t h_t
  (float64); q, k, v are [1, T, H, D] packed, h0 is [N, H, D, D]."""
  q, k, v = (np.asarray(a, np.float64)[0] for a in (q, k, v))
  h0 = np.asarray(h0, np.float64)
  decay = np.exp(np.asarray(gamma, np.float64))[:, None, None]
  out, final = np.zeros_like(v), np.zeros_like(h0)
  for i in range(len(cu) - 1):
    h = h0[i]
    for t in range(cu[i], cu[i + 1]):
      h = decay * h + np.einsum("hk,hv->hkv", k[t], v[t])
      out[t] = scale * np.einsum("hk,hkv->hv", q[t], h)
    final[i] = h
  return out[None], final


@pytest.mark.parametrize("lens", [(5, 70, 1, 30), (64, 0, 129), (128,)])
def test_simple_gla_chunk_prefill_varlen(lens):
  gla = projects.load(K + "simple_gla.simple_gla")
  native = projects.load(K + "simple_gla.native")
  rng = np.random.default_rng(sum(lens))
  heads, d = 2, 128
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  t = int(cu[-1])
  q, k, v = (jnp.asarray(rng.normal(size=(1, t, heads, d)) * 0.1, jnp.float32)
             for _ in range(3))
  h0 = jnp.asarray(rng.normal(size=(len(lens), heads, d, d)) * 0.1, jnp.float32)
  gamma = jnp.asarray(rng.uniform(-0.1, -0.01, size=(heads,)), jnp.float32)
  # the kernel takes only the per-head decay g_gamma (it asserts a per-token g is None)
  out, ht = gla.chunk_simple_gla_fwd_varlen(q, k, v, g_gamma=gamma, h0=h0, use_ht=True,
                                            cu_seqlens_dev=jnp.asarray(cu), chunk_size=64)
  o_ref, h_ref = _gla_prefill_reference(q, k, v, gamma, h0, cu, d ** -0.5)
  np.testing.assert_allclose(out, o_ref, atol=1e-5, rtol=1e-4)
  np.testing.assert_allclose(ht, h_ref, atol=1e-5, rtol=1e-4)
  o_native, _ = native.naive_gla_prefill(q, k, v, gamma, h0, jnp.asarray(cu))
  np.testing.assert_allclose(out, o_native, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------
# gmm (megablox v1 and the emit_pipeline v2), with bias, group offset, int8 weights
# ----------------------------------------------------------------------------------

def _gmm_reference(lhs, rhs, group_sizes, *, scale=None, bias=None, offset=0):
  """Rows of global group i times rhs[i - offset] (blockwise-scaled over k), + bias;
  rows of groups outside this shard are zero."""
  groups, k, n = rhs.shape
  blocks = scale.shape[1] if scale is not None else 1
  width = k // blocks
  lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  out, start = [], 0
  for i, rows in enumerate(np.asarray(group_sizes)):
    g = i - offset
    acc = np.zeros((rows, n))
    if 0 <= g < groups:
      for b in range(blocks):
        part = lhs[start:start + rows, b * width:(b + 1) * width] @ rhs[g, b * width:(b + 1) * width]
        acc += part * (np.asarray(scale[g, b], np.float64) if scale is not None else 1.0)
      if bias is not None:
        acc += np.asarray(bias[g], np.float64)
    out.append(acc)
    start += rows
  return np.concatenate(out)


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("quantized", [False, True])
def test_gmm(version, quantized):
  rng = np.random.default_rng(5)
  m, k, n, offset = 128, 512, 256, 2
  sizes = np.array([10, 0, 30, 5, 20, 40, 3, 20], np.int32)
  local = len(sizes) - offset
  lhs = jnp.asarray(rng.uniform(-1, 1, (m, k)), jnp.bfloat16)
  scale = None
  if quantized:   # int8 weights, one float32 scale per 128-row block of k and column
    w = rng.uniform(-1, 1, (local, k // 128, 128, n))
    s = np.abs(w).max(2, keepdims=True) / 127.0
    rhs = jnp.asarray(np.clip(np.round(w / s), -127, 127).reshape(local, k, n), jnp.int8)
    scale = jnp.asarray(s, jnp.float32)                 # [groups, k blocks, 1, n]
  else:
    rhs = jnp.asarray(rng.uniform(-1, 1, (local, k, n)), jnp.bfloat16)
  bias = jnp.asarray(rng.normal(size=(local, 1, n)), jnp.bfloat16)
  if version == "v1":
    gmm = projects.load(K + "gmm.megablox_gmm_kernel.gmm")
    out = gmm.gmm(lhs, rhs, jnp.asarray(sizes), preferred_element_type=jnp.float32,
                  rhs_scale=scale, rhs_bias=bias, tiling=(128, 128, 128),
                  group_offset=jnp.array(offset, jnp.int32))
  else:
    gmm = projects.load(K + "gmm.megablox_gmm_kernel.gmm_v2")
    out = gmm.gmm_v2(lhs, rhs, jnp.asarray(sizes), rhs_scale=scale, rhs_bias=bias,
                     group_offset=jnp.array([offset], jnp.int32),
                     preferred_element_type=jnp.float32, maybe_quantize_lhs=False)
  expected = _gmm_reference(lhs, rhs, sizes, scale=scale, bias=bias, offset=offset)
  # bf16 operands are exact in float32; the only error is float32 accumulation
  np.testing.assert_allclose(out, expected, atol=1e-4, rtol=1e-5)


# ----------------------------------------------------------------------------------
# MoE routing: biased top-k, top-k, grouped top-k
# ----------------------------------------------------------------------------------

def _routing_inputs(tokens=256, experts=256):
  rng = np.random.default_rng(9)
  logits = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(tokens, experts)), jnp.float32))
  bias = jnp.asarray(rng.normal(size=(experts,)) * 0.1, jnp.float32)
  return logits, bias


def test_biased_topk_and_topk():
  topk = projects.load(K + "biased_topk.v1.kernel")
  logits, bias = _routing_inputs()
  weights, ids = topk.biased_topk_pallas(logits, bias, topk=8, block_tokens=128)
  want_ids = jax.lax.top_k(logits + bias, 8)[1]
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_array_equal(weights, jnp.take_along_axis(logits, want_ids, 1))
  values, ids = topk.topk_pallas(logits, topk=8, block_tokens=128)
  want_values, want_ids = jax.lax.top_k(logits, 8)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_array_equal(values, want_values)


def test_grouped_topk():
  grouped = projects.load(K + "grouped_topk.v1.kernel")
  logits, bias = _routing_inputs()
  tokens, experts = logits.shape
  groups, keep_groups, k = 8, 4, 8
  weights, ids = grouped.grouped_topk_pallas(logits, bias, num_expert_group=groups,
                                             topk_group=keep_groups, topk=k, block_tokens=128)
  # DeepSeek-style: a group's score is the sum of its two best biased scores
  scores = logits + bias
  group_scores = jax.lax.top_k(scores.reshape(tokens, groups, -1), 2)[0].sum(-1)
  kept = jax.lax.top_k(group_scores, keep_groups)[1]
  mask = jnp.zeros((tokens, groups), bool).at[jnp.arange(tokens)[:, None], kept].set(True)
  masked = jnp.where(jnp.repeat(mask, experts // groups, axis=1), scores, -jnp.inf)
  want_ids = jax.lax.top_k(masked, k)[1]
  np.testing.assert_array_equal(jnp.sort(ids, 1), jnp.sort(want_ids, 1))
  np.testing.assert_array_equal(weights, jnp.take_along_axis(logits, ids, 1))


# ----------------------------------------------------------------------------------
# update_kv_cache: ragged slices of new K/V copied into the flat cache
# ----------------------------------------------------------------------------------

def test_kv_cache_update():
  update = projects.load(K + "update_kv_cache.update_kv_cache")
  rng = np.random.default_rng(4)
  heads_x2, d, pages, page_size, tokens = 4, 128, 6, 16, 20
  cache = rng.normal(size=(pages, page_size, heads_x2, 1, d)).astype(np.float32)
  new = rng.normal(size=(tokens, 1, heads_x2, 1, d)).astype(np.float32)
  slices = [(5, 0, 3), (40, 3, 9), (70, 12, 8)]   # (cache start, new start, length)
  mapping = update.get_slot_mapping(4, *(jnp.array([s[i] for s in slices]) for i in range(3)))
  out = update.kv_cache_update_impl(jnp.asarray(new), mapping, jnp.asarray(cache),
                                    jnp.array([len(slices)], jnp.int32), page_size=16,
                                    num_slices_per_block=4)
  expected = cache.reshape(pages * page_size, heads_x2, d).copy()
  for start, src, length in slices:
    expected[start:start + length] = new.reshape(tokens, heads_x2, d)[src:src + length]
  np.testing.assert_array_equal(np.asarray(out).reshape(expected.shape), expected)
