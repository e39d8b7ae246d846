"""vllm-project/tpu-inference's non-attention Pallas kernels, run on pallet.

The kernels are loaded from the checkout in PALLET_TPU_INFERENCE_SOURCE (skipped when
unset) with their Pallas imports routed to pallet; the cases mirror a few of those in
the project's tests/kernels/*_test.py, compared against the project's reference
functions where they live in the package and against jax.numpy references written here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallet import PalletError
from tests.foreign import projects


def kernels(module: str):
  return projects.load("tpu_inference.kernels." + module)


def close(actual, expected, *, atol, rtol):
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                             atol=atol, rtol=rtol)


# --- megablox gmm_v2 ---------------------------------------------------------------

def group_sizes(key, batch, groups):
  """Random group sizes summing to `batch`, some of them zero (as gmm_test.py makes them)."""
  d = jax.random.uniform(key, (groups - 1,), jnp.float32)
  sizes = jnp.floor(d / d.sum() * batch).astype(jnp.int32)
  return jnp.append(sizes, batch - sizes.sum())


def quantize_blocks(w, dtype, block):
  """Symmetric per-block quantization of w [G, K, N] along K: (w_q, scale [G, K/block, 1, N])."""
  g, k, n = w.shape
  info = jnp.iinfo(dtype) if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype)
  wb = w.astype(jnp.float32).reshape(g, k // block, block, n)
  scale = jnp.max(jnp.abs(wb), axis=2, keepdims=True) / float(info.max)
  q = jnp.clip(wb / scale, float(info.min), float(info.max)).astype(dtype)
  return q.reshape(g, k, n), scale.astype(jnp.float32)


def gmm_reference(lhs, rhs, sizes, *, scale=None, bias=None, offset=0):
  """f32 per-group matmul; rows of groups outside [offset, offset + G) are zero."""
  w = rhs.astype(jnp.float32)
  if scale is not None:
    g, k, n = rhs.shape
    w = (w.reshape(g, scale.shape[1], -1, n) * scale).reshape(g, k, n)
  out, start = [], 0
  for g, s in enumerate(np.asarray(sizes)):
    x = lhs[start:start + s].astype(jnp.float32)
    local = g - offset
    if 0 <= local < rhs.shape[0]:
      y = x @ w[local]
      if bias is not None:
        y = y + bias[local].astype(jnp.float32)
    else:
      y = jnp.zeros((s, rhs.shape[2]), jnp.float32)
    out.append(y)
    start += s
  return jnp.concatenate(out)


def local_rows(sizes, offset, local_groups):
  """The rows of lhs that belong to the groups held locally."""
  bounds = np.concatenate([[0], np.cumsum(np.asarray(sizes))])
  return slice(int(bounds[offset]), int(bounds[offset + local_groups]))


def gmm_inputs(seed, batch, k, n, groups, offset, *, uniform=False):
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  if uniform:
    lhs = jax.random.uniform(k1, (batch, k), jnp.bfloat16, -1, 1)
    rhs = jax.random.uniform(k2, (groups - offset, k, n), jnp.bfloat16, -1, 1)
  else:
    lhs = jax.random.normal(k1, (batch, k), jnp.bfloat16)
    rhs = jax.random.normal(k2, (groups - offset, k, n), jnp.bfloat16)
  bias = jax.random.normal(k3, (groups - offset, 1, n), jnp.bfloat16)
  return lhs, rhs, bias, group_sizes(k4, batch, groups)


@pytest.mark.parametrize("k,n,has_bias", [(512, 512, True), (512, 1024, False), (255, 500, True)])
def test_gmm_v2_bf16(k, n, has_bias):
  m = kernels("megablox.gmm_v2")
  lhs, rhs, bias, sizes = gmm_inputs(0, 128, k, n, 16, 0)
  bias = bias if has_bias else None
  # zero_initialize=False: every row belongs to a local group, so no row needs zeroing
  out = m.gmm_v2(lhs, rhs, sizes, rhs_bias=bias, zero_initialize=False)
  assert out.shape == (128, n)
  close(out, gmm_reference(lhs, rhs, sizes, bias=bias), atol=0.5, rtol=2e-2)


@pytest.mark.parametrize("offset", [2, 3])
def test_gmm_v2_group_offset_local_rows(offset):
  """Rows of non-local groups are left unwritten without zero_initialize: check the rest."""
  m = kernels("megablox.gmm_v2")
  lhs, rhs, bias, sizes = gmm_inputs(1, 128, 512, 512, 16, offset)
  out = m.gmm_v2(lhs, rhs, sizes, rhs_bias=bias, group_offset=jnp.array(offset, jnp.int32),
                 zero_initialize=False)
  rows = local_rows(sizes, offset, 16 - offset)
  expected = gmm_reference(lhs, rhs, sizes, bias=bias, offset=offset)
  close(out[rows], expected[rows], atol=0.5, rtol=2e-2)


def test_gmm_v2_zero_initialize():
  m = kernels("megablox.gmm_v2")
  lhs, rhs, bias, sizes = gmm_inputs(2, 128, 512, 512, 16, 2)
  out = m.gmm_v2(lhs, rhs, sizes, rhs_bias=bias, group_offset=jnp.array(2, jnp.int32))
  close(out, gmm_reference(lhs, rhs, sizes, bias=bias, offset=2), atol=0.5, rtol=2e-2)


@pytest.mark.parametrize("dtype,block,tile_k", [
    (jnp.int8, 256, None), (jnp.int8, 64, None), (jnp.float8_e4m3fn, 128, None),
    (jnp.int8, 1024, 256)])
def test_gmm_v2_weight_quantized(dtype, block, tile_k):
  m = kernels("megablox.gmm_v2")
  k = 1024 if block == 1024 else 512
  lhs, rhs, bias, sizes = gmm_inputs(3, 128, k, 512, 8, 0, uniform=True)
  rhs_q, scale = quantize_blocks(rhs, dtype, block)
  kwargs = {}
  if tile_k is not None:
    kwargs["tile_info"] = m.TileSizes(tile_m=128, bucket_base=128, tile_k=tile_k, tile_n=512)
  out = m.gmm_v2(lhs, rhs_q, sizes, rhs_scale=scale, rhs_bias=bias, maybe_quantize_lhs=False,
                 zero_initialize=False, **kwargs)
  # the kernel rounds dequantized weights / partial sums to bf16; the sums are ~|10|
  close(out, gmm_reference(lhs, rhs_q, sizes, scale=scale, bias=bias), atol=0.1, rtol=2e-2)


def test_gmm_v2_activation_quantized():
  """maybe_quantize_lhs: the kernel quantizes lhs to int8 in blocks of 512 (the v5e
  tables pallet reports), so the reference quantizes lhs the same way."""
  m = kernels("megablox.gmm_v2")
  lhs, rhs, _, sizes = gmm_inputs(4, 128, 512, 512, 8, 0, uniform=True)
  rhs_q, scale = quantize_blocks(rhs, jnp.int8, 512)
  out = m.gmm_v2(lhs, rhs_q, sizes, rhs_scale=scale, maybe_quantize_lhs=True,
                 zero_initialize=False)
  lq, ls = quantize_rows(lhs, jnp.int8, 512)
  lhs_sim = lq.astype(jnp.float32) * jnp.repeat(ls, 512, axis=1)
  # bf16 accumulation (acc_dtype defaults to bf16 with a quantized lhs) over K=512
  close(out, gmm_reference(lhs_sim, rhs_q, sizes, scale=scale), atol=0.5, rtol=5e-2)


@pytest.mark.parametrize("act", ["silu", "gelu", "swigluoai"])
def test_gmm_v2_fused_activation(act):
  m = kernels("megablox.gmm_v2")
  lhs, rhs, bias, sizes = gmm_inputs(5, 128, 512, 512, 8, 0, uniform=True)
  out = m.gmm_v2(lhs, rhs, sizes, rhs_bias=bias, fuse_act=act, zero_initialize=False)
  raw = gmm_reference(lhs, rhs, sizes, bias=bias)
  gate, up = raw[:, :256], raw[:, 256:]
  if act == "silu":
    expected = jax.nn.silu(gate) * up
  elif act == "gelu":
    expected = jax.nn.gelu(gate) * up
  else:
    g, u = jnp.minimum(gate, 7.0), jnp.clip(up, -7.0, 7.0)
    expected = (u + 1.0) * g * jax.nn.sigmoid(1.702 * g)
  assert out.shape == (128, 256)
  close(out, expected, atol=0.5, rtol=5e-2)
  # the project's own activation helper, on the project's interleaved layout
  project = m.apply_act_fn(m.interleave_lane(gate, up), act)
  close(out, project, atol=0.5, rtol=5e-2)


# --- gated delta rule (GDN) kernels ------------------------------------------------

def gdn_reference(q, k, v, a, b, a_log, dt_bias, state, cu, state_indices, has_init):
  """Gated delta rule over ragged sequences, token by token, in float64 NumPy.

  q, k [T, Hqk, K] and v [T, Hv, V] are already activated; q, k are l2-normalized here,
  and value head h uses query/key head h // (Hv // Hqk). Per token:
  S <- exp(g) S;  S <- S + k (beta (v - k S))^T;  o = (q / sqrt(K)) S,
  with g = -exp(a_log) softplus(a + dt_bias) and beta = sigmoid(b). Returns (o, state)."""
  f = lambda x: np.asarray(x, np.float64)
  q, k, v, a, b = f(q), f(k), f(v), f(a), f(b)
  a_log, dt_bias, state = f(a_log), f(dt_bias), f(state).copy()
  hv, hqk, dk = v.shape[1], q.shape[1], q.shape[2]
  rep = hv // hqk
  q = np.repeat(q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6), rep, axis=1)
  k = np.repeat(k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6), rep, axis=1)
  g = -np.exp(a_log) * np.logaddexp(0.0, a + dt_bias)
  beta = 1 / (1 + np.exp(-b))
  out = np.zeros(v.shape)
  cu = np.asarray(cu)
  for i, slot in enumerate(np.asarray(state_indices)[:len(has_init)]):
    start, end = int(cu[i]), int(cu[i + 1])
    if end <= start:
      continue
    s = state[slot] if has_init[i] else np.zeros_like(state[slot])
    for t in range(start, end):
      s = s * np.exp(g[t])[:, None, None]
      kv = np.einsum("hd,hdm->hm", k[t], s)
      s = s + np.einsum("hd,hm->hdm", k[t], beta[t][:, None] * (v[t] - kv))
      out[t] = np.einsum("hd,hdm->hm", q[t] / np.sqrt(dk), s)
    state[slot] = s
  return out, state


def gdn_inputs(seed, seqlens, hqk, hv, dk=128, dv=128, *, slots=None):
  rng = np.random.RandomState(seed)
  t = sum(seqlens)
  cu = np.cumsum([0] + list(seqlens)).astype(np.int32)
  slots = slots or len(seqlens)
  if slots > len(seqlens):
    cu = np.concatenate([cu, np.full(slots - len(seqlens), t, np.int32)])
  bf = lambda *shape: jnp.asarray(rng.randn(*shape), jnp.bfloat16)
  q, k, v, a, b = bf(t, hqk, dk), bf(t, hqk, dk), bf(t, hv, dv), bf(t, hv), bf(t, hv)
  a_log = jnp.asarray(rng.randn(hv), jnp.float32)
  h0 = jnp.asarray(rng.randn(slots, hv, dk, dv), jnp.float32)
  return q, k, v, a, b, a_log, h0, jnp.asarray(cu), jnp.arange(slots, dtype=jnp.int32)


def gdn_project_reference(q, k, v, a, b, a_log, dt_bias, h0, cu, state_indices, has_init,
                          distribution, hqk, hv):
  """The project's ragged_gated_delta_rule reference (it applies silu to q, k, v)."""
  ref = kernels("gdn.reference.ragged_gated_delta_rule_ref")
  t = q.shape[0]
  mixed = jnp.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], -1)
  state, out = ref.ragged_gated_delta_rule(
      mixed.astype(jnp.float32), b.astype(jnp.float32), a.astype(jnp.float32),
      h0.astype(jnp.float32), a_log[None, None], dt_bias[None, None], cu, state_indices,
      distribution, has_init, n_kq=hqk, n_v=hv, d_k=q.shape[2], d_v=v.shape[2])
  return out.reshape(t, hv, -1), state


