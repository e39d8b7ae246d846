"""The rest of sgl-project/sglang-jax's Pallas kernels (python/sgl_jax/srt/kernels), run on
pallet: quantized matmul (per channel and blockwise), the GPU paged attention, ragged paged
attention (the pre-v3 kernel, with a custom mask), fused MLP, KDA, fused MoE v2, the GDN
fused chunk-parallel prefill, the speculative-decoding kernels, DSA sparse MLA prefill and
top-k, and the multimodal flash/varlen attention.

The kernels are read from a checkout (PALLET_SGLANG_JAX_SOURCE) at test time; nothing of
sglang-jax is copied here. Each test compares with the project's own reference where it
has one and with a jax.numpy / float64 numpy reference written here, on random inputs;
one case per TPU kernel also with the same project code on JAX's own Pallas (TPU
interpreter, tests/foreign/peer.py). Block sizes are passed explicitly: the defaults read
TPU-generation tables. GPU (Triton-style) kernels run on the backend under test
(PALLET_TEST_BACKEND=triton: Triton's interpreter).
"""
from __future__ import annotations

import collections
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet
from tests.foreign import peer, projects
from tests.foreign.test_sglang_jax import _attention_reference, _rpa_case
from tests.helpers import current_test_backend

K = "sgl_jax.srt.kernels."
QMM = K + "quantized_matmul.quantized_matmul_kernels."
BACKEND = current_test_backend()

# The kernels' block-size record (`tuned_block_sizes.TunedValue`), as a class of this
# module: it travels pickled to the JAX-Pallas child process, which cannot import sgl_jax
# before it unpickles. The child imports this module as tests.foreign.test_sglang_jax_rest;
# pytest may have imported it under another name, so that name is made to find it here too.
_NAME = "tests.foreign.test_sglang_jax_rest"
sys.modules.setdefault(_NAME, sys.modules[__name__])
TunedValue = collections.namedtuple(
    "TunedValue", "batch_block_size out_block_size in_block_size n_lane_multiplier",
    defaults=(1,), module=_NAME)


def _close(actual, expected, atol, rtol, what=""):
  np.testing.assert_allclose(np.asarray(jnp.asarray(actual, jnp.float32), np.float64),
                             np.asarray(jnp.asarray(expected, jnp.float32), np.float64),
                             atol=atol, rtol=rtol, err_msg=what)


# ----------------------------------------------------------------------------------
# quantized_matmul: per-channel weights (kernel.py) and blockwise weights (blockwise_kernel.py)
# ----------------------------------------------------------------------------------

def _qmm_per_channel_reference(x, w_q, w_scale, x_q_dtype):
  """x @ dequant(w_q)^T, x quantized per row as the kernel's `util.quantize_array` does
  (scale = max|x| / dtype max, then a plain cast: truncation, no rounding); float64."""
  if x_q_dtype is not None:   # in float32 as the kernel: a cast truncates 126.99998 to 126
    info = jnp.finfo(x_q_dtype) if jnp.issubdtype(x_q_dtype, jnp.floating) else jnp.iinfo(x_q_dtype)
    scale = jnp.max(jnp.abs(x), -1, keepdims=True) / np.float32(info.max)
    x_q = (x * (1 / scale)).astype(x_q_dtype)
    x = np.asarray(x_q.astype(jnp.float32), np.float64) * np.asarray(scale, np.float64)
  x = np.asarray(x, np.float64)
  w = np.asarray(w_q.astype(jnp.float32), np.float64) * np.asarray(w_scale, np.float64)[:, None]
  return x @ w.T


@pytest.mark.parametrize("shape,blocks,x_q,w_q", [
    ((16, 256, 512), (8, 128, 128), jnp.int8, jnp.int8),          # 4 K steps: acc scratch
    ((20, 384, 256), (8, 128, 256), jnp.float8_e4m3fn, jnp.float8_e4m3fn),  # cached x_q
    ((16, 256, 512), (8, 128, 256), None, jnp.int8),               # activations unquantized
    ((16, 256, 512), (16, 256, 512), jnp.int8, jnp.int8),          # one block
])
def test_quantized_matmul_per_channel(shape, blocks, x_q, w_q):
  kernel = projects.load(QMM + "kernel")
  util = projects.load(QMM + "util")
  bs, n_out, n_in = shape
  rng = np.random.default_rng(n_in + bs)
  x = jnp.asarray(rng.standard_normal((bs, n_in)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((n_out, n_in)), jnp.float32)
  wq, ws = util.quantize_tensor(w, w_q, dim=1)
  ws = ws.reshape(-1)
  out = kernel.quantized_matmul_kernel(x, wq, ws, x_q_dtype=x_q, tuned_value=TunedValue(*blocks))
  _close(out, _qmm_per_channel_reference(x, wq, ws, x_q), atol=2e-3, rtol=1e-4)
  if x_q is None or x_q == jnp.float8_e4m3fn:
    # the project's reference quantizes with rounding (int8): equal only without int8 x
    _close(out, util.xla_quantized_matmul(x, wq, ws, quantize_activation=x_q is not None),
           atol=2e-3, rtol=1e-4)


def test_quantized_matmul_per_channel_on_jax_pallas():
  util = projects.load(QMM + "util")
  kernel = projects.load(QMM + "kernel")
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((16, 512)), jnp.float32)
  wq, ws = util.quantize_tensor(jnp.asarray(rng.standard_normal((256, 512)), jnp.float32),
                                jnp.int8, dim=1)
  args = (x, wq, ws.reshape(-1))
  kwargs = dict(x_q_dtype=jnp.int8, tuned_value=TunedValue(8, 128, 128))
  out = kernel.quantized_matmul_kernel(*args, **kwargs)
  theirs = peer.run_on_jax_pallas(QMM + "kernel", "quantized_matmul_kernel", *args, **kwargs)
  _close(out, theirs, atol=1e-4, rtol=1e-5)


