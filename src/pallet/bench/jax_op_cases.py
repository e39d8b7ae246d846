"""JAX's own Pallas kernel library as benchmark rows (one row per op).

Each row runs one op of `jax/experimental/pallas/ops` three ways: on pallet (the
module read from the installed jax by src/pallet/bench/jax_ops.py, its Pallas imports
routed to pallet), as a jax.numpy twin written here, and on Pallas's interpreter
(jax's own module, imported normally: `interpret=True` for the GPU ops, TPU
interpret mode for the TPU ops). The op decides its own `pallas_call`s, so the
variant's call options reach it as a backend override (pallet) or as the op's
`interpret` flag (peer). Rows exist only where jax ships JAX 0.12's library.

The "test" size class takes its shapes from JAX's own tests of each op
(`tests/pallas/gpu_ops_test.py`, `gpu_attention_test.py`, `gpu_paged_attention_test.py`,
`tpu_gmm_test.py`, `tpu_paged_attention_kernel_test.py`,
`tpu_splash_attention_kernel_test.py`; float32 where they also run float16/bfloat16);
docs/performance.md lists them.
"""
from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallet.bench import jax_ops
from pallet.bench.case import Benchmark, Size
from pallet.bench.peer import peer_op, peer_pallas

GPU_FAMILY = "jax_ops_gpu"
TPU_FAMILY = "jax_ops_tpu"
HIGHEST = jax.lax.Precision.HIGHEST


# ------------------------------------------------------------------ running an op
def _builder(module_name: str, run: Callable[..., Any], *, gpu: bool):
  """build_pallas for an op: `run(module, *args, **op_kwargs)` on pallet or on the peer."""

  def build(pl: Any, **call_kwargs: Any) -> Callable[..., Any]:
    if isinstance(pl, types.ModuleType) and pl.__name__ == "pallet":
      return _on_pallet(pl, jax_ops.load(module_name), run, call_kwargs)
    module = peer_op(module_name)
    interpret = bool(call_kwargs.get("interpret"))
    if gpu:
      return functools.partial(run, module, interpret=interpret)
    if not interpret:
      return functools.partial(run, module)
    force_interpret = peer_pallas().tpu.force_tpu_interpret_mode

    def interpreted(*args):
      with force_interpret():
        return run(module, *args)
    return interpreted

  return build


def _on_pallet(pallet: types.ModuleType, module: types.ModuleType, run: Callable[..., Any],
               call_kwargs: dict[str, Any]) -> Callable[..., Any]:
  """The op on pallet; a `backend=`/`interpret=` call option becomes pallet.default_backend."""
  if "backend" not in call_kwargs:
    return functools.partial(run, module)
  backend, interpret = call_kwargs["backend"], call_kwargs.get("interpret")

  def program(*args):
    with pallet.default_backend(backend, interpret=interpret):
      return run(module, *args)
  return program


def _case(name: str, module: str, *, gpu: bool, grid: tuple[int, ...], shapes: str,
          make_inputs: Callable[[jax.Array], tuple[jax.Array, ...]], twin: Callable[..., Any],
          run: Callable[..., Any], rtol: float = 1e-4, atol: float = 1e-4) -> Benchmark:
  return Benchmark(name=name, family=GPU_FAMILY if gpu else TPU_FAMILY, grid=grid,
                   shapes=shapes, make_inputs=make_inputs, reference=twin,
                   build_pallas=_builder(module, run, gpu=gpu), rtol=rtol, atol=atol)


def _normal(key: jax.Array, n: int, *shapes: tuple[int, ...]) -> tuple[jax.Array, ...]:
  keys = jax.random.split(key, n)
  return tuple(jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes))


# ------------------------------------------------------------------ jax.numpy twins
def _softmax(x):
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  return e / jnp.sum(e, axis=-1, keepdims=True)


def _layer_norm(x, w, b, eps=1e-5):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * w + b


def _rms_norm(x, w, b, eps=1e-5):
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * w + b


