"""vllm-project/tpu-inference's experimental Pallas kernels (kernels/experimental/), run on
pallet.

The kernels are loaded from the checkout in PALLET_TPU_INFERENCE_SOURCE (skipped when
unset) with their Pallas imports routed to pallet. The cases mirror (smaller) ones of the
project's tests/kernels/deepseek_v4/*, stacked_rpa/* and rpa_v3_cp/* tests, whose
reference functions live in those test files (not in the package), so each case compares
with a jax.numpy reference written here and, where JAX's TPU interpreter runs the kernel,
with the same project function run on JAX's own Pallas (tests/foreign/peer.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.foreign import peer, projects

EXP = "tpu_inference.kernels.experimental."


def kernels(module: str):
  return projects.load(EXP + module)


def close(actual, expected, *, atol, rtol):
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                             atol=atol, rtol=rtol)


def cdiv(a, b):
  return -(-a // b)


# --- deepseek_v4 core attention: mla (HCA) ------------------------------------------

def hca_cache(rng, pages, page_size, head_dim=512):
  """A bf16 cache [pages, page_size, head_dim] and its uint8 kernel layout
  [pages, 2 * page_size, 4, 128] (each token's bf16 row as 2 x 4 x 128 bytes, the
  layout mla_test.py builds)."""
  base = jnp.asarray(rng.random((pages, page_size, head_dim), np.float32), jnp.bfloat16)
  raw = jax.lax.bitcast_convert_type(base.reshape(pages, page_size, 4, 128), jnp.uint8)
  raw = raw.transpose(0, 1, 2, 4, 3).reshape(pages, page_size * 2, 4, 128)
  return base, raw


def merged_attention(q, k, v, valid, sinks, acc1, l1, m1, sm_scale):
  """Attention of q [T, H, D] over k/v [T, S, D] (valid [T, S]) merged with a running
  softmax state (acc1 [T, H, D], l1/m1 [T, H]) and per-head sinks [H]; f32."""
  s = jnp.einsum("thd,tsd->ths", q.astype(jnp.float32), k.astype(jnp.float32)) * sm_scale
  s = jnp.where(valid[:, None, :], s, -jnp.inf)
  m = jnp.maximum(m1, s.max(-1))
  p = jnp.exp(s - m[..., None])
  l = l1 * jnp.exp(m1 - m) + p.sum(-1) + jnp.exp(sinks[None, :] - m)
  acc = acc1.astype(jnp.float32) * jnp.exp(m1 - m)[..., None] + jnp.einsum(
      "ths,tsd->thd", p, v.astype(jnp.float32))
  return acc / l[..., None]


def mla_inputs(seed, *, num_decode=3, num_mixed=3, heads=16, page_size=16, max_kv=160):
  rng = np.random.default_rng(seed)
  seqs = num_decode + num_mixed
  q_lens = np.concatenate([np.ones(num_decode, np.int32), rng.integers(4, 30, num_mixed)])
  kv_lens = q_lens + rng.integers(30, max_kv - 30, seqs)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  tokens = int(cu[-1])
  to_attend = np.concatenate([rng.integers(0, kv_lens[i], q_lens[i]) for i in range(seqs)])
  pages_per_seq = cdiv(max_kv, page_size)
  pages = seqs * pages_per_seq
  page_indices = rng.permutation(pages).astype(np.int32)
  base, raw = hca_cache(rng, pages, page_size)
  f = lambda *s: jnp.asarray(rng.random(s, np.float32))
  return dict(
      q=f(tokens, heads, 512).astype(jnp.bfloat16), base=base, cache=raw,
      kv_lens=jnp.asarray(kv_lens, jnp.int32), to_attend=jnp.asarray(to_attend, jnp.int32),
      page_indices=jnp.asarray(page_indices), cu=jnp.asarray(cu),
      distribution=jnp.asarray([num_decode, num_decode, seqs], jnp.int32),
      sinks=f(heads), acc=f(tokens, heads, 512).astype(jnp.bfloat16), l=f(tokens, heads),
      m=f(tokens, heads), pages_per_seq=pages_per_seq, q_lens=q_lens)


def mla_reference(x, sm_scale):
  page_size = x["base"].shape[1]
  kv_all = x["base"][x["page_indices"]].reshape(len(x["q_lens"]), -1, 512)
  seq_of_token = np.repeat(np.arange(len(x["q_lens"])), x["q_lens"])
  kv = kv_all[seq_of_token]                                        # [T, S, D]
  valid = jnp.arange(kv.shape[1])[None, :] < x["to_attend"][:, None]
  del page_size
  return merged_attention(x["q"], kv, kv, valid, x["sinks"], x["acc"], x["l"], x["m"],
                          sm_scale)


def mla_call(x, sm_scale):
  return ((x["q"], x["cache"], x["kv_lens"], x["to_attend"], x["page_indices"], x["cu"],
           x["distribution"], x["sinks"], x["acc"], x["l"], x["m"]),
          dict(sm_scale=sm_scale, num_kv_pages_per_block=2, num_queries_per_block=8))


def test_dsv4_mla_hca():
  m = kernels("deepseek_v4.core_attention.mla")
  x = mla_inputs(0)
  args, kwargs = mla_call(x, 0.05)
  out = m.mla_ragged_paged_attention(*args, **kwargs)
  # bf16 output of a softmax average of values in [0, 1)
  close(out, mla_reference(x, 0.05), atol=2e-2, rtol=2e-2)


# JAX's TPU interpreter cannot run mla (its DMAs go through ref.reshape: the interpreter
# fails with "'ReshapeTransform' object has no attribute 'indices'"), so no peer case.


# --- deepseek_v4 core attention: mla_swa (sliding window, writes the new kv) -------

def swc_rows(cache, page_size):
  """The SWA cache [pages, 2 * physical, 4, 128] uint8 back to bf16 [pages, page_size, 512]."""
  raw = cache[:, :2 * page_size].reshape(cache.shape[0], page_size, 4, 2, 128)
  return jax.lax.bitcast_convert_type(jnp.swapaxes(raw, -1, -2), jnp.bfloat16).reshape(
      cache.shape[0], page_size, 512)


def swa_reference(q, history, q_lens, kv_lens, sinks, window, sm_scale):
  """Causal sliding-window attention with sinks; history [S, L, 512] is each sequence's
  whole kv (new tokens included). Returns (out, l without sinks, m)."""
  seq = np.repeat(np.arange(len(q_lens)), q_lens)
  pos = np.concatenate([np.arange(k - n, k) for n, k in zip(q_lens, kv_lens)])
  kv = history[seq].astype(jnp.float32)                           # [T, L, D]
  span = np.arange(history.shape[1])[None, :]
  valid = jnp.asarray((span <= pos[:, None]) & (span > pos[:, None] - window))
  s = jnp.einsum("thd,tsd->ths", q.astype(jnp.float32), kv) * sm_scale
  s = jnp.where(valid[:, None, :], s, -jnp.inf)
  m = s.max(-1)
  p = jnp.exp(s - m[..., None])
  l = p.sum(-1)
  out = jnp.einsum("ths,tsd->thd", p, kv) / (l + jnp.exp(sinks[None] - m))[..., None]
  return out, l, m


@pytest.mark.slow  # ~40 s on two shared cores
def test_dsv4_mla_swa_two_steps():
  """A prefill step, then a step of decodes and prefills, as mla_swa_test.py runs them
  (smaller); checks the output, l, m and the new tokens written to the cache."""
  m = kernels("deepseek_v4.core_attention.mla_swa")
  rng = np.random.default_rng(2)
  seqs, heads, page, window = 4, 16, 16, 16
  pages_per_seq = cdiv(window * 5, page)
  page_indices = jnp.asarray(rng.permutation(seqs * pages_per_seq), jnp.int32)
  cache = jnp.zeros((seqs * pages_per_seq, (page + 4) * 2, 4, 128), jnp.uint8)
  sinks = jnp.asarray(rng.random(heads, np.float32))
  history = np.zeros((seqs, pages_per_seq * page, 512), np.float32)
  kv_lens = np.zeros(seqs, np.int32)
  for step, (decodes, q_lens) in enumerate([
      (0, rng.integers(window // 2, window * 2, seqs)),
      (2, np.concatenate([[1, 1], rng.integers(window // 2, window * 2, seqs - 2)]))]):
    q_lens = q_lens.astype(np.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    tokens = int(q_lens.sum())
    q = jnp.asarray(rng.random((tokens, heads, 512), np.float32), jnp.bfloat16)
    new_kv = jnp.asarray(rng.random((tokens, 512), np.float32), jnp.bfloat16)
    starts = kv_lens.copy()
    kv_lens = kv_lens + q_lens
    for i, (a, b) in enumerate(zip(np.asarray(cu[:-1]), np.asarray(cu[1:]))):
      history[i, starts[i]:kv_lens[i]] = np.asarray(new_kv[a:b], np.float32)
    out, cache, l, mx = m.mla_sliding_window_ragged_paged_attention(
        q, new_kv, cache, jnp.asarray(kv_lens), page_indices, cu,
        jnp.asarray([decodes, decodes, seqs], jnp.int32), sinks, sm_scale=0.05,
        sliding_window=window, logical_page_size=page, num_queries_per_block=8,
        num_kv_pages_per_block=2, q_compute_block_size=2)
    ref_out, ref_l, ref_m = swa_reference(q, jnp.asarray(history, jnp.bfloat16), q_lens,
                                          kv_lens, sinks, window, 0.05)
    close(out, ref_out, atol=2e-2, rtol=2e-2)
    close(l, ref_l, atol=1e-2, rtol=1e-2)
    close(mx, ref_m, atol=1e-2, rtol=1e-2)
    rows = swc_rows(cache, page)[page_indices].reshape(seqs, -1, 512)
    for i in range(seqs):
      close(rows[i, :kv_lens[i]], history[i, :kv_lens[i]], atol=0, rtol=0)


# --- deepseek_v4 core attention: csa_gather, sparse_mla -----------------------------

def test_dsv4_csa_gather_needs_sparsecore():
  kernels("deepseek_v4.core_attention.csa_gather")
  pytest.skip("D: csa_gather is a SparseCore kernel (plsc.VectorSubcoreMesh, pl.kernel, "
              "indirect gathers); sparse_mla's case below stands a jax.numpy gather in for it")


def csa_gather_jnp(nope_cache, rope_cache, indices):
  """What csa_gather returns: each token's 512 nope bytes, and its rope row as bf16 from
  (high bytes [0:64], low bytes [64:128])."""
  nope = nope_cache.reshape(-1, 512)[indices]
  rope = rope_cache.reshape(-1, 128)[indices].astype(jnp.uint16)
  return nope, jax.lax.bitcast_convert_type((rope[:, :64] << 8) | rope[:, 64:], jnp.bfloat16)


def dsv4_fp8_cache(rng, pages, page_size):
  """A DSv4 fp8 cache: (dequantized bf16 rows [pages, page_size, 512], nope bytes
  [pages, page_size, 4, 128], rope bytes [pages, page_size // 4, 4, 128])."""
  shape = (pages, page_size)
  fp8 = jnp.asarray(rng.normal(size=(*shape, 7, 64)).astype(np.float32) * 8,
                    jnp.float8_e4m3fn)
  scale = jnp.asarray(2.0 ** rng.integers(-6, 0, (*shape, 7)), jnp.float8_e8m0fnu)
  rope = jnp.asarray(rng.random((*shape, 64), np.float32), jnp.bfloat16)
  nope = (fp8.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).reshape(*shape, 448)
  rows = jnp.concatenate([nope, rope.astype(jnp.float32)], -1)
  u8 = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8)
  nope_bytes = jnp.concatenate([u8(fp8).reshape(*shape, 448), u8(scale),
                                jnp.zeros((*shape, 57), jnp.uint8)], -1)
  r16 = jax.lax.bitcast_convert_type(rope, jnp.uint16)
  rope_bytes = jnp.concatenate([(r16 >> 8).astype(jnp.uint8), (r16 & 0xFF).astype(jnp.uint8)],
                               -1)
  return (rows, nope_bytes.reshape(pages, page_size, 4, 128),
          rope_bytes.reshape(pages, page_size // 4, 4, 128))


def test_dsv4_sparse_mla_with_jnp_gather(monkeypatch):
  """sparse_ragged_paged_attention (its page-id gather kernel and attention kernel) with
  the SparseCore csa_gather replaced by csa_gather_jnp."""
  m = kernels("deepseek_v4.core_attention.sparse_mla")
  monkeypatch.setattr(m.csa_gather, "csa_gather", csa_gather_jnp)
  rng = np.random.default_rng(3)
  decodes, mixed, heads, page, topk, chunk = 3, 2, 16, 16, 128, 32
  seqs = decodes + mixed
  q_lens = np.concatenate([np.ones(decodes, np.int64), rng.integers(4, 12, mixed)])
  kv_lens = q_lens + rng.integers(30, 200, seqs)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  tokens = int(cu[-1])
  topk_idx = np.full((chunk, topk), -1, np.int32)
  t = 0
  for i in range(seqs):
    for _ in range(q_lens[i]):
      pick = rng.permutation(kv_lens[i])[:topk]
      topk_idx[t, :len(pick)] = pick
      t += 1
  pages_per_seq = cdiv(256, page)
  page_indices = rng.permutation(seqs * pages_per_seq).astype(np.int32)
  rows, nope, rope = dsv4_fp8_cache(rng, seqs * pages_per_seq, page)
  f = lambda *s: jnp.asarray(rng.random(s, np.float32))
  pad = lambda a: jnp.pad(a, [(0, chunk - tokens)] + [(0, 0)] * (a.ndim - 1))
  q = pad(f(tokens, heads, 512).astype(jnp.bfloat16))
  acc = pad(f(tokens, heads, 512).astype(jnp.bfloat16))
  l, mx, sinks = pad(f(tokens, heads)), pad(f(tokens, heads)), f(heads)
  out = m.sparse_ragged_paged_attention(
      q, nope, rope, jnp.asarray(topk_idx), jnp.asarray(page_indices), jnp.asarray(cu),
      jnp.asarray([decodes, decodes, seqs], jnp.int32), sinks, acc, l, mx, sm_scale=0.05,
      attention_kernel_batch_size=4, gather_and_attention_chunk_size=chunk)
  # reference: each token attends to its chosen positions of its sequence
  seq_rows = rows[page_indices].reshape(seqs, -1, 512)
  seq = np.repeat(np.arange(seqs), q_lens)
  kv = seq_rows[seq]
  valid = np.zeros((tokens, kv.shape[1]), bool)
  for t in range(tokens):
    chosen = topk_idx[t][topk_idx[t] >= 0]
    valid[t, chosen] = True
  ref = merged_attention(q[:tokens], kv, kv, jnp.asarray(valid), sinks, acc[:tokens],
                         l[:tokens], mx[:tokens], 0.05)
  close(out[:tokens], ref, atol=2e-2, rtol=2e-2)


# --- deepseek_v4 mHC: pre, post, fused post+pre -------------------------------------

HC = 4
MHC_EPS = dict(rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6, hc_post_mult_value=2.0)


def mhc_inputs(seed, tokens, hidden):
  """As mhc_test.py makes them: residual streams, the mix projection fn [24, 4H] and its
  scale/base, plus a layer output x and post/comb gates for the post step."""
  rng = np.random.default_rng(seed)
  n = lambda *s: rng.standard_normal(s).astype(np.float32)
  comb = np.abs(n(tokens, HC, HC)) + 0.01
  return dict(
      residual=jnp.asarray(n(tokens, HC, hidden), jnp.bfloat16),
      fn=jnp.asarray(n(2 * HC + HC * HC, HC * hidden) * 0.02),
      hc_scale=jnp.asarray(1 + 0.1 * n(3)), hc_base=jnp.asarray(0.5 * n(2 * HC + HC * HC)),
      x=jnp.asarray(n(tokens, hidden), jnp.bfloat16),
      post=jnp.asarray(2 / (1 + np.exp(-n(tokens, HC, 1)))),
      comb=jnp.asarray(comb / comb.sum(-1, keepdims=True)))


def mhc_mixes_ref(residual, fn):
  x = residual.reshape(residual.shape[0], -1).astype(jnp.float32)
  mixes = jnp.dot(x, fn.T, precision=jax.lax.Precision.HIGHEST)
  return mixes, jnp.sum(x * x, -1, keepdims=True)


def mhc_pre_ref(residual, fn, hc_scale, hc_base, sinkhorn_repeat):
  """(post [T, 4, 1], comb [T, 4, 4], layer input [T, H] bf16); the gates from the
  project's own mhc_pre_gates (plain jax.numpy), the mixes and collapse written here."""
  utils = kernels("deepseek_v4.mhc.utils")
  t, _, hidden = residual.shape
  mixes, sqrsum = mhc_mixes_ref(residual, fn)
  pre, post, comb = utils.mhc_pre_gates(mixes, sqrsum, HC, hidden, hc_scale, hc_base,
                                        MHC_EPS["rms_eps"], MHC_EPS["hc_pre_eps"],
                                        MHC_EPS["hc_sinkhorn_eps"],
                                        MHC_EPS["hc_post_mult_value"], sinkhorn_repeat)
  layer = jnp.einsum("tm,tmh->th", pre, residual.astype(jnp.float32))
  return post.reshape(t, HC, 1), comb, layer.astype(jnp.bfloat16)


def mhc_post_ref(x, residual, post, comb):
  mixed = jnp.einsum("tij,tih->tjh", comb, residual.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
  return (mixed + post * x[:, None, :].astype(jnp.float32)).astype(jnp.bfloat16)


@pytest.mark.parametrize("tokens", [17, 64])
def test_dsv4_mhc_pre_mixes(tokens):
  m = kernels("deepseek_v4.mhc.pre_kernel")
  x = mhc_inputs(10, tokens, 256)
  mixes, sqrsum = m.mhc_pre_mixes(x["residual"].reshape(tokens, -1), x["fn"],
                                  token_block_size=64)
  want_mixes, want_sqrsum = mhc_mixes_ref(x["residual"], x["fn"])
  close(mixes, want_mixes, atol=1e-4, rtol=1e-4)
  close(sqrsum, want_sqrsum, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("tokens,repeat", [(17, 20), (16, 1)])
def test_dsv4_mhc_pre(tokens, repeat):
  m = kernels("deepseek_v4.mhc.pre_kernel")
  x = mhc_inputs(11, tokens, 256)
  got = m.mhc_pre(x["residual"], x["fn"], x["hc_scale"], x["hc_base"], *MHC_EPS.values(),
                  repeat, token_block_size=64)
  want = mhc_pre_ref(x["residual"], x["fn"], x["hc_scale"], x["hc_base"], repeat)
  close(got[0], want[0], atol=1e-5, rtol=1e-4)
  close(got[1], want[1], atol=1e-5, rtol=1e-4)
  close(got[2], want[2], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tokens,block", [(17, 64), (200, 64), (128, 32)])
def test_dsv4_mhc_post(tokens, block):
  m = kernels("deepseek_v4.mhc.post_kernel")
  x = mhc_inputs(12, tokens, 256)
  got = m.mhc_post(x["x"], x["residual"], x["post"], x["comb"], token_block_size=block)
  close(got, mhc_post_ref(x["x"], x["residual"], x["post"], x["comb"]), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tokens", [17, 64])
def test_dsv4_mhc_fused_post_pre(tokens):
  m = kernels("deepseek_v4.mhc.fused_post_pre_kernel")
  x = mhc_inputs(13, tokens, 256)
  got = m.mhc_fused_post_pre(x["x"], x["residual"], x["post"], x["comb"], x["fn"],
                             x["hc_scale"], x["hc_base"], *MHC_EPS.values(), 20,
                             token_block_size=64)
  res = mhc_post_ref(x["x"], x["residual"], x["post"], x["comb"])
  post, comb, layer = mhc_pre_ref(res, x["fn"], x["hc_scale"], x["hc_base"], 20)
  close(got[0], res, atol=2e-2, rtol=2e-2)
  # gates: a residual value one bf16 ulp apart (rounding order) moves them ~1e-3 at H=256,
  # the bound mhc_test.py uses for this shape (FUSED_SMALL_H_RTOL)
  close(got[1], post, atol=1e-5, rtol=5e-3)
  close(got[2], comb, atol=1e-5, rtol=5e-3)
  close(got[3], layer, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("which", ["pre", "post", "fused"])
def test_dsv4_mhc_matches_jax_pallas(which):
  x = mhc_inputs(14, 17, 256)
  if which == "pre":
    module, fn = "pre_kernel", "mhc_pre"
    args = (x["residual"], x["fn"], x["hc_scale"], x["hc_base"], *MHC_EPS.values(), 20)
  elif which == "post":
    module, fn = "post_kernel", "mhc_post"
    args = (x["x"], x["residual"], x["post"], x["comb"])
  else:
    module, fn = "fused_post_pre_kernel", "mhc_fused_post_pre"
    args = (x["x"], x["residual"], x["post"], x["comb"], x["fn"], x["hc_scale"],
            x["hc_base"], *MHC_EPS.values(), 20)
  got = getattr(kernels("deepseek_v4.mhc." + module), fn)(*args, token_block_size=64)
  theirs = peer.run_on_jax_pallas(EXP + "deepseek_v4.mhc." + module, fn, *args,
                                  token_block_size=64)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(theirs)):
    close(a, b, atol=1e-2, rtol=1e-3)


# --- deepseek_v4 indexer: streamindex_topk -------------------------------------------

def indexer_inputs(seed, q_lens, seq_lens, *, page_size=64, heads=4, comp=2):
  """fp8 (ue8m0-scaled, one scale per 128-row) compressed index keys laid out as
  test_streamindex_topk.py packs them: cache [pages, page_size // 4, 4, 256] uint8, each
  token's record 128 e4m3 bytes then its scale byte."""
  rng = np.random.default_rng(seed)
  seqs = len(q_lens)
  pages_per_seq = max(cdiv(s // comp, page_size) for s in seq_lens)
  pages = seqs * pages_per_seq
  keys = rng.standard_normal((pages, page_size, 128)).astype(np.float32)
  amax = np.maximum(np.abs(keys).max(-1, keepdims=True), 1e-4)
  scale = 2.0 ** np.ceil(np.log2(amax / 448.0))
  k8 = jnp.asarray(keys / scale, jnp.float8_e4m3fn)
  s8 = jnp.asarray(scale[..., 0], jnp.float8_e8m0fnu)
  deq = np.asarray(k8.astype(jnp.float32)) * scale
  record = jnp.concatenate([jax.lax.bitcast_convert_type(k8, jnp.uint8),
                            jax.lax.bitcast_convert_type(s8, jnp.uint8)[..., None],
                            jnp.zeros((pages, page_size, 127), jnp.uint8)], -1)
  cache = record.reshape(pages, page_size // 4, 4, 256)
  tokens = int(sum(q_lens))
  return dict(q=jnp.asarray(rng.standard_normal((tokens, heads, 128)), jnp.float32),
              w=jnp.asarray(rng.uniform(-1.5, 1.5, (tokens, heads)), jnp.float32),
              cache=cache, keys=deq, page_indices=rng.permutation(pages).astype(np.int32),
              pages_per_seq=pages_per_seq, q_lens=np.asarray(q_lens),
              seq_lens=np.asarray(seq_lens, np.int32), comp=comp)


def indexer_scores(x):
  """[T, S] f32 scores sum_h relu(q_h . key_s) w_h, -inf where the compressed key s is
  past the query's causal position (s * comp > pos) or past the sequence."""
  seqs = len(x["q_lens"])
  keys = x["keys"][x["page_indices"]].reshape(seqs, -1, 128)
  seq = np.repeat(np.arange(seqs), x["q_lens"])
  pos = np.concatenate([np.arange(s - n, s) for n, s in zip(x["q_lens"], x["seq_lens"])])
  dots = np.einsum("thd,tsd->ths", np.asarray(x["q"], np.float64), keys[seq])
  scores = (np.maximum(dots, 0) * np.asarray(x["w"], np.float64)[..., None]).sum(1)
  s = np.arange(keys.shape[1])[None]
  valid = (s * x["comp"] <= pos[:, None]) & (s < (x["seq_lens"][seq] // x["comp"])[:, None])
  return np.where(valid, scores, -np.inf)


def check_topk(got, scores, k):
  """got [T, k]: distinct valid indices first, -1 after, and they are a top-k set of scores."""
  got = np.asarray(got)
  for t in range(got.shape[0]):
    valid = np.isfinite(scores[t])
    n = min(k, int(valid.sum()))
    picked = got[t, :n]
    assert (got[t, n:] == -1).all(), t
    assert len(set(picked.tolist())) == n and valid[picked].all(), t
    kth = np.sort(scores[t][valid])[::-1][n - 1]
    # the kernel's scores use bf16 products: allow near-ties at the boundary
    assert scores[t, picked].min() >= kth - 1e-2 * max(1.0, abs(kth)), t


def indexer_call(x, k, bq=8, bkv=2):
  decodes = int(np.argmax(x["q_lens"] != 1)) if (x["q_lens"] != 1).any() else len(x["q_lens"])
  cu = np.concatenate([[0], np.cumsum(x["q_lens"])]).astype(np.int32)
  args = (x["q"], x["w"], x["cache"], jnp.asarray(x["seq_lens"]),
          jnp.asarray(x["page_indices"]), jnp.asarray(cu),
          jnp.asarray([decodes, decodes, len(x["q_lens"])], jnp.int32))
  return args, dict(k=k, compression_ratio=x["comp"], num_kv_pages_per_block=bkv,
                    num_queries_per_block=bq)


@pytest.mark.parametrize("q_lens,seq_lens,k", [
    ([1, 1, 1, 1, 1, 7, 12], [300, 90, 500, 17, 256, 400, 230], 128),  # batched decodes
    ([5, 3], [160, 60], 512),                                          # k past every length
])
def test_dsv4_streamindex_topk(q_lens, seq_lens, k):
  m = kernels("deepseek_v4.indexer.streamindex_topk")
  x = indexer_inputs(20, q_lens, seq_lens)
  args, kwargs = indexer_call(x, k)
  got = m.streamindex_topk(*args, **kwargs)
  assert got.shape == (sum(q_lens), k)
  check_topk(got, indexer_scores(x), k)


# JAX's TPU interpreter cannot run streamindex_topk either (DMAs through ref.reshape).


# --- deepseek_v4 compress_and_store: proj_and_save_state ------------------------------

@pytest.mark.xfail(strict=True, reason=(
    "C: DMA of run-time length from a bitcast VMEM ref (acc_ref.bitcast(uint8)"
    ".at[b, i, pl.ds(0, size)], proj_and_save_state.py:155) is refused by "
    "pallet/core/dma.py _dynamic_window"))
def test_dsv4_proj_and_save_state():
  """Projects hidden states, adds the position embedding and scatters each token's f32
  state into the uint8 state cache at slot_mapping (-1: skipped); the project's
  reference is project_and_save_state_ref.ref_wkv_proj_and_save_state."""
  m = kernels("deepseek_v4.compress_and_store.proj_and_save_state")
  ref = kernels("deepseek_v4.compress_and_store.project_and_save_state_ref")
  head_dim, ratio, block, hidden, tokens, pages = 512, 4, 4, 512, 20, 8
  slots = 2 * head_dim // 128                       # 128 f32 per 512-byte slot
  rng = np.random.default_rng(30)
  h = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((hidden, 2 * head_dim)) * 0.05, jnp.float32)
  ape = jnp.asarray(rng.standard_normal((ratio, head_dim)), jnp.float32)
  pos = jnp.arange(tokens, dtype=jnp.int32) + 3
  slot = jnp.asarray(rng.permutation(pages * block)[:tokens] * slots, jnp.int32).at[5].set(-1)
  cache = jnp.asarray(rng.integers(0, 256, (pages, block * slots, 4, 128)), jnp.uint8)
  got = m.proj_and_save_state(h, w, ape, pos, slot, cache, ratio)
  want = ref.ref_wkv_proj_and_save_state(h, w, ape, pos, slot, cache, block, head_dim, ratio,
                                         False)
  as_f32 = lambda c: jax.lax.bitcast_convert_type(
      c.reshape(pages, block, slots, 4, 128).swapaxes(-1, -2), jnp.float32)
  close(as_f32(got), as_f32(want), atol=1e-3, rtol=1e-4)


# --- modules that subclass or allocate pltpu.BufferedRef --------------------------------

BUFFERED_REF_MODULES = {
    # custom BufferedRef subclasses overriding copy_in/wait_in (per-token gather DMAs),
    # BufferedRef.create/input/output/input_output, pl.with_scoped(allocations=...)
    # and emit_pipeline(..., allocations=...)
    "deepseek_v4.rope": "rope.py:31 CosSinRef(pltpu.BufferedRef)",
    "deepseek_v4.o_projection": "imports deepseek_v4.rope",
    "deepseek_v4.compress_and_store.kernel": "buffered_ref.py:29 _BufferedRef subclasses",
    "stacked_rpa.wrapper": "decode/non_sliding_window/bref.py:31 BufferedRef subclass",
    "batched_rpa.wrapper": "bref_override.py:27 BufferedRef subclass",
}


@pytest.mark.parametrize("module", sorted(BUFFERED_REF_MODULES))
@pytest.mark.xfail(strict=True, raises=Exception, reason=(
    "C: subclassing pltpu.BufferedRef (the TPU pipeline scheduler's internals) is "
    "refused with a clear PalletError at import"))
def test_buffered_ref_modules_load(module):
  kernels(module)


# --- rpa_v3_cp: ragged paged attention with prefill context parallelism -----------------

CP = "rpa_v3_cp.kernel"
CP_PAGE, CP_PAGES, CP_SEQS = 16, 32, 8


def cp_cache(m, k, v, dtype):
  """A NaN-filled cache [pages, page, heads2 // packing, packing, 128] holding k/v's
  tokens (merged by the project's merge_kv) in its first pages."""
  packing = 4 // jnp.dtype(dtype).itemsize
  heads2 = cdiv(2 * k.shape[1], packing) * packing
  cache = jnp.full((CP_PAGES, CP_PAGE, heads2 // packing, packing, 128), jnp.nan, dtype)
  if k.shape[0] == 0:
    return cache
  kv = m.merge_kv(k, v)
  pad = cdiv(k.shape[0], CP_PAGE) * CP_PAGE - k.shape[0]
  kv = jnp.pad(kv, ((0, pad),) + ((0, 0),) * (kv.ndim - 1), constant_values=jnp.nan)
  kv = kv.reshape(-1, CP_PAGE, heads2 // packing, packing, 128)
  return cache.at[:kv.shape[0]].set(kv)


# the default block sizes come from TPU-generation tables: explicit ones for every case
CP_BLOCKS = dict(d_block_sizes=(32, 64, 32, 32), p_block_sizes=(32, 64, 32, 32),
                 m_block_sizes=(32, 64, 32, 32))


def cp_meta(kv_len, q_len, pages):
  pad = lambda xs, n: jnp.pad(jnp.asarray(xs, jnp.int32), (0, n - len(xs)))
  return (pad([kv_len], CP_SEQS), pad(np.arange(pages), CP_SEQS * pages),
          pad([0, q_len], CP_SEQS + 1), jnp.array([0, 0, 1], jnp.int32))


def causal_attention(q, k, v, offset=0, sm_scale=1.0):
  """f32 causal attention of q [Q, H, D] at positions offset.. over k/v [S, KH, D] (GQA)."""
  rep = q.shape[1] // k.shape[1]
  k, v = (jnp.repeat(a.astype(jnp.float32), rep, axis=1) for a in (k, v))
  s = jnp.einsum("qhd,shd->hqs", q.astype(jnp.float32), k) * sm_scale
  pos = offset + jnp.arange(q.shape[0])[:, None]
  s = jnp.where(jnp.arange(k.shape[0])[None] <= pos, s, -jnp.inf)
  return jnp.einsum("hqs,shd->qhd", jax.nn.softmax(s, -1), v)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rpa_v3_cp_current_head_tail(dtype):
  """Each rank's head and tail chunk of a fresh prefill attends the current KV causally
  (test_pcp_current_head_tail with P=2, S=128): compared with the project's
  ref_ragged_paged_attention over the whole sequence and a jax.numpy reference."""
  m = kernels(CP)
  P, S, nq, nkv, hd = 2, 128, 8, 2, 128
  C = S // (2 * P)
  rng = np.random.default_rng(40)
  q, k, v = (jnp.asarray(rng.random(s, np.float32), dtype)
             for s in [(S, nq, hd), (S, nkv, hd), (S, nkv, hd)])
  pages = cdiv(S, CP_PAGE)
  kv_lens, pi, _, dist = cp_meta(S, S, pages)
  # the project's reference in f32 (in bf16 it rounds its softmax to bf16, ~0.04 off)
  f32 = lambda a: a.astype(jnp.float32)
  expected = m.ref_ragged_paged_attention(
      f32(q), f32(k), f32(v), cp_cache(m, k[:0], v[:0], jnp.float32), kv_lens, pi,
      cp_meta(S, S, pages)[2], dist)[0][:S]
  close(expected, causal_attention(q, k, v), atol=1e-4, rtol=1e-4)
  tol = 1e-3 if dtype == jnp.float32 else 2e-2
  for rank in range(P):
    for chunk in (rank, 2 * P - 1 - rank):
      q_buf = jnp.zeros_like(q).at[:C].set(q[chunk * C:(chunk + 1) * C])
      out, _ = m.ragged_paged_attention(
          q_buf, k, v, cp_cache(m, k[:0], v[:0], dtype), kv_lens, pi, cp_meta(S, C, pages)[2],
          dist, cp_rank=jnp.array([rank], jnp.int32), cp_group_size=P,
          kv_cache_lens=jnp.zeros(CP_SEQS, jnp.int32),
          q_pos_offsets=jnp.zeros(CP_SEQS, jnp.int32).at[0].set(chunk * C),
          skip_cache_attn=True, update_kv_cache=False, use_causal_mask=True, **CP_BLOCKS)
      close(out[:C], expected[chunk * C:(chunk + 1) * C], atol=tol, rtol=tol)


@pytest.mark.slow  # ~25 s
def test_rpa_v3_cp_two_phase_chunked_prefill():
  """A previous cache (non-causal phase) and the current tokens (causal phase), merged
  by their log-sum-exps (test_pcp_two_phase_chunked_prefill, f32)."""
  m = kernels(CP)
  prev, cur, nq, nkv, hd = 64, 64, 8, 2, 128
  C, total = cur // 2, prev + cur
  rng = np.random.default_rng(41)
  k_all, v_all = (jnp.asarray(rng.random((total, nkv, hd), np.float32)) for _ in range(2))
  q_cur = jnp.asarray(rng.random((cur, nq, hd), np.float32))
  pages = cdiv(total, CP_PAGE)
  kv_lens, pi, _, dist = cp_meta(total, cur, pages)
  expected = causal_attention(q_cur, k_all, v_all, offset=prev)
  for chunk in (0, 1):
    q_buf = jnp.zeros_like(q_cur).at[:C].set(q_cur[chunk * C:(chunk + 1) * C])
    common = dict(cp_rank=jnp.array([0], jnp.int32), cp_group_size=1,
                  kv_cache_lens=jnp.zeros(CP_SEQS, jnp.int32).at[0].set(prev),
                  update_kv_cache=False, return_lse=True, **CP_BLOCKS)
    cache = lambda: cp_cache(m, k_all[:prev], v_all[:prev], jnp.float32)
    o1, _, l1 = m.ragged_paged_attention(
        q_buf, k_all[prev:], v_all[prev:], cache(), kv_lens, pi, cp_meta(total, C, pages)[2],
        dist, use_causal_mask=False, skip_current_attn=True, **common)
    o2, _, l2 = m.ragged_paged_attention(
        q_buf, k_all[prev:], v_all[prev:], cache(), kv_lens, pi, cp_meta(total, C, pages)[2],
        dist, use_causal_mask=True, skip_cache_attn=True,
        q_pos_offsets=jnp.zeros(CP_SEQS, jnp.int32).at[0].set(chunk * C), **common)
    o1, o2, l1, l2 = o1[:C], o2[:C], l1[:C], l2[:C]
    mx = jnp.maximum(l1, l2)
    e1, e2 = jnp.exp(l1 - mx), jnp.exp(l2 - mx)
    o = (o1 * e1[..., None] + o2 * e2[..., None]) / (e1 + e2)[..., None]
    close(o, expected[chunk * C:(chunk + 1) * C], atol=1e-3, rtol=1e-3)
