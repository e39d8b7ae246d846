"""openxla/tokamax's Pallas-Triton kernels (normalization, gated linear unit, flash
attention and its VJP, ragged dot, flex attention), run on pallet.

The kernels are read from a checkout (PALLET_TOKAMAX_SOURCE) at test time; nothing of
tokamax is copied here. Each test calls a tokamax op class (`PallasTritonNormalization`,
`PallasTritonFlashAttention`, ...) with an explicit config (block sizes, num_warps: the
heuristic configs read `jax.devices()[0].core_count`, which a CPU device lacks), on fresh
random inputs, forward and, where the op has a VJP, through `jax.vjp`, against a plain
jax.numpy reference written here and, where cheap, tokamax's own XLA implementation
(`attention.base.DotProductAttention`).

How tokamax is made to run on a CPU, without changing it:
- `Op.__call__` refuses devices without Triton (`gpu_utils.has_triton_support`: platform
  != 'gpu'), a hardware check only; tokamax's own option `config.cross_compile(True)`
  lifts it. `config.ignore_autotuning_cache(True)` keeps it from reading its autotuning
  tables (package files, which the loader's top-level package does not expose).
- GLU's index maps reorder program ids with `tokamax._src.pallas.grid`, which reads the
  GPU's SM count at trace time: that module is given a `jax` whose `devices()` reports a
  GPU with 8 SMs (the reordering logic itself runs unchanged).
tokamax's pydantic arg specs need its annotations at run time, which the loader keeps
(tests/foreign/test_projects.py: test_loaded_modules_keep_their_own_annotations).

GPU kernels run on the backend under test (PALLET_TEST_BACKEND=triton: Triton's
interpreter).
"""
from __future__ import annotations

import contextlib
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet
from tests.foreign import projects
from tests.helpers import current_test_backend

OPS = "tokamax._src.ops."
BACKEND = current_test_backend()


class _FakeGpu:
  platform, device_kind, core_count = "gpu", "fake GPU", 8


class _JaxWithSms(types.SimpleNamespace):
  """`jax`, except that `devices()` reports a GPU (for tokamax's SM-count lookups)."""

  def __getattr__(self, name):
    return getattr(jax, name)

  def devices(self, *args):
    return [_FakeGpu()]


@pytest.fixture
def tokamax_on_cpu(monkeypatch):
  """Runs tokamax's ops here, their pallas_calls on the backend under test."""
  config = projects.load("tokamax._src.config")
  monkeypatch.setattr(projects.load("tokamax._src.pallas.grid"), "jax", _JaxWithSms())
  with contextlib.ExitStack() as stack:
    stack.enter_context(config.cross_compile(True))
    stack.enter_context(config.ignore_autotuning_cache(True))
    if BACKEND != "xla":
      stack.enter_context(pallet.default_backend(BACKEND))
    yield


def _close(actual, expected, atol, rtol=0.0, what=""):
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                             atol=atol, rtol=rtol, err_msg=what)


def _normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


# ----------------------------------------------------------------------------------
# normalization (layer norm / RMS norm, forward kernel and Pallas VJP kernel)
# ----------------------------------------------------------------------------------

@pytest.mark.usefixtures("tokamax_on_cpu")
@pytest.mark.parametrize("shape,axis,block_m,block_n,subtract_mean", [
    ((16, 42), -1, 4, None, True),     # reduced axis not a power of two
    ((6, 40, 20), 1, 2, 16, True),     # a middle axis: 3-D blocks, ragged block_n
    ((5, 33), -1, 4, None, False),     # RMS norm, rows not a multiple of block_m
])
def test_normalization_forward_and_vjp(shape, axis, block_m, block_n, subtract_mean):
  fwd = projects.load(OPS + "normalization.pallas_triton")
  vjp = projects.load(OPS + "normalization.pallas_triton_vjp")
  op = fwd.PallasTritonNormalization(
      config=fwd.Config(block_m=block_m, block_n=block_n, num_warps=4),
      vjp=vjp.PallasTritonNormalizationVjp(
          config=vjp.Config(block_m=block_m, block_n=block_n, num_warps=4)))
  n = shape[axis]
  x = _normal(0, shape)
  scale = jax.random.uniform(jax.random.key(1), (n,))
  offset = jax.random.uniform(jax.random.key(2), (n,))
  cotangent = _normal(3, shape)
  bshape = [1] * len(shape)
  bshape[axis] = n
  eps = 1e-6

  def reference(x, scale, offset):
    mean = jnp.mean(x, axis=axis, keepdims=True) if subtract_mean else 0.0
    var = jnp.mean(jnp.square(x - mean), axis=axis, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps) * scale.reshape(bshape)
    return y + offset.reshape(bshape) if subtract_mean else y

  def kernel(x, scale, offset):
    return op(x, scale, offset if subtract_mean else None, axis=axis, epsilon=eps,
              subtract_mean=subtract_mean)

  out, f_vjp = jax.vjp(kernel, x, scale, offset)
  grads = f_vjp(cotangent)
  out_ref, f_vjp_ref = jax.vjp(reference, x, scale, offset)
  grads_ref = f_vjp_ref(cotangent)
  _close(out, out_ref, 1e-5, what="y")
  for name, g, g_ref in zip(("dx", "dscale", "doffset"), grads, grads_ref):
    _close(g, g_ref, 1e-4, what=name)


