"""maxtext's Pallas kernels (AI-Hypercomputer/maxtext, src/maxtext/kernels), run on pallet.

Each kernel is loaded from the checkout named by PALLET_MAXTEXT_SOURCE (skips without it)
and compared on random inputs with maxtext's own reference functions where it ships them
and with a jax.numpy reference written here.

maxtext's megablox kernels call `qwix.pallas` (qwix's quantization-aware wrappers of
`pallas_call` and `dot_general`) and its MoE ops import `tokamax` and
`maxtext.layers.quantizations` (which pulls in maxtext's whole config system). None of
that is exercised on the unquantized path tested below, and qwix, where installed, calls
JAX's own `pallas_call`; so while a module loads this file puts stand-ins in `sys.modules`: `qwix.pallas` routes
`pallas_call` to pallet and `dot`/`dot_general` to jax.lax (what qwix does for plain,
unquantized arrays), and nothing is ever a `QArray`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet
from tests.foreign import projects


# ---------------------------------------------------------------------------------------
# loading


class _NeverQArray:
  """qwix's quantized array: nothing on the tested (unquantized) path is one."""


def _qwix_stand_ins() -> dict[str, types.ModuleType]:
  qwix = types.ModuleType("qwix")
  qwix.QtRule = type("QtRule", (), {})
  qpl = types.ModuleType("qwix.pallas")
  qpl.QArray = _NeverQArray
  qpl.pallas_call = lambda kernel, **kw: pallet.pallas_call(kernel, **kw)

  def dot(a, b, *, preferred_element_type=None, precision=None):
    return jax.lax.dot(a, b, precision=precision, preferred_element_type=preferred_element_type)

  def dot_general(a, b, dimension_numbers, *, preferred_element_type=None, precision=None):
    return jax.lax.dot_general(a, b, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)

  def unavailable(*args, **kwargs):
    raise NotImplementedError("qwix quantization is not available in these tests")

  qpl.dot, qpl.dot_general = dot, dot_general
  qpl.quantize = qpl.get_current_rule = unavailable
  qwix.pallas = qpl
  quantizations = types.ModuleType("maxtext.layers.quantizations")
  quantizations.manual_quantize = quantizations.get_static_scale = unavailable
  return {"qwix": qwix, "qwix.pallas": qpl, "tokamax": types.ModuleType("tokamax"),
          "maxtext.layers.quantizations": quantizations}


@contextlib.contextmanager
def _stand_ins():
  """The stand-ins replace qwix even where it is installed: qwix's own `pallas_call`
  calls JAX's Pallas, not pallet."""
  stand_ins = _qwix_stand_ins()
  saved = {n: sys.modules[n] for n in stand_ins if n in sys.modules}
  sys.modules.update(stand_ins)
  try:
    yield
  finally:
    for name in stand_ins:
      sys.modules.pop(name, None)
    sys.modules.update(saved)


def load(dotted: str) -> types.ModuleType:
  if projects.skip_reason("maxtext"):
    return projects.load(dotted)  # skips
  with _stand_ins():
    return projects.load(dotted)