def _qmm_blockwise_reference(x, w_q, w_scale, block, x_q_dtype, util):
  """sum over K blocks of quant(x_blk) @ w_q_blk^T * scale_blk (float64); x blocks are
  quantized with the project's `util.quantize_block` (per row, rounding for ints)."""
  x = np.asarray(x, np.float64)
  wq = np.asarray(w_q.astype(jnp.float32), np.float64)
  ws = np.asarray(w_scale, np.float64)        # [n_in // block, 1, n_out]
  out = 0.0
  for i in range(x.shape[1] // block):
    xs = x[:, i * block:(i + 1) * block]
    if x_q_dtype is not None:
      q, s = util.quantize_block(jnp.asarray(xs, jnp.float32), 1, x_q_dtype)
      xs = np.asarray(q.astype(jnp.float32), np.float64) * np.asarray(s, np.float64)
    out = out + xs @ wq[:, i * block:(i + 1) * block].T * ws[i]
  return out


@pytest.mark.parametrize("shape,block,blocks,x_q,w_q", [
    ((5, 256, 512), 128, (1, 256, 512, 1), jnp.float8_e4m3fn, jnp.float8_e4m3fn),
    ((16, 512, 512), 128, (8, 256, 256, 1), jnp.float8_e4m3fn, jnp.float8_e4m3fn),
    ((16, 512, 256), 128, (16, 512, 128, 2), None, jnp.int8),
    ((8, 512, 512), 256, (8, 512, 256, 1), None, jnp.float8_e4m3fn),
])
def test_quantized_matmul_blockwise(shape, block, blocks, x_q, w_q):
  kernel = projects.load(QMM + "blockwise_kernel")
  util = projects.load(QMM + "util")
  bs, n_out, n_in = shape
  rng = np.random.default_rng(n_out + bs)
  x = jnp.asarray(rng.standard_normal((bs, n_in)), jnp.float32)
  wq, ws = util.quantize_tensor(jnp.asarray(rng.standard_normal((n_out, n_in)), jnp.float32),
                                w_q, block_size=block)
  out = kernel.quantized_matmul_kernel(x, wq, ws, block_size=block, x_q_dtype=x_q,
                                       tuned_value=TunedValue(*blocks))
  # the kernel accumulates in bfloat16 (acc_dtype): relative error ~ 2^-8 of the sum
  _close(out, _qmm_blockwise_reference(x, wq, ws, block, x_q, util), atol=0.6, rtol=1e-2)


def test_quantized_matmul_blockwise_on_jax_pallas():
  kernel = projects.load(QMM + "blockwise_kernel")
  util = projects.load(QMM + "util")
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((16, 512)), jnp.float32)
  wq, ws = util.quantize_tensor(jnp.asarray(rng.standard_normal((512, 512)), jnp.float32),
                                jnp.float8_e4m3fn, block_size=128)
  args = (x, wq, ws)
  kwargs = dict(block_size=128, x_q_dtype=jnp.float8_e4m3fn, tuned_value=TunedValue(8, 256, 256))
  out = kernel.quantized_matmul_kernel(*args, **kwargs)
  theirs = peer.run_on_jax_pallas(QMM + "blockwise_kernel", "quantized_matmul_kernel", *args,
                                  **kwargs)
  _close(out, theirs, atol=1e-2, rtol=1e-3)   # both accumulate in bf16


def test_quantized_matmul_blockwise_int8_activations_on_jax_pallas():
  """int8 x int8: the kernel casts its float scales to its int32 accumulator type
  (`lhs_scale.astype(acc_dtype)`), so every scale becomes 0 and so does the output. A
  project bug: JAX's own Pallas gives the same zeros; pinned so a change shows."""
  kernel = projects.load(QMM + "blockwise_kernel")
  util = projects.load(QMM + "util")
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((16, 512)), jnp.float32)
  wq, ws = util.quantize_tensor(jnp.asarray(rng.standard_normal((512, 512)), jnp.float32),
                                jnp.int8, block_size=128)
  args = (x, wq, ws)
  kwargs = dict(block_size=128, x_q_dtype=jnp.int8, tuned_value=TunedValue(8, 256, 256))
  out = kernel.quantized_matmul_kernel(*args, **kwargs)
  theirs = peer.run_on_jax_pallas(QMM + "blockwise_kernel", "quantized_matmul_kernel", *args,
                                  **kwargs)
  np.testing.assert_array_equal(np.asarray(out), theirs)
  assert not np.asarray(out).any()


# ----------------------------------------------------------------------------------
# paged_attention: the GPU (Triton-style) decode kernel, k_splits partitions + final merge
# ----------------------------------------------------------------------------------