@pytest.mark.parametrize("decodes,prefills,hqk,hv,extra_slots,state_dtype,init", [
    (3, [9, 15], 2, 2, 0, jnp.float32, None),
    (0, [9, 15], 2, 8, 2, jnp.float32, None),
    (8, [], 2, 2, 0, jnp.float32, None),
    (5, [9, 15], 2, 8, 0, jnp.bfloat16, None),
    (0, [9, 15, 33, 7], 2, 8, 4, jnp.float32, [True, False, True, False]),
    # the project's own case (fused_gdn_kernel_test.test_has_initial_state_pattern_matches_ref)
    # 4 slots < the decode kernel's bt=8: a guarded static index past the SMEM ref, which
    # pallet reports as an IndexBoundsWarning (the branch never runs)
    pytest.param(0, [9, 15, 33, 7], 2, 8, 0, jnp.float32, [True, False, True, False],
                 marks=pytest.mark.filterwarnings("ignore::pallet.IndexBoundsWarning")),
])
def test_fused_gdn_v1(decodes, prefills, hqk, hv, extra_slots, state_dtype, init):
  w = kernels("gdn.v1.fused_gdn_kernel_wrapper")
  seqlens = [1] * decodes + prefills
  n = len(seqlens)
  q, k, v, a, b, a_log, h0, cu, si = gdn_inputs(42, seqlens, hqk, hv, slots=n + extra_slots)
  h0 = h0.astype(state_dtype)
  init = np.ones(n + extra_slots, bool) if init is None else np.array(init + [True] * extra_slots)
  dt_bias = jnp.asarray(np.random.RandomState(1).randn(hv), jnp.float32)
  act = lambda x: jax.nn.silu(x.astype(jnp.float32))
  o_ref, s_ref = gdn_reference(act(q), act(k), act(v), a, b, a_log, dt_bias, h0, cu, si, init[:n])
  o_prj, s_prj = gdn_project_reference(q, k, v, a, b, a_log, dt_bias, h0, cu, si, jnp.asarray(init),
                                       jnp.array([decodes, n, n], jnp.int32), hqk, hv)
  o, s = w.fused_gdn(jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v), cu, a, h0, si, b=b,
                     has_initial_state=jnp.asarray(init),
                     distribution=jnp.array([decodes, n], jnp.int32),
                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=a_log,
                     dt_bias=dt_bias)
  tol = 1e-2 if state_dtype == jnp.float32 else 5e-2   # the project's tolerances
  close(o, o_ref, atol=tol, rtol=tol)
  close(s[:n], s_ref[:n], atol=tol, rtol=tol)
  close(o, o_prj, atol=tol, rtol=tol)
  close(s[:n], s_prj[:n], atol=tol, rtol=tol)