def _rand(key, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


# ---------------------------------------------------------------------------------------
# megablox: backend.gmm / backend.tgmm and ops.gmm (custom VJP)


def _gmm_ref(lhs, rhs, group_sizes, transpose_rhs=False):
  """out[rows of group g] = lhs[rows of g] @ rhs[g]; rows past sum(group_sizes) are 0."""
  rhs = rhs.swapaxes(1, 2) if transpose_rhs else rhs
  m = lhs.shape[0]
  ends = np.cumsum(np.asarray(group_sizes))
  group = np.searchsorted(ends, np.arange(m), side="right")  # == len(groups) past the end
  per_row = jnp.einsum("mk,gkn->mgn", lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                       precision="highest")
  valid = group < rhs.shape[0]
  out = per_row[np.arange(m), np.minimum(group, rhs.shape[0] - 1)]
  return jnp.where(valid[:, None], out, 0.0)


def _tgmm_ref(lhs_t, rhs, group_sizes):
  """out[g] = lhs_t[:, rows of g] @ rhs[rows of g]."""
  ends = np.cumsum(np.asarray(group_sizes))
  starts = ends - np.asarray(group_sizes)
  outs = [jnp.dot(lhs_t[:, s:e].astype(jnp.float32), rhs[s:e].astype(jnp.float32),
                  precision="highest") for s, e in zip(starts, ends)]
  return jnp.stack(outs)


GMM_CASES = [
    # m, k, n, group_sizes, tiling
    (128, 128, 128, [32, 0, 64, 32], (32, 64, 64)),       # tiles split by groups, an empty one
    (64, 96, 80, [10, 30, 5, 19], (16, 32, 32)),          # k, n not multiples of the tile
    (64, 64, 64, [40, 24], (64, 64, 64)),                  # one m tile, two groups in it
    (96, 64, 32, [20, 20, 20], (32, 32, 32)),              # rows past the last group
]


@pytest.mark.parametrize("m,k,n,sizes,tiling", GMM_CASES)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_megablox_gmm(m, k, n, sizes, tiling, transpose_rhs):
  backend = load("maxtext.kernels.megablox.backend")
  g = len(sizes)
  lhs = _rand(0, (m, k))
  rhs = _rand(1, (g, n, k) if transpose_rhs else (g, k, n))
  group_sizes = jnp.array(sizes, jnp.int32)
  out = backend.gmm(lhs, rhs, group_sizes, jnp.float32, tiling, transpose_rhs=transpose_rhs)
  expected = _gmm_ref(lhs, rhs, group_sizes, transpose_rhs)
  rows = int(np.sum(sizes))  # rows past the groups are left unwritten by the kernel
  np.testing.assert_allclose(out[:rows], expected[:rows], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m,k,n,sizes,tiling", GMM_CASES)
def test_megablox_tgmm(m, k, n, sizes, tiling):
  backend = load("maxtext.kernels.megablox.backend")
  lhs_t = _rand(2, (k, m))
  rhs = _rand(3, (m, n))
  group_sizes = jnp.array(sizes, jnp.int32)
  out = backend.tgmm(lhs_t, rhs, group_sizes, jnp.float32, tiling)
  np.testing.assert_allclose(out, _tgmm_ref(lhs_t, rhs, group_sizes), rtol=1e-5, atol=1e-4)


def test_megablox_gmm_sharded_groups():
  """rhs holds groups 1..2 of 4 (group_offset=1): their rows are computed, the rest zeroed."""
  backend = load("maxtext.kernels.megablox.backend")
  sizes = [24, 20, 12, 8]
  lhs, rhs_all = _rand(4, (64, 64)), _rand(5, (4, 64, 48))
  group_sizes = jnp.array(sizes, jnp.int32)
  out = backend.gmm(lhs, rhs_all[1:3], group_sizes, jnp.float32, (16, 32, 16),
                    group_offset=jnp.array(1, jnp.int32))
  expected = _gmm_ref(lhs, rhs_all, group_sizes)
  rows = np.arange(64)
  mine = (rows >= 24) & (rows < 56)
  expected = jnp.where(mine[:, None], expected, 0.0)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


def test_megablox_gmm_existing_out():
  """existing_out is aliased to the output: rows outside this shard's groups keep it."""
  backend = load("maxtext.kernels.megablox.backend")
  sizes = [24, 20, 12, 8]
  lhs, rhs_all = _rand(6, (64, 64)), _rand(7, (4, 64, 48))
  existing = _rand(8, (64, 48))
  group_sizes = jnp.array(sizes, jnp.int32)
  out = backend.gmm(lhs, rhs_all[1:3], group_sizes, jnp.float32, (16, 32, 16),
                    group_offset=jnp.array(1, jnp.int32), existing_out=existing)
  rows = np.arange(64)
  mine = (rows >= 24) & (rows < 56)
  expected = jnp.where(mine[:, None], _gmm_ref(lhs, rhs_all, group_sizes), existing)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


def test_megablox_tgmm_sharded_groups():
  backend = load("maxtext.kernels.megablox.backend")
  sizes = [24, 0, 20, 12, 8]
  lhs_t, rhs = _rand(9, (48, 64)), _rand(10, (64, 32))
  group_sizes = jnp.array(sizes, jnp.int32)
  out = backend.tgmm(lhs_t, rhs, group_sizes, jnp.float32, (16, 16, 16),
                     group_offset=jnp.array(1, jnp.int32), num_actual_groups=3)
  expected = _tgmm_ref(lhs_t, rhs, group_sizes)[1:4]
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_megablox_ops_gmm_and_grad(transpose_rhs, dtype):
  """ops.gmm forward and its custom VJP (a gmm for dlhs, a tgmm for drhs)."""
  ops = load("maxtext.kernels.megablox.ops")
  sizes = [20, 0, 28, 16]  # sums to m: the VJP's rows past the groups are not defined
  m, k, n, g = 64, 64, 48, len(sizes)
  lhs = _rand(11, (m, k), dtype)
  rhs = _rand(12, (g, n, k) if transpose_rhs else (g, k, n), dtype)
  cot = _rand(13, (m, n))
  group_sizes = jnp.array(sizes, jnp.int32)
  tiling = (16, 32, 16) * 3

  def kernel_loss(lhs, rhs):
    out = ops.gmm(lhs, rhs, group_sizes, jnp.float32, tiling, transpose_rhs=transpose_rhs)
    return jnp.sum(out * cot), out

  def ref_loss(lhs, rhs):
    out = _gmm_ref(lhs, rhs, group_sizes, transpose_rhs)
    return jnp.sum(out * cot), out

  (_, out), grads = jax.value_and_grad(kernel_loss, argnums=(0, 1), has_aux=True)(lhs, rhs)
  (_, ref), ref_grads = jax.value_and_grad(ref_loss, argnums=(0, 1), has_aux=True)(lhs, rhs)
  # bf16 inputs are exact in f32 products; the gradients are rounded to bf16 (the inputs'
  # dtype) by the kernel, so they get bf16's tolerance
  tol = dict(rtol=1e-5, atol=1e-4) if dtype == jnp.float32 else dict(rtol=2e-2, atol=5e-2)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
  for got, want in zip(grads, ref_grads):
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), **tol)


