"""More of erfanzar/ejkernel's Pallas TPU kernels, run on pallet's CPU backend:
paged attention (decode) and ragged paged attention (mixed prefill / decode).

The kernels are read from a checkout (PALLET_EJKERNEL_SOURCE) at test time; nothing of
ejkernel is copied here. These kernels' pallas_calls live in their `_interface` modules,
which this JAX cannot import as written, for reasons outside the kernels:
  - they decorate with beartype (not installed here): while loading, a stand-in whose
    `beartype` decorator returns the function unchecked;
  - every ejkernel package `__init__` chain reaches `ejkernel.callib.ejit`, which calls
    `jax.jit(..., abstracted_axes=...)` (an argument JAX 0.12 removed): `ejit` is replaced
    by plain `jax.jit`, also skipping its persistent compilation-cache settings;
  - ragged_page_attention reads `jax._src.dtypes.bit_width` (gone in JAX 0.12): supplied.
The kernel functions themselves run unmodified. References: the project's own
`ref_ragged_page_attention` and float64 numpy written here.
"""
from __future__ import annotations

import functools
import sys
import types
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.foreign import projects

TPU = "ejkernel.kernels._pallas.tpu."


def _ejit(func=None, *, abstracted_axes=None, **kwargs):
  del abstracted_axes
  if func is None:
    return functools.partial(_ejit, **kwargs)
  return jax.jit(func, **kwargs)


def _load(dotted: str) -> types.ModuleType:
  """`projects.load` with the stand-ins described in the module docstring."""
  callib = projects.load("ejkernel.callib")
  callib.ejit = _ejit
  sys.modules["ejkernel.callib._ejit"].ejit = _ejit
  added = []
  try:
    import beartype  # noqa: F401
  except ImportError:
    stand_in = types.ModuleType("beartype")
    stand_in.beartype = lambda func=None, **_: func if func is not None else (lambda f: f)
    stand_in.typing = typing
    sys.modules["beartype"], sys.modules["beartype.typing"] = stand_in, typing
    added = ["beartype", "beartype.typing"]
  try:
    return projects.load(dotted)
  finally:
    for name in added:
      del sys.modules[name]


# ----------------------------------------------------------------------------------
# page_attention: one query token per sequence over paged K/V (JAX's paged attention)
# ----------------------------------------------------------------------------------