@pytest.mark.parametrize("decodes,hqk,hv,extra_slots", [(13, 2, 2, 0), (5, 2, 8, 0), (3, 2, 2, 5)])
def test_gdn_v2_decode_only(decodes, hqk, hv, extra_slots):
  m = kernels("gdn.v2.gdn_decode_kernel")
  n = decodes
  q, k, v, a, b, a_log, h0, cu, si = gdn_inputs(7, [1] * n, hqk, hv, slots=n + extra_slots)
  dt_bias = jnp.asarray(np.random.RandomState(2).randn(hv), jnp.float32)
  init = jnp.ones(n + extra_slots, bool)
  t = q.shape[0]
  mixed = jnp.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], -1)
  dist = jnp.array([n, n, n], jnp.int32)
  s, o = m.ragged_gated_delta_rule_decode_only(
      mixed_qkv=mixed, b=b, a=a, recurrent_state=h0, A_log=a_log, dt_bias=dt_bias,
      query_start_loc=cu, state_indices=si, distribution=dist, has_initial_state=init,
      n_kq=hqk, n_v=hv, d_k=128, d_v=128, apply_silu=True)
  o = o.reshape(t, hv, 128)
  act = lambda x: jax.nn.silu(x.astype(jnp.float32))
  o_ref, s_ref = gdn_reference(act(q), act(k), act(v), a, b, a_log, dt_bias, h0, cu, si,
                               np.ones(n, bool))
  close(o, o_ref, atol=1e-2, rtol=1e-2)
  close(s[:n], s_ref[:n], atol=1e-2, rtol=1e-2)
  o_prj, s_prj = gdn_project_reference(q, k, v, a, b, a_log, dt_bias, h0, cu, si, init, dist,
                                       hqk, hv)
  close(o, o_prj, atol=1e-2, rtol=1e-2)
  close(s[:n], s_prj[:n], atol=1e-2, rtol=1e-2)