# ---------------------------------------------------------------------------------------
# megablox v2: pallas_mosaic_tpu_v2_gmm_kernel.gmm_v2 / ..._tgmm_kernel.tgmm_v2 (HBM refs,
# emit_pipeline, SMEM metadata, zero-fill DMAs). maxtext's own references for these
# (reference_gmm / reference_tgmm) live in tests/unit/pallas_mosaic_tpu_v2_kernel_test.py,
# which needs chex (not installed here); the jax.numpy references above do their job.


def _offset_ref(lhs, rhs_local, group_sizes, group_offset):
  """gmm with rhs holding groups [offset, offset + len(rhs_local)): other rows are 0."""
  sizes = np.asarray(group_sizes)
  g_local = rhs_local.shape[0]
  full = jnp.zeros((len(sizes),) + rhs_local.shape[1:], rhs_local.dtype)
  full = full.at[group_offset:group_offset + g_local].set(rhs_local)
  return _gmm_ref(lhs, full, group_sizes)


GMM_V2_CASES = [
    # m, k, n, sizes, group_offset, g_local, tiles (m, k, n)
    (128, 256, 256, [20, 36, 0, 72], 0, 4, (32, 128, 128)),
    (64, 128, 384, [5, 11, 30, 18], 0, 4, (16, 128, 128)),   # groups inside sublane tiles
    (128, 256, 128, [16, 40, 8, 64], 1, 2, (32, 128, 128)),  # local groups 1..2 only
    (64, 256, 200, [24, 40], 0, 2, (32, 128, 128)),          # n not lane-aligned
    (96, 128, 128, [30, 30], 0, 2, (32, 128, 128)),          # rows past the last group
]


def _local_rows(sizes, offset, g_local):
  ends = np.cumsum(sizes)
  starts = ends - np.asarray(sizes)
  rows = np.zeros(ends[-1] if len(ends) else 0, bool)
  rows[starts[offset]:ends[offset + g_local - 1]] = True
  return rows


@pytest.mark.parametrize("m,k,n,sizes,offset,g_local,tiles,dtype",
                         [c + (jnp.float32,) for c in GMM_V2_CASES]
                         + [GMM_V2_CASES[1] + (jnp.bfloat16,)])
def test_megablox_gmm_v2(m, k, n, sizes, offset, g_local, tiles, dtype):
  """zero_initialize=False: only the rows of the local groups are written (and checked)."""
  gmm_v2 = load("maxtext.kernels.megablox.pallas_mosaic_tpu_v2_gmm_kernel")
  lhs, rhs = _rand(20, (m, k), dtype), _rand(21, (g_local, k, n), dtype)
  group_sizes = jnp.array(sizes, jnp.int32)
  out = gmm_v2.gmm_v2(lhs, rhs, group_sizes, group_offset=jnp.array([offset], jnp.int32),
                      tile_info=gmm_v2.TileSizes(*tiles), preferred_element_type=jnp.float32,
                      zero_initialize=False)
  expected = _offset_ref(lhs, rhs, group_sizes, offset)
  rows = _local_rows(sizes, offset, g_local)
  np.testing.assert_allclose(out[:len(rows)][rows], expected[:len(rows)][rows],
                             rtol=1e-5, atol=1e-4)


def test_megablox_gmm_v2_zero_initialize():
  """The default zero_initialize=True also zeroes the rows outside the local groups."""
  gmm_v2 = load("maxtext.kernels.megablox.pallas_mosaic_tpu_v2_gmm_kernel")
  m, k, n, sizes, offset, g_local = 128, 256, 128, [16, 40, 8, 64], 1, 2
  lhs, rhs = _rand(20, (m, k)), _rand(21, (g_local, k, n))
  group_sizes = jnp.array(sizes, jnp.int32)
  out = gmm_v2.gmm_v2(lhs, rhs, group_sizes, group_offset=jnp.array([offset], jnp.int32),
                      tile_info=gmm_v2.TileSizes(32, 128, 128),
                      preferred_element_type=jnp.float32)
  np.testing.assert_allclose(out, _offset_ref(lhs, rhs, group_sizes, offset),
                             rtol=1e-5, atol=1e-4)


