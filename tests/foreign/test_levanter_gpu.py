"""Levanter's Pallas-Triton (GPU) kernels (marin-community/marin, lib/levanter/src/levanter/
kernels/pallas), run on pallet: fused cross-entropy (`pallas_gpu`), fused RMSNorm +
GatedNorm, the streaming short convolution (forward and backward kernels), and the ReLU²
expert-MLP GEMM epilogues.

The kernels are read from a checkout (PALLET_LEVANTER_SOURCE) at test time; nothing of
Levanter is copied here. Each test compares a kernel with the project's own reference
(where it has one) and a jax.numpy reference written here, on random inputs, forward
and, where the project differentiates the kernel, gradients.

How the kernels are made to run on a CPU, without changing them:
- gated_rms_norm and short_conv run inside the project's own `interpret_mode()`, its
  switch for CPU coverage (it passes `interpret=True` and, for short_conv, takes the f32
  path instead of inline PTX `fma.rn.f32` / `mul.rn.bf16x2`, which only a GPU executes).
- fused_cross_entropy_loss.pallas_gpu refuses a non-GPU backend (`jax.default_backend()`)
  and reads `jax.devices()[0].device_kind` (GB10 fallbacks): the module is given a `jax`
  that reports a GPU of another kind. Its backward differentiates through the forward's
  `pallas_call` (`jax.vjp` of the kernel), so pallet's autodiff of a kernel is under test.

GPU kernels run on the backend under test (PALLET_TEST_BACKEND=triton with
TRITON_INTERPRET=1: Triton's interpreter).
"""
from __future__ import annotations

import contextlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet
from pallet.errors import TritonLoweringError
from tests.foreign import projects
from tests.foreign.test_levanter import _JaxReporting, _ce_numpy, _close, _normal
from tests.helpers import current_test_backend

K = "levanter.kernels.pallas."
BACKEND = current_test_backend()


def _on_backend():
  return pallet.default_backend(BACKEND)


# ----------------------------------------------------------------------------------
# fused_cross_entropy_loss.pallas_gpu
# ----------------------------------------------------------------------------------

def _load_ce_gpu(monkeypatch):
  # pallas_gpu imports `.xla` (the XLA streaming fallback, used on GB10 only), which this
  # checkout may lack (it pulls in the tuned block-size tables): a stand-in then.
  name = K + "fused_cross_entropy_loss.xla"
  try:
    projects.load(name)
  except ModuleNotFoundError:
    stand_in = types.ModuleType(name)

    def linear_softmax_cross_entropy_loss_xla(*args, **kwargs):
      raise AssertionError("the GB10 fallback ran")

    stand_in.linear_softmax_cross_entropy_loss_xla = linear_softmax_cross_entropy_loss_xla
    monkeypatch.setitem(__import__("sys").modules, name, stand_in)
  kernel = projects.load(K + "fused_cross_entropy_loss.pallas_gpu")
  monkeypatch.setattr(kernel, "jax", _JaxReporting(platform="gpu", kind="not a GB10"))
  return kernel


# (B, H, V, block sizes (b, h, v), soft cap): B, H and V not multiples of their blocks
# exercise the wrapper's padding (labels -1, zero weights) and the kernel's V mask.
CE_CASES = [
    (32, 64, 128, (16, 32, 64), None),
    (40, 48, 200, (16, 16, 64), 5.0),
]


@pytest.mark.parametrize("b,h,v,blocks,cap", CE_CASES,
                         ids=[f"B{c[0]}H{c[1]}V{c[2]}-cap{c[4]}" for c in CE_CASES])
