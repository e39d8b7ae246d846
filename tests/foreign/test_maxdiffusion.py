"""AI-Hypercomputer/maxdiffusion's Pallas TPU attention kernels on pallet.

The kernels are read from a checkout (PALLET_MAXDIFFUSION_SOURCE) at test time; nothing of
maxdiffusion is copied here. Written against commit 7cfb8801d41d1728f0232cd7ee59e900a151fecf
(main, 2026-08-21). Its `src/maxdiffusion/kernels/` holds:

- `custom_splash_attention.py`, maxdiffusion's own dense flash-attention kernel (no mask):
  the output is written transposed ([heads, head_dim_v, q_len]), the scores in base 2
  (the caller scales q by log2(e)), a ragged last K/V block handled by slicing
  `pl.ds(start, kv_len % block_kv_compute)`, an inner loop over `block_kv_compute_in`
  rows, GQA by the index map, the m / l / o "scratch" buffers passed as outputs with a
  constant block. Variants: several heads per grid step (`heads_per_tile`), "fixed-m"
  (per head, from a scalar-prefetch operand: a Cauchy-Schwarz bound in place of the
  running max, heads past the bound online) and the ring partials (un-normalised output
  with m and l, for the ring merge).
- `splash_attention/`, a fork of tokamax's splash attention (masks through MaskInfo,
  segment ids, soft cap, sinks, forward and fused dq/dkv backward kernels) with a raw
  ring forward, and `ring_attention_kernel.py`: the splash ring (custom VJP, `ppermute`
  of K/V over a mesh axis) and the custom kernel's forward-only ring (unidirectional,
  bidirectional, fixed-m with its LSE merge).

Each is compared on random inputs with a jax.numpy softmax attention written here
(gradients too where the project defines a VJP); the rings run under `jax.shard_map` on
one CPU device in process and on 2 and 4 simulated CPU devices in a child process (the
device count is fixed when JAX starts). One custom-kernel case also runs on JAX's own
Pallas (TPU interpreter, tests/foreign/peer.py) as a second oracle.

Project bug, pinned: the splash fork with attention sinks and `use_base2_exp=True` (its
default) uses the sink as a base-2 logit (tokamax's kernel multiplies it by log2(e);
the fork predates that): the output is off wherever the sink matters. JAX's own Pallas
gives the same numbers as pallet (test_splash_sinks_base2_matches_jax_pallas).

TPU kernels: they run on pallet's default backend whatever PALLET_TEST_BACKEND says.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.foreign import peer, projects

MD = "maxdiffusion.kernels."
CUSTOM = MD + "custom_splash_attention"
SA = MD + "splash_attention."
LOG2E = math.log2(math.e)
P = jax.sharding.PartitionSpec
_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _cs():
  return projects.load(CUSTOM)


def _splash():
  return types.SimpleNamespace(kernel=projects.load(SA + "splash_attention_kernel"),
                               mask=projects.load(SA + "splash_attention_mask"),
                               base=projects.load(SA + "base"),
                               ring=projects.load(SA + "ring_attention_kernel"))


def _normal(seed, shape, dtype=jnp.float32, scale=1.0):
  return (scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)).astype(dtype)


def _attention(q, k, v, mask=None, segment_ids=None, soft_cap=None, sinks=None):
  """Softmax attention in float32 jax.numpy: q [H, S, D], k / v [Hkv, T, D] or [T, D]
  (MQA); query head h reads K/V head h // (H // Hkv). `mask` [S, T] (True: attend),
  `segment_ids` (q [S], kv [T]), `sinks` [H] (a logit per head that takes part in the
  normaliser only)."""
  if k.ndim == 2:
    k, v = k[None], v[None]
  rep = q.shape[0] // k.shape[0]
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  k, v = jnp.repeat(k, rep, 0), jnp.repeat(v, rep, 0)
  s = jnp.einsum("hsd,htd->hst", q, k, precision="highest")
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  keep = jnp.ones(s.shape[1:], bool) if mask is None else jnp.asarray(mask)
  if segment_ids is not None:
    keep = keep & (segment_ids[0][:, None] == segment_ids[1][None, :])
  s = jnp.where(keep[None], s, -1e30)
  if sinks is not None:
    s = jnp.concatenate([s, jnp.broadcast_to(sinks[:, None, None], s.shape[:2] + (1,))], -1)
  p = jax.nn.softmax(s, -1)
  if sinks is not None:
    p = p[..., :-1]
  return jnp.einsum("hst,htd->hsd", p, v, precision="highest")


def _close(actual, expected, rtol, what=""):
  """Max error relative to the reference's largest magnitude."""
  actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  assert np.isfinite(actual).all(), f"{what}: non-finite values"
  err = np.abs(actual - expected).max() / np.abs(expected).max()
  assert err <= rtol, f"{what}: max error {err:.2e} of the largest magnitude > {rtol:.0e}"