def test_megablox_gmm_v2_bias_and_partial_sum():
  gmm_v2 = load("maxtext.kernels.megablox.pallas_mosaic_tpu_v2_gmm_kernel")
  m, k, n, sizes = 128, 256, 256, [20, 36, 0, 72]
  lhs, rhs = _rand(22, (m, k)), _rand(23, (4, k, n))
  bias, ps = _rand(24, (4, 1, n)), _rand(25, (m, n))
  group_sizes = jnp.array(sizes, jnp.int32)
  out = gmm_v2.gmm_v2(lhs, rhs, group_sizes, rhs_bias=bias, partial_sum=ps,
                      tile_info=gmm_v2.TileSizes(32, 128, 128),
                      preferred_element_type=jnp.float32, zero_initialize=False)
  group = np.repeat(np.arange(4), sizes)
  expected = _gmm_ref(lhs, rhs, group_sizes) + bias[group, 0] + ps
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


TGMM_V2_CASES = [
    # m, k, n, sizes, group_offset, num_actual_groups, tiles (m, k, n)
    (128, 256, 256, [20, 36, 0, 72], 0, 4, (32, 128, 128)),
    (64, 128, 384, [5, 11, 30, 18], 0, 4, (16, 128, 128)),
    (128, 256, 128, [16, 40, 8, 64], 1, 2, (32, 128, 128)),
    (64, 200, 136, [24, 40], 0, 2, (32, 128, 128)),           # k, n not tile-aligned
]


@pytest.mark.parametrize("m,k,n,sizes,offset,groups,tiles,dtype",
                         [c + (jnp.float32,) for c in TGMM_V2_CASES]
                         + [TGMM_V2_CASES[0] + (jnp.bfloat16,)])
def test_megablox_tgmm_v2(m, k, n, sizes, offset, groups, tiles, dtype):
  tgmm_v2 = load("maxtext.kernels.megablox.pallas_mosaic_tpu_v2_tgmm_kernel")
  gmm_v2 = load("maxtext.kernels.megablox.pallas_mosaic_tpu_v2_gmm_kernel")
  lhs, rhs = _rand(26, (m, k), dtype), _rand(27, (m, n), dtype)
  group_sizes = jnp.array(sizes, jnp.int32)
  out = tgmm_v2.tgmm_v2(lhs, rhs, group_sizes, groups,
                        group_offset=jnp.array([offset], jnp.int32),
                        tile_info=gmm_v2.TileSizes(*tiles), preferred_element_type=jnp.float32)
  expected = _tgmm_ref(lhs.T, rhs, group_sizes)[offset:offset + groups]
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