# ----------------------------------------------------------------------------------
# gated linear unit (forward kernel; tokamax's VJP for it is XLA)
# ----------------------------------------------------------------------------------

@pytest.mark.usefixtures("tokamax_on_cpu")
@pytest.mark.parametrize("batch,m,n,k,blocks,activation,dtype,unfused", [
    ((), 64, 64, 32, (16, 16, 16), jax.nn.sigmoid, jnp.float32, False),
    ((2,), 40, 48, 40, (16, 32, 16), jnp.tanh, jnp.float32, False),   # ragged m, n, k
    ((), 50, 30, 24, (16, 16, 16), None, jnp.float32, True),          # tuple weights
    ((), 64, 64, 64, (32, 32, 32), jax.nn.swish, jnp.bfloat16, False),
])
def test_gated_linear_unit(batch, m, n, k, blocks, activation, dtype, unfused):
  glu = projects.load(OPS + "gated_linear_unit.pallas_triton")
  bm, bn, bk = blocks
  op = glu.PallasTritonGatedLinearUnit(config=glu.Config(
      block_m=bm, block_n=bn, block_k=bk, num_warps=4, num_stages=2))
  x = _normal(0, (*batch, m, k), dtype)
  w = _normal(1, (k, 2, n), dtype)
  if unfused:
    w = tuple(jnp.unstack(w, axis=1))
  dout = _normal(2, (*batch, m, n), dtype)

  def reference(x, w):
    gate, proj = w if isinstance(w, tuple) else jnp.unstack(w, axis=1)
    x, gate, proj = (a.astype(jnp.float32) for a in (x, gate, proj))
    g = jnp.matmul(x, gate, precision="highest")
    p = jnp.matmul(x, proj, precision="highest")
    return p * (g if activation is None else activation(g))

  out, f_vjp = jax.vjp(lambda x, w: op(x, w, activation=activation, precision="highest"), x, w)
  grads = f_vjp(dout)
  out_ref, f_vjp_ref = jax.vjp(reference, x, w)
  grads_ref = f_vjp_ref(dout.astype(jnp.float32))
  # bf16: gate and projection are rounded to bf16 before their product (as the kernel
  # stores them), so compare relative to the output's scale
  rtol = 1e-5 if dtype == jnp.float32 else 2e-2
  for what, a, b in [("out", out, out_ref), *zip(("dx", "dw", "dv"), jax.tree.leaves(grads),
                                                  jax.tree.leaves(grads_ref))]:
    _close(a, b, rtol * float(jnp.abs(b).max()), what=what)


# ----------------------------------------------------------------------------------
# flash attention (forward kernel, Pallas VJP kernel)
# ----------------------------------------------------------------------------------

