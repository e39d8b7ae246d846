"""apple/axlearn's Pallas kernels (GPU/Triton-style and TPU-style), run on pallet.

The kernels are read from a checkout (PALLET_AXLEARN_SOURCE) at test time; nothing of
axlearn is copied here. Each test calls a kernel (or the thin axlearn layer class that
launches it: PallasGPUFlashAttention, GPUDecoding, TPUSplashAttention, ...) on fresh random
inputs from axlearn's own `generate_attention_data`, and compares it with axlearn's own
reference (ReferenceMHA, the linear-scan linear attention, `scatter_update_pages`) and,
where it is cheap, a plain jax.numpy reference written here.

The GPU kernels run on the backend under test (PALLET_TEST_BACKEND=triton: Triton's
interpreter); the TPU kernels run on the XLA backend only.

axlearn pins jax 0.8.3. A few of its modules use APIs that JAX 0.12 changed; where such a
thing is only plumbing (a kernel's name, a private import, a loop written for an older
JAX), a test adapts it module-locally with `monkeypatch` and says so, and the unmodified
path is kept as a skip (class D) or, where pallet is at fault, a strict xfail.
"""
from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet
import pallet.tpu as pltpu
from tests.foreign import projects
from tests.helpers import current_test_backend

FA = "axlearn.common.flash_attention."
BACKEND = current_test_backend()

tpu_only = pytest.mark.skipif(
    BACKEND != "xla", reason="TPU kernels run on the XLA backend; the Triton run covers the GPU kernels")


@pytest.fixture
def gpu_backend():
  """Runs a GPU kernel's own pallas_calls on the backend under test."""
  if BACKEND == "xla":
    yield BACKEND
    return
  with pallet.default_backend(BACKEND):
    yield BACKEND


def _close(actual, expected, atol, rtol, what=""):
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                             atol=atol, rtol=rtol, err_msg=what)


def _tol(dtype):
  # f32: the kernels differ from the references by ~1e-6 here; 16-bit: rounding of p and o
  return {jnp.float32: dict(atol=1e-4, rtol=1e-4),
          jnp.float16: dict(atol=1e-2, rtol=1e-2),
          jnp.bfloat16: dict(atol=5e-2, rtol=2e-2)}[dtype]


def _reference_mha(cfg):
  return projects.load(FA + "common").ReferenceMHA.default_config().set(**cfg).instantiate()


def _grads(fn, batch, cotangent, names=("query", "key", "value")):
  """d<fn(batch), cotangent>/d batch[names] (a fixed random cotangent, not a mean)."""
  def loss(floats):
    return jnp.sum(fn({**batch, **floats}).astype(jnp.float32) * cotangent)
  return jax.grad(loss)({n: batch[n] for n in names})


def _check_layer(fn, batch, *, dtype, grad=True, ref_batch=None, names=("query", "key", "value")):
  """`fn` (an axlearn attention layer) against ReferenceMHA, forward and through jax.grad."""
  cfg = dict(softmax_scale=fn.config.softmax_scale, dropout_rate=fn.config.dropout_rate)
  ref = _reference_mha(cfg)
  if ref_batch is not None:   # e.g. the kernel's own dropout mask
    ref = functools.partial(ref, **ref_batch)
  out = fn(batch)
  with jax.default_matmul_precision("highest"):
    expected = ref(batch)
  _close(out, expected, **_tol(dtype), what="forward")
  if not grad:
    return out
  cotangent = jax.random.normal(jax.random.key(3), out.shape, jnp.float32)
  got = _grads(fn, batch, cotangent, names)
  with jax.default_matmul_precision("highest"):
    want = _grads(ref, batch, cotangent, names)
  for name in names:
    _close(got[name], want[name], **_tol(dtype), what=f"d{name}")
  return out


def _attention_data(*args, **kwargs):
  return projects.load(FA + "test_utils").generate_attention_data(*args, **kwargs)


def _masks():
  return projects.load("axlearn.common.attention_bias")


# ----------------------------------------------------------------------------------
# rattention/kernels/linear_attention_kernels.py (residual linear attention, fwd + bwd)
# ----------------------------------------------------------------------------------
RLA = "axlearn.common.rattention.kernels."