def _paged_reference(q, k_pages, v_pages, tables, lengths, scale, soft_cap=None):
  """softmax(scale q k^T) v over each sequence's first `length` tokens (float64)."""
  q, k_pages, v_pages = (np.asarray(jnp.asarray(a, jnp.float32), np.float64)
                         for a in (q, k_pages, v_pages))
  batch, heads, d = q.shape
  kv_heads = k_pages.shape[0]
  out = np.zeros_like(q)
  for b in range(batch):
    n, table = int(lengths[b]), np.asarray(tables[b])
    k = np.repeat(k_pages[:, table].reshape(kv_heads, -1, d)[:, :n], heads // kv_heads, 0)
    v = np.repeat(v_pages[:, table].reshape(kv_heads, -1, d)[:, :n], heads // kv_heads, 0)
    s = np.einsum("hd,hkd->hk", q[b], k) * scale
    if soft_cap is not None:
      s = soft_cap * np.tanh(s / soft_cap)
    p = np.exp(s - s.max(-1, keepdims=True))
    out[b] = np.einsum("hk,hkd->hd", p / p.sum(-1, keepdims=True), v)
  return out


@pytest.mark.parametrize("heads,kv_heads,ppb,k_splits,soft_cap,scaled,dtype", [
    (8, 2, 2, 2, None, False, jnp.float32),
    (4, 4, 4, 1, 20.0, False, jnp.float32),      # MHA, one partition, soft cap
    (32, 1, 1, 4, None, False, jnp.float32),     # 32 q heads per kv head: two head blocks
    (8, 2, 2, 2, None, True, jnp.float32),       # int8 K/V pages with per-token scales
    (8, 2, 4, 2, None, False, jnp.bfloat16),
])
def test_paged_attention_gpu(heads, kv_heads, ppb, k_splits, soft_cap, scaled, dtype):
  pa = projects.load(K + "paged_attention.paged_attention")
  rng = np.random.default_rng(heads + ppb)
  batch, d, page, pages, pps = 3, 64, 16, 40, 8
  q = jnp.asarray(rng.standard_normal((batch, heads, d)), dtype)
  kp = rng.standard_normal((kv_heads, pages, page, d))
  vp = rng.standard_normal((kv_heads, pages, page, d))
  tables = jnp.asarray(rng.permutation(pages)[:batch * pps].reshape(batch, pps), jnp.int32)
  lengths = jnp.asarray([37, 128, 5], jnp.int32)
  scales = {}
  if scaled:
    ks, vs = (rng.uniform(0.01, 0.03, (kv_heads, pages, page)) for _ in range(2))
    kq = np.clip(np.round(kp / ks[..., None]), -127, 127)
    vq = np.clip(np.round(vp / vs[..., None]), -127, 127)
    kp, vp = kq * ks[..., None], vq * vs[..., None]   # what the reference sees
    k_in, v_in = jnp.asarray(kq, jnp.int8), jnp.asarray(vq, jnp.int8)
    scales = dict(k_scales_pages=jnp.asarray(ks, jnp.float32),
                  v_scales_pages=jnp.asarray(vs, jnp.float32))
  else:
    kp, vp = (np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in (kp, vp))
    k_in, v_in = jnp.asarray(kp, dtype), jnp.asarray(vp, dtype)
  scale = d ** -0.5
  with pallet.default_backend(BACKEND):
    out = pa.paged_attention(q, k_in, v_in, tables, lengths, **scales, block_h=16,
                             pages_per_compute_block=ppb, k_splits=k_splits, sm_scale=scale,
                             attn_logits_soft_cap=soft_cap)
  tol = 1e-5 if dtype == jnp.float32 and not scaled else 2e-2
  expected = _paged_reference(q, kp, vp, tables, lengths, scale, soft_cap)
  _close(out, expected, atol=tol, rtol=tol)
  if not scaled:
    gather = lambda p: jnp.asarray(p[:, np.asarray(tables)]).swapaxes(0, 1).reshape(
        batch, kv_heads, -1, d).swapaxes(1, 2).astype(dtype)
    _close(out, pa.paged_attention_reference(q, gather(kp), gather(vp), lengths, sm_scale=scale,
                                             attn_logits_soft_cap=soft_cap),
           atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------
# ragged_paged_attention (the pre-v3 kernel): mixed prefill/decode, fused KV cache update,
# causal or a custom mask
# ----------------------------------------------------------------------------------

RPA = K + "ragged_paged_attention.ragged_paged_attention"


def _rpa_custom_mask(seqs, seed):
  """Per sequence a [q_len, kv_len] 0/1 mask, flattened and concatenated (int32); each row
  keeps its own (diagonal) token so that no row is empty."""
  rng = np.random.default_rng(seed)
  parts = []
  for q_len, kv_len in seqs:
    m = rng.integers(0, 2, (q_len, kv_len))
    m[np.arange(q_len), kv_len - q_len + np.arange(q_len)] = 1
    parts.append(m.reshape(-1))
  return np.concatenate(parts + [np.zeros(8, np.int64)]).astype(np.int32)


def _four_d(kernel_args):
  """Copies of the v3 case's arguments (the kernel donates its cache), the fused cache in
  this kernel's 4-D layout [pages, page, 2 * kv heads, head dim]."""
  args = [jnp.array(a, copy=True) if a is not None else None for a in kernel_args]
  args[3] = args[3].reshape(*args[3].shape[:2], -1, args[3].shape[-1])
  return tuple(args)


def _masked_reference(q, k_pages, v_pages, kv_lens, table, cu_q, mask, seqs, scale):
  q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
  group = q.shape[1] // k_pages.shape[2]
  out, start = [], 0
  for i, (q_len, kv_len) in enumerate(seqs):
    qs = q[cu_q[i]:cu_q[i + 1]]
    k = np.repeat(k_pages[np.asarray(table[i])].reshape(-1, *k_pages.shape[2:])[:kv_len], group, 1)
    v = np.repeat(v_pages[np.asarray(table[i])].reshape(-1, *v_pages.shape[2:])[:kv_len], group, 1)
    m = mask[start:start + q_len * kv_len].reshape(q_len, kv_len).astype(bool)
    start += q_len * kv_len
    s = np.where(m[None], np.einsum("qhd,khd->hqk", qs, k) * scale, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    out.append(np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v))
  return np.concatenate(out)


@pytest.mark.parametrize("seqs,hq,hkv,blocks,window,soft_cap", [
    ([(1, 20), (1, 37), (5, 40), (20, 20), (13, 50)], 4, 2, (2, 8), None, None),
    ([(1, 64), (7, 33), (16, 70)], 2, 1, (1, 16), 24, None),
    ([(1, 80), (3, 17), (9, 9)], 8, 2, (4, 8), None, 15.0),   # decode-only first
])
def test_ragged_paged_attention_causal(seqs, hq, hkv, blocks, window, soft_cap):
  rpa = projects.load(RPA)
  d, page = 128, 16
  kernel_args, cache_expected, ref_args, n = _rpa_case(
      seqs, hq=hq, hkv=hkv, d=d, page_size=page, dtype=jnp.float32, seed=hq + len(seqs))
  scale = d ** -0.5
  out, cache = rpa.ragged_paged_attention(
      *_four_d(kernel_args), sm_scale=scale, sliding_window=window, soft_cap=soft_cap,
      num_kv_pages_per_block=blocks[0], num_queries_per_block=blocks[1],
      vmem_limit_bytes=64 * 1024 * 1024)
  expected = rpa.ref_ragged_paged_attention(*ref_args, sm_scale=scale, sliding_window=window,
                                            soft_cap=soft_cap)
  _close(out[:n], expected[:n], atol=2e-5, rtol=2e-5)
  if soft_cap is None:
    _close(out[:n], _attention_reference(*ref_args[:6], scale, window)[:n], atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(np.asarray(cache).reshape(cache_expected.shape), cache_expected)


def test_ragged_paged_attention_custom_mask():
  rpa = projects.load(RPA)
  seqs = [(1, 20), (5, 40), (20, 20), (13, 50)]
  d, page, scale = 128, 16, 0.1
  kernel_args, cache_expected, ref_args, n = _rpa_case(
      seqs, hq=4, hkv=2, d=d, page_size=page, dtype=jnp.float32, seed=11)
  mask = _rpa_custom_mask(seqs, 11)
  kernel_args = _four_d(kernel_args)[:-1] + (jnp.asarray(mask),)
  out, cache = rpa.ragged_paged_attention(
      *kernel_args, causal=0, sm_scale=scale, num_kv_pages_per_block=2,
      num_queries_per_block=8, vmem_limit_bytes=64 * 1024 * 1024)
  expected = rpa.ref_ragged_paged_attention(*ref_args, custom_mask=jnp.asarray(mask),
                                            causal=False, sm_scale=scale)
  _close(out[:n], expected[:n], atol=2e-5, rtol=2e-5)
  _close(out[:n], _masked_reference(*ref_args[:6], mask, seqs, scale), atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(np.asarray(cache).reshape(cache_expected.shape), cache_expected)


# ----------------------------------------------------------------------------------
# fused_mlp: SwiGLU MLP, an emit_pipeline over the intermediate dimension per row block
# ----------------------------------------------------------------------------------

def _shard_map(f=None, *, check_rep=None, **kwargs):
  """`jax.shard_map` taking the `check_rep` argument JAX 0.12 renamed to `check_vma`
  (fused_mlp.py passes check_rep=False; a JAX API change, not the kernel's)."""
  if f is None:
    return lambda g: _shard_map(g, check_rep=check_rep, **kwargs)
  return jax.shard_map(f, check_vma=bool(check_rep), **kwargs)


@pytest.mark.parametrize("seq,hidden,inter,b_seq,b_inter,w_dtype", [
    (100, 128, 384, 32, 128, jnp.float32),    # padded rows, 3 pipeline steps
    (64, 256, 256, 64, 256, jnp.float32),     # one block each way
    (48, 128, 512, 16, 128, jnp.bfloat16),    # bf16 weights, upcast in the kernel
])
def test_fused_mlp(monkeypatch, seq, hidden, inter, b_seq, b_inter, w_dtype):
  mlp = projects.load(K + "fused_mlp")
  monkeypatch.setattr(mlp, "shard_map", _shard_map)
  rng = np.random.default_rng(seq + inter)
  x = jnp.asarray(rng.standard_normal((seq, hidden)) * 0.5, jnp.float32)
  wg, wu, wd = (np.asarray(jnp.asarray(rng.standard_normal(s) * 0.1, w_dtype), np.float64)
                for s in ((hidden, inter), (hidden, inter), (inter, hidden)))
  # gate and up interleaved per b_inter columns: [g0 u0 g1 u1 ...]
  wgu = np.concatenate([np.concatenate([wg[:, j:j + b_inter], wu[:, j:j + b_inter]], 1)
                        for j in range(0, inter, b_inter)], 1)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tensor",))
  out = mlp.apply_fused_mlp_with_padding(x, jnp.asarray(wgu, w_dtype), jnp.asarray(wd, w_dtype),
                                         mesh, b_seq, b_inter)
  xx = np.asarray(x, np.float64)
  g, u = xx @ wg, xx @ wu
  _close(out, (g / (1 + np.exp(-g)) * u) @ wd, atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------------
# kda: chunked Kimi delta attention (varlen), four Pallas stages, vs kda/naive.py
# ----------------------------------------------------------------------------------

KDA = K + "kda.kda"


def _kda_case(lens, gate_in_kernel, seed):
  h, dk, dv = 2, 128, 128
  t = sum(lens)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  keys = jax.random.split(jax.random.key(seed), 8)
  shape = (1, t, h, dk)
  q = 0.1 * jax.random.normal(keys[0], shape)
  k = jax.random.normal(keys[1], shape)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = 0.1 * jax.random.normal(keys[2], (1, t, h, dv))
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (1, t, h)))
  h0 = 0.1 * jax.random.normal(keys[7], (len(lens), h, dk, dv))
  a_log = -1.5 + 0.1 * jax.random.normal(keys[5], (h,))
  dt_bias = 0.1 + 0.2 * jax.random.normal(keys[6], (h, dk))
  if gate_in_kernel:
    raw = 0.25 + 0.2 * jax.random.normal(keys[3], shape)
    g = -jnp.exp(a_log)[None, None, :, None] * jax.nn.softplus(raw + dt_bias[None, None])
    extra = dict(use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias)
  else:
    raw = g = -0.3 * jax.nn.softplus(jax.random.normal(keys[3], shape))
    extra = {}
  args = (q, k, v, raw, beta)
  kwargs = dict(scale=dk ** -0.5, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                chunk_size=64, **extra)
  return args, kwargs, g


def _kda_naive(kda_args, kwargs, g, lens):
  naive = projects.load(K + "kda.naive")
  q, k, v, _, beta = kda_args
  cu, h0 = np.asarray(kwargs["cu_seqlens"]), kwargs["initial_state"]
  outs, finals = [], []
  for i in range(len(lens)):
    s, e = cu[i], cu[i + 1]
    o, h = naive.naive_recurrent_kda(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                                     scale=kwargs["scale"], initial_state=h0[i:i + 1],
                                     output_final_state=True)
    outs.append(o)
    finals.append(h[0])
  return jnp.concatenate(outs, 1), jnp.stack(finals)


@pytest.mark.parametrize("lens,gate_in_kernel", [
    ((70, 1, 130), False),
    ((64, 33, 5), True),
    ((0, 64, 33), True),     # a zero-length request
])
def test_chunk_kda(lens, gate_in_kernel):
  kda = projects.load(KDA)
  args, kwargs, g = _kda_case(lens, gate_in_kernel, seed=len(lens) + sum(lens))
  o, final, *_ = kda.chunk_kda_fwd(*args, **kwargs)
  o_ref, final_ref = _kda_naive(args, kwargs, g, lens)
  _close(o, o_ref, atol=1e-5, rtol=1e-4)
  # a zero-length request's final state is left unspecified (sglang-jax's own kda_test
  # checks only non-empty requests' states: primatrix/projects#326)
  nonempty = np.asarray(lens) > 0
  _close(np.asarray(final)[nonempty], np.asarray(final_ref)[nonempty], atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------
# fused_moe v2: expert-parallel fused MoE (1x1 mesh), bf16
# ----------------------------------------------------------------------------------

def _moe_reference(a, w1, w2, w3, weights, ids):
  """sum_k w_k * (silu(a W1_e) * (a W3_e)) W2_e (float64)."""
  f = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  a, w1, w2, w3, weights = (f(x) for x in (a, w1, w2, w3, weights))
  out = np.zeros_like(a)
  for t in range(a.shape[0]):
    for w, e in zip(weights[t], np.asarray(ids[t])):
      g, u = a[t] @ w1[e], a[t] @ w3[e]
      out[t] += w * ((g / (1 + np.exp(-g)) * u) @ w2[e])
  return out


@pytest.mark.slow
def test_fused_ep_moe_v2():
  """bf16, 4 experts, hidden = intermediate = 128, 16 tokens, top-2 (45-75 s here)."""
  moe = projects.load(K + "fused_moe.v2.kernel")
  experts, hidden, inter, tokens, top_k = 4, 128, 128, 16, 2
  keys = jax.random.split(jax.random.key(0), 5)
  cast = lambda x: (x / 10).astype(jnp.bfloat16)
  a = cast(jax.random.normal(keys[0], (tokens, hidden)))
  w1 = cast(jax.random.normal(keys[1], (experts, hidden, inter)))
  w2 = cast(jax.random.normal(keys[2], (experts, inter, hidden)))
  w3 = cast(jax.random.normal(keys[3], (experts, hidden, inter)))
  weights, ids = jax.lax.top_k(jax.random.normal(keys[4], (tokens, experts)), top_k)
  weights, ids = jax.nn.softmax(weights, -1), ids.astype(jnp.int32)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
  config = moe.FusedMoEBlockConfig(bt=8, bf=128, btc=8, bse=128)
  out = moe.fused_ep_moe_v2(mesh, a, w1, w2, w3, weights, ids, top_k, block_config=config)
  # bf16 output (values ~0.02): a few bf16 ulps
  _close(out, moe.ref_moe(a, w1, w2, w3, weights, ids, top_k), atol=5e-4, rtol=2e-2)
  _close(out, _moe_reference(a, w1, w2, w3, weights, ids), atol=5e-4, rtol=2e-2)


# ----------------------------------------------------------------------------------
# speculative: draft-tree verification (greedy, and target-only sampling), SMEM kernels
# ----------------------------------------------------------------------------------

SPEC = K + "speculative."


def _random_trees(bs, n, vocab, seed):
  """`bs` random draft trees of `n` nodes (node 0 the root, each node's parent an earlier
  node), as first-child / next-sibling links; token ids drawn from a small vocabulary so
  that drafts often match."""
  rng = np.random.default_rng(seed)
  first = np.full((bs, n), -1, np.int32)
  sibling = np.full((bs, n), -1, np.int32)
  for b in range(bs):
    last_child = {}
    for j in range(1, n):
      p = int(rng.integers(0, j))
      if p in last_child:
        sibling[b, last_child[p]] = j
      else:
        first[b, p] = j
      last_child[p] = j
  candidates = rng.integers(0, vocab, (bs, n)).astype(np.int32)
  index = (np.arange(bs)[:, None] * n + np.arange(n)[None]).astype(np.int32)
  return (jnp.asarray(candidates), jnp.asarray(index), jnp.asarray(first),
          jnp.asarray(sibling), rng)


def _accepted_predicts(predicts, accept_index, accept_num):
  """The predicts the kernel writes: one per accepted node (the rest stays unwritten)."""
  return [[int(predicts[i]) for i in accept_index[b, :accept_num[b] + 1]]
          for b in range(len(accept_num))]


@pytest.mark.parametrize("bs,n,steps,seed", [(2, 6, 4, 0), (4, 8, 5, 1), (3, 16, 6, 2)])
def test_verify_tree_greedy(bs, n, steps, seed):
  verify = projects.load(SPEC + "verify_tree_greedy_kernel")
  reference = projects.load(SPEC + "kernel")
  vocab = 4
  candidates, index, first, sibling, rng = _random_trees(bs, n, vocab, seed)
  # target logits whose argmax is a child's draft token most of the time
  logits = rng.standard_normal((bs * n, vocab)).astype(np.float32)
  for b in range(bs):
    for j in range(n):
      if first[b, j] >= 0 and rng.random() < 0.8:
        child = int(first[b, j])
        while sibling[b, child] >= 0 and rng.random() < 0.5:
          child = int(sibling[b, child])
        logits[b * n + j, int(candidates[b, child])] += 10
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  with jax.set_mesh(mesh):
    accept_index, accept_num, predicts = verify.verify_tree_greedy(
        speculative_num_steps=steps - 1, num_draft_tokens=n, draft_tokens=candidates,
        retrive_index=index, retrive_next_token=first, retrive_next_sibling=sibling,
        next_token_logits=jnp.asarray(logits))
  ref_index, ref_num, ref_predicts = reference.verify_tree_greedy(
      jnp.zeros(bs * n + 1, jnp.int32), jnp.full((bs, steps), -1, jnp.int32),
      jnp.zeros(bs, jnp.int32), candidates, index, first, sibling,
      jnp.argmax(jnp.asarray(logits), -1))
  np.testing.assert_array_equal(accept_index, ref_index)
  np.testing.assert_array_equal(accept_num, ref_num)
  assert np.asarray(accept_num).max() > 0      # the case accepts something
  assert (_accepted_predicts(np.asarray(predicts), np.asarray(accept_index), np.asarray(accept_num))
          == _accepted_predicts(np.asarray(ref_predicts), np.asarray(ref_index),
                                np.asarray(ref_num)))


@pytest.mark.xfail(strict=True, raises=TypeError, reason=(
    "P: the kernel does not trace on any Pallas: its init loop's fori_loop body returns () "
    "for a None carry (JAX's own TypeError); sglang-jax's test of it returns early ('this "
    "kernel still have some problems')"))
@pytest.mark.parametrize("bs,n,steps,thresholds,seed", [(3, 8, 5, (0.3, 0.6), 1)])
def test_tree_speculative_sampling_target_only(bs, n, steps, thresholds, seed):
  sampling = projects.load(SPEC + "tree_speculative_sampling_target_only_kernel")
  reference = projects.load(SPEC + "kernel")
  vocab = 8
  candidates, index, first, sibling, rng = _random_trees(bs, n, vocab, seed)
  target = jax.nn.softmax(jnp.asarray(rng.standard_normal((bs * n, vocab)) * 2, jnp.float32))
  coins = jnp.asarray(rng.uniform(size=(bs, n)), jnp.float32)
  final_coins = jnp.asarray(rng.uniform(size=(bs,)), jnp.float32)
  args = (candidates, index, first, sibling, coins, final_coins, target,
          jnp.zeros_like(target))
  fresh = lambda: (jnp.full(bs * n, -1, jnp.int32), jnp.full((bs, steps), -1, jnp.int32),
                   jnp.zeros(bs, jnp.int32))
  kw = dict(threshold_single=thresholds[0], threshold_acc=thresholds[1], deterministic=True)
  accept_index, accept_num, predicts = sampling.tree_speculative_sampling_target_only_pallas_call(
      *fresh(), *args, **kw)
  ref_index, ref_num, ref_predicts = reference.tree_speculative_sampling_target_only(
      *fresh(), *args, **kw)
  np.testing.assert_array_equal(accept_index, ref_index)
  np.testing.assert_array_equal(accept_num, ref_num)
  assert (_accepted_predicts(np.asarray(predicts), np.asarray(accept_index), np.asarray(accept_num))
          == _accepted_predicts(np.asarray(ref_predicts), np.asarray(ref_index),
                                np.asarray(ref_num)))


def _eagle_case(bs, topk, depth, n, seed):
  """Draft trees as EAGLE builds them: per request, `parents` [topk * (depth - 1) + 1]
  (entry 0 is the root's -1, entry b >= 1 the flattened id of the token whose top-k
  children form block b) and `selected` (n - 1 flattened token ids, ascending, each one's
  parent selected too). Returns the inputs and, per request, each node's parent node
  (node 0 the verified token, node i + 1 the token selected[i])."""
  rng = np.random.default_rng(seed)
  parents = np.zeros((bs, topk * (depth - 1) + 1), np.int32)
  selected = np.zeros((bs, n - 1), np.int32)
  parent_nodes = []
  level_start = lambda i: 0 if i == 0 else topk + (i - 1) * topk * topk
  for b in range(bs):
    parents[b, 0] = -1
    expanded = {}                         # block -> parent token id
    for i in range(1, depth):             # level i's blocks: children of level i-1 picks
      prev = np.arange(level_start(i - 1),
                       level_start(i - 1) + (topk if i == 1 else topk * topk))
      picks = rng.choice(prev, topk, replace=False)
      for c, token in enumerate(picks):
        parents[b, 1 + (i - 1) * topk + c] = token
        expanded[1 + (i - 1) * topk + c] = int(token)
    chosen = set()
    parent_of = lambda t: None if t // topk == 0 else expanded[t // topk]
    candidates = list(range(topk))
    while len(chosen) < n - 1:
      t = int(rng.choice(candidates))
      chosen.add(t)
      candidates = [c for c in range(level_start(depth - 1) + topk * topk)
                    if c not in chosen and (parent_of(c) is None or parent_of(c) in chosen)]
    sel = sorted(chosen)
    selected[b] = sel
    parent_nodes.append([None] + [0 if parent_of(t) is None else sel.index(parent_of(t)) + 1
                                  for t in sel])
  return parents, selected, parent_nodes


def _eagle_module():
  """The kernel module as written: it imports `sync_copy` from JAX's private
  `jax._src.pallas.mosaic.helpers`, which the loader routes to pallet.tpu."""
  import pallet.tpu
  build = projects.load(SPEC + "build_eagle_tree_structure_kernel")
  assert build.sync_copy is pallet.tpu.sync_copy
  return build


@pytest.mark.parametrize("bs,topk,depth,n,seed", [(2, 2, 3, 5, 0), (3, 4, 4, 8, 1)])
def test_build_eagle_tree_structure(bs, topk, depth, n, seed):
  build = _eagle_module()
  parents, selected, parent_nodes = _eagle_case(bs, topk, depth, n, seed)
  seq_lens = np.array([5, 11, 3][:bs], np.int32)
  max_context = 16
  out = build.build_eagle_tree_structure_pallas_call(
      jnp.asarray(parents), jnp.asarray(selected), jnp.asarray(seq_lens),
      jnp.asarray(int(seq_lens.sum())), draft_token_num=n, topk=topk,
      max_context_len=max_context)
  mask, positions, index, next_token, next_sibling = (np.asarray(a) for a in out)
  # expected: depth-based positions, first child / next sibling in node order, and a full
  # mask row per draft token: the request's context, then its ancestors-or-self in the tree
  exp_mask = np.zeros_like(mask)
  start = 0
  for b in range(bs):
    pn, s = parent_nodes[b], int(seq_lens[b])
    depth_of = lambda j: 0 if j == 0 else 1 + depth_of(pn[j])
    np.testing.assert_array_equal(positions[b * n:(b + 1) * n], [s + depth_of(j) for j in range(n)])
    np.testing.assert_array_equal(index[b], b * n + np.arange(n))
    first = np.full(n, -1)
    sibling = np.full(n, -1)
    for j in range(n - 1, 0, -1):
      sibling[j], first[pn[j]] = first[pn[j]], j
    np.testing.assert_array_equal(next_token[b], first)
    np.testing.assert_array_equal(next_sibling[b], sibling)
    for j in range(n):
      row = np.zeros(s + n, np.int32)
      row[:s + 1] = 1
      a = j
      while a:
        row[s + a] = 1
        a = pn[a]
      exp_mask[start:start + s + n] = row
      start += s + n
  np.testing.assert_array_equal(mask, exp_mask)


def test_build_eagle_tree_structure_on_jax_pallas():
  parents, selected, _ = _eagle_case(2, 4, 4, 8, 3)
  args = (jnp.asarray(parents), jnp.asarray(selected), jnp.asarray([7, 2], jnp.int32),
          jnp.asarray(9, jnp.int32))
  kw = dict(draft_token_num=8, topk=4, max_context_len=16)
  build = _eagle_module()
  ours = build.build_eagle_tree_structure_pallas_call(*args, **kw)
  theirs = peer.run_on_jax_pallas(SPEC + "build_eagle_tree_structure_kernel",
                                  "build_eagle_tree_structure_pallas_call", *args, **kw)
  for a, b in zip(ours, theirs):
    np.testing.assert_array_equal(np.asarray(a), b)


# ----------------------------------------------------------------------------------
# multimodal kernels: packed variable-length attention, and the (JAX-derived) flash attention
# ----------------------------------------------------------------------------------

MM = K.replace("kernels.", "multimodal.kernels.")


def _varlen_reference(q, k, v, lens, scale, window, soft_cap=None):
  """Per packed sequence attention with a (left, right) window, -1 = unbounded (float64)."""
  q, k, v = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q, k, v))
  group = q.shape[1] // k.shape[1]
  out = np.zeros_like(q)
  start = 0
  for n in lens:
    qs, ks, vs = (a[start:start + n] for a in (q, k, v))
    ks, vs = np.repeat(ks, group, 1), np.repeat(vs, group, 1)
    s = np.einsum("qhd,khd->hqk", qs, ks) * scale
    if soft_cap is not None:
      s = soft_cap * np.tanh(s / soft_cap)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    m = np.ones((n, n), bool)
    if window[0] >= 0:
      m &= j >= i - window[0]
    if window[1] >= 0:
      m &= j <= i + window[1]
    s = np.where(m[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    out[start:start + n] = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), vs)
    start += n
  return out


@pytest.mark.parametrize("lens,hq,hkv,window,soft_cap,dtype", [
    ((63, 129, 40), 4, 4, (-1, -1), None, jnp.bfloat16),    # the MHA fast path
    ((33, 129), 8, 2, (-1, 0), None, jnp.float32),          # GQA, causal
    ((50, 7, 90), 2, 1, (16, 16), 20.0, jnp.float32),       # local window, soft cap
])
def test_varlen_attention(lens, hq, hkv, window, soft_cap, dtype):
  va = projects.load(MM + "varlen_attention")
  rng = np.random.default_rng(sum(lens))
  t = sum(lens) + 5                                       # 5 padding rows
  q = jnp.asarray(rng.standard_normal((t, hq, 128)), dtype)
  k = jnp.asarray(rng.standard_normal((t, hkv, 128)), dtype)
  v = jnp.asarray(rng.standard_normal((t, hkv, 128)), dtype)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  num = jnp.asarray([len(lens)], jnp.int32)
  kw = dict(window_size=window, sm_scale=128 ** -0.5, soft_cap=soft_cap)
  out = va.varlen_attention(q, k, v, cu, num, max_seq_len=max(lens), num_queries_per_block=32,
                            num_kv_per_block=64, **kw)
  n = sum(lens)
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  _close(out[:n], va.ref_varlen_attention(q, k, v, cu, num, **kw)[:n], atol=tol, rtol=tol)
  _close(out[:n], _varlen_reference(q, k, v, lens, 128 ** -0.5, window, soft_cap)[:n],
         atol=tol, rtol=tol)


@pytest.mark.parametrize("causal,use_ab,use_segments", [
    (False, False, False), (True, False, False), (False, True, True), (True, True, False)])
def test_multimodal_flash_attention(causal, use_ab, use_segments):
  fa = projects.load(MM + "flash_attention")
  rng = np.random.default_rng(int(causal) + 2 * int(use_ab))
  b, h, n, d = 2, 2, 256, 128
  q, k, v = (jnp.asarray(rng.standard_normal((b, h, n, d)), jnp.float32) for _ in range(3))
  ab = jnp.asarray(rng.standard_normal((b, h, n, n)), jnp.float32) if use_ab else None
  seg = None
  if use_segments:
    ids = jnp.asarray(np.repeat([[0, 1, 2, 3]], b, 0).repeat(n // 4, 1), jnp.int32)
    seg = fa.SegmentIds(q=ids, kv=ids)
  sizes = fa.BlockSizes(block_q=128, block_k_major=128, block_k=128, block_b=1)
  out = fa.flash_attention(q, k, v, ab, seg, causal=causal, sm_scale=0.1, block_sizes=sizes)
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest")
  if ab is not None:
    s = s + ab
  s = s * 0.1
  mask = np.ones((n, n), bool)
  if causal:
    mask &= np.tril(np.ones((n, n), bool))
  m = jnp.asarray(mask)[None, None]
  if seg is not None:
    m = m & (seg.q[:, None, :, None] == seg.kv[:, None, None, :])
  p = jax.nn.softmax(jnp.where(m, s, -jnp.inf), -1)
  expected = jnp.einsum("bhqk,bhkd->bhqd", p, v, precision="highest")
  _close(out, expected, atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------------
# dsa: sparse MLA prefill (selected KV units per query; flat or paged latent cache)
# ----------------------------------------------------------------------------------

def _sparse_mla_reference(q, kv, token_ids, positions, lkv, scale):
  """Softmax over each query's selected tokens that are causal (id <= position) and in
  range; value = the first lkv latent columns (float64). q [B,S,H,Dk], kv [B,T,Dk]."""
  q, kv = np.asarray(q, np.float64), np.asarray(kv, np.float64)
  b_, s_, h_, _ = q.shape
  out = np.zeros((b_, s_, h_, lkv))
  for b in range(b_):
    for s in range(s_):
      ids = token_ids[b, s]
      ids = ids[(ids >= 0) & (ids <= positions[b, s]) & (ids < kv.shape[1])]
      k = kv[b, ids]
      logits = q[b, s] @ k.T * scale
      p = np.exp(logits - logits.max(-1, keepdims=True))
      out[b, s] = (p / p.sum(-1, keepdims=True)) @ k[:, :lkv]
  return out


@pytest.mark.parametrize("read_block,units,block_units,paged", [
    (16, 3, 3, False),     # page-level units, one chunk
    (16, 3, 3, True),      # the same from a paged cache, pages shuffled
    (1, 24, 8, False),     # token-level units, three chunks
    (16, 4, 2, True),
])
def test_sparse_mla_prefill(read_block, units, block_units, paged):
  smp = projects.load(K + "dsa.sparse_mla_prefill")
  rng = np.random.default_rng(read_block + units + int(paged))
  b_, s_, h_, lkv, rope, page, t = 2, 6, 4, 128, 64, 16, 64
  dk = lkv + rope
  q = jnp.asarray(rng.standard_normal((b_, s_, h_, dk)) * 0.3, jnp.float32)
  kv = rng.standard_normal((b_, t, dk)).astype(np.float32) * 0.3
  positions = np.stack([np.linspace(read_block, t - 1, s_).astype(np.int32)] * b_)
  idx = np.full((b_, s_, units), -1, np.int32)
  for b in range(b_):
    for s in range(s_):
      reachable = int(positions[b, s]) // read_block + 1
      n = min(units, reachable)
      pick = rng.choice(reachable, n, replace=False)
      pick[0] = 0 if 0 not in pick else pick[0]        # one causal unit at least
      idx[b, s, :n] = pick
  token_ids = (idx[..., None] * read_block + np.arange(read_block)).reshape(b_, s_, -1)
  token_ids = np.where(np.repeat(idx, read_block, -1) >= 0, token_ids, -1)
  kw = dict(kv_lora_rank=lkv, read_block=read_block, block_units=block_units,
            sm_scale=dk ** -0.5)
  if paged:   # [pages, page // 2, 2, Dk padded to 128s], pages in random order
    pages_per_seq = t // page
    perm = rng.permutation(b_ * pages_per_seq)
    table = perm.reshape(b_, pages_per_seq).astype(np.int32)
    width = -(-dk // 128) * 128
    cache = np.zeros((b_ * pages_per_seq, page // 2, 2, width), np.float32)
    for b in range(b_):
      for tok in range(t):
        cache[table[b, tok // page], (tok % page) // 2, tok % 2, :dk] = kv[b, tok]
    out = smp.sparse_mla_attention(q, jnp.asarray(cache), jnp.asarray(idx),
                                   jnp.asarray(positions), page_table=jnp.asarray(table),
                                   page_size=page, seq_len=t, **kw)
  else:
    out = smp.sparse_mla_attention(q, jnp.asarray(kv), jnp.asarray(idx),
                                   jnp.asarray(positions), **kw)
  _close(out, _sparse_mla_reference(q, kv, token_ids, positions, lkv, dk ** -0.5),
         atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("q_lens,kv_lens,k", [
    ([1, 1, 1], [40, 300, 130], 32),     # batched decode, uneven lengths
    ([4, 2], [200, 150], 64),            # prefill chunks
    ([1, 5], [90, 260], 32),             # decode then prefill
])
def test_streamindex_topk_bf16(q_lens, kv_lens, k):
  """Lightning-indexer top-k over a bf16 paged key cache: every returned position is
  causal, distinct and scores within rounding of the k-th best exact score (f64 oracle
  on the same bf16 values), with -1 padding only at the end."""
  topk = projects.load(K + "dsa.streamindex_topk")
  rng = np.random.default_rng(sum(kv_lens))
  page, h, d, num_pages = 64, 4, 128, 24
  b_ = len(kv_lens)
  pps = max(-(-s // page) for s in kv_lens) + 1
  table = (rng.permutation(num_pages - 1)[:b_ * pps] + 1).reshape(b_, pps).astype(np.int32)
  t = sum(q_lens)
  q = jnp.asarray(rng.standard_normal((t, h, d)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  keys = jnp.asarray(rng.standard_normal((num_pages, page, d)), jnp.bfloat16)
  cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  decode = next((i for i, n in enumerate(q_lens) if n != 1), b_)
  got = np.asarray(topk.streamindex_topk(
      q=q, indexer_weights=w, cache_kv=keys.reshape(num_pages, page // 2, 2, d),
      seq_lens=jnp.asarray(kv_lens, jnp.int32), page_indices=jnp.asarray(table.reshape(-1)),
      cu_q_lens=jnp.asarray(cu_q), distribution=jnp.asarray([decode, decode, b_], jnp.int32),
      k=k, compression_ratio=1, num_kv_pages_per_block=2, num_queries_per_block=8))
  kf = np.asarray(keys.astype(jnp.float32), np.float64)
  qf = np.asarray(q.astype(jnp.float32), np.float64)
  wf = np.asarray(w, np.float64)
  for b in range(b_):
    kv = kf[table[b]].reshape(-1, d)[:kv_lens[b]]
    for i in range(q_lens[b]):
      row = cu_q[b] + i
      end = kv_lens[b] - q_lens[b] + i + 1
      scores = np.maximum(np.einsum("hd,sd->hs", qf[row], kv[:end]), 0).T @ wf[row]
      n = min(k, end)
      ids = got[row]
      assert (ids[n:] == -1).all() and (ids[:n] >= 0).all(), (row, ids)
      chosen = ids[:n]
      assert len(set(chosen.tolist())) == n and chosen.max() < end, (row, chosen)
      kth = np.sort(scores)[::-1][n - 1]
      assert scores[chosen].min() >= kth - 1e-3 * max(1.0, abs(kth)), (row, chosen)


# ----------------------------------------------------------------------------------
# gdn fused_chunk_parallel (conv1d + gated delta rule in one kernel)
# ----------------------------------------------------------------------------------

@pytest.mark.xfail(strict=True, raises=pallet.PalletError,
                   reason="C: gdn/fused_chunk_parallel/memory_ref.py subclasses "
                   "pltpu.BufferedRef, which pallet does not support (its pipeline has no "
                   "scheduler buffers): a clear PalletError at import")
def test_gdn_fused_chunk_parallel_imports():
  projects.load(K + "gdn.fused_chunk_parallel.wrapper")