def _attention_reference(q, k, v, bias=None, mask=None, causal=False, soft_cap=None):
  """softmax(q k^T / sqrt(d) + bias) v, [B, T, H, D] layout, GQA by repeating k/v heads."""
  q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
  rep = q.shape[-2] // k.shape[-2]
  k, v = jnp.repeat(k, rep, axis=-2), jnp.repeat(v, rep, axis=-2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * q.shape[-1] ** -0.5
  if bias is not None:
    s = s + bias
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  keep = jnp.ones(s.shape, bool)
  if mask is not None:
    keep &= mask
  if causal:
    keep &= jnp.arange(q.shape[1])[:, None] >= jnp.arange(k.shape[1])[None, :]
  p = jax.nn.softmax(jnp.where(keep, s, jnp.finfo(jnp.float32).min), axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")


ATTENTION_CASES = {
    # name: (B, T, t, H, h, D), forward config, VJP config (block_m1, block_n1, block_m2, block_n2)
    "basic": ((1, 64, 64, 2, 2, 32), dict(block_q=16, block_k=16), (16, 32, 32, 16)),
    "causal_gqa": ((2, 64, 64, 2, 1, 32), dict(block_q=32, block_k=16), (32, 32, 32, 32)),
    "ragged_lengths": ((1, 40, 56, 2, 2, 16), dict(block_q=16, block_k=16), (16, 16, 16, 16)),
    "kv_longer": ((1, 32, 128, 2, 2, 16), dict(block_q=16, block_k=32), (16, 32, 32, 32)),
    "bias_mask": ((1, 32, 48, 2, 2, 16), dict(block_q=16, block_k=16), (16, 16, 16, 16)),
    "k_ranges": ((1, 48, 48, 2, 2, 16), dict(block_q=16, block_k=16), (16, 16, 16, 16)),
    "block_d": ((1, 32, 32, 2, 2, 64), dict(block_q=16, block_k=16, block_d=16, block_d_out=32),
                (16, 16, 16, 16)),
    "pack_mask": ((1, 32, 64, 2, 2, 16), dict(block_q=16, block_k=16, pack_mask=True),
                  (16, 16, 16, 16)),
}


@pytest.mark.usefixtures("tokamax_on_cpu")
@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_flash_attention_forward_and_vjp(name):
  fa = projects.load(OPS + "attention.pallas_triton")
  fa_vjp = projects.load(OPS + "attention.pallas_triton_vjp")
  base = projects.load(OPS + "attention.base")
  (b, t_q, t_k, h_q, h_k, d), fwd_cfg, (m1, n1, m2, n2) = ATTENTION_CASES[name]
  op = fa.PallasTritonFlashAttention(
      config=fa.Config(num_warps=4, num_stages=2, **fwd_cfg),
      vjp=fa_vjp.PallasTritonFlashAttentionVjp(config=fa_vjp.Config(
          block_m1=m1, block_n1=n1, block_m2=m2, block_n2=n2, num_warps=4, num_stages=2)))
  q, k, v = _normal(1, (b, t_q, h_q, d)), _normal(2, (b, t_k, h_k, d)), _normal(3, (b, t_k, h_k, d))
  dout = _normal(4, (b, t_q, h_q, d))
  causal = name == "causal_gqa"
  bias = _normal(5, (b, h_q, t_q, t_k)) if name == "bias_mask" else None
  mask = ref_mask = None
  if name in ("bias_mask", "pack_mask"):
    mask = ref_mask = jax.random.bernoulli(jax.random.key(6), 0.7, (b, h_q, t_q, t_k))
  if name == "k_ranges":
    k_start = jax.random.randint(jax.random.key(7), (t_q,), 0, t_k // 2)
    k_end = k_start + 1 + jax.random.randint(jax.random.key(8), (t_q,), 0, t_k // 2)
    mask = base.Mask(k_start=k_start, k_end=k_end)
    cols = jnp.arange(t_k)[None, :]
    ref_mask = (cols >= k_start[:, None]) & (cols < k_end[:, None])
  args = (q, k, v) if bias is None else (q, k, v, bias)

  def call(impl, q, k, v, bias=None):
    return impl(q, k, v, bias=bias, mask=mask, is_causal=causal, precision="highest")

  out, f_vjp = jax.vjp(functools.partial(call, op), *args)
  grads = f_vjp(dout)
  out_ref, f_vjp_ref = jax.vjp(
      lambda q, k, v, bias=None: _attention_reference(q, k, v, bias, ref_mask, causal), *args)
  grads_ref = f_vjp_ref(dout)
  _close(out, out_ref, 1e-5, what="out")
  _close(call(base.DotProductAttention(), *args), out_ref, 1e-5, what="tokamax XLA reference")
  for what, g, g_ref in zip(("dq", "dk", "dv", "dbias"), grads, grads_ref):
    _close(g, g_ref, 1e-5, what=what)


@pytest.mark.usefixtures("tokamax_on_cpu")
def test_flash_attention_forward_variants():
  """Forward-only features: the q-range skip path (lax.cond storing zeros), exp2,
  unstable softmax, unnormalized output, a dropout mask, int8 k/v, split_k, block_q=2."""
  fa = projects.load(OPS + "attention.pallas_triton")
  base = projects.load(OPS + "attention.base")
  import qwix
  b, t_q, t_k, h, d = 1, 40, 48, 2, 16
  q, k, v = _normal(1, (b, t_q, h, d)), _normal(2, (b, t_k, h, d)), _normal(3, (b, t_k, h, d))
  config = fa.Config(block_q=16, block_k=16, num_warps=4, num_stages=2)
  attn = fa.PallasTritonFlashAttention(config=config)
  xla = base.DotProductAttention()

  # q_start/q_end of one element: kernel blocks wholly outside [8, 30) store zeros (the
  # third q block, rows 32..39); rows of other blocks with no key follow the XLA version
  m = base.Mask(q_start=jnp.array([8]), q_end=jnp.array([30]))
  out = attn(q, k, v, mask=m, precision="highest")
  _close(out[:, 8:30], _attention_reference(q, k, v)[:, 8:30], 1e-5, what="q range")
  _close(out[:, :32], xla(q, k, v, mask=m, precision="highest")[:, :32], 1e-5, what="q range")
  _close(out[:, 32:], 0.0, 0.0, what="skipped q block")

  causal_ref = _attention_reference(q, k, v, causal=True)
  for kw in (dict(use_base2=True), dict(use_stable_softmax=False)):
    out = fa.PallasTritonFlashAttention(config=config, **kw)(q, k, v, precision="highest",
                                                             is_causal=True)
    _close(out, causal_ref, 1e-5, what=str(kw))

  _close(attn(q, k, v, precision="highest", normalize_output=False),
         xla(q, k, v, precision="highest", normalize_output=False), 1e-4, what="unnormalized")

  drop = jax.random.bernoulli(jax.random.key(4), 0.8, (b, h, t_q, t_k))
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * d ** -0.5
  dropped = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1) * drop / 0.8, v,
                       precision="highest")
  _close(attn(q, k, v, precision="highest", dropout_mask=drop, dropout_rate=0.2), dropped, 1e-5,
         what="dropout")

  quantize = lambda x: qwix.quantize(x, jnp.int8, channelwise_axes=(0, 1, 2))
  kq, vq = quantize(k), quantize(v)
  _close(attn(q, kq, vq, precision="highest"),
         _attention_reference(q, qwix.dequantize(kq), qwix.dequantize(vq)), 1e-5, what="int8 k/v")

  split = fa.PallasTritonFlashAttention(config=fa.Config(
      block_q=16, block_k=16, num_warps=4, num_stages=2, split_k=2))
  _close(split(q, k, v, precision="highest"), _attention_reference(q, k, v), 1e-5, what="split_k")

  tiny_q = fa.PallasTritonFlashAttention(config=fa.Config(
      block_q=2, block_k=16, num_warps=4, num_stages=2))
  _close(tiny_q(q[:, :16], k, v, precision="highest"), _attention_reference(q[:, :16], k, v),
         1e-5, what="block_q=2")


@pytest.mark.usefixtures("tokamax_on_cpu")
def test_flash_attention_bf16_soft_cap():
  fa = projects.load(OPS + "attention.pallas_triton")
  q, k, v = (_normal(i, (1, 32, 2, 32), jnp.bfloat16) for i in (1, 2, 3))
  op = fa.PallasTritonFlashAttention(config=fa.Config(block_q=16, block_k=16, num_warps=4,
                                                      num_stages=2))
  out = op(q, k, v, logits_soft_cap=20.0)
  # bf16 inputs, p rounded to bf16 before p @ v: ~1e-2 of outputs of size ~1
  _close(out, _attention_reference(q, k, v, soft_cap=20.0), 2e-2)


# ----------------------------------------------------------------------------------
# ragged dot (grouped matmul; its VJP is the same kernels, with tokamax's default config)
# ----------------------------------------------------------------------------------

def _ragged_reference(a, b, group_sizes):
  ends = np.cumsum(group_sizes)
  rows = jnp.arange(a.shape[0])
  out = jnp.zeros((a.shape[0], b.shape[-1]), jnp.float32)
  for g, (lo, hi) in enumerate(zip(ends - group_sizes, ends)):
    inside = ((rows >= lo) & (rows < hi))[:, None]
    out += jnp.where(inside, jnp.matmul(a, b[g], precision="highest"), 0.0)
  return out


@pytest.mark.usefixtures("tokamax_on_cpu")
@pytest.mark.parametrize("m,k,n,group_sizes,blocks", [
    (64, 32, 32, (16, 16, 16, 16), (16, 16, 16)),
    (64, 40, 48, (5, 3, 27, 20, 9), (16, 16, 16)),     # ragged groups, k and n ragged
    (64, 32, 32, (7, 13, 9), (16, 32, 16)),             # rows past sum(group_sizes)
    # block_m=64: unmasked lhs loads through a run-time window partly past the end of a
    # (row-padded) ref keep their in-bounds rows in place
    (64, 32, 32, (16, 16, 16, 16), (64, 16, 16)),
])
def test_ragged_dot_forward(m, k, n, group_sizes, blocks):
  rd = projects.load(OPS + "ragged_dot.pallas_triton")
  bm, bn, bk = blocks
  op = rd.PallasTritonRaggedDot(config=rd.Config(block_m=bm, block_n=bn, block_k=bk,
                                                 num_warps=4, num_stages=2))
  gs = np.array(group_sizes, np.int32)
  a, b = _normal(0, (m, k)), _normal(1, (len(gs), k, n))
  out = op(a, b, group_sizes=jnp.asarray(gs), precision="highest")
  count = int(gs.sum())   # rows past the groups are never written (as tokamax's tests check)
  want = _ragged_reference(a, b, gs)
  _close(out[:count], want[:count], 1e-4)
  _close(jax.lax.ragged_dot(a, b, jnp.asarray(gs), precision="highest")[:count], want[:count], 1e-4)


@pytest.mark.usefixtures("tokamax_on_cpu")
@pytest.mark.parametrize("m,n,group_sizes", [
    (64, 32, (16, 16, 16, 16)),
    # n=48 is not a multiple of the VJP's block_k=32: dlhs's lhs loads get a mask, and the
    # masked path pads instead of clamping. (No empty group: tokamax's ragged-contracting
    # kernel reads block_k rows before an empty group's start, garbage on a GPU too.)
    (64, 48, (5, 3, 27, 20, 9)),
])
def test_ragged_dot_vjp(m, n, group_sizes):
  """The VJP's ragged dots take tokamax's default config (block_m = min(128, pow2(m)))."""
  rd = projects.load(OPS + "ragged_dot.pallas_triton")
  k = 32
  op = rd.PallasTritonRaggedDot(config=rd.Config(block_m=16, block_n=16, block_k=16,
                                                 num_warps=4, num_stages=2))
  gs = np.array(group_sizes, np.int32)
  a, b, dout = _normal(0, (m, k)), _normal(1, (len(gs), k, n)), _normal(2, (m, n))
  _, f_vjp = jax.vjp(lambda a, b: op(a, b, group_sizes=jnp.asarray(gs), precision="highest"), a, b)
  da, db = f_vjp(dout)
  _, f_vjp_ref = jax.vjp(lambda a, b: _ragged_reference(a, b, gs), a, b)
  da_ref, db_ref = f_vjp_ref(dout)
  _close(da, da_ref, 1e-4, what="dlhs")
  _close(db, db_ref, 1e-4, what="drhs")


@pytest.mark.usefixtures("tokamax_on_cpu")
def test_ragged_dot_block_longer_than_lhs():
  """block_m=64 > m=48: unmasked loads through a run-time window longer than the ref."""
  rd = projects.load(OPS + "ragged_dot.pallas_triton")
  op = rd.PallasTritonRaggedDot(config=rd.Config(block_m=64, block_n=16, block_k=16,
                                                 num_warps=4, num_stages=2))
  gs = np.array([10, 30, 8], np.int32)
  a, b = _normal(0, (48, 32)), _normal(1, (3, 32, 32))
  out = op(a, b, group_sizes=jnp.asarray(gs), precision="highest")
  _close(out, _ragged_reference(a, b, gs), 1e-4)


# ----------------------------------------------------------------------------------
# flex attention (score_mod / mask_mod fused into the kernel)
# ----------------------------------------------------------------------------------

@pytest.mark.usefixtures("tokamax_on_cpu")
def test_flex_attention():
  fx = projects.load(OPS + "flex_attention.pallas_triton")
  b, t, h, d = 1, 64, 2, 16
  q, k, v = (_normal(i, (b, t, h, d)) for i in (1, 2, 3))
  small_bias = _normal(4, (b, 1, 32, 16))
  upscale = lambda x: jnp.repeat(jnp.repeat(x, 2, axis=-2), 4, axis=-1)
  relative = (jnp.arange(t)[:, None] - jnp.arange(t)).astype(jnp.float32)
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)
  op = fx.PallasTritonFlexAttention(config=fx.Config(block_q=16, block_k=16, num_warps=4,
                                                     num_stages=2))

  def reference(bias, mask=None):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / jnp.sqrt(d) + bias
    if mask is not None:
      s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v, precision="highest")

  out = op(q, k, v, score_mod=lambda s: s / jnp.sqrt(d) + upscale(small_bias), precision="highest")
  _close(out, reference(upscale(small_bias)), 1e-5, what="upscaled bias")
  out = op(q, k, v, score_mod=lambda s: s / jnp.sqrt(d) + relative, precision="highest")
  _close(out, reference(relative), 1e-5, what="relative position bias")
  out = op(q, k, v, score_mod=lambda s: s / jnp.sqrt(d), mask_mod=lambda shape: causal,
           precision="highest")
  _close(out, reference(0.0, causal), 1e-5, what="causal mask_mod")