# float32: summation order and exp2 vs exp; bfloat16: p rounded to bf16 before P @ V
_RTOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _blocks(bq, bkv, bkv_compute=None, bkv_compute_in=256):
  return _cs()._BlockSizes(bq, bkv, bkv_compute, bkv_compute_in)


# ------------------------------------------------------------- the custom dense kernel
# (heads, kv heads, q len, kv len, head_dim, head_dim_v, block_q, block_kv,
#  block_kv_compute, block_kv_compute_in, base-2 exp, dtype)
CUSTOM_CASES = {
    "even_blocks": (2, 2, 256, 256, 64, 64, 128, 128, 128, 128, True, jnp.float32),
    "gqa_ragged_q_and_kv": (2, 1, 200, 300, 64, 64, 128, 256, 128, 64, False, jnp.float32),
    "kv_tail_in_last_compute": (2, 2, 128, 330, 64, 64, 128, 256, 128, 64, True, jnp.float32),
    "head_dim_v_128": (3, 3, 136, 384, 64, 128, 128, 128, 64, 32, True, jnp.float32),
    "bf16_gqa": (4, 2, 128, 384, 128, 128, 128, 256, 256, 128, True, jnp.bfloat16),
    "bf16_mqa_one_block": (4, 1, 128, 512, 128, 128, 128, 512, 256, 128, False, jnp.bfloat16),
}


@pytest.mark.parametrize("case", list(CUSTOM_CASES))
def test_custom_splash_attention(case):
  """make_splash_mha on unpadded q / k / v: the last q block and the last K/V block run
  past the arrays, the kernel slices the K/V tail to kv_len % block_kv_compute rows."""
  h, hkv, s, t, d, dv, bq, bkv, bkvc, bkvi, base2, dtype = CUSTOM_CASES[case]
  cs = _cs()
  q = _normal(0, (h, s, d), dtype, 0.3)
  k, v = _normal(1, (hkv, t, d), dtype), _normal(2, (hkv, t, dv), dtype)
  f = cs.make_splash_mha(_blocks(bq, bkv, bkvc, bkvi), use_base2_exp=base2)
  out = f(q * LOG2E if base2 else q, k, v)
  assert out.shape == (h, dv, s) and out.dtype == dtype
  _close(jnp.swapaxes(out, 1, 2), _attention(q, k, v), _RTOL[dtype], case)


@pytest.mark.parametrize("heads_per_tile,kv_len", [(2, 384), (2, 300), (4, 200)])
def test_custom_splash_heads_per_tile(heads_per_tile, kv_len):
  """The multi-head-per-tile kernel: [hpt, block, D] blocks, per-head loops in the body."""
  cs = _cs()
  q = _normal(3, (4, 256, 64), scale=0.3)
  k, v = _normal(4, (4, kv_len, 64)), _normal(5, (4, kv_len, 64))
  f = cs.make_splash_mha(_blocks(128, 128, 64, 64), heads_per_tile=heads_per_tile,
                         use_base2_exp=True)
  out = f(q * LOG2E, k, v)
  _close(jnp.swapaxes(out, 1, 2), _attention(q, k, v), 2e-5)


def _pad(x, multiple):
  pad = -x.shape[-2] % multiple
  return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pad), (0, 0)])


def _fixed_m_inputs(q, k, bound):
  """What maxdiffusion's attention does before the fixed-m kernel: k smoothed (its row
  mean over the sequence removed), q scaled by log2(e), per head the largest q and k
  norms and whether their product stays within the bound."""
  k = k - jnp.mean(k, axis=-2, keepdims=True)
  q = q * LOG2E
  qn = jnp.sqrt((q * q).sum(-1)).max(-1)
  mk = jnp.sqrt((k * k).sum(-1)).max(-1)
  return q, k, qn, mk, (qn * mk <= bound).astype(jnp.float32)