# --- quantized_matmul ----------------------------------------------------------------

def quantize_rows(x, dtype, block=None, *, truncate=False):
  """Symmetric quantization of x [M, K] along K (per row, or per `block` columns):
  (x_q [M, K], scale [M, K // block or 1]). `truncate`: x * (1 / scale) cast to an integer
  type without rounding, as quantized_matmul/util.py quantize_array does."""
  m, kdim = x.shape
  block = block or kdim
  xb = x.astype(jnp.float32).reshape(m, kdim // block, block)
  info = jnp.iinfo(dtype) if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype)
  scale = jnp.max(jnp.abs(xb), axis=-1, keepdims=True) / float(info.max)
  scale = jnp.where(scale == 0, 1.0, scale)
  q = xb * (1 / scale) if truncate else xb / scale
  q = (jnp.round(q) if jnp.issubdtype(dtype, jnp.integer) and not truncate
       else jnp.clip(q, float(info.min), float(info.max)))
  return q.astype(dtype).reshape(m, kdim), scale[..., 0]


@pytest.mark.parametrize("dtype,q_dtype,m,kdim,n,tuned", [
    (jnp.bfloat16, jnp.int8, 128, 256, 256, None),
    (jnp.float32, jnp.int8, 64, 192, 192, None),
    (jnp.float32, jnp.float8_e4m3fn, 128, 256, 384, (128, 128, 128)),
    (jnp.bfloat16, jnp.int8, 256, 512, 256, (128, 128, 256)),
])
def test_quantized_matmul_per_channel(dtype, q_dtype, m, kdim, n, tuned):
  km = kernels("quantized_matmul.kernel")
  tbs = kernels("quantized_matmul.tuned_block_sizes")
  k0, k1 = jax.random.split(jax.random.key(1234))
  x = jax.random.uniform(k0, (m, kdim), dtype, 0, 1)
  w = jax.random.uniform(k1, (n, kdim), dtype, -1, 1)
  w_q, w_scale = quantize_rows(w, q_dtype)
  w_scale = w_scale[:, 0]
  tuned_value = tbs.TunedValue(*tuned) if tuned else None
  out = km.quantized_matmul_kernel(x, w_q, w_scale, x_q_dtype=q_dtype, tuned_value=tuned_value)
  assert out.shape == (m, n) and out.dtype == dtype
  x_q, x_scale = quantize_rows(x, q_dtype, truncate=True)
  exact = (x_q.astype(jnp.float32) @ w_q.astype(jnp.float32).T) * x_scale * w_scale[None, :]
  # the same quantization; rounding of x / scale may differ in a few elements by one step
  close(out, exact, atol=0.1, rtol=2e-2)
  # and the float product, within the quantization error (the project's tolerance)
  close(out, x.astype(jnp.float32) @ (w_q.astype(jnp.float32) * w_scale[:, None]).T,
        atol=0.5, rtol=0.5)