def test_linear_attention_unmodified():
  pytest.skip("D: the kernel bodies assign into a fori_loop carry value "
              "(`h_carry_ref[:, :] = next_h_block`), 'JAX arrays are immutable' on JAX 0.12, "
              "on JAX's own Pallas too (axlearn pins jax 0.8.3; its test runs on TPU only)")


def _ref_carry_fori_loop(lower, upper, body, init):
  """fori_loop whose carry the body sees as refs (run_scoped VMEM), as the axlearn loop
  bodies expect (they read `carry[:, :]` and write `carry[:, :] = ...`)."""
  leaves, tree = jax.tree.flatten(init)

  def scoped(*refs):
    for ref, value in zip(refs, leaves):
      ref[...] = value
    carry = jax.tree.unflatten(tree, list(refs))

    def step(t, unused):
      body(t, carry)
      return unused
    jax.lax.fori_loop(lower, upper, step, 0)
    return tuple(ref[...] for ref in refs)

  out = pallet.run_scoped(scoped, *[pltpu.VMEM(x.shape, x.dtype) for x in leaves])
  return jax.tree.unflatten(tree, list(out))


def _linear_attention_own_reference(q, k, v, h0, feat_fwd, window):
  """o_t = phi(q_t) (h0 + sum_{s <= t - window - 1} phi(k_s)^T v_s), by masked matmuls."""
  group = q.shape[1] // k.shape[1]
  k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
  fq, fk = feat_fwd(q), feat_fwd(k)
  length = q.shape[2]
  mask = jnp.arange(length)[:, None] - jnp.arange(length)[None, :] >= window + 1
  scores = jnp.einsum("bhtd,bhsd->bhts", fq, fk, precision="highest") * mask
  return (jnp.einsum("bhts,bhsd->bhtd", scores, v, precision="highest")
          + jnp.einsum("bhtd,bhde->bhte", fq, h0, precision="highest"))


@tpu_only
@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
def test_linear_attention_forward_and_grad(monkeypatch, feature_map):
  la = projects.load(RLA + "linear_attention_kernels")
  utils = projects.load(RLA + "utils")
  # adaptation (see test_linear_attention_unmodified): only the loop is swapped
  monkeypatch.setattr(la, "fori_loop", _ref_carry_fori_loop)
  b, h, kvh, length, d = 1, 2, 1, 512, 128
  keys = jax.random.split(jax.random.key(0), 5)
  q = jax.random.uniform(keys[0], (b, h, length, d))
  k = jax.random.uniform(keys[1], (b, kvh, length, d))
  v = jax.random.uniform(keys[2], (b, kvh, length, d))
  h0 = jax.random.uniform(keys[3], (b, h, 2 * d, d))   # 2*d: the feature maps double dk
  do = jax.random.uniform(keys[4], (b, h, length, d))
  fm = utils.FeatureMap(feature_map)
  kw = dict(window_size=127, feat_map=fm, chunk_size=256)   # 2 chunks of 2 subchunks
  kernel = lambda *a: la.residual_linear_attention(*a, **kw)
  scan = lambda *a: la.residual_linear_attention_linear_scan(*a, **kw)[0]
  out, vjp = jax.vjp(kernel, q, k, v, h0)
  expected, ref_vjp = jax.vjp(scan, q, k, v, h0)
  scale = float(jnp.abs(expected).max())   # relu features grow to ~1e4 here
  tol = dict(atol=1e-5 * scale, rtol=1e-4)
  _close(out, expected, **tol, what="o vs linear scan")
  own = _linear_attention_own_reference(q, k, v, h0, utils.get_feature_map(fm).fwd, 127)
  _close(out, own, **tol, what="o vs jnp reference")
  # dq and dk go through the feature maps' backward, y * (dy - <dy, y>), which cancels: the
  # linear scan's and the masked-matmul reference's float32 gradients already differ by
  # 2-3e-4 of their largest entry (softmax map), so the gradients get 1e-3 of it
  for name, got, want in zip(["dq", "dk", "dv", "dh0"], vjp(do), ref_vjp(do)):
    _close(got, want, atol=1e-3 * float(jnp.abs(want).max()), rtol=1e-4, what=name)


# ----------------------------------------------------------------------------------
# flash_attention/gpu_attention.py (Triton flash attention: forward, dK/dV and dQ kernels)
# ----------------------------------------------------------------------------------