@pytest.mark.parametrize("kv_len", [256, 300])
def test_custom_splash_fixed_m(kv_len):
  """Fixed-m: heads 0 and 2 within the bound (exp2 of score - bound, no running max),
  heads 1 and 3 past it (online softmax); the per-head choice is read from the scalar
  prefetch operand. Batched with vmap and padded to whole blocks, as maxdiffusion calls
  it (orig_q_seq_len / orig_kv_seq_len bound the grid)."""
  cs = _cs()
  scale = jnp.array([0.2, 3.0, 0.2, 3.0])[None, :, None, None]
  q = _normal(6, (2, 4, 200, 64)) * scale
  k, v = _normal(7, (2, 4, kv_len, 64)), _normal(8, (2, 4, kv_len, 64))
  qs, ks, qn, mk, ok = _fixed_m_inputs(q, k, cs._FIXED_M_SAFE_BOUND)
  mk_h, ok_h = mk.max(0), ok.min(0)
  assert ok_h.tolist() == [1.0, 0.0, 1.0, 0.0]
  f = cs.make_splash_mha(_blocks(128, 128, 128, 64), orig_q_seq_len=200,
                         orig_kv_seq_len=kv_len, use_base2_exp=True, use_fixed_m=True)
  out = jax.vmap(f, in_axes=(0, 0, 0, None))(_pad(qs, 128), _pad(ks, 128), _pad(v, 128),
                                             jnp.stack([mk_h, ok_h]))
  assert out.shape == (2, 4, 64, 200)
  ref = jax.vmap(_attention)(q, ks, v)
  _close(jnp.swapaxes(out, 2, 3), ref, 5e-5)


def test_custom_splash_vmapped_padded_caller_layout():
  """As maxdiffusion's attention calls it: q scaled by log2(e), q / k / v zero-padded to
  whole blocks, the true lengths passed, vmapped over the batch, head_dim_v != head_dim."""
  cs = _cs()
  q = _normal(9, (2, 2, 200, 64), scale=0.3)
  k, v = _normal(10, (2, 2, 330, 64)), _normal(11, (2, 2, 330, 128))
  f = cs.make_splash_mha(_blocks(128, 256, 128, 64), orig_q_seq_len=200, orig_kv_seq_len=330)
  out = jax.vmap(f)(_pad(q * LOG2E, 128), _pad(k, 256), _pad(v, 256))
  assert out.shape == (2, 2, 128, 200)
  _close(jnp.swapaxes(out, 2, 3), jax.vmap(_attention)(q, k, v), 2e-5)


@pytest.mark.parametrize("fixed", [False, True])
def test_custom_splash_ring_partials(fixed):
  """_splash_attention_forward_ring: the un-normalised output o, the row max m (base 2)
  and the denominator l, so that o / l is the attention. Online: m is the max score;
  uniform fixed-m: m is the per-row bound ceil(|q_i| max|k|) (every score below it)
  less 88, which keeps exp2 of the largest scores clear of float32's flush to zero."""
  cs = _cs()
  q = _normal(12, (2, 256, 64), scale=0.3)
  k, v = _normal(13, (2, 300, 64)), _normal(14, (2, 300, 64))
  if fixed:
    qs, k, qn, mk, ok = _fixed_m_inputs(q, k, cs._FIXED_M_RING_SAFE_BOUND)
    assert ok.tolist() == [1.0, 1.0]
    kw = dict(use_fixed_m=True, mk=jnp.stack([mk, ok]), uniform_fixed_m=True)
  else:
    qs, kw = q * LOG2E, {}
  o, m, l = cs._splash_attention_forward_ring(qs, k, v, _blocks(128, 128, 64, 64), **kw)
  scores = jnp.einsum("hsd,htd->hst", qs, k, precision="highest")
  if fixed:
    m_ref = jnp.ceil(jnp.sqrt((qs * qs).sum(-1)) * mk[:, None]) - 88.0
    assert bool((scores.max(-1) <= m_ref + 88.0).all())
  else:
    m_ref = scores.max(-1)
  l_ref = jnp.exp2(scores - m_ref[..., None]).sum(-1)
  _close(m, m_ref, 1e-5, "m")
  _close(l, l_ref, 2e-5, "l")
  _close(o / l[..., None], _attention(q, k, v), 2e-5, "o / l")


def _custom_ring(block_sizes, s_local, t_local, base2=True, **kw):
  return _splash().ring.make_custom_ring_attention(
      block_sizes=block_sizes, orig_q_seq_len=s_local, orig_kv_seq_len=t_local,
      use_base2_exp=base2, ring_axis="context", **kw)