def _attend(q, k, v, mask=None, sm_scale=1.0):
  """q [..., H, T, D], k/v [..., Hkv, S, D] (grouped-query when Hkv < H)."""
  groups = q.shape[-3] // k.shape[-3]
  k, v = jnp.repeat(k, groups, axis=-3), jnp.repeat(v, groups, axis=-3)
  s = jnp.einsum("...td,...sd->...ts", q, k, precision=HIGHEST) * sm_scale
  if mask is not None:
    s = jnp.where(mask, s, -1e30)
  return jnp.einsum("...ts,...sd->...td", jax.nn.softmax(s, axis=-1), v, precision=HIGHEST)


def _causal(t: int, s: int) -> jax.Array:
  return jnp.arange(t)[:, None] >= jnp.arange(s)[None, :]


def _paged_twin(q, k_pages, v_pages, tables, lengths):
  """q [B, Hq, D]; pages [Hkv, P, page, D]; tables [B, n]; keys past `lengths` ignored."""
  h, _, page, d = k_pages.shape
  b, n = tables.shape
  hq = q.shape[1]
  gather = lambda p: p[:, tables].reshape(h, b, n * page, d)    # [Hkv, B, S, D]
  qg = q.reshape(b, h, hq // h, d)
  logits = jnp.einsum("bhgd,hbsd->bhgs", qg, gather(k_pages), precision=HIGHEST)
  mask = (jnp.arange(n * page)[None, :] < lengths[:, None])[:, None, None, :]
  p = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
  return jnp.einsum("bhgs,hbsd->bhgd", p, gather(v_pages), precision=HIGHEST).reshape(b, hq, d)


_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def _mulhilo(a: int, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The high and low 32 bits of a * b (uint32), from 16-bit halves."""
  a_hi, a_lo = jnp.uint32(a >> 16), jnp.uint32(a & 0xFFFF)
  b_hi, b_lo = b >> 16, b & 0xFFFF
  lo_lo, hi_lo, lo_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi
  mid = (lo_lo >> 16) + (hi_lo & 0xFFFF) + (lo_hi & 0xFFFF)
  hi = a_hi * b_hi + (hi_lo >> 16) + (lo_hi >> 16) + (mid >> 16)
  return hi, jnp.uint32(a) * b


def _philox_bits(key, shape):
  """Philox-4x32-10 at counter (0, flat index, 0, 0); words 0 xor 1 (the op's fused output)."""
  c1 = jnp.arange(math.prod(shape), dtype=jnp.uint32).reshape(shape)
  c = [jnp.zeros_like(c1), c1, jnp.zeros_like(c1), jnp.zeros_like(c1)]
  k0, k1 = key[0], key[1]
  for _ in range(10):
    hi0, lo0 = _mulhilo(_PHILOX_M[0], c[0])
    hi1, lo1 = _mulhilo(_PHILOX_M[1], c[2])
    c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    k0, k1 = k0 + jnp.uint32(_PHILOX_W[0]), k1 + jnp.uint32(_PHILOX_W[1])
  return c[0] ^ c[1]


def _threefry_bits(key, shape):
  with jax.threefry_partitionable(True):
    return jax.random.bits(jax.random.wrap_key_data(key, impl="threefry2x32"), shape,
                           jnp.uint32)


def _key_inputs(key):
  return (jax.random.bits(key, (2,), jnp.uint32),)


# ------------------------------------------------------------------ GPU ops
def _softmax_f32(x):
  """The op's own bf16 program: max and subtraction in bf16, exp and sum in f32, the
  result cast back."""
  e = jnp.exp((x - jnp.max(x, axis=-1, keepdims=True)).astype(jnp.float32))
  return (e / jnp.sum(e, axis=-1, keepdims=True)).astype(x.dtype)


def _gpu_rowwise(size: Size) -> list[Benchmark]:
  b, t, n = {"full": (4, 1024, 1024), "test": (2, 384, 192), "small": (2, 128, 256),
             "tiny": (2, 4, 128)}[size]
  shapes = f"{b}x{t}x{n} f32, one kernel instance per row"
  norm_inputs = lambda key: _normal(key, 3, (b, t, n), (n,), (n,))
  bf16_inputs = lambda key: tuple(x.astype(jnp.bfloat16) for x in _normal(key, 1, (b, t, n)))
  return [
      _case("op_gpu_softmax_bf16", "gpu/softmax", gpu=True, grid=(b * t,),
            shapes=shapes.replace("f32", "bf16"), make_inputs=bf16_inputs, twin=_softmax_f32,
            run=lambda m, x, **kw: m.softmax(x, **kw), rtol=1e-2, atol=1e-2),
      _case("op_gpu_softmax", "gpu/softmax", gpu=True, grid=(b * t,), shapes=shapes,
            make_inputs=lambda key: _normal(key, 1, (b, t, n)), twin=_softmax,
            run=lambda m, x, **kw: m.softmax(x, **kw), rtol=1e-5, atol=1e-6),
      _case("op_gpu_layer_norm", "gpu/layer_norm", gpu=True, grid=(b * t,), shapes=shapes,
            make_inputs=norm_inputs, twin=_layer_norm,
            run=lambda m, x, w, bias, **kw: m.layer_norm(x, w, bias, **kw), atol=1e-5,
            rtol=1e-5),
      _case("op_gpu_rms_norm", "gpu/rms_norm", gpu=True, grid=(b * t,), shapes=shapes,
            make_inputs=norm_inputs, twin=_rms_norm,
            run=lambda m, x, w, bias, **kw: m.rms_norm(x, w, bias, **kw), atol=1e-5,
            rtol=1e-5),
  ]


MHA_SIZES = {"full": (2, 1024, 4, 64, 64), "test": (2, 384, 2, 64, 64),
             "small": (1, 256, 2, 64, 64), "tiny": (1, 64, 2, 32, 32)}


def _gpu_mha(size: Size) -> list[Benchmark]:
  """Causal at head_dim 64; head_dim 72 (padded to 128 lanes inside the kernel, masked
  loads and stores); segment ids (two segments per sequence, not causal)."""
  b, t, h, d, block = MHA_SIZES[size]
  return [_mha_row("op_gpu_mha", b, t, h, d, block, causal=True, segments=False),
          _mha_row("op_gpu_mha_d72", b, t, h, 72, block, causal=False, segments=False),
          _mha_row("op_gpu_mha_segment_ids", b, t, h, d, block, causal=False, segments=True)]


def segment_halves(b: int, t: int) -> jax.Array:
  """Segment ids of two segments per sequence (JAX's tests: zeros then ones)."""
  return jnp.broadcast_to((jnp.arange(t) >= t // 2).astype(jnp.int32), (b, t))


def _mha_row(name: str, b: int, t: int, h: int, d: int, block: int, *, causal: bool,
             segments: bool) -> Benchmark:
  def run(m, q, k, v, **kw):
    blocks = m.BlockSizes(block_q=block, block_k=block)
    ids = segment_halves(b, t) if segments else None
    return m.mha(q, k, v, ids, sm_scale=d ** -0.5, causal=causal, block_sizes=blocks, **kw)

  def twin(q, k, v):
    heads = lambda x: jnp.swapaxes(x, 1, 2)
    mask = _causal(t, t) if causal else None
    if segments:
      ids = segment_halves(b, t)
      mask = (ids[:, :, None] == ids[:, None, :])[:, None]
    return heads(_attend(heads(q), heads(k), heads(v), mask, d ** -0.5))

  what = ("causal" if causal else "not causal") + (", 2 segments" if segments else "")
  return _case(name, "gpu/attention", gpu=True, grid=(t // block, b, h),
               shapes=f"{what}, B{b} T{t} H{h} D{d} f32, blocks {block}",
               make_inputs=lambda key: _normal(key, 3, *[(b, t, h, d)] * 3), twin=twin, run=run)


# (batch, q heads, kv heads, seq, head dim, k splits, block_k) of the decode rows
DECODE_GQA_SIZES = {"full": (8, 32, 8, 4096, 128, 16, 128), "test": (2, 16, 4, 1024, 64, 16, 128),
                    "small": (2, 8, 2, 512, 64, 4, 64), "tiny": (2, 8, 2, 64, 32, 4, 16)}
# (batch, heads, seq, head dim, k splits, block_k); one kv head
DECODE_MQA_SIZES = {"full": (8, 32, 4096, 128, 16, 128), "test": (2, 8, 1024, 64, 16, 256),
                    "small": (2, 8, 512, 64, 4, 64), "tiny": (2, 8, 64, 32, 4, 16)}
# the query-head block both decode rows run with (the ops' default)
DECODE_BLOCK_H = 16


def _gpu_decode(size: Size) -> Benchmark:
  b, hq, hkv, s, d, splits, block_k = DECODE_GQA_SIZES[size]

  def make_inputs(key):
    q, k, v = _normal(key, 3, (b, hq, d), (b, s, hkv, d), (b, s, hkv, d))
    return q, k, v, jnp.arange(b, dtype=jnp.int32) * (s // (2 * b)) + s // 2

  run = lambda m, q, k, v, lengths, **kw: m.gqa(q, k, v, None, lengths, block_h=DECODE_BLOCK_H,
                                                block_k=block_k, k_splits=splits, **kw)

  def twin(q, k, v, lengths):
    # grouped heads contract against their kv head directly (no repeated K/V copies)
    qg = q.reshape(b, hkv, hq // hkv, d)
    logits = jnp.einsum("bhgd,bshd->bhgs", qg, k, precision=HIGHEST) * d ** -0.5
    mask = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
    p = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
    return jnp.einsum("bhgs,bshd->bhgd", p, v, precision=HIGHEST).reshape(b, hq, d)

  return _case("op_gpu_decode_gqa", "gpu/decode_attention", gpu=True, grid=(b, hkv, 1, splits),
               shapes=f"B{b} Hq{hq} Hkv{hkv} S{s} D{d} f32, kv_seq_len, {splits} splits",
               make_inputs=make_inputs, twin=twin, run=run)


def _gpu_decode_mqa(size: Size) -> Benchmark:
  b, h, s, d, splits, block_k = DECODE_MQA_SIZES[size]

  def make_inputs(key):
    q, k, v = _normal(key, 3, (b, h, d), (b, s, d), (b, s, d))
    return q, k, v, jnp.arange(b, dtype=jnp.int32) * (s // (2 * b)) + s // 2

  run = lambda m, q, k, v, lengths, **kw: m.mqa(q, k, v, None, lengths, block_h=DECODE_BLOCK_H,
                                                block_k=block_k, k_splits=splits, **kw)

  def twin(q, k, v, lengths):
    logits = jnp.einsum("bhd,bsd->bhs", q, k, precision=HIGHEST) * d ** -0.5
    mask = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, :]
    p = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
    return jnp.einsum("bhs,bsd->bhd", p, v, precision=HIGHEST)

  return _case("op_gpu_decode_mqa", "gpu/decode_attention", gpu=True, grid=(b, 1, splits),
               shapes=f"B{b} H{h} S{s} D{d} f32 (one kv head), kv_seq_len, {splits} splits",
               make_inputs=make_inputs, twin=twin, run=run)


def _paged_inputs(key, b, hq, hkv, d, pages, page, per_seq, *, bf16_exact=False,
                  lengths=None):
  kq, kk, kv, kt = jax.random.split(key, 4)
  q = jax.random.normal(kq, (b, hq, d), jnp.float32)
  k_pages, v_pages = (jax.random.normal(k_, (hkv, pages, page, d), jnp.float32)
                      for k_ in (kk, kv))
  if bf16_exact:   # the TPU kernel rounds K and V to bfloat16
    k_pages, v_pages = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (k_pages, v_pages))
  tables = jax.vmap(lambda k_: jax.random.permutation(k_, pages)[:per_seq])(
      jax.random.split(kt, b)).astype(jnp.int32)
  if lengths is None:
    lengths = page * per_seq - jnp.arange(b, dtype=jnp.int32) * (page * per_seq // (2 * b))
  else:
    lengths = jnp.asarray(lengths, jnp.int32)
  return q, k_pages, v_pages, tables, lengths


# (batch, q heads, kv heads, head_dim, pages, page size, pages per sequence)
PAGED_SIZES = {"full": (8, 32, 8, 128, 1024, 16, 128), "test": (5, 32, 2, 64, 640, 16, 128),
               "small": (2, 8, 2, 64, 64, 16, 16), "tiny": (2, 4, 2, 32, 16, 8, 8)}
# JAX's tests: sequence lengths 3, 256, 513, 1023, 2048 of a 2048-token cache (the TPU
# test also has an empty sequence, whose output it does not check: 1 token here)
TEST_LENGTHS = (3, 256, 513, 1023, 2048)


def gpu_paged_splits(size: Size) -> tuple[int, int]:
  """(k_splits, pages_per_compute_block) of the GPU paged attention row at `size`."""
  return {"test": (16, 8), "tiny": (2, 2)}.get(size, (8, 8))


def _gpu_paged(size: Size) -> Benchmark:
  b, hq, hkv, d, pages, page, per_seq = PAGED_SIZES[size]
  splits, per_block = gpu_paged_splits(size)
  lengths = TEST_LENGTHS if size == "test" else None
  run = lambda m, q, kp, vp, tables, lengths, **kw: m.paged_attention(
      q, kp, vp, tables, lengths, block_h=16, pages_per_compute_block=per_block,
      k_splits=splits, **kw)
  return _case("op_gpu_paged_attention", "gpu/paged_attention", gpu=True,
               grid=(b, hkv, 1, splits),
               shapes=f"B{b} Hq{hq} Hkv{hkv} D{d} f32, {per_seq} pages of {page}",
               make_inputs=lambda key: _paged_inputs(key, b, hq, hkv, d, pages, page, per_seq,
                                                     lengths=lengths),
               twin=_paged_twin, run=run)


# ------------------------------------------------------------------ TPU ops
def _tpu_matmul(size: Size) -> Benchmark:
  m_, k_, n_, block = {"full": (1024, 1024, 1024, 256), "test": (512, 512, 512, 128),
                       "small": (256, 256, 256, 128), "tiny": (128, 256, 128, 64)}[size]
  run = lambda m, x, y: m.matmul(x, y, block_shape=(block, block), block_k=block)
  return _case("op_tpu_matmul", "tpu/matmul", gpu=False,
               grid=(m_ // block, n_ // block, k_ // block),
               shapes=f"{m_}x{k_} @ {k_}x{n_} f32, blocks {block}",
               make_inputs=lambda key: _normal(key, 2, (m_, k_), (k_, n_)),
               twin=lambda x, y: jnp.matmul(x, y, precision=HIGHEST), run=run, rtol=2e-4,
               atol=2e-4)


# query and key block of the TPU flash and splash attention rows (algorithm_twins uses it)
TPU_ATTENTION_BLOCK = 128


def _tpu_flash(size: Size) -> list[Benchmark]:
  """Causal, plain (no mask) and with segment ids (two segments per sequence)."""
  b, h, t, d = {"full": (2, 4, 1024, 128), "test": (2, 2, 512, 64), "small": (1, 2, 256, 64),
                "tiny": (1, 1, 256, 64)}[size]
  return [_tpu_flash_row(name, b, h, t, d, causal=causal, segments=segments)
          for name, causal, segments in (("op_tpu_flash_attention", True, False),
                                         ("op_tpu_flash_attention_plain", False, False),
                                         ("op_tpu_flash_attention_segment_ids", False, True))]


def _tpu_flash_row(name: str, b: int, h: int, t: int, d: int, *, causal: bool,
                   segments: bool) -> Benchmark:
  def run(m, q, k, v):
    block = TPU_ATTENTION_BLOCK
    blocks = m.BlockSizes(block_q=block, block_k_major=block, block_k=block, block_b=1)
    ids = m.SegmentIds(q=segment_halves(b, t), kv=segment_halves(b, t)) if segments else None
    return m.flash_attention(q, k, v, segment_ids=ids, causal=causal, sm_scale=d ** -0.5,
                             block_sizes=blocks)

  def twin(q, k, v):
    mask = _causal(t, t) if causal else None
    if segments:
      ids = segment_halves(b, t)
      mask = (ids[:, :, None] == ids[:, None, :])[:, None]
    return _attend(q, k, v, mask, d ** -0.5)

  what = ("causal" if causal else "not causal") + (", 2 segments" if segments else "")
  n = t // TPU_ATTENTION_BLOCK
  return _case(name, "tpu/flash_attention", gpu=False, grid=(b, h, n, n),
               shapes=f"{what}, B{b} H{h} T{t} D{d} f32",
               make_inputs=lambda key: _normal(key, 3, *[(b, h, t, d)] * 3), twin=twin, run=run)


GMM_SIZES = {"full": (2048, 512, 512, 8, (128, 128, 128)),
             "test": (512, 2048, 256, 8, (128, 128, 128)),
             "small": (512, 256, 256, 4, (128, 128, 128)),
             "tiny": (192, 128, 128, 4, (32, 64, 64))}


def _group_sizes(m: int, groups: int) -> jax.Array:
  """Uneven groups that straddle tiles, one of them empty."""
  weights = np.arange(1, groups + 1, dtype=np.float64)
  weights[1] = 0
  sizes = np.floor(weights / weights.sum() * m).astype(np.int32)
  sizes[-1] += m - sizes.sum()
  return jnp.asarray(sizes)


def _tpu_gmm(size: Size) -> list[Benchmark]:
  m_, k_, n_, g, tiling = GMM_SIZES[size]
  tm, tk, tn = tiling
  shapes = f"m{m_} k{k_} n{n_} f32, {g} groups, tiles {tm}x{tk}x{tn}"
  sizes = _group_sizes(m_, g)
  gmm_inputs = lambda key: (*_normal(key, 2, (m_, k_), (g, k_, n_)), sizes)
  tgmm_inputs = lambda key: (*_normal(key, 2, (k_, m_), (m_, n_)), sizes)
  tgmm_dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([1], [0]), ([], [])), lhs_ragged_dimensions=[1],
      rhs_group_dimensions=[])
  return [
      _case("op_tpu_gmm", "tpu/megablox/gmm", gpu=False, grid=(n_ // tn, m_ // tm + g - 1, k_ // tk),
            shapes=shapes, make_inputs=gmm_inputs,
            twin=lambda lhs, rhs, gs: jax.lax.ragged_dot(lhs, rhs, gs, precision=HIGHEST),
            run=lambda m, lhs, rhs, gs: m.gmm(lhs, rhs, gs, jnp.float32, tiling),
            rtol=2e-4, atol=2e-4),
      _case("op_tpu_tgmm", "tpu/megablox/gmm", gpu=False,
            grid=(n_ // tn, k_ // tk, m_ // tm + g - 1), shapes=shapes, make_inputs=tgmm_inputs,
            twin=lambda lhs, rhs, gs: jax.lax.ragged_dot_general(lhs, rhs, gs, tgmm_dims,
                                                                 precision=HIGHEST),
            run=lambda m, lhs, rhs, gs: m.tgmm(lhs, rhs, gs, jnp.float32, tiling),
            rtol=2e-4, atol=2e-4),
  ]


# JAX's test: 2048-token caches, 512-token compute blocks, head_dim 128
TPU_PAGED_TEST = (6, 32, 8, 128, 384, 32, 64)


def _tpu_paged(size: Size) -> Benchmark:
  b, hq, hkv, d, pages, page, per_seq = (TPU_PAGED_TEST if size == "test"
                                         else PAGED_SIZES[size])
  per_block = {"test": 16, "tiny": 2}.get(size, 8)
  lengths = (1,) + TEST_LENGTHS if size == "test" else None
  run = lambda m, q, kp, vp, tables, lengths: m.paged_attention(
      q, kp, vp, lengths, tables, pages_per_compute_block=per_block)
  return _case("op_tpu_paged_attention", "tpu/paged_attention", gpu=False, grid=(1, b, hkv),
               shapes=f"B{b} Hq{hq} Hkv{hkv} D{d} f32, {per_seq} pages of {page}",
               make_inputs=lambda key: _paged_inputs(key, b, hq, hkv, d, pages, page, per_seq,
                                                     bf16_exact=True, lengths=lengths),
               twin=_paged_twin, run=run)


def _tpu_splash(size: Size) -> Benchmark:
  h, t, d = {"full": (4, 1024, 128), "test": (2, 1024, 64), "small": (2, 256, 64),
             "tiny": (2, 256, 64)}[size]

  def run(m, q, k, v):
    block = TPU_ATTENTION_BLOCK
    blocks = m.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block)
    mask = m.MultiHeadMask([m.CausalMask((t, t))] * h)
    kernel = m.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1)
    return kernel(q, k, v)

  return _case("op_tpu_splash_attention", "tpu/splash_attention", gpu=False,
               grid=(h, t // TPU_ATTENTION_BLOCK, t // TPU_ATTENTION_BLOCK),
               shapes=f"causal, H{h} T{t} D{d} f32",
               make_inputs=lambda key: _normal(key, 3, *[(h, t, d)] * 3),
               twin=lambda q, k, v: _attend(q, k, v, _causal(t, t)), run=run)


def _tpu_example(size: Size) -> Benchmark:
  shape = {"full": (1024, 1024), "test": (512, 512), "small": (512, 512),
           "tiny": (64, 128)}[size]
  return _case("op_tpu_example_double", "tpu/example_kernel", gpu=False, grid=(1,),
               shapes=f"{shape[0]}x{shape[1]} f32, one grid-less call",
               make_inputs=lambda key: _normal(key, 1, shape), twin=lambda x: 2 * x,
               run=lambda m, x: m.double(x), rtol=0, atol=0)


def _tpu_random(size: Size) -> list[Benchmark]:
  shape = {"full": (1024, 1024), "test": (512, 512), "small": (512, 512),
           "tiny": (256, 512)}[size]
  grid = (shape[0] // 256, shape[1] // 256)
  text = f"{shape[0]}x{shape[1]} uint32 bits"
  return [
      _case("op_tpu_philox", "tpu/random/philox", gpu=False, grid=grid, shapes=text,
            make_inputs=_key_inputs, twin=lambda key: _philox_bits(key, shape),
            run=lambda m, key: m.philox_random_bits(key, 32, shape), rtol=0, atol=0),
      _case("op_tpu_threefry", "tpu/random/threefry", gpu=False, grid=grid, shapes=text,
            make_inputs=_key_inputs, twin=lambda key: _threefry_bits(key, shape),
            run=lambda m, key: m.plthreefry_random_bits(key, 32, shape), rtol=0, atol=0),
  ]


_ROWS: tuple[tuple[str, Callable[[Size], Benchmark | list[Benchmark]]], ...] = (
    ("gpu/softmax", _gpu_rowwise), ("gpu/attention", _gpu_mha),
    ("gpu/decode_attention", _gpu_decode), ("gpu/decode_attention", _gpu_decode_mqa),
    ("gpu/paged_attention", _gpu_paged), ("tpu/example_kernel", _tpu_example),
    ("tpu/matmul", _tpu_matmul), ("tpu/flash_attention", _tpu_flash),
    ("tpu/megablox/gmm", _tpu_gmm), ("tpu/paged_attention", _tpu_paged),
    ("tpu/splash_attention", _tpu_splash), ("tpu/random/philox", _tpu_random),
)


def benchmarks(size: Size) -> list[Benchmark]:
  """One row per op of JAX 0.12's kernel library (none on an older jax)."""
  out: list[Benchmark] = []
  for module, make in _ROWS:
    if jax_ops.unavailable_reason(module) is None:
      rows = make(size)
      out.extend(rows if isinstance(rows, list) else [rows])
  return out