@pytest.mark.parametrize("dtype,m,kdim,n,block", [
    (jnp.bfloat16, 256, 1024, 512, 512), (jnp.float32, 256, 512, 1024, 256)])
def test_quantized_matmul_blockwise_w8a8(dtype, m, kdim, n, block):
  bw = kernels("quantized_matmul.blockwise_kernel")
  tbs = kernels("quantized_matmul.tuned_block_sizes")
  k0, k1 = jax.random.split(jax.random.key(7))
  x = jax.random.uniform(k0, (m, kdim), dtype, 0, 1)
  w = jax.random.uniform(k1, (n, kdim), dtype, -1, 1)
  w_q, w_scale = quantize_rows(w, jnp.float8_e4m3fn, block)   # scale [n, K/block]
  w_scale_k = w_scale.T[:, None, :]                            # [K/block, 1, n]
  out = bw.quantized_matmul_kernel(x, w_q, w_scale_k, block_size=block,
                                   x_q_dtype=jnp.float8_e4m3fn,
                                   tuned_value=tbs.TunedValue(128, 256, 512, 2))
  x_q, x_scale = quantize_rows(x, jnp.float8_e4m3fn, block)
  xb = x_q.astype(jnp.float32).reshape(m, -1, block)
  wb = w_q.astype(jnp.float32).reshape(n, -1, block)
  expected = jnp.einsum("bnk,onk->bno", xb, wb) * x_scale[:, :, None] * w_scale.T[None]
  # bf16 accumulation across blocks in the kernel (acc_dtype bfloat16)
  close(out, expected.sum(1), atol=0.5, rtol=2e-2)


