"""erfanzar/ejkernel's Pallas TPU kernels, run on pallet's CPU backend.

The kernels are read from a checkout (PALLET_EJKERNEL_SOURCE) at test time; nothing of
ejkernel is copied here. The public `_interface` wrappers need beartype and jaxtyping's
runtime type checking, which this environment lacks, so the tests call the kernel
modules (`_pallas_impl*`) directly, as the wrappers do. References are plain jax.numpy.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.foreign import projects

TPU = "ejkernel.kernels._pallas.tpu."


# ----------------------------------------------------------------------------------
# flash_attention (forward kernel and the dkv / dq backward kernels)
# ----------------------------------------------------------------------------------

def _flash_modules():
  fwd = projects.load(TPU + "flash_attention._pallas_impl_fwd")
  bwd = projects.load(TPU + "flash_attention._pallas_impl_bwd")
  utils = projects.load(TPU + "flash_attention._utils")
  return fwd, bwd, utils


def _flash(fwd, bwd):
  """The kernel pair as a custom_vjp, wired as ejkernel's `_interface` wires it."""
  @functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
  def attention(q, k, v, ab, segment_ids, save_residuals, causal, scale, bs):
    return fwd._flash_attention_impl(q, k, v, ab, segment_ids, save_residuals, causal, scale,
                                     bs.block_b, bs.block_q, bs.block_k_major, bs.block_k)
  attention.defvjp(fwd._flash_attention_fwd, bwd._flash_attention_bwd)
  return attention


def _attention_reference(q, k, v, ab, q_seg, kv_seg, causal, scale):
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest")
  if ab is not None:
    s = s + ab   # ejkernel (like JAX's TPU flash attention) adds the bias before scaling
  s = s * scale
  mask = jnp.ones(s.shape, bool)
  if causal:
    mask &= jnp.arange(q.shape[2])[:, None] >= jnp.arange(k.shape[2])[None, :]
  if q_seg is not None:
    mask &= q_seg[:, None, :, None] == kv_seg[:, None, None, :]
  p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
  return jnp.einsum("bhqk,bhkd->bhqd", p, v, precision="highest")


@pytest.mark.parametrize("causal,use_bias,use_segments,seq,blocks", [
    (False, False, False, 256, (128, 128, 128)),
    (True, False, False, 256, (128, 128, 128)),
    (False, True, False, 256, (128, 128, 128)),
    (True, True, True, 256, (128, 256, 128)),
    (True, False, True, 384, (128, 128, 128)),
])
def test_flash_attention_forward_and_grad(causal, use_bias, use_segments, seq, blocks):
  fwd, bwd, utils = _flash_modules()
  attention = _flash(fwd, bwd)
  b, h, d = 1, 2, 64
  keys = jax.random.split(jax.random.key(7), 6)
  q, k, v, do = (jax.random.normal(keys[i], (b, h, seq, d), jnp.float32) for i in range(4))
  ab = jax.random.normal(keys[4], (b, h, seq, seq), jnp.float32) if use_bias else None
  segment_ids = q_seg = kv_seg = None
  if use_segments:
    q_seg = kv_seg = jnp.sort(jax.random.randint(keys[5], (b, seq), 0, 3), axis=1)
    segment_ids = utils.SegmentIds(q=q_seg, kv=kv_seg)
  bq, bkm, bk = blocks
  bs = utils.BlockSizes(block_q=bq, block_k_major=bkm, block_k=bk, block_b=1,
                        block_q_major_dkv=bq, block_k_major_dkv=bkm, block_k_dkv=bk,
                        block_q_dkv=bq, block_k_major_dq=bkm, block_k_dq=bk, block_q_dq=bq)
  scale = d ** -0.5

  def kernel_loss(q, k, v, ab):
    return jnp.sum(attention(q, k, v, ab, segment_ids, False, causal, scale, bs) * do)

  def reference_loss(q, k, v, ab):
    return jnp.sum(_attention_reference(q, k, v, ab, q_seg, kv_seg, causal, scale) * do)

  out = attention(q, k, v, ab, segment_ids, False, causal, scale, bs)
  expected = _attention_reference(q, k, v, ab, q_seg, kv_seg, causal, scale)
  np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
  argnums = (0, 1, 2, 3) if use_bias else (0, 1, 2)
  grads = jax.grad(kernel_loss, argnums=argnums)(q, k, v, ab)
  expected_grads = jax.grad(reference_loss, argnums=argnums)(q, k, v, ab)
  for name, got, want in zip("q k v bias".split(), grads, expected_grads):
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")