def _gpu_flash_layer(d, block):
  ga = projects.load(FA + "gpu_attention")
  return ga.PallasGPUFlashAttention.default_config().set(
      softmax_scale=d ** -0.5, gpu_block_size=block).instantiate()


def _mha_own_reference(q, k, v, bias, segment_ids, causal, scale):
  """[B, T, H, D] attention: scale, then bias, causal and segment masks."""
  s = jnp.einsum("bthd,bshd->bhts", q, k, precision="highest") * scale
  if bias is not None:
    s = s + bias
  mask = jnp.ones(s.shape, bool)
  if causal:
    mask &= jnp.arange(q.shape[1])[:, None] >= jnp.arange(k.shape[1])[None, :]
  if segment_ids is not None:
    mask &= segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
  p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
  return jnp.einsum("bhts,bshd->bthd", p, v, precision="highest")


GPU_FLASH_CASES = [
    # b, t, kv, h, d, causal, bias, segments, dtype
    pytest.param(1, 128, 128, 2, 64, True, None, False, jnp.float32, id="causal"),
    pytest.param(1, 128, 128, 2, 64, False, "4d", True, jnp.float32, id="bias4d-segments"),
    pytest.param(2, 64, 128, 2, 72, False, "2d", False, jnp.float32, id="bias2d-cross-d72"),
    pytest.param(1, 128, 128, 2, 64, True, None, True, jnp.float16, id="fp16-causal-segments"),
]


@pytest.mark.usefixtures("gpu_backend")
@pytest.mark.parametrize("b,t,kv,h,d,causal,bias_type,segments,dtype", GPU_FLASH_CASES)
def test_gpu_flash_attention_forward_and_grad(b, t, kv, h, d, causal, bias_type,
                                              segments, dtype):
  masks = _masks()
  q, k, v, bias = _attention_data(b, t, kv, h, d, mask_fn=masks.causal_mask if causal else None,
                                  attention_bias_type=bias_type, with_segment_ids=segments,
                                  dtype=dtype)
  fn = _gpu_flash_layer(d, 64)
  batch = dict(query=q, key=k, value=v, bias=bias, logit_sink=None)
  out = _check_layer(fn, batch, dtype=dtype)
  tensor = [x.value() for x in bias.biases if isinstance(x, masks.TensorAttentionBias)]
  segment_ids = [x.segment_ids for x in bias.biases
                 if isinstance(x, masks.SegmentIdAttentionBias)]
  own = _mha_own_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                           tensor[0] if tensor else None, segment_ids[0] if segment_ids else None,
                           causal, d ** -0.5)
  _close(out, own, **_tol(dtype), what="forward vs jnp reference")


# ----------------------------------------------------------------------------------
# gpu_decoding.py (flash decoding) and gpu_paged_attention.py
# ----------------------------------------------------------------------------------

def _decoding_batch(b, s, h, d, kv_factor, padding, window, bias_type, dtype, sink=False):
  masks = _masks()
  extra = dict(mask_fn=masks.causal_mask) if window < 0 else dict(sliding_window_sz=window)
  q, k, v, bias = _attention_data(b, 1, s, h, d, num_kv_heads=h // kv_factor,
                                  attention_bias_type=bias_type, dtype=dtype,
                                  query_offset=s - padding - 1, **extra)
  sink = jax.random.normal(jax.random.key(42), (h,)) if sink else None
  return dict(query=q, key=k, value=v, bias=bias, logit_sink=sink)


def _paged_batch(b, s, h, d, kv_factor, padding, window, bias_type, dtype, page):
  masks = _masks()
  extra = dict(mask_fn=masks.causal_mask) if window < 0 else dict(sliding_window_sz=window)
  q, k, v, page_tables, bias = projects.load(FA + "test_utils").generate_paged_attention_data(
      batch_size=b, query_len=1, kv_len=s, num_heads=h, per_head_dim=d,
      num_kv_heads=h // kv_factor, attention_bias_type=bias_type, dtype=dtype,
      query_offset=s - padding - 1, page_size=page, **extra)
  return dict(query=q, key=k, value=v, page_tables=page_tables, bias=bias, logit_sink=None)