@pytest.mark.parametrize("base2", [True, False])
def test_custom_ring_attention_one_device(base2):
  """The custom kernel's ring on a one-device ring (one hop, no rotation)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("context",))
  q = _normal(15, (2, 192, 64), scale=0.3)
  k, v = _normal(16, (1, 192, 64)), _normal(17, (1, 192, 64))
  ring = _custom_ring(_blocks(128, 128, 64, 64), 192, 192, base2)
  spec = P(None, "context", None)
  f = jax.jit(jax.shard_map(ring, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                            check_vma=False))
  out = f(q * LOG2E if base2 else q, k, v)
  _close(out, _attention(q, k, v), 2e-5)


# ------------------------------------------------------------------ the splash fork
def _config(sa, **kw):
  base = dict(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128,
              block_kv_dkv=128, block_kv_dkv_compute=128)
  return sa.kernel.SplashConfig(**{**base, **kw})


_S, _T = 256, 384
# q in two segments of 128, kv in 128 + 256: with the causal and the local masks here no
# query row is left without a key (a fully masked row has no defined attention)
_SEGMENTS = (np.repeat([0, 1], [128, 128]).astype(np.int32),
             np.repeat([0, 1], [128, 256]).astype(np.int32))


def _mask(sa, name):
  ml = sa.mask
  if name == "causal":
    return ml.make_causal_mask((_S, _T))
  if name == "local":
    return ml.LocalMask((_S, _T), (64, 32), 0)
  if name == "random":
    return ml.make_random_mask((_S, _T), 0.5, 7) | ml.make_causal_mask((_S, _T))
  if name == "full":
    return ml.FullMask(_shape=(_S, _T))
  raise ValueError(name)


# mask, config overrides, MQA, segment ids, soft cap, dtype, dynamic (jax.Array) mask
SPLASH_CASES = {
    "causal": ("causal", {}, False, False, None, jnp.float32, False),
    "causal_base_e": ("causal", dict(use_base2_exp=False), False, False, None, jnp.float32,
                      False),
    "local_segments": ("local", {}, False, True, None, jnp.float32, False),
    "causal_segments_mqa": ("causal", {}, True, True, None, jnp.float32, False),
    "random_partial_blocks": ("random", {}, False, False, None, jnp.float32, False),
    "soft_cap": ("causal", {}, False, False, 5.0, jnp.float32, False),
    "full_no_fused_reciprocal": ("full", dict(fuse_reciprocal=False), False, False, None,
                                 jnp.float32, False),
    "dq_reduction_steps_3": ("causal", dict(dq_reduction_steps=3), False, False, None,
                             jnp.float32, False),
    "max_logit_const": ("full", dict(max_logit_const=10.0), False, False, None, jnp.float32,
                        False),
    "seq_minor_layouts": ("causal", dict(q_layout=2, k_layout=2, v_layout=2), False, False,
                          None, jnp.float32, False),
    "big_blocks": ("causal", dict(block_q=256, block_kv=384, block_kv_compute=128,
                                  block_kv_dkv=384, block_kv_dkv_compute=128), False, False,
                   None, jnp.float32, False),
    "dynamic_mask": ("causal", {}, False, False, None, jnp.float32, True),
    "bf16_causal_segments": ("causal", {}, False, True, None, jnp.bfloat16, False),
}


@pytest.mark.parametrize("case", list(SPLASH_CASES))
def test_splash_attention_forward_backward(case):
  """The fork's make_splash_mha / make_splash_mqa: output and dq, dk, dv (its custom VJP:
  the fused dkv kernel, dq accumulated there) against jax.grad of the reference."""
  mask_name, overrides, mqa, segmented, cap, dtype, dynamic = SPLASH_CASES[case]
  sa = _splash()
  overrides = dict(overrides)
  for layout in ("q_layout", "k_layout", "v_layout"):
    if layout in overrides:
      overrides[layout] = sa.kernel.QKVLayout(overrides[layout])
  config = _config(sa, attn_logits_soft_cap=cap, **overrides)
  mask = _mask(sa, mask_name)
  dense = np.asarray(mask[:, :])
  if dynamic:
    make = sa.kernel.make_dynamic_splash_mqa if mqa else sa.kernel.make_dynamic_splash_mha
    kernel = make(jnp.asarray(dense), config=config)
  else:
    make = sa.kernel.make_splash_mqa if mqa else sa.kernel.make_splash_mha
    kernel = make(mask, config=config, q_seq_shards=1)
  q = _normal(20, (2, _S, 128), dtype, 0.2)
  kv_shape = (_T, 128) if mqa else (2, _T, 128)
  k, v = _normal(21, kv_shape, dtype), _normal(22, kv_shape, dtype)
  do = _normal(23, (2, _S, 128), dtype)
  seg = tuple(jnp.asarray(s) for s in _SEGMENTS) if segmented else None
  seg_ids = sa.base.SegmentIds(*seg) if segmented else None
  out, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, seg_ids), q, k, v)
  ref, ref_vjp = jax.vjp(
      lambda q, k, v: _attention(q, k, v, dense, seg, cap).astype(dtype), q, k, v)
  rtol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
  _close(out, ref, rtol, "out")
  for name, g, g_ref in zip(("dq", "dk", "dv"), vjp(do), ref_vjp(do)):
    _close(g, g_ref, 3 * rtol, name)


def test_splash_attention_save_residuals():
  """save_residuals=True: the output with its logsumexp and max logits (natural log)."""
  sa = _splash()
  mask = _mask(sa, "causal")
  kernel = sa.kernel.make_splash_mha(mask, config=_config(sa), save_residuals=True,
                                     q_seq_shards=1)
  q = _normal(24, (2, _S, 128), scale=0.2)
  k, v = _normal(25, (2, _T, 128)), _normal(26, (2, _T, 128))
  out, stats = kernel(q, k, v)
  s = jnp.einsum("hsd,htd->hst", q, k, precision="highest")
  s = jnp.where(np.asarray(mask[:, :])[None], s, -jnp.inf)
  _close(out, _attention(q, k, v, np.asarray(mask[:, :])), 1e-5, "out")
  _close(stats["max_logits"], s.max(-1), 1e-5, "max_logits")
  _close(stats["logsumexp"], jax.nn.logsumexp(s, -1), 1e-5, "logsumexp")


@pytest.mark.parametrize("base2", [
    False,
    pytest.param(True, marks=pytest.mark.xfail(strict=True, reason=(
        "maxdiffusion: with use_base2_exp the fork's kernel takes the sink as a base-2 "
        "logit (no `sink *= LOG2E`, which tokamax's kernel has); JAX's Pallas gives the "
        "same result"))),
])
def test_splash_attention_sinks(base2):
  """Attention sinks (a logit per head in the normaliser), forward and backward."""
  sa = _splash()
  mask = _mask(sa, "causal")
  kernel = sa.kernel.make_splash_mha(mask, config=_config(sa, use_base2_exp=base2),
                                     q_seq_shards=1)
  q = _normal(27, (2, _S, 128), scale=0.2)
  k, v = _normal(28, (2, _T, 128)), _normal(29, (2, _T, 128))
  do = _normal(30, (2, _S, 128))
  sinks = jnp.array([0.5, -1.0])
  out, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, None, sinks), q, k, v)
  ref, ref_vjp = jax.vjp(
      lambda q, k, v: _attention(q, k, v, np.asarray(mask[:, :]), sinks=sinks), q, k, v)
  _close(out, ref, 1e-5, "out")
  for name, g, g_ref in zip(("dq", "dk", "dv"), vjp(do), ref_vjp(do)):
    _close(g, g_ref, 3e-5, name)


_SINKS_CHILD = r"""
import os, sys, numpy as np, jax, jax.numpy as jnp
from tests.foreign import projects
sk = projects.load("maxdiffusion.kernels.splash_attention.splash_attention_kernel")
ml = projects.load("maxdiffusion.kernels.splash_attention.splash_attention_mask")
q, k, v = (jax.random.normal(jax.random.key(i), (2, 256, 128)) * s
           for i, s in ((0, 0.2), (1, 1.0), (2, 1.0)))