def test_fused_cross_entropy_pallas_gpu_value_and_grad(monkeypatch, b, h, v, blocks, cap):
  kernel = _load_ce_gpu(monkeypatch)
  ref = projects.load(K + "fused_cross_entropy_loss.reference")
  config = projects.load(K + "fused_cross_entropy_loss.config")
  x = _normal(b, (b, h))
  w = _normal(b + 1, (h, v), scale=h ** -0.5)
  labels = jax.random.randint(jax.random.key(b + 2), (b,), 0, v, jnp.int32)
  d_loss, d_lse = _normal(3, (b,)), _normal(4, (b,))

  def run(fn):
    (loss, lse), vjp = jax.vjp(lambda x_, w_: fn(x_, labels, w_), x, w)
    return (loss, lse, *vjp((d_loss, d_lse)))

  with _on_backend():
    got = run(lambda x_, l_, w_: kernel.linear_softmax_cross_entropy_loss_pallas_gpu(
        x_, l_, w_, block_sizes=config.BlockSizes(*blocks), logit_soft_cap=cap))
  want = run(lambda x_, l_, w_: ref.linear_softmax_cross_entropy_loss_reference(
      x_, l_, w_, logit_soft_cap=cap, precision=jax.lax.Precision.HIGHEST))
  for name, g, r in zip(("loss", "lse", "dx", "dw"), got, want):
    _close(g, r, atol=2e-5 * max(1.0, float(np.abs(r).max())), rtol=2e-5, what=name)
  loss, lse = _ce_numpy(x, labels, w, cap)
  _close(got[0], loss, atol=1e-4, what="loss vs float64")
  _close(got[1], lse, atol=1e-4, what="lse vs float64")


# ----------------------------------------------------------------------------------
# gated_rms_norm (two forward kernels; the project's hand-written XLA backward)
# ----------------------------------------------------------------------------------

EPS = 1e-5


def _grn_inputs(shape, rank, dtype, seed):
  d = shape[-1]
  x = _normal(seed, shape, dtype)
  norm_weight = 1.0 + _normal(seed + 1, (d,), scale=0.2)
  w_down = _normal(seed + 2, (d, rank), dtype, scale=d ** -0.5)
  w_up = _normal(seed + 3, (rank, d), dtype, scale=2.0 * rank ** -0.5)
  return x, norm_weight, w_down, w_up


def _grn_numpy(x, norm_weight, w_down, w_up):
  x, nw, wd, wu = (np.asarray(t, np.float64) for t in (x, norm_weight, w_down, w_up))
  rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)
  y = x * rstd * nw
  h = y @ wd
  gate = 1.0 / (1.0 + np.exp(-((h / (1.0 + np.exp(-h))) @ wu)))
  return y * gate, gate, h, rstd[..., 0]


GRN_BLOCKS = [dict(t_block_size=16, stats_d_block_size=32, out_d_block_size=64),
              dict(t_block_size=16, stats_d_block_size=64, out_d_block_size=32, out_loop=True)]


@pytest.mark.parametrize("blocks", GRN_BLOCKS, ids=["tiles", "out_loop"])
def test_gated_rms_norm_forward_kernels(blocks):
  kernel = projects.load(K + "gated_rms_norm.pallas_gpu")
  config = projects.load(K + "gated_rms_norm.config")
  ref = projects.load(K + "gated_rms_norm.reference")
  x, nw, wd, wu = _grn_inputs((48, 128), 16, jnp.float32, seed=7)
  with _on_backend(), kernel.interpret_mode():
    out, gate, h, rstd = kernel.gated_rms_norm_pallas_fwd_local(
        x, nw, wd, wu, eps=EPS, block_sizes=config.GatedRmsNormBlockSizes(**blocks))
  _close(out, ref.gated_rms_norm_reference(x, nw, wd, wu, eps=EPS), atol=2e-5, what="out")
  for name, g, r in zip(("out", "gate", "h", "rstd"), (out, gate, h, rstd),
                        _grn_numpy(x, nw, wd, wu)):
    _close(g, r, atol=1e-4, rtol=1e-4, what=name)


@pytest.mark.parametrize("shape,rank,dtype", [((2, 37, 128), 32, jnp.float32),
                                              ((2, 32, 64), 16, jnp.bfloat16)],
                         ids=["f32-padded-tokens", "bf16"])