def _paged_reference(q, k_pages, v_pages, lengths, tables, soft_cap=None):
  """softmax(q k^T) v over each sequence's first `length` tokens; no scaling (the
  kernel takes pre-scaled queries); float64."""
  q, k_pages, v_pages = (np.asarray(jnp.asarray(a, jnp.float32), np.float64)
                         for a in (q, k_pages, v_pages))
  batch, heads, d = q.shape
  kv_heads = k_pages.shape[0]
  out = np.zeros_like(q)
  for i in range(batch):
    table, n = np.asarray(tables[i]), int(lengths[i])
    k = np.repeat(k_pages[:, table].reshape(kv_heads, -1, d)[:, :n], heads // kv_heads, 0)
    v = np.repeat(v_pages[:, table].reshape(kv_heads, -1, d)[:, :n], heads // kv_heads, 0)
    s = np.einsum("hd,hkd->hk", q[i], k)
    if soft_cap is not None:
      s = soft_cap * np.tanh(s / soft_cap)
    p = np.exp(s - s.max(-1, keepdims=True))
    out[i] = np.einsum("hk,hkd->hd", p / p.sum(-1, keepdims=True), v)
  return out


@pytest.mark.parametrize("heads,pages_per_block,inline,soft_cap,dtype", [
    (8, 2, True, None, jnp.float32),      # 4 q heads per kv head: the [b, h, 1, d] path
    (16, 2, False, None, jnp.float32),    # 8 per kv head: the [b, h, d] path, one step per block
    (4, 4, True, 30.0, jnp.float32),
    (16, 2, True, None, jnp.bfloat16),
    (8, 4, False, None, jnp.bfloat16),
    (2, 8, True, None, jnp.float32),      # MHA, a whole sequence's pages in one block
])
def test_page_attention(heads, pages_per_block, inline, soft_cap, dtype):
  attention = _load(TPU + "page_attention._interface")
  rng = np.random.default_rng(heads + pages_per_block)
  batch, kv_heads, d, page, pages, per_seq = 4, 2, 128, 16, 40, 8
  q = jnp.asarray(rng.standard_normal((batch, heads, d)) * 0.3, dtype)
  k_pages = jnp.asarray(rng.standard_normal((kv_heads, pages, page, d)), dtype)
  v_pages = jnp.asarray(rng.standard_normal((kv_heads, pages, page, d)), dtype)
  lengths = jnp.asarray([37, 128, 1, 100], jnp.int32)
  tables = jnp.asarray(rng.permutation(pages)[:batch * per_seq].reshape(batch, per_seq),
                       jnp.int32)
  out = attention.page_attention(q, k_pages, v_pages, lengths, tables,
                                 pages_per_compute_block=pages_per_block, inline_seq_dim=inline,
                                 attn_logits_soft_cap=soft_cap)
  tol = 1e-5 if dtype == jnp.float32 else 3e-2   # bf16 inputs and output
  np.testing.assert_allclose(np.asarray(out, np.float64),
                             _paged_reference(q, k_pages, v_pages, lengths, tables, soft_cap),
                             atol=tol, rtol=tol)


@pytest.mark.skip(reason="D: megacore_mode splits a 'parallel' grid axis over a TPU's two "
                  "cores; run on one core its cross-step DMA prefetch waits for copies never "
                  "started (pallet reports the hang as a KernelCheckError; ejkernel's docstring: "
                  "'set this only if megacore is enabled, otherwise the kernel may hang')")
def test_page_attention_megacore():
  pass


# ----------------------------------------------------------------------------------
# ragged_page_attention: mixed prefill / decode over a combined K/V page cache
# ----------------------------------------------------------------------------------

def _ragged_modules():
  interface = _load(TPU + "ragged_page_attention._interface")
  impl = _load(TPU + "ragged_page_attention._pallas_impl_fwd")
  from jax._src import dtypes
  if not hasattr(impl.dtypes, "bit_width"):
    shim = types.SimpleNamespace(**{n: getattr(dtypes, n) for n in dir(dtypes)
                                    if not n.startswith("__")})
    shim.bit_width = lambda dtype: np.dtype(dtype).itemsize * 8
    impl.dtypes = shim
  return interface, impl


def _ragged_reference(q, kv_pages, lengths, tables, starts, scale, window=None, soft_cap=None):
  """Causal attention of each sequence's queries (its last tokens) over its K/V; K and V
  heads interleaved in the combined cache (float64)."""
  q, kv_pages = (np.asarray(a, np.float64) for a in (q, kv_pages))
  d = q.shape[-1]
  k_pages, v_pages = kv_pages[:, :, 0::2], kv_pages[:, :, 1::2]
  group = q.shape[1] // k_pages.shape[2]
  out = []
  for i, n in enumerate(np.asarray(lengths)):
    qs = q[starts[i]:starts[i + 1]]
    k = np.repeat(k_pages[np.asarray(tables[i])].reshape(-1, k_pages.shape[2], d)[:n], group, 1)
    v = np.repeat(v_pages[np.asarray(tables[i])].reshape(-1, k_pages.shape[2], d)[:n], group, 1)
    s = np.einsum("qhd,khd->hqk", qs, k) * scale
    if soft_cap is not None:
      s = soft_cap * np.tanh(s / soft_cap)
    pos_q = n - len(qs) + np.arange(len(qs))[:, None]
    mask = np.arange(n)[None, :] <= pos_q
    if window is not None:
      mask &= pos_q - window < np.arange(n)[None, :]
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    out.append(np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v))
  return np.concatenate(out)


@pytest.mark.parametrize("kv_pages_per_block,queries_per_block,window,soft_cap", [
    (2, 8, None, None),
    (1, 16, 24, None),
    (4, 8, None, 20.0),
])
def test_ragged_page_attention(kv_pages_per_block, queries_per_block, window, soft_cap):
  interface, impl = _ragged_modules()
  rng = np.random.default_rng(kv_pages_per_block)
  heads, kv_heads, d, page, pages, per_seq = 4, 2, 128, 16, 24, 4
  seqs = [(1, 20), (1, 37), (5, 40), (20, 20), (13, 50)]   # (new tokens, kv length)
  q = jnp.asarray(rng.standard_normal((48, heads, d)), jnp.float32)   # 8 padding rows
  kv_pages = jnp.asarray(rng.standard_normal((pages, page, 2 * kv_heads, d)), jnp.float32)
  tables = jnp.asarray(rng.permutation(pages)[:len(seqs) * per_seq].reshape(len(seqs), per_seq),
                       jnp.int32)
  lengths = jnp.asarray([kv for _, kv in seqs], jnp.int32)
  starts = jnp.asarray(np.concatenate([[0], np.cumsum([n for n, _ in seqs])]), jnp.int32)
  num_seqs = jnp.asarray([len(seqs)], jnp.int32)
  scale, n = 0.1, int(starts[-1])
  out = interface.ragged_page_attention(
      q, kv_pages, lengths, tables, starts, num_seqs, softmax_scale=scale,
      sliding_window=window, logits_soft_cap=soft_cap,
      num_kv_pages_per_block=kv_pages_per_block, num_queries_per_block=queries_per_block)
  expected = impl.ref_ragged_page_attention(q, kv_pages, lengths, tables, starts, num_seqs,
                                            softmax_scale=scale, sliding_window=window,
                                            logits_soft_cap=soft_cap)
  np.testing.assert_allclose(out[:n], expected[:n], atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(out[:n], _ragged_reference(q, kv_pages, lengths, tables, starts,
                                                        scale, window, soft_cap),
                             atol=2e-5, rtol=2e-5)