DECODING_CASES = [
    # b, s, h, d, kv_factor, padding, window, bias, dtype
    pytest.param(2, 512, 8, 64, 4, 111, -1, None, jnp.float32, id="gqa-causal-padded"),
    pytest.param(1, 256, 4, 64, 1, 0, 16, None, jnp.float32, id="sliding16"),
    pytest.param(1, 256, 4, 64, 2, 5, -1, "4d", jnp.float32, id="bias4d"),
    pytest.param(1, 256, 4, 64, 2, 5, -1, None, jnp.float16, id="fp16"),
]


@pytest.mark.usefixtures("gpu_backend")
@pytest.mark.parametrize("b,s,h,d,kv_factor,padding,window,bias_type,dtype", DECODING_CASES)
def test_gpu_decoding(b, s, h, d, kv_factor, padding, window, bias_type, dtype):
  gd = projects.load(FA + "gpu_decoding")
  fn = gd.GPUDecoding.default_config().set(softmax_scale=d ** -0.5).instantiate()
  _check_layer(fn, _decoding_batch(b, s, h, d, kv_factor, padding, window, bias_type, dtype),
               dtype=dtype, grad=False)


@pytest.mark.usefixtures("gpu_backend")
@pytest.mark.parametrize("b,s,h,d,kv_factor,padding,window,bias_type,dtype", [
    pytest.param(2, 512, 8, 64, 4, 111, -1, None, jnp.float32, id="gqa-causal-padded"),
    pytest.param(1, 256, 4, 64, 1, 0, 127, "2d", jnp.float32, id="sliding127-bias2d"),
])
def test_gpu_paged_attention(b, s, h, d, kv_factor, padding, window, bias_type, dtype):
  gp = projects.load(FA + "gpu_paged_attention")
  fn = gp.GPUPagedAttention.default_config().set(softmax_scale=d ** -0.5).instantiate()
  _check_layer(fn, _paged_batch(b, s, h, d, kv_factor, padding, window, bias_type, dtype, 16),
               dtype=dtype, grad=False)


# ----------------------------------------------------------------------------------
# tpu_decoding.py and tpu_paged_attention.py / tpu_paged_attention_kernel.py
# ----------------------------------------------------------------------------------

@tpu_only
@pytest.mark.parametrize("b,s,h,d,kv_factor,padding,window,sink", [
    pytest.param(2, 512, 8, 128, 4, 111, -1, False, id="gqa-causal-padded"),
    pytest.param(1, 1024, 4, 128, 1, 0, 127, True, id="sliding127-logit-sink"),
])
def test_tpu_decoding(b, s, h, d, kv_factor, padding, window, sink):
  td = projects.load(FA + "tpu_decoding")
  fn = td.TPUDecoding.default_config().set(softmax_scale=d ** -0.5).instantiate()
  _check_layer(fn, _decoding_batch(b, s, h, d, kv_factor, padding, window, None, jnp.float32,
                                   sink), dtype=jnp.float32, grad=False)


@tpu_only
@pytest.mark.parametrize("b,s,h,d,kv_factor,padding,window,bias_type", [
    pytest.param(2, 512, 8, 128, 4, 111, -1, None, id="gqa-causal-padded"),
    pytest.param(1, 1024, 8, 128, 1, 0, 127, "4d", id="sparse-sliding127-bias4d"),
])
def test_tpu_paged_attention(b, s, h, d, kv_factor, padding, window, bias_type):
  tp = projects.load(FA + "tpu_paged_attention")
  # interpret=True only lets its TPU core-count probe fall back to 1 core (pallet runs
  # interpret=True on its CPU backend, as it does interpret=False)
  fn = tp.TPUPagedAttention.default_config().set(softmax_scale=d ** -0.5,
                                                 interpret=True).instantiate()
  _check_layer(fn, _paged_batch(b, s, h, d, kv_factor, padding, window, bias_type, jnp.float32,
                                16), dtype=jnp.float32, grad=False)


# ----------------------------------------------------------------------------------
# tpu_attention.py (+ tpu_splash_attention.py): splash and legacy TPU flash, fwd + bwd
# ----------------------------------------------------------------------------------

def test_tpu_splash_attention_unmodified():
  pytest.skip("D: axlearn's tpu_splash_attention calls JAX's splash `get_kernel_name` with jax "
              "0.8's signature (block sizes first): TypeError on JAX 0.12, on JAX's Pallas too")