def test_gated_rms_norm_value_and_grad(shape, rank, dtype):
  api = projects.load(K + "gated_rms_norm.api")
  kernel = projects.load(K + "gated_rms_norm.pallas_gpu")
  config = projects.load(K + "gated_rms_norm.config")
  ref = projects.load(K + "gated_rms_norm.reference")
  args = _grn_inputs(shape, rank, dtype, seed=sum(shape))
  cotangent = _normal(99, shape, dtype)
  blocks = config.GatedRmsNormBlockSizes(t_block_size=16, stats_d_block_size=32,
                                         out_d_block_size=64)

  def value_and_grads(fn, args, cot):
    out, vjp = jax.vjp(fn, *args)
    return [np.asarray(a, np.float64) for a in (out, *vjp(cot))]

  with _on_backend(), kernel.interpret_mode():
    got = value_and_grads(lambda *a: api.gated_rms_norm(
        *a, eps=EPS, implementation="pallas_gpu", block_sizes=blocks), args, cotangent)
  want = value_and_grads(lambda *a: ref.gated_rms_norm_reference(*a, eps=EPS), args, cotangent)
  names = ("out", "dx", "dnorm_weight", "dw_down", "dw_up")
  if dtype == jnp.float32:
    for name, g, w in zip(names, got, want):
      _close(g, w, atol=2e-5 * np.max(np.abs(w)), rtol=2e-5, what=name)
  else:
    # The project's own criterion: the kernel rounds x * w (not x * rstd * w) before the
    # down projection, so in bf16 it is held to the reference's error against float32.
    exact = value_and_grads(lambda *a: ref.gated_rms_norm_reference(*a, eps=EPS),
                            [a.astype(jnp.float32) for a in args], cotangent.astype(jnp.float32))
    for name, g, w, e in zip(names, got, want, exact):
      kernel_error = np.sqrt(np.mean((g - e) ** 2))
      reference_error = np.sqrt(np.mean((w - e) ** 2))
      assert kernel_error <= 1.5 * reference_error, (name, kernel_error, reference_error)


# ----------------------------------------------------------------------------------
# short_conv (streaming forward and backward kernels, masked edge-row loads)
# ----------------------------------------------------------------------------------

def _segments(batch, seq, seed, docs=4):
  ids = np.sort(np.random.default_rng(seed).integers(0, docs, (batch, seq)), axis=1)
  return jnp.asarray(ids, jnp.int32)


def _short_conv_numpy(w, x, seg):
  w, x, seg = np.asarray(w, np.float64), np.asarray(x, np.float64), np.asarray(seg)
  out = w[0] * x
  for lag in range(1, w.shape[0]):
    shifted = np.zeros_like(x)
    shifted[:, lag:] = x[:, :-lag]
    same = np.zeros(seg.shape, bool)
    same[:, lag:] = seg[:, lag:] == seg[:, :-lag]
    out = out + w[lag] * np.where(same[..., None], shifted, 0.0)
  return out


# (B, S, C, W, forward tiles (s, c, warps, rows), backward tiles, dtype)
SC_CASES = [
    (2, 64, 64, 4, (16, 32, 4, 4), (32, 32, 2, 8), jnp.float32),
    (2, 64, 96, 4, (32, 64, 4, 8), (16, 64, 2, 4), jnp.bfloat16),   # 96: 32-channel blocks
    (1, 32, 32, 2, (8, 32, 4, 2), (32, 32, 2, 32), jnp.float32),
]


@pytest.mark.parametrize("b,s,c,width,fwd,bwd,dtype", SC_CASES,
                         ids=[f"B{t[0]}S{t[1]}C{t[2]}W{t[3]}-{jnp.dtype(t[6]).name}"
                              for t in SC_CASES])
def test_short_conv_forward_and_backward(b, s, c, width, fwd, bwd, dtype):
  kernel = projects.load(K + "short_conv.pallas_gpu")
  config = projects.load(K + "short_conv.config")
  ref = projects.load(K + "short_conv.reference")
  tiles = config.ShortConvTiles
  blocks = config.ShortConvBlockSizes(forward=tiles(*fwd), backward=tiles(*bwd))
  x, dy = _normal(s + c, (b, s, c), dtype), _normal(s + c + 1, (b, s, c), dtype)
  w = _normal(s + c + 2, (width, c), dtype, scale=0.5)
  seg = _segments(b, s, seed=c)
  with _on_backend(), kernel.interpret_mode():
    assert kernel.short_conv_shapes_supported(w.shape, x.shape, blocks) is None
    y = kernel.short_conv_pallas_fwd_local(w, x, seg, block_sizes=blocks,
                                           exact_reference_rounding=True)
    dx, dw_partials = kernel.short_conv_pallas_bwd_local(w, x, seg, dy, block_sizes=blocks,
                                                         exact_reference_rounding=True)
  want_y, vjp = jax.vjp(lambda w_, x_: ref.short_conv_reference(w_, x_, seg), w, x)
  want_dw, want_dx = vjp(dy)
  if dtype == jnp.bfloat16 and BACKEND == "xla":
    # The project's contract: with exact_reference_rounding the forward and dx round as
    # the reference does, op for op (bit-identical).
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want_y, np.float32))
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(want_dx, np.float32))
  elif dtype == jnp.bfloat16:
    # Under Triton's interpreter pallet holds bf16 values in float32 (the interpreter's
    # bf16 arithmetic is broken), so intermediate roundings differ: one bf16 ulp or two.
    _close(y, want_y, atol=2e-2, rtol=2e-2, what="y")
    _close(dx, want_dx, atol=2e-2, rtol=2e-2, what="dx")
  else:
    _close(y, want_y, atol=1e-5, what="y")
    _close(dx, want_dx, atol=1e-5, what="dx")
  scale = float(np.abs(want_dw).max())
  _close(dw_partials.sum(0), want_dw, atol=2e-2 * scale if dtype == jnp.bfloat16 else 1e-5 * scale,
         what="dw")  # bf16: the reference's dw is itself rounded to bf16
  _close(y, _short_conv_numpy(w, x, seg),
         atol=5e-2 if dtype == jnp.bfloat16 else 1e-5, what="y vs float64")