cfg = sk.SplashConfig(block_q=128, block_kv=128, block_kv_compute=128, use_base2_exp=True)
kernel = sk.make_splash_mha(ml.make_causal_mask((256, 256)), config=cfg, q_seq_shards=1)
if os.environ.get(projects.PEER_VARIABLE):
  from jax.experimental.pallas import tpu as jpltpu
  with jpltpu.force_tpu_interpret_mode(jpltpu.InterpretParams()):
    out = kernel(q, k, v, None, jnp.array([0.5, -1.0]))
else:
  out = kernel(q, k, v, None, jnp.array([0.5, -1.0]))
np.save(sys.argv[1], np.asarray(out))
"""


def _child(code, out, *, jax_pallas=False, devices=1, timeout=600):
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
         "PYTHONPATH": os.pathsep.join([str(_ROOT / "src"), str(_ROOT),
                                        os.environ.get("PYTHONPATH", "")])}
  if jax_pallas:
    env[projects.PEER_VARIABLE] = "1"
  done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=_ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return done.stdout


def test_splash_sinks_base2_matches_jax_pallas(tmp_path):
  """The pinned sinks case is the project's: JAX's own Pallas (TPU interpreter) computes
  what pallet computes."""
  reason = projects.skip_reason("maxdiffusion")
  if reason:
    pytest.skip(reason)
  _child(_SINKS_CHILD, tmp_path / "pallet.npy")
  _child(_SINKS_CHILD, tmp_path / "jax.npy", jax_pallas=True)
  ours, theirs = np.load(tmp_path / "pallet.npy"), np.load(tmp_path / "jax.npy")
  np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=0)


@pytest.mark.parametrize("is_mqa", [False, True])
def test_ring_splash_attention_one_device(is_mqa):
  """The splash ring (make_ring_attention, its custom VJP) on a one-device ring."""
  sa = _splash()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("ring",))
  mask = sa.mask.make_causal_mask((_S, _S))
  config = _config(sa, use_base2_exp=False)
  ring = sa.ring.make_ring_attention(mask, is_mqa=is_mqa, ring_axis="ring", config=config)
  q = _normal(31, (2, _S, 64), scale=0.3)
  kv_shape = (_S, 64) if is_mqa else (2, _S, 64)
  k, v, do = _normal(32, kv_shape), _normal(33, kv_shape), _normal(34, (2, _S, 64))
  qs = P(None, "ring", None)
  kvs = P("ring", None) if is_mqa else qs
  f = jax.shard_map(lambda r, q, k, v: r(q, k, v), mesh=mesh,
                    in_specs=(ring.manual_sharding_spec(), qs, kvs, kvs), out_specs=qs,
                    check_vma=False)
  out, vjp = jax.vjp(f, ring, q, k, v)
  ref, ref_vjp = jax.vjp(lambda q, k, v: _attention(q, k, v, mask), q, k, v)
  _close(out, ref, 1e-5, "out")
  for name, g, g_ref in zip(("dq", "dk", "dv"), vjp(do)[1:], ref_vjp(do)):
    _close(g, g_ref, 3e-5, name)


_RING_CHILD = r"""
import dataclasses, math, sys
import jax, jax.numpy as jnp, numpy as np
from tests.foreign import projects
from tests.foreign.test_maxdiffusion import _attention
P = jax.sharding.PartitionSpec
cs = projects.load("maxdiffusion.kernels.custom_splash_attention")
SA = "maxdiffusion.kernels.splash_attention."
ring = projects.load(SA + "ring_attention_kernel")
sk, ml = projects.load(SA + "splash_attention_kernel"), projects.load(SA + "splash_attention_mask")
base = projects.load(SA + "base")
nd = jax.device_count()
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("context",))
spec = P(None, "context", None)
LOG2E = math.log2(math.e)
def err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / np.abs(b).max()
def report(name, e, tol):
  print(f"CASE {name} devices={nd} err={e:.2e} {'OK' if e <= tol else 'BAD'}")