def test_flash_attention_residuals():
  """save_residuals=True returns the softmax row max and sum the backward pass uses."""
  fwd, _, _ = _flash_modules()
  b, h, s, d = 1, 2, 256, 128
  keys = jax.random.split(jax.random.key(3), 3)
  q, k, v = (jax.random.normal(keys[i], (b, h, s, d), jnp.float32) for i in range(3))
  o, l, m = fwd._flash_attention_impl(q, k, v, None, None, True, True, 0.125, 1, 128, 256, 128)
  logits = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest") * 0.125
  logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -jnp.inf)
  m_ref = logits.max(-1)
  l_ref = jnp.exp(logits - m_ref[..., None]).sum(-1)
  np.testing.assert_allclose(m, m_ref, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(l, l_ref, atol=1e-4, rtol=1e-5)
  np.testing.assert_allclose(o, _attention_reference(q, k, v, None, None, None, True, 0.125),
                             atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------------
# grouped_matmul (gmm) and transposed_grouped_matmul (tgmm)
# ----------------------------------------------------------------------------------

def _gmm_reference(lhs, rhs, group_sizes, groups=None):
  """out[rows of group i] = lhs[rows] @ rhs[i]; rows of groups outside `groups` are 0."""
  out, start = [], 0
  for i, n in enumerate(np.asarray(group_sizes)):
    rows = lhs[start:start + n].astype(jnp.float32)
    if groups is None or i in groups:
      r = rhs[i - (min(groups) if groups else 0)].astype(jnp.float32)
      out.append(jnp.dot(rows, r, precision="highest"))
    else:
      out.append(jnp.zeros((n, rhs.shape[-1]), jnp.float32))
    start += n
  return jnp.concatenate(out)


def _tgmm_reference(lhs, rhs, group_sizes):
  out, start = [], 0
  for n in np.asarray(group_sizes):
    out.append(jnp.dot(lhs[:, start:start + n].astype(jnp.float32),
                       rhs[start:start + n].astype(jnp.float32), precision="highest"))
    start += n
  return jnp.stack(out)


@pytest.mark.parametrize("dtype,tiling,sizes", [
    (jnp.float32, (128, 128, 128), (100, 0, 200, 84)),
    (jnp.float32, (64, 128, 128), (1, 63, 64, 256)),
    (jnp.bfloat16, (128, 128, 128), (37, 150, 0, 197)),
])
def test_grouped_matmul(dtype, tiling, sizes):
  gmm = projects.load(TPU + "grouped_matmul._pallas_impl")
  rng = np.random.default_rng(11)
  m, k, n = sum(sizes), 256, 256
  group_sizes = jnp.asarray(sizes, jnp.int32)
  lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
  rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)), dtype)
  tol = 1e-4 if dtype == jnp.float32 else 2e-2   # bf16 operands, float32 accumulation
  expected = _gmm_reference(lhs, rhs, group_sizes)
  out = gmm.grouped_matmul(lhs, rhs, group_sizes, tiling=tiling)
  np.testing.assert_allclose(out, expected, atol=tol * 16, rtol=tol)
  out_t = gmm.grouped_matmul(lhs, jnp.swapaxes(rhs, 1, 2), group_sizes, tiling=tiling,
                             transpose_rhs=True)
  np.testing.assert_allclose(out_t, expected, atol=tol * 16, rtol=tol)


def test_grouped_matmul_group_offset():
  """A shard holding groups 1..3 computes their rows and zeroes group 0's."""
  gmm = projects.load(TPU + "grouped_matmul._pallas_impl")
  rng = np.random.default_rng(12)
  sizes = (100, 60, 140, 84)
  m, k, n = sum(sizes), 128, 256
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((3, k, n)), jnp.float32)
  out = gmm.grouped_matmul(lhs, rhs, jnp.asarray(sizes, jnp.int32), tiling=(128, 128, 128),
                           group_offset=jnp.array(1, jnp.int32))
  np.testing.assert_allclose(out, _gmm_reference(lhs, rhs, sizes, groups={1, 2, 3}),
                             atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("sizes", [(100, 0, 200, 84), (128, 128, 1, 127)])
def test_transposed_grouped_matmul(sizes):
  gmm = projects.load(TPU + "grouped_matmul._pallas_impl")
  rng = np.random.default_rng(13)
  m, k, n = sum(sizes), 256, 128
  lhs = jnp.asarray(rng.standard_normal((k, m)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  out = gmm.transposed_grouped_matmul(lhs, rhs, jnp.asarray(sizes, jnp.int32),
                                      tiling=(128, 128, 128))
  np.testing.assert_allclose(out, _tgmm_reference(lhs, rhs, sizes), atol=2e-3, rtol=1e-4)