def test_megablox_tgmm_v2_partial_sum():
  tgmm_v2 = load("maxtext.kernels.megablox.pallas_mosaic_tpu_v2_tgmm_kernel")
  gmm_v2 = load("maxtext.kernels.megablox.pallas_mosaic_tpu_v2_gmm_kernel")
  m, k, n, sizes = 128, 256, 256, [20, 36, 0, 72]
  lhs, rhs, ps = _rand(28, (m, k)), _rand(29, (m, n)), _rand(30, (4, k, n))
  group_sizes = jnp.array(sizes, jnp.int32)
  out = tgmm_v2.tgmm_v2(lhs, rhs, group_sizes, 4, partial_sum=ps,
                        tile_info=gmm_v2.TileSizes(32, 128, 128),
                        preferred_element_type=jnp.float32)
  np.testing.assert_allclose(out, _tgmm_ref(lhs.T, rhs, group_sizes) + ps, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------
# attention/ragged_attention.py: ragged_mqa / ragged_mha / ragged_gqa (decode attention over
# the first `lengths[b]` keys; a data-dependent index map that stops fetching past the end)

_LENGTHS = [1, 16, 17, 40, 64]  # inside a block, exactly a block, one past, mid, full


def _attention_ref(q, k, v, lengths):
  """q [b, h, d], k/v [b, h, t, d] -> (out [b, h, d], max logit [b, h], denominator [b, h])."""
  s = jnp.einsum("bhd,bhtd->bht", q.astype(jnp.float32), k.astype(jnp.float32),
                 precision="highest")
  valid = jnp.arange(k.shape[2])[None, None, :] < lengths[:, None, None]
  s = jnp.where(valid, s, -jnp.inf)
  m = s.max(-1)
  p = jnp.exp(s - m[..., None])
  l = p.sum(-1)
  o = jnp.einsum("bht,bhtd->bhd", p, v.astype(jnp.float32), precision="highest") / l[..., None]
  return o, m, l


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_mqa(dtype):
  ra = load("maxtext.kernels.attention.ragged_attention")
  b, t, h, d = len(_LENGTHS), 64, 4, 32
  q, k, v = _rand(40, (b, h, d), dtype), _rand(41, (b, t, d), dtype), _rand(42, (b, t, d), dtype)
  lengths = jnp.array(_LENGTHS, jnp.int32)
  out, m, l = ra.ragged_mqa(q, k, v, lengths, block_size=16)
  ro, rm, rl = ra.reference_mqa(q, k, v, lengths)
  mo, mm, ml = _attention_ref(q, jnp.broadcast_to(k[:, None], (b, h, t, d)),
                              jnp.broadcast_to(v[:, None], (b, h, t, d)), lengths)
  tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(out, mo, **tol)
  np.testing.assert_allclose(m, mm, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(l, ml, rtol=1e-5, atol=1e-5)
  # maxtext's reference multiplies the probabilities in v's dtype: bf16's tolerance there
  np.testing.assert_allclose(out, ro, **tol)
  np.testing.assert_allclose(l, rl[..., 0], rtol=1e-5, atol=1e-5)


def test_ragged_mha():
  ra = load("maxtext.kernels.attention.ragged_attention")
  b, t, h, d = len(_LENGTHS), 64, 4, 32
  q, k, v = _rand(43, (b, 1, h, d)), _rand(44, (b, t, h, d)), _rand(45, (b, t, h, d))
  lengths = jnp.array(_LENGTHS, jnp.int32)
  out, m, l = ra.ragged_mha(q, k, v, lengths, block_size=16)
  out = out / l  # ragged_mha returns the unnormalized output
  ro, rm, rl = ra.reference_mha(q, k, v, lengths)
  mo, mm, ml = _attention_ref(q[:, 0], k.swapaxes(1, 2), v.swapaxes(1, 2), lengths)
  np.testing.assert_allclose(out[:, 0], mo, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out, ro, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(m[:, 0, :, 0], mm, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(l[:, 0, :, 0], ml, rtol=1e-5, atol=1e-5)


def test_ragged_gqa():
  ra = load("maxtext.kernels.attention.ragged_attention")
  b, t, hq, hkv, d = len(_LENGTHS), 64, 8, 2, 32
  q, k, v = _rand(46, (b, 1, hq, d)), _rand(47, (b, t, hkv, d)), _rand(48, (b, t, hkv, d))
  lengths = jnp.array(_LENGTHS, jnp.int32)
  out, m, l = ra.ragged_gqa(q, k, v, lengths, block_size=16)
  out = out / l
  ro, rm, rl = ra.reference_gqa(q[:, 0], k.swapaxes(1, 2), v.swapaxes(1, 2), lengths)
  rep = hq // hkv
  mo, mm, ml = _attention_ref(q[:, 0], jnp.repeat(k.swapaxes(1, 2), rep, axis=1),
                              jnp.repeat(v.swapaxes(1, 2), rep, axis=1), lengths)
  np.testing.assert_allclose(out[:, 0], mo, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out, ro, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(m[:, 0, :, 0], mm, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(l, rl, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# mhc/: mHC-lite pre (coefficients + stream collapse) and post (residual stream mixing),
# forward kernels and their backward kernels (custom VJPs in mhc_kernels_fwd)


def _mhc_inputs(batch=2, sequence=32, embedding=256, seed=0):
  mhc = load("maxtext.kernels.mhc")
  import itertools
  streams, perms = 4, 24
  ks = jax.random.split(jax.random.key(seed), 10)
  bf = jnp.bfloat16
  n = lambda i, shape, s=1.0: (jax.random.normal(ks[i], shape, jnp.float32) * s).astype(bf)
  x = n(0, (batch, sequence, streams, embedding))
  weights = mhc.MhcWeights(
      norm_scale=n(1, (streams * embedding,)),
      pre_alpha=n(2, (streams * embedding, streams), 0.1), pre_bias=n(3, (streams,), 0.1),
      pre_scale=jnp.array([1.25], bf),
      post_alpha=n(4, (streams * embedding, streams), 0.1), post_bias=n(5, (streams,), 0.1),
      post_scale=jnp.array([0.75], bf),
      res_alpha=n(6, (streams * embedding, perms), 0.1), res_bias=n(7, (perms,), 0.1),
      res_scale=jnp.array([1.5], bf))
  permutations = jnp.eye(streams, dtype=jnp.float32)[
      jnp.array(list(itertools.permutations(range(streams))))]
  cotangent = n(8, x.shape)
  return mhc, x, weights, permutations, cotangent


def _mhc_ref(x, w, permutations, eps=1e-5, pre_eps=1e-6):
  """mHC-lite in f32: RMS-normalised streams -> sigmoid gates and a softmax mix of
  permutations; layer_input = sum_s h_pre*x, out = residual^T x + h_post * layer_input."""
  b, s, k, d = x.shape
  xt = x.reshape(b * s, k, d).astype(jnp.float32)
  flat = xt.reshape(b * s, k * d)
  normed = flat * jax.lax.rsqrt(jnp.mean(flat * flat, -1, keepdims=True) + eps)
  normed = normed * w.norm_scale.astype(jnp.float32)
  f32 = lambda a: a.astype(jnp.float32)
  hp = functools.partial(jnp.dot, precision="highest")
  h_pre = jax.nn.sigmoid(f32(w.pre_scale) * hp(normed, f32(w.pre_alpha)) + f32(w.pre_bias)) + pre_eps
  h_post = 2 * jax.nn.sigmoid(f32(w.post_scale) * hp(normed, f32(w.post_alpha)) + f32(w.post_bias))
  mix = jax.nn.softmax(f32(w.res_scale) * hp(normed, f32(w.res_alpha)) + f32(w.res_bias), -1)
  residual = hp(mix, permutations.reshape(24, k * k)).reshape(-1, k, k)
  layer_input = jnp.sum(h_pre[:, :, None] * xt, 1)
  out = jnp.einsum("tkj,tkd->tjd", residual, xt, precision="highest")
  out = out + h_post[:, :, None] * layer_input[:, None, :]
  return out.reshape(x.shape), layer_input


def _mhc_kernel_pipeline(mhc, x, w, permutations, config):
  layer_input, context = mhc.pre(x, w, permutations, config=config)
  return mhc.post(layer_input, context, config=config), layer_input


def _close_to_scale(got, want, tol, msg=""):
  """|got - want| <= tol * max|want| (maxtext's own gradient check, per leaf)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  scale = max(float(np.max(np.abs(want))), 1e-7)
  np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=msg)


@pytest.mark.parametrize("feature_block", [None, 128])
def test_mhc_forward_and_vjp(feature_block):
  mhc, x, w, permutations, cot = _mhc_inputs()
  common = load("maxtext.kernels.mhc.common")
  config = mhc.MhcKernelConfig(block_size=32, bwd_block_size=16)
  if feature_block:
    config = dataclasses.replace(config, bwd_feature_block_size=feature_block)
  (out, layer_input), vjp = jax.vjp(
      lambda x_, w_: _mhc_kernel_pipeline(mhc, x_, w_, permutations, config), x, w)
  # maxtext's own XLA formulae (common.py), composed into the same pipeline
  tokens = x.reshape(-1, 4, x.shape[-1])
  coeffs = common.mhc_coeffs(tokens, w.to_coeff_params(), permutations,
                             rms_epsilon=1e-5, pre_mapping_epsilon=1e-6)
  li_common = common.pre_apply(tokens, coeffs.h_pre)
  out_common = common.post_apply(tokens, li_common, coeffs.h_post, coeffs.residual)
  # bf16 outputs: 2 bf16 ulps at the magnitudes here
  np.testing.assert_allclose(layer_input.astype(jnp.float32).reshape(li_common.shape),
                             li_common.astype(jnp.float32), rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(out.astype(jnp.float32).reshape(out_common.shape),
                             out_common.astype(jnp.float32), rtol=2e-2, atol=2e-2)

  (ref_out, ref_li), ref_vjp = jax.vjp(lambda x_, w_: _mhc_ref(x_, w_, permutations), x, w)
  # the kernels project with bf16 weights, and round layer_input and out to bf16
  _close_to_scale(out, ref_out, 2e-2, "out")
  _close_to_scale(layer_input.reshape(ref_li.shape), ref_li, 2e-2, "layer_input")

  dx, dw = vjp((cot, jnp.zeros_like(layer_input)))
  ref_dx, ref_dw = ref_vjp((cot.astype(jnp.float32), jnp.zeros_like(ref_li)))
  _close_to_scale(dx, ref_dx, 2e-2, "dx")
  for name in ("norm_scale", "pre_alpha", "pre_bias", "post_alpha", "post_bias", "res_alpha",
               "res_bias", "pre_scale", "post_scale", "res_scale"):
    got, want = getattr(dw, name), getattr(ref_dw, name)
    _close_to_scale(got, want, 5e-2 if want.size == 1 else 2e-2, name)


# ---------------------------------------------------------------------------------------
# tokamax_splash_attention: the splash attention kernel (forward, fused dq/dkv backward)


def _splash_masks(mask_lib, seq):
  return {
      "causal": mask_lib.CausalMask((seq, seq)),
      "local": mask_lib.LocalMask((seq, seq), window_size=(160, 32), offset=0),
  }


def _splash_config(splash, **kw):
  # kv blocks of 256 computed in two 128-wide slices (the kernel's minimum is 128 lanes)
  return splash.SplashConfig(
      block_q=128, block_kv=256, block_kv_compute=128,
      block_q_dkv=128, block_kv_dkv=256, block_kv_dkv_compute=128, **kw)


def _mha_ref(q, k, v, mask, segment_ids=None):
  """Plain softmax attention, GQA by repeating kv heads; fully masked rows give 0."""
  rep = q.shape[0] // k.shape[0]
  k, v = jnp.repeat(k, rep, 0).astype(jnp.float32), jnp.repeat(v, rep, 0).astype(jnp.float32)
  s = jnp.einsum("hqd,hkd->hqk", q.astype(jnp.float32), k, precision="highest")
  if segment_ids is not None:
    mask = mask & (segment_ids[0][:, None] == segment_ids[1][None, :])
  s = jnp.where(mask[None], s, -jnp.inf)
  m = jnp.max(s, -1, keepdims=True)
  p = jnp.where(mask[None], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0)), 0)
  l = p.sum(-1, keepdims=True)
  return jnp.einsum("hqk,hkd->hqd", p / jnp.where(l == 0, 1, l), v, precision="highest")


def _splash_modules():
  """tokamax's splash attention as vendored in maxtext: kernel, masks, reference."""
  prefix = "maxtext.kernels.tokamax_splash_attention."
  return (load(prefix + "splash_attention_kernel"), load(prefix + "splash_attention_mask"),
          load(prefix + "base"))


def _assert_same_vjp(out, vjp, ref_out, ref_vjp, do):
  np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-4)
  for name, got, want in zip("qkv", vjp(do), ref_vjp(do)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-4, err_msg=f"d{name}")


@pytest.mark.parametrize("mask_name", ["causal", "local"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_splash_attention_forward_and_grad(mask_name, kv_heads):
  splash, mask_lib, base = _splash_modules()
  seq, heads, d = 512, 4, 64
  mask = _splash_masks(mask_lib, seq)[mask_name]
  kernel = splash.make_splash_mha_single_device(mask, config=_splash_config(splash))
  q, k, v = _rand(60, (heads, seq, d)), _rand(61, (kv_heads, seq, d)), _rand(62, (kv_heads, seq, d))
  do = _rand(63, (heads, seq, d))
  dense = jnp.asarray(mask[:, :])

  out, vjp = jax.vjp(kernel, q, k, v)
  ref_out, ref_vjp = jax.vjp(lambda q, k, v: base.attention_reference(q, k, v, dense, is_mqa=False),
                             q, k, v)
  mine = _mha_ref(q, k, v, dense)
  np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(out, mine, rtol=1e-4, atol=1e-4)
  for name, got, want in zip("qkv", vjp(do), ref_vjp(do)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-4, err_msg=f"d{name}")


def test_splash_attention_segments_and_residuals():
  """Packed segments with a causal mask; save_residuals returns the logsumexp."""
  splash, mask_lib, base = _splash_modules()
  seq, heads, d = 512, 2, 64
  mask = mask_lib.CausalMask((seq, seq))
  kernel = splash.make_splash_mha_single_device(mask, config=_splash_config(splash),
                                                save_residuals=True)
  q, k, v = _rand(64, (heads, seq, d)), _rand(65, (heads, seq, d)), _rand(66, (heads, seq, d))
  ids = jnp.array(np.repeat([0, 1, 2, 3], [40, 200, 130, 142]), jnp.int32)
  segment_ids = base.SegmentIds(q=ids, kv=ids)
  out, stats = kernel(q, k, v, segment_ids=segment_ids)
  dense = jnp.asarray(mask[:, :])
  ref_out, ref_stats = base.attention_reference(q, k, v, dense, segment_ids, is_mqa=False,
                                                save_residuals=True)
  np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(out, _mha_ref(q, k, v, dense, (ids, ids)), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(stats["logsumexp"], ref_stats["logsumexp"], rtol=1e-4, atol=1e-4)


def test_splash_mqa_grad():
  splash, mask_lib, base = _splash_modules()
  seq, heads, d = 512, 4, 64
  mask = mask_lib.LocalMask((seq, seq), window_size=(160, 32), offset=0)
  kernel = splash.make_splash_mqa_single_device(mask, config=_splash_config(splash))
  q, k, v = _rand(67, (heads, seq, d)), _rand(68, (seq, d)), _rand(69, (seq, d))
  do = _rand(70, (heads, seq, d))
  dense = jnp.asarray(mask[:, :])
  out, vjp = jax.vjp(kernel, q, k, v)
  ref_out, ref_vjp = jax.vjp(lambda q, k, v: base.attention_reference(q, k, v, dense, is_mqa=True),
                             q, k, v)
  _assert_same_vjp(out, vjp, ref_out, ref_vjp, do)


@pytest.mark.parametrize("variant", [
    dict(bwd_dkv_megacore=True),            # the dkv grid split over kv-head groups
    dict(attn_logits_soft_cap=5.0),
    dict(use_base2_exp=False, fuse_reciprocal=False),
])
def test_splash_attention_config_variants(variant):
  splash, mask_lib, base = _splash_modules()
  seq, heads, kv_heads, d = 512, 4, 2, 64
  mask = mask_lib.LocalMask((seq, seq), window_size=(160, 32), offset=0)
  kernel = splash.make_splash_mha_single_device(mask, config=_splash_config(splash, **variant))
  q, k, v = _rand(71, (heads, seq, d)), _rand(72, (kv_heads, seq, d)), _rand(73, (kv_heads, seq, d))
  do = _rand(74, (heads, seq, d))
  dense = jnp.asarray(mask[:, :])
  cap = variant.get("attn_logits_soft_cap")
  out, vjp = jax.vjp(kernel, q, k, v)
  ref_out, ref_vjp = jax.vjp(
      lambda q, k, v: base.attention_reference(q, k, v, dense, is_mqa=False,
                                               attn_logits_soft_cap=cap), q, k, v)
  _assert_same_vjp(out, vjp, ref_out, ref_vjp, do)


def test_splash_attention_sinks():
  splash, mask_lib, base = _splash_modules()
  seq, heads, d = 512, 2, 64
  mask = mask_lib.CausalMask((seq, seq))
  kernel = splash.make_splash_mha_single_device(mask, config=_splash_config(splash))
  q, k, v = _rand(75, (heads, seq, d)), _rand(76, (heads, seq, d)), _rand(77, (heads, seq, d))
  sinks = _rand(78, (heads,)) + 2.0
  dense = jnp.asarray(mask[:, :])
  out = kernel(q, k, v, sinks=sinks)
  ref = base.attention_reference(q, k, v, dense, None, sinks, is_mqa=False)
  # own: the sink is one more logit in the softmax denominator, with no value
  s = jnp.einsum("hqd,hkd->hqk", q, k, precision="highest")
  s = jnp.where(dense[None], s, -jnp.inf)
  m = jnp.maximum(s.max(-1, keepdims=True), sinks[:, None, None])
  p = jnp.exp(s - m)
  l = p.sum(-1, keepdims=True) + jnp.exp(sinks[:, None, None] - m)
  mine = jnp.einsum("hqk,hkd->hqd", p / l, v, precision="highest")
  np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(out, mine, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seq,kv_heads", [(512, 1), (1024, 2)])
def test_splash_attention_dynamic_grid_grad(seq, kv_heads):
  """dq_reduction_steps=3: the dkv backward runs over the active blocks only (a grid sized
  at run time) and accumulates dk/dv over a kv group's q heads, and dq over kv blocks
  j, j+3, ..., through input_output_aliases: a blocked aliased input must see the output
  blocks earlier grid steps wrote back (one buffer, as on a TPU)."""
  splash, mask_lib, base = _splash_modules()
  heads, d = 2, 64
  mask = mask_lib.CausalMask((seq, seq))
  kernel = splash.make_splash_mha_single_device(
      mask, config=_splash_config(splash, dq_reduction_steps=3))
  q, k, v = _rand(79, (heads, seq, d)), _rand(80, (kv_heads, seq, d)), _rand(81, (kv_heads, seq, d))
  do = _rand(82, (heads, seq, d))
  dense = jnp.asarray(mask[:, :])
  out, vjp = jax.vjp(kernel, q, k, v)
  ref_out, ref_vjp = jax.vjp(
      lambda q, k, v: base.attention_reference(q, k, v, dense, is_mqa=False), q, k, v)
  _assert_same_vjp(out, vjp, ref_out, ref_vjp, do)


# ---------------------------------------------------------------------------------------
# attention/splash_attention_kernel.py: maxtext's older splash kernel (JAX's mask library),
# separate dq and dkv backward kernels by default, and the fused one


@pytest.mark.parametrize("fused_bwd", [False, True])
def test_attention_splash_kernel_causal_gqa(fused_bwd):
  splash = load("maxtext.kernels.attention.splash_attention_kernel")
  seq, heads, kv_heads, d = 512, 4, 2, 128  # this kernel needs head_dim % 128 == 0
  extra = {} if fused_bwd else dict(block_q_dq=128, block_kv_dq=256)
  sizes = splash.BlockSizes(block_q=128, block_kv=256, block_kv_compute=128, block_q_dkv=128,
                            block_kv_dkv=256, block_kv_dkv_compute=128,
                            use_fused_bwd_kernel=fused_bwd, **extra)
  mask = splash.mask_lib.MultiHeadMask([splash.mask_lib.CausalMask((seq, seq))] * heads)
  kernel = splash.make_splash_mha_single_device(mask, block_sizes=sizes)
  q, k, v = _rand(83, (heads, seq, d)), _rand(84, (kv_heads, seq, d)), _rand(85, (kv_heads, seq, d))
  do = _rand(86, (heads, seq, d))
  dense = jnp.tril(jnp.ones((seq, seq), bool))
  out, vjp = jax.vjp(kernel, q, k, v)
  ref_out, ref_vjp = jax.vjp(lambda q, k, v: _mha_ref(q, k, v, dense), q, k, v)
  _assert_same_vjp(out, vjp, ref_out, ref_vjp, do)


# ---------------------------------------------------------------------------------------
# SparseCore kernels: class D on this machine


@pytest.mark.parametrize("module", [
    "maxtext.kernels.gather_reduce_pallas",       # sc_gather_reduce
    "maxtext.kernels.ragged.ragged_gather",
    "maxtext.kernels.ragged.ragged_gather_reduce",
    "maxtext.kernels.ragged.ragged_gather_reduce_v2",
    "maxtext.kernels.ragged.ragged_sort",          # calls ragged_gather / ragged_gather_reduce_v2
])
def test_sparsecore_kernels_are_out_of_scope(module):
  load(module)  # they load; running them needs a SparseCore
  pytest.skip("D: runs on TPU SparseCore vector subcores (plsc.VectorSubcoreMesh, "
              "get_tpu_info().sparse_core)")