# the custom kernel's ring: 192 queries / keys per device (a ragged K/V tail in every hop)
sl = 192
key = jax.random.split(jax.random.key(nd), 3)
q = jax.random.normal(key[0], (4, sl * nd, 64)) * jnp.array([0.3, 0.3, 2.0, 0.3])[:, None, None]
k = jax.random.normal(key[1], (2, sl * nd, 64))
v = jax.random.normal(key[2], (2, sl * nd, 64))
bs = cs._BlockSizes(128, 128, 64, 64)
for name, bidir, fixed, base2 in [("unidirectional", False, None, True),
                                  ("unidirectional_base_e", False, None, False),
                                  ("bidirectional", True, None, True),
                                  ("fixed_m_accumulate", False, "all", True),
                                  ("fixed_m_lse_merge", False, "mixed", True)]:
  qq, kk = (q if fixed != "all" else q.at[2].multiply(0.15)), k
  if fixed:
    qs, kk = qq * LOG2E, kk - kk.mean(1, keepdims=True)
  else:
    qs = qq * LOG2E if base2 else qq
  def body(q, k, v):
    kw = {}
    if fixed:
      qn = jax.lax.pmax(jnp.sqrt((q * q).sum(-1)).max(-1), "context")
      mk = jnp.repeat(jnp.sqrt((k * k).sum(-1)).max(-1), 2)
      kw = dict(use_fixed_m=True, fixed_m_norms=(qn, mk))
    f = ring.make_custom_ring_attention(block_sizes=bs, orig_q_seq_len=sl, orig_kv_seq_len=sl,
                                        use_base2_exp=base2, ring_axis="context",
                                        bidirectional=bidir, **kw)
    return f(q, k, v)
  g = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                            check_vma=False))
  report(name, err(g(qs, kk, v), _attention(qq, kk, v)), 2e-5)