def _splash_adapted(monkeypatch):
  """tpu_splash_attention with its JAX-0.8-only plumbing adapted: the kernel's name, and the
  PRNG key (it converts with JAX's private `jax._src.pallas.mosaic.random.to_pallas_key`,
  which the loader does not route; pallet's public pltpu.to_pallas_key instead)."""
  splash = projects.load(FA + "tpu_splash_attention")
  monkeypatch.setattr(splash, "get_kernel_name",
                      lambda *a, **k: f"splash_attention_{k.get('phase', '')}")
  monkeypatch.setattr(splash, "plrandom",
                      types.SimpleNamespace(to_pallas_key=pltpu.to_pallas_key))
  return projects.load(FA + "tpu_attention")


TPU_ATTENTION_CASES = [
    # layer, b, h, kv_heads, t, kv, d, mask, bias, segments, dtype, sink, dropout, overrides
    pytest.param("TPUSplashAttention", 1, 2, None, 256, 256, 128, "causal", None, False,
                 jnp.float32, None, 0.0, None, id="splash-causal"),
    pytest.param("TPUSplashAttention", 1, 4, 2, 256, 256, 128, None, None, True,
                 jnp.float32, None, 0.0, None, id="splash-gqa-segments"),
    pytest.param("TPUSplashAttention", 1, 2, None, 256, 256, 128, "sliding16", None, False,
                 jnp.float32, None, 0.0, None, id="splash-sliding16"),
    pytest.param("TPUSplashAttention", 1, 2, None, 256, 256, 128, "causal", None, False,
                 jnp.float32, None, 0.0, {"splash_use_fused_bwd_kernel": False},
                 id="splash-causal-unfused-bwd"),
    pytest.param("TPUSplashAttention", 1, 2, None, 256, 256, 128, None, None, False,
                 jnp.float32, 1.0, 0.0, None, id="splash-logit-sink"),
    pytest.param("TPUSplashAttention", 1, 2, None, 256, 256, 128, "causal", None, False,
                 jnp.float32, None, 0.3, None, id="splash-dropout"),
    pytest.param("TPUSplashAttention", 2, 2, None, 256, 256, 128, "causal", None, False,
                 jnp.bfloat16, None, 0.0, None, id="splash-bf16"),
    pytest.param("LegacyTPUFlashAttention", 1, 2, None, 256, 256, 128, "causal", "4d", False,
                 jnp.float32, None, 0.0, None, id="legacy-bias4d-causal"),
    pytest.param("LegacyTPUFlashAttention", 1, 2, None, 256, 256, 64, None, "2d", True,
                 jnp.float32, None, 0.0, None, id="legacy-bias2d-segments-d64"),
    pytest.param("LegacyTPUFlashAttention", 1, 2, None, 128, 256, 128, None, "4d", False,
                 jnp.float32, None, 0.0, None, id="legacy-bias4d-cross"),
]


@tpu_only
@pytest.mark.parametrize(
    "layer,b,h,kv_heads,t,kv,d,mask,bias_type,segments,dtype,sink,dropout,overrides",
    TPU_ATTENTION_CASES)
def test_tpu_attention_forward_and_grad(monkeypatch, layer, b, h, kv_heads, t, kv, d, mask,
                                        bias_type, segments, dtype, sink, dropout, overrides):
  ta = _splash_adapted(monkeypatch)
  masks = _masks()
  mask_fn = {None: None, "causal": masks.causal_mask,
             "sliding16": masks.sliding_window_causal_mask(16)}[mask]
  q, k, v, bias = _attention_data(b, t, kv, h, d, kv_heads, mask_fn=mask_fn,
                                  attention_bias_type=bias_type, with_segment_ids=segments,
                                  dtype=dtype)
  fn = getattr(ta, layer).default_config().set(
      softmax_scale=d ** -0.5, tpu_block_size=128, dropout_rate=dropout,
      backend_overrides=overrides).instantiate()
  batch = dict(query=q, key=k, value=v, bias=bias, prng_key=jax.random.PRNGKey(66),
               logit_sink=None if sink is None else jnp.full((h,), sink, dtype))
  assert fn.is_supported(input_batch=batch, kv_cache_type=None)
  # with dropout the reference drops what the kernel's own generator dropped
  ref_batch = dict(dropout_mask=fn.get_dropout_mask(batch)) if dropout else None
  names = ("query", "key", "value") + (("logit_sink",) if sink is not None else ())
  _check_layer(fn, batch, dtype=dtype, ref_batch=ref_batch, names=names)