# --- causal_conv1d ---------------------------------------------------------------

def causal_conv1d_reference(x, state, weight, bias, q_loc, state_indices, n_seqs, has_init):
  """Per-sequence causal depthwise convolution; the previous kernel_size - 1 rows come from
  `state` (or zeros without initial state); the state becomes the last kernel_size - 1 rows."""
  f = lambda a: np.asarray(a, np.float64)
  x, state, w = f(x), f(state).copy(), f(weight)[:, 0, :]
  ks = w.shape[1]
  out = np.zeros_like(x)
  for i in range(n_seqs):
    s, start, end = int(state_indices[i]), int(q_loc[i]), int(q_loc[i + 1])
    if end <= start:
      continue
    prev = state[s] if has_init[i] else np.zeros_like(state[s])
    full = np.concatenate([prev, x[start:end]])
    out[start:end] = sum(full[j:j + end - start] * w[:, j] for j in range(ks))
    if bias is not None:
      out[start:end] += f(bias)
    state[s] = full[-(ks - 1):]
  return out, state


# Slow: XLA:CPU compiles the kernel's 64 unrolled rows per loop iteration (about 30 s per
# new shape on a quiet machine; docs/performance.md, "Chained views in one window")
@pytest.mark.slow
@pytest.mark.parametrize("lengths,q_loc,n_seqs,decodes,dtype,has_bias", [
    ([256], [0, 128], 1, 0, jnp.float32, True),
    ([64, 64, 64, 64], [0, 32, 64, 96, 128], 4, 0, jnp.bfloat16, True),
    ([100, 10, 50], [0, 64, 64, 96], 3, 0, jnp.bfloat16, False),
    ([10] * 16, list(range(17)), 16, 16, jnp.float32, True),
    ([150, 20, 100, 30], [0, 128, 135, 199, 214], 4, 0, jnp.float32, True),
    ([128, 64], [0, 128, 192], 2, 0, jnp.float32, False),
])
def test_ragged_causal_conv1d(lengths, q_loc, n_seqs, decodes, dtype, has_bias):
  m = kernels("causal_conv1d.causal_conv1d")
  dim, ks = 128, 4
  keys = jax.random.split(jax.random.key(0), 4)
  n = len(lengths)
  x = jax.random.normal(keys[0], (q_loc[-1], dim), dtype)
  state = jax.random.normal(keys[1], (n + 1, ks - 1, dim), dtype)
  weight = jax.random.normal(keys[2], (dim, 1, ks), dtype)
  bias = jax.random.normal(keys[3], (dim,), dtype) if has_bias else None
  q_loc = jnp.array(q_loc, jnp.int32)
  si = jnp.arange(1, n + 1, dtype=jnp.int32)
  has_init = jnp.array(lengths) > (q_loc[1:] - q_loc[:-1])
  dist = jnp.array([decodes, n_seqs, n_seqs], jnp.int32)
  out, new_state = m.ragged_causal_conv1d(x=jnp.copy(x), conv_state=jnp.copy(state),
                                          conv_weight=weight, conv_bias=bias,
                                          query_start_loc=q_loc, state_indices=si,
                                          distribution=dist, has_initial_state=has_init,
                                          kernel_size=ks)
  out_ref, state_ref = causal_conv1d_reference(x, state, weight, bias, q_loc, si, n_seqs,
                                               np.asarray(has_init))
  tol = 1e-2 if dtype == jnp.float32 else 5e-2   # bf16 output rounding of |y| up to ~8
  close(out, out_ref, atol=tol, rtol=tol)
  close(new_state, state_ref, atol=tol, rtol=tol)