# the splash ring: causal mask, segment ids rotating with K/V, gradients
s = 256 * nd
q, k, v, do = (jax.random.normal(jax.random.key(10 + i), (2, s, 64)) * (0.3 if i == 0 else 1)
               for i in range(4))
mask = ml.make_causal_mask((s, s))
seg = np.repeat(np.arange(3), [s // 3, s // 3, s - 2 * (s // 3)]).astype(np.int32)
for name, segmented in [("splash_ring_causal", False), ("splash_ring_causal_segments", True)]:
  cfg = sk.SplashConfig(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128,
                        block_kv_dkv=128, block_kv_dkv_compute=128, use_base2_exp=False)
  rk = ring.make_ring_attention(mask, is_mqa=False, ring_axis="context", config=cfg,
                                q_seq_shards=nd, kv_seq_shards=nd)
  segs = base.SegmentIds(jnp.asarray(seg), jnp.asarray(seg)) if segmented else None
  sspec = base.SegmentIds(P("context"), P("context")) if segmented else None
  f = jax.shard_map(lambda r, q, k, v, sg: r(q, k, v, sg), mesh=mesh,
                    in_specs=(rk.manual_sharding_spec(), spec, spec, spec, sspec),
                    out_specs=spec, check_vma=False)
  out, vjp = jax.vjp(f, rk, q, k, v, segs)
  ref, ref_vjp = jax.vjp(lambda q, k, v: _attention(
      q, k, v, mask, (jnp.asarray(seg),) * 2 if segmented else None), q, k, v)
  report(name, err(out, ref), 1e-5)
  for gname, g, gr in zip(("dq", "dk", "dv"), vjp(do)[1:4], ref_vjp(do)):
    report(f"{name}_{gname}", err(g, gr), 3e-5)
"""


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
def test_ring_attention_devices(devices, tmp_path):
  """Both rings on 2 and 4 simulated CPU devices: K/V rotated with ppermute. The custom
  ring unidirectional, bidirectional (no wrap hop; line ends masked out), fixed-m with
  every head within the ring bound (hops accumulated) and with one head past it (merged
  in log-sum-exp space); the splash ring with gradients."""
  reason = projects.skip_reason("maxdiffusion")
  if reason:
    pytest.skip(reason)
  stdout = _child(_RING_CHILD, tmp_path / "unused", devices=devices)
  lines = [l for l in stdout.splitlines() if l.startswith("CASE")]
  assert len(lines) == 13, stdout[-3000:]
  assert all(l.endswith(" OK") for l in lines), "\n".join(lines)


# ------------------------------------------------------------------ JAX's own Pallas
def test_custom_splash_matches_jax_pallas():
  """One custom-kernel case (GQA, ragged K/V tail, base 2) on JAX's Pallas (TPU
  interpreter) as well: the same numbers as pallet."""
  cs = _cs()
  q = _normal(40, (2, 128, 64), scale=0.3 * LOG2E)
  k, v = _normal(41, (1, 200, 64)), _normal(42, (1, 200, 64))
  blocks = dict(block_q=128, block_kv=128, block_kv_compute=64, block_kv_compute_in=32)
  ours = cs._splash_attention_forward(q, k, v, cs._BlockSizes(**blocks))
  theirs = peer.run_on_jax_pallas(CUSTOM, "_splash_attention_forward", q, k, v,
                                  types.SimpleNamespace(**blocks))
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=2e-6, rtol=0)
  _close(jnp.swapaxes(ours, 1, 2), _attention(q / LOG2E, k, v), 2e-5)