def test_short_conv_without_interpret_mode_needs_a_gpu():
  """Off interpret mode the backward's fp32 FMA is inline PTX: a GPU-only (D) path, which
  each backend refuses by name (the XLA backend with a PalletError, the Triton backend under
  its interpreter with a TritonLoweringError)."""
  kernel = projects.load(K + "short_conv.pallas_gpu")
  config = projects.load(K + "short_conv.config")
  tiles = config.ShortConvTiles
  blocks = config.ShortConvBlockSizes(forward=tiles(16, 32, 4, 4), backward=tiles(16, 32, 2, 4))
  x = _normal(1, (1, 32, 32))
  refused = pallet.PalletError if BACKEND == "xla" else TritonLoweringError
  with _on_backend(), pytest.raises(refused, match="inline GPU assembly"):
    kernel.short_conv_pallas_bwd_local(_normal(2, (4, 32)), x, _segments(1, 32, 3), x,
                                       block_sizes=blocks, exact_reference_rounding=True)


# ----------------------------------------------------------------------------------
# relu2_mlp (GEMM + relu² epilogue, and its backward epilogue)
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_relu2_up_and_dpre(dtype):
  kernel = projects.load(K + "relu2_mlp.pallas_gpu")
  e, r, k, n, m = 2, 32, 96, 64, 64
  blocks = kernel.BlockSizes(bm=16, bn=32, bk=32)
  x, w_up = _normal(1, (e, r, k), dtype), _normal(2, (e, k, n), dtype, scale=k ** -0.5)
  g, w_down = _normal(3, (e, r, m), dtype), _normal(4, (e, n, m), dtype, scale=m ** -0.5)
  with _on_backend():
    post = kernel.relu2_up_pallas(x, w_up, block_sizes=blocks)
    dpre = kernel.relu2_dpre_pallas(g, w_down, post, block_sizes=blocks)
  pre = np.einsum("erk,ekn->ern", np.asarray(x, np.float64), np.asarray(w_up, np.float64))
  want_post = np.maximum(pre, 0.0) ** 2
  post64 = np.asarray(post, np.float64)
  want_dpre = np.einsum("erm,enm->ern", np.asarray(g, np.float64),
                        np.asarray(w_down, np.float64)) * 2.0 * np.sqrt(post64)
  tol = 3e-2 if dtype == jnp.bfloat16 else 1e-4
  _close(post, want_post, atol=tol * np.abs(want_post).max(), rtol=tol, what="post")
  _close(dpre, want_dpre, atol=tol * np.abs(want_dpre).max(), rtol=tol, what="dpre")
  # dpre is the gradient of relu(pre)^2 through the down projection's input gradient
  _, vjp = jax.vjp(lambda p: jnp.maximum(p, 0.0) ** 2, jnp.asarray(pre, jnp.float32))
  (want_grad,) = vjp(jnp.einsum("erm,enm->ern", g.astype(jnp.float32), w_down.astype(jnp.float32)))
  _close(dpre, want_grad, atol=tol * float(jnp.abs(want_grad).max()), rtol=tol, what="dpre vs vjp")