# --- fused_moe v1 ------------------------------------------------------------------

@pytest.mark.slow   # ~35 s on a CPU
def test_fused_ep_moe_single_device():
  from jax.sharding import Mesh
  m = kernels("fused_moe.v1.kernel")
  e, h, i, t, top_k = 8, 256, 256, 32, 2
  ks = jax.random.split(jax.random.key(0), 4)
  a = jax.random.normal(ks[0], (t, h), jnp.bfloat16) / 10
  w1 = jax.random.normal(ks[1], (e, 2, h, i), jnp.bfloat16) / 10
  w2 = jax.random.normal(ks[2], (e, i, h), jnp.bfloat16) / 10
  gating = jax.random.normal(ks[3], (t, e), jnp.bfloat16)
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  out = m.fused_ep_moe(mesh=mesh, tokens=a, w1=w1, w2=w2, gating_output=gating, top_k=top_k,
                       bt=16, bf=256, bd1=256, bd2=256, btc=16, bfc=128, bd1c=256, bd2c=256)
  # own reference: softmax over experts, top-k, silu(x w1[0]) * (x w1[1]) w2, weighted sum
  probs = jax.nn.softmax(gating.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, top_k)
  x = a.astype(jnp.float32)
  expected = jnp.zeros((t, h), jnp.float32)
  for k in range(top_k):
    w1e, w2e = w1[experts[:, k]].astype(jnp.float32), w2[experts[:, k]].astype(jnp.float32)
    gate = jnp.einsum("td,tdf->tf", x, w1e[:, 0])
    up = jnp.einsum("td,tdf->tf", x, w1e[:, 1])
    expected += weights[:, k:k + 1] * jnp.einsum("tf,tfd->td", jax.nn.silu(gate) * up, w2e)
  close(out, expected, atol=2e-2, rtol=5e-2)
  close(out, m.ref_moe(a, w1, w2, gating, top_k), atol=2e-2, rtol=5e-2)


@pytest.mark.xfail(strict=True, raises=PalletError,
                   reason="C: gdn/v3 subclasses pltpu.BufferedRef, which pallet does not "
                   "support (its pipeline has no scheduler buffers): PalletError at import")
def test_gdn_v3_imports():
  kernels("gdn.v3.wrapper")