# ----------------------------------------------------------------------------------
# kv_cache/paged_kv_cache_{gpu,tpu}_kernel.py (one token into paged KV cache)
# ----------------------------------------------------------------------------------

def _scatter_case(b, page, h, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  d, pages_per_seq = 128, 8
  num_pages = pages_per_seq * b + 5
  kv_pages = jax.random.normal(keys[0], (h, num_pages, page, d), jnp.bfloat16)
  kv_proj = jax.random.normal(keys[1], (h, b, 1, d), jnp.bfloat16)
  page_indices = jax.random.choice(keys[2], jnp.arange(1, num_pages), shape=(b, pages_per_seq),
                                   replace=False)
  # positions past the pages (dropped) included
  positions = jax.random.choice(keys[3], jnp.arange(0, pages_per_seq * page + 64), shape=(b, 1))
  return kv_pages, kv_proj, page_indices, positions


def _check_scatter(fn, b, page, h):
  kv_pages, kv_proj, page_indices, positions = _scatter_case(b, page, h)
  ref = projects.load("axlearn.common.kv_cache.paged_kv_cache").scatter_update_pages(
      kv_pages, kv_proj, page_indices, positions)
  out = jax.jit(fn)(kv_pages, kv_proj, page_indices, positions.squeeze(1))
  # own reference: the row of each in-range position replaced, nothing else touched
  own = np.asarray(kv_pages).copy()
  for i, pos in enumerate(np.asarray(positions)[:, 0]):
    if pos < page_indices.shape[1] * page:
      own[:, int(page_indices[i, pos // page]), pos % page] = np.asarray(kv_proj)[:, i, 0]
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  np.testing.assert_array_equal(np.asarray(out), own)


@pytest.mark.usefixtures("gpu_backend")
@pytest.mark.parametrize("b,page,h", [(1, 4, 1), (4, 16, 2), (3, 64, 2)])
def test_gpu_scatter_update_pages(b, page, h):
  kernel = projects.load("axlearn.common.kv_cache.paged_kv_cache_gpu_kernel")
  _check_scatter(kernel.gpu_scatter_update_pages_shmap_fn, b, page, h)


@tpu_only
@pytest.mark.parametrize("b,page,h", [(1, 4, 1), (4, 16, 2), (3, 64, 2)])
def test_tpu_scatter_update_pages(b, page, h):
  kernel = projects.load("axlearn.common.kv_cache.paged_kv_cache_tpu_kernel")
  _check_scatter(kernel.tpu_scatter_update_pages_shmap_fn, b, page, h)


# ----------------------------------------------------------------------------------
# kernels/online_softmax_log_probs.py (streaming log-normalizer and top-k over the vocab)
# ----------------------------------------------------------------------------------

@tpu_only
@pytest.mark.parametrize("vocab,tile_v,top_k,seq,tile_s,dtype", [
    (100, 16, 0, 128, 128, jnp.float32),
    (24, 8, 3, 128, 128, jnp.float32),
    (100, 32, 5, 128, 128, jnp.float32),
    (24, 8, 0, 100, 128, jnp.float32),     # sequence padded to the tile
    (100, 16, 3, 200, 64, jnp.float32),
    (100, 16, 3, 128, 128, jnp.bfloat16),
])
def test_online_softmax_log_probs(vocab, tile_v, top_k, seq, tile_s, dtype):
  kernel = projects.load("axlearn.common.kernels.online_softmax_log_probs")
  k1, k2 = jax.random.split(jax.random.key(42))
  x = jax.random.normal(k1, (2, seq, 8), dtype)
  w = jax.random.normal(k2, (vocab, 8), dtype)
  logits = jnp.einsum("bsh,vh->bsv", x.astype(jnp.float32), w.astype(jnp.float32),
                      precision="highest")
  lse = jax.scipy.special.logsumexp(logits, axis=-1)
  out = kernel.online_softmax_log_probs_pallas(x, w, top_k=top_k, tile_s=tile_s, tile_v=tile_v)
  if not top_k:
    _close(out, lse, atol=1e-5, rtol=1e-5)
    return
  log_norm, top_values, top_indices = out
  want_values, want_indices = jax.lax.top_k(logits, top_k)
  _close(log_norm, lse, atol=1e-5, rtol=1e-5)
  _close(top_values, want_values, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(top_indices), np.asarray(want_indices))
