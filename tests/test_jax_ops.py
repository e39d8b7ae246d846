"""JAX's own Pallas kernel library (`jax/experimental/pallas/ops/{gpu,tpu}`) on pallet.

Each kernel module is read from the installed jax at test time and run with its
Pallas imports routed to pallet (src/pallet/bench/jax_ops.py); nothing of it is copied
here. Every public op runs on fresh random inputs and is checked against the plain
jax.numpy references of tests/jax_op_references.py, forward and, where the op
defines a custom VJP, through `jax.grad`.

The GPU ops call `pl.pallas_call` themselves, so they run on the backend under test
through `pallet.default_backend` (PALLET_TEST_BACKEND=triton: Triton's interpreter).
The TPU ops are CPU-backend programs (DMAs, semaphores, SMEM) and run in the default
(XLA) run only.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import pallet
from pallet.bench import jax_ops
import jax_op_references as ref
from helpers import assert_close, current_test_backend, random_array

# jax's own kernels are correct Pallas code: a grid-order warning on one is a false alarm.
pytestmark = pytest.mark.filterwarnings("error::pallet.GridOrderWarning")

ATTENTION_TOL = dict(rtol=2e-4, atol=2e-4)
GRAD_TOL = dict(rtol=1e-3, atol=1e-3)


def op(name: str):
  """The routed module `ops/<name>`, or a skip saying why this jax has none to test."""
  reason = jax_ops.unavailable_reason(name)
  if reason:
    pytest.skip(reason)
  return jax_ops.load(name)


@pytest.fixture
def gpu_backend():
  """Runs a GPU op's own pallas_calls on the backend under test."""
  backend = current_test_backend()
  if backend == "xla":
    yield backend
    return
  with pallet.default_backend(backend):
    yield backend


gpu_op = pytest.mark.usefixtures("gpu_backend")
tpu_op = pytest.mark.skipif(
    current_test_backend() != "xla",
    reason="TPU kernels (DMAs, semaphores, SMEM) run on the XLA backend; the "
           "Triton run covers the GPU ops")


def grads(f, args, cotangent, argnums):
  """d<f(*args), cotangent>/d args[argnums] (a fixed random cotangent, not ones)."""
  loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cotangent)
  return jax.grad(loss, argnums=argnums)(*args)


def segments(batch: int, length: int, cuts: tuple[int, ...]) -> jax.Array:
  """int32 [batch, length] segment ids: a new segment starts at each cut (shifted per row)."""
  rows = [np.searchsorted(np.array(cuts) + 8 * b, np.arange(length), side="right")
          for b in range(batch)]
  return jnp.asarray(np.stack(rows), jnp.int32)


def bf16_exact(shape) -> jax.Array:
  """float32 values that bfloat16 represents exactly (for kernels that round to bf16)."""
  return random_array(shape).astype(jnp.bfloat16).astype(jnp.float32)


# ================================================================== GPU ops
@gpu_op
@pytest.mark.parametrize("shape,dtype", [((3, 5, 40), jnp.float32), ((4, 128), jnp.float32),
                                         ((2, 3, 33), jnp.float16)])
def test_gpu_softmax(shape, dtype):
  m = op("gpu/softmax")
  x = random_array(shape, dtype)
  assert_close(m.softmax(x, axis=-1), ref.softmax(x))


@gpu_op
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_gpu_norm_forward(name):
  m = op(f"gpu/{name}")
  x, w, b = random_array((2, 9, 72)), random_array((72,)), random_array((72,))
  want = getattr(ref, name)(x, w, b, eps=1e-5)
  assert_close(getattr(m, name)(x, w, b), want, rtol=2e-5, atol=2e-5)


@gpu_op
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_gpu_norm_grad(name):
  m = op(f"gpu/{name}")
  x, w, b = random_array((2, 9, 72)), random_array((72,)), random_array((72,))
  ct = random_array((2, 9, 72))
  got = grads(getattr(m, name), (x, w, b), ct, (0, 1, 2))
  want = grads(lambda *a: getattr(ref, name)(*a, eps=1e-5), (x, w, b), ct, (0, 1, 2))
  assert_close(got, want, **GRAD_TOL)


def _mha_inputs(head_dim: int, seq: int = 64, batch: int = 2, heads: int = 2):
  shape = (batch, seq, heads, head_dim)
  return random_array(shape), random_array(shape), random_array(shape)


def _mha_blocks(m):
  return m.BlockSizes(block_q=32, block_k=32, block_q_dkv=32, block_kv_dkv=32,
                      block_q_dq=32, block_kv_dq=32)


MHA_CASES = [
    pytest.param(dict(head_dim=32), id="plain"),
    pytest.param(dict(head_dim=32, causal=True), id="causal"),
    pytest.param(dict(head_dim=32, segments=True), id="segment_ids"),
    pytest.param(dict(head_dim=72, causal=True, segments=True), id="head_dim72-causal-segments"),
]
SLOW = pytest.mark.slow


def slow_except(cases, *fast_ids):
  """The cases again, all but `fast_ids` marked slow (each op keeps a fast default case)."""
  return [c if c.id in fast_ids else pytest.param(*c.values, id=c.id, marks=[*c.marks, SLOW])
          for c in cases]


@gpu_op
@pytest.mark.parametrize("case", MHA_CASES)
def test_gpu_mha_forward(case):
  m = op("gpu/attention")
  q, k, v = _mha_inputs(case["head_dim"])
  seg = segments(2, 64, (20, 41)) if case.get("segments") else None
  causal = case.get("causal", False)
  got = m.mha(q, k, v, seg, sm_scale=0.5, causal=causal, block_sizes=_mha_blocks(m))
  want = ref.mha_btHd(q, k, v, segment_ids=seg, causal=causal, sm_scale=0.5)
  assert_close(got, want, **ATTENTION_TOL)


@gpu_op
@pytest.mark.parametrize("case", slow_except(MHA_CASES, "causal"))
def test_gpu_mha_grad(case):
  m = op("gpu/attention")
  q, k, v = _mha_inputs(case["head_dim"])
  seg = segments(2, 64, (20, 41)) if case.get("segments") else None
  causal = case.get("causal", False)
  ct = random_array(q.shape)
  kernel = lambda q, k, v: m.mha(q, k, v, seg, sm_scale=0.5, causal=causal,
                                 block_sizes=_mha_blocks(m))
  reference = lambda q, k, v: ref.mha_btHd(q, k, v, segment_ids=seg, causal=causal,
                                           sm_scale=0.5)
  assert_close(grads(kernel, (q, k, v), ct, (0, 1, 2)),
               grads(reference, (q, k, v), ct, (0, 1, 2)), **GRAD_TOL)


@gpu_op
def test_gpu_mha_residuals():
  m = op("gpu/attention")
  q, k, v = _mha_inputs(32)
  out, lse = m.mha(q, k, v, None, causal=True, block_sizes=_mha_blocks(m),
                   return_residuals=True)
  want, mx, l = ref.attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)),
                              mask=ref.causal_mask(64, 64), with_stats=True)
  assert_close(out, jnp.swapaxes(want, 1, 2), **ATTENTION_TOL)
  # The kernel keeps the log-sum-exp in base 2.
  assert_close(lse, (mx + jnp.log(l)) / np.log(2), **ATTENTION_TOL)


DECODE_MASKS = [
    pytest.param(None, None, id="full"),
    pytest.param([3, 10], None, id="start_idx"),
    pytest.param(None, [40, 20], id="kv_seq_len"),
    pytest.param([5, 0], [50, 17], id="start_idx-kv_seq_len"),
]
DECODE_BLOCKS = dict(block_h=16, block_k=16, k_splits=4)


def _maybe_i32(x):
  return None if x is None else jnp.asarray(x, jnp.int32)


@gpu_op
@pytest.mark.parametrize("start,stop", DECODE_MASKS)
def test_gpu_decode_mqa(start, stop):
  m = op("gpu/decode_attention")
  q, k, v = random_array((2, 4, 32)), random_array((2, 64, 32)), random_array((2, 64, 32))
  start, stop = _maybe_i32(start), _maybe_i32(stop)
  got = m.mqa(q, k, v, start, stop, **DECODE_BLOCKS)
  assert_close(got, ref.decode_attention(q, k, v, start_idx=start, kv_seq_len=stop),
               **ATTENTION_TOL)


@gpu_op
@pytest.mark.parametrize("start,stop", DECODE_MASKS)
def test_gpu_decode_gqa(start, stop):
  m = op("gpu/decode_attention")
  q = random_array((2, 8, 32))
  k, v = random_array((2, 64, 2, 32)), random_array((2, 64, 2, 32))
  start, stop = _maybe_i32(start), _maybe_i32(stop)
  got = m.gqa(q, k, v, start, stop, **DECODE_BLOCKS)
  assert_close(got, ref.decode_attention(q, k, v, start_idx=start, kv_seq_len=stop),
               **ATTENTION_TOL)


@gpu_op
def test_gpu_decode_gqa_unnormalized_with_residuals():
  m = op("gpu/decode_attention")
  q = random_array((2, 8, 32))
  k, v = random_array((2, 64, 2, 32)), random_array((2, 64, 2, 32))
  start, stop = _maybe_i32([2, 7]), _maybe_i32([60, 33])
  o, (l, mx) = m.gqa(q, k, v, start, stop, return_residuals=True, normalize_output=False,
                     **DECODE_BLOCKS)
  want, (l_want, m_want) = ref.decode_attention(q, k, v, start_idx=start, kv_seq_len=stop,
                                                with_stats=True)
  assert_close(l, l_want, **ATTENTION_TOL)
  assert_close(mx, m_want, **ATTENTION_TOL)
  assert_close(o, want * l_want[..., None], **ATTENTION_TOL)


def _paged_inputs(q_heads=4, kv_heads=2, head_dim=32, pages=16, page_size=8, per_seq=8,
                  batch=2, dtype=jnp.float32):
  q = random_array((batch, q_heads, head_dim))
  k_pages = random_array((kv_heads, pages, page_size, head_dim), dtype)
  v_pages = random_array((kv_heads, pages, page_size, head_dim), dtype)
  rng = np.random.default_rng(7)
  tables = np.stack([rng.permutation(pages)[:per_seq] for _ in range(batch)])
  return q, k_pages, v_pages, jnp.asarray(tables, jnp.int32)


@gpu_op
@pytest.mark.parametrize("lengths", [None, [64, 64], [37, 64], [20, 9]],
                         ids=["no-lengths", "full", "ragged", "empty-partitions"])
def test_gpu_paged_attention(lengths):
  m = op("gpu/paged_attention")
  q, kp, vp, tables = _paged_inputs()
  lengths = _maybe_i32(lengths)
  got = m.paged_attention(q, kp, vp, tables, lengths, block_h=16, pages_per_compute_block=2,
                          k_splits=2)
  assert_close(got, ref.paged_attention(q, kp, vp, tables, lengths), **ATTENTION_TOL)


@gpu_op
def test_gpu_paged_attention_soft_cap_and_int8_pages():
  m = op("gpu/paged_attention")
  q, kp, vp, tables = _paged_inputs()
  k8 = jnp.clip(jnp.round(kp * 40), -127, 127).astype(jnp.int8)
  v8 = jnp.clip(jnp.round(vp * 40), -127, 127).astype(jnp.int8)
  k_scales = jnp.abs(random_array(kp.shape[:-1])) / 40 + 1e-3
  v_scales = jnp.abs(random_array(vp.shape[:-1])) / 40 + 1e-3
  lengths = _maybe_i32([45, 64])
  got = m.paged_attention(q, k8, v8, tables, lengths, k_scales, v_scales, block_h=16,
                          pages_per_compute_block=2, k_splits=2, attn_logits_soft_cap=5.0)
  want = ref.paged_attention(q, k8, v8, tables, lengths, k_scales=k_scales[..., None],
                             v_scales=v_scales[..., None], soft_cap=5.0)
  assert_close(got, want, **ATTENTION_TOL)


# ================================================================== TPU ops
@tpu_op
@pytest.mark.parametrize("dtype,out_dtype", [(jnp.float32, None), (jnp.bfloat16, jnp.float32),
                                             (jnp.int8, jnp.int32)])
def test_tpu_matmul(dtype, out_dtype):
  m = op("tpu/matmul")
  x, y = random_array((128, 192), dtype), random_array((192, 128), dtype)
  got = m.matmul(x, y, block_shape=(64, 64), block_k=64, out_dtype=out_dtype)
  assert_close(got, ref.matmul(x, y, out_dtype), matmul=True)


@tpu_op
def test_tpu_example_kernel():
  m = op("tpu/example_kernel")
  x = random_array((8, 128))
  assert_close(m.double(x), 2 * x)


def _flash_blocks(m, block_b=1):
  return m.BlockSizes(block_q=64, block_k_major=128, block_k=128, block_b=block_b,
                      block_q_major_dkv=64, block_k_major_dkv=128, block_k_dkv=128,
                      block_q_dkv=64, block_k_major_dq=128, block_k_dq=128, block_q_dq=64)


FLASH_CASES = [
    pytest.param(dict(), id="plain"),
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(segments=True), id="segment_ids"),
    pytest.param(dict(causal=True, segments=True, bias=True, block_b=2), id="causal-segments-bias"),
]


def _flash_call(m, case):
  q, k, v = (random_array((2, 2, 256, 64)) for _ in range(3))
  bias = random_array((2, 2, 256, 256)) if case.get("bias") else None
  seg = segments(2, 256, (60, 130, 200)) if case.get("segments") else None
  causal = case.get("causal", False)
  kernel = lambda q, k, v, bias: m.flash_attention(
      q, k, v, bias, None if seg is None else m.SegmentIds(seg, seg), causal=causal,
      sm_scale=0.125, block_sizes=_flash_blocks(m, case.get("block_b", 1)))
  mask = ref.causal_mask(256, 256) if causal else None
  if seg is not None:
    sm = ref.segment_mask(seg, seg)[:, None]
    mask = sm if mask is None else mask & sm
  reference = lambda q, k, v, bias: ref.attention(q, k, v, mask=mask, bias=bias, sm_scale=0.125)
  return kernel, reference, (q, k, v, bias)


@tpu_op
@pytest.mark.parametrize("case", slow_except(FLASH_CASES, "plain", "causal", "segment_ids"))
def test_tpu_flash_attention_forward(case):
  m = op("tpu/flash_attention")
  kernel, reference, args = _flash_call(m, case)
  assert_close(kernel(*args), reference(*args), **ATTENTION_TOL)


@tpu_op
@pytest.mark.parametrize("case", slow_except(FLASH_CASES, "causal", "segment_ids"))
def test_tpu_flash_attention_grad(case):
  m = op("tpu/flash_attention")
  kernel, reference, args = _flash_call(m, case)
  argnums = (0, 1, 2, 3) if args[3] is not None else (0, 1, 2)
  ct = random_array(args[0].shape)
  assert_close(grads(kernel, args, ct, argnums), grads(reference, args, ct, argnums),
               **GRAD_TOL)


GROUP_SIZES = [40, 0, 100, 52]   # m = 192: groups straddle tiles, one is empty


def _gmm_inputs(k=128, n=128, dtype=jnp.float32, transpose_rhs=False):
  lhs = random_array((sum(GROUP_SIZES), k), dtype)
  rhs = random_array((len(GROUP_SIZES), n, k) if transpose_rhs else (len(GROUP_SIZES), k, n),
                     dtype)
  return lhs, rhs, jnp.asarray(GROUP_SIZES, jnp.int32)


GMM_CASES = [
    pytest.param(dict(), id="f32"),
    pytest.param(dict(transpose_rhs=True), id="transpose_rhs"),
    pytest.param(dict(k=96, n=80), id="irregular-k-n"),
    pytest.param(dict(dtype=jnp.bfloat16), id="bf16"),
]


@tpu_op
@pytest.mark.parametrize("case", GMM_CASES)
def test_tpu_gmm(case):
  m = op("tpu/megablox/gmm")
  lhs, rhs, sizes = _gmm_inputs(**case)
  transpose = case.get("transpose_rhs", False)
  got = m.gmm(lhs, rhs, sizes, jnp.float32, (32, 64, 64), transpose_rhs=transpose)
  want = ref.gmm(lhs, rhs, GROUP_SIZES, transpose_rhs=transpose)
  tol = dict(rtol=2e-2, atol=5e-2) if case.get("dtype") == jnp.bfloat16 else {}
  assert_close(got, want, matmul=True, **tol)


@tpu_op
def test_tpu_gmm_group_offset():
  """A shard holding groups 1..2 of rhs computes their rows and zeroes the others."""
  m = op("tpu/megablox/gmm")
  lhs, rhs, sizes = _gmm_inputs()
  # The kernel leaves the rows of the other shards' groups unwritten on purpose; gmm
  # zeroes them after the call (what PALLET_CHECKS=1 would otherwise report).
  with pallet.allow_unwritten_outputs():
    got = m.gmm(lhs, rhs[1:3], sizes, jnp.float32, (32, 64, 64), jnp.asarray(1, jnp.int32))
  full = ref.gmm(lhs, rhs, GROUP_SIZES)
  rows = np.zeros(lhs.shape[0], bool)
  rows[GROUP_SIZES[0]:sum(GROUP_SIZES[:3])] = True
  assert_close(got, jnp.where(rows[:, None], full, 0.0), matmul=True)


@tpu_op
@pytest.mark.parametrize("k,n", [(128, 128), (96, 80)])
def test_tpu_tgmm(k, n):
  m = op("tpu/megablox/gmm")
  lhs = random_array((k, sum(GROUP_SIZES)))
  rhs = random_array((sum(GROUP_SIZES), n))
  sizes = jnp.asarray(GROUP_SIZES, jnp.int32)
  got = m.tgmm(lhs, rhs, sizes, jnp.float32, (32, 64, 64))
  assert_close(got, ref.tgmm(lhs, rhs, GROUP_SIZES), matmul=True)


@tpu_op
@pytest.mark.parametrize("transpose_rhs", [False, pytest.param(True, marks=SLOW)])
def test_tpu_gmm_vjp(transpose_rhs):
  m = op("tpu/megablox/ops")
  lhs, rhs, sizes = _gmm_inputs(transpose_rhs=transpose_rhs)
  ct = random_array((lhs.shape[0], 128))
  kernel = lambda lhs, rhs: m.gmm(lhs, rhs, sizes, jnp.float32, (32, 64, 64), None, None,
                                  transpose_rhs)
  reference = lambda lhs, rhs: ref.gmm(lhs, rhs, GROUP_SIZES, transpose_rhs=transpose_rhs)
  assert_close(kernel(lhs, rhs), reference(lhs, rhs), matmul=True)
  assert_close(grads(kernel, (lhs, rhs), ct, (0, 1)), grads(reference, (lhs, rhs), ct, (0, 1)),
               matmul=True)


def _tpu_paged_inputs(q_heads, kv_heads=2, head_dim=32):
  q = random_array((2, q_heads, head_dim))
  # The kernel computes with K and V rounded to bfloat16: give it values that round exactly.
  kp, vp = bf16_exact((kv_heads, 20, 8, head_dim)), bf16_exact((kv_heads, 20, 8, head_dim))
  rng = np.random.default_rng(11)
  tables = jnp.asarray(np.stack([rng.permutation(20)[:8] for _ in range(2)]), jnp.int32)
  return q, kp, vp, tables


PAGED_CASES = [
    pytest.param(dict(q_heads=4), id="groups2"),
    pytest.param(dict(q_heads=16), id="groups8"),
    pytest.param(dict(q_heads=4, inline_seq_dim=False), id="grid-over-pages"),
    pytest.param(dict(q_heads=4, soft_cap=4.0), id="soft_cap"),
]


@tpu_op
@pytest.mark.parametrize("case", PAGED_CASES)
def test_tpu_paged_attention(case):
  m = op("tpu/paged_attention")
  q, kp, vp, tables = _tpu_paged_inputs(case["q_heads"])
  lengths = jnp.asarray([37, 64], jnp.int32)
  got = m.paged_attention(q, kp, vp, lengths, tables, pages_per_compute_block=2,
                          attn_logits_soft_cap=case.get("soft_cap"),
                          megacore_mode=case.get("megacore_mode"),
                          inline_seq_dim=case.get("inline_seq_dim", True))
  want = ref.paged_attention(q, kp, vp, tables, lengths, soft_cap=case.get("soft_cap"))
  assert_close(got, want, **ATTENTION_TOL)


@tpu_op
@pytest.mark.parametrize("mode,inline", [("kv_head", True), ("batch", False)])
def test_tpu_paged_attention_megacore_on_one_core_is_a_clear_error(mode, inline):
  """megacore_mode splits the work over two TensorCores whose DMA prefetches hand over
  to each other; the kernel documents that it hangs without megacore. On pallet's one
  CPU "core" the first wait on the second core's never-started copy must be an error
  naming the kernel, not a hang."""
  m = op("tpu/paged_attention")
  q, kp, vp, tables = _tpu_paged_inputs(4)
  lengths = jnp.asarray([37, 64], jnp.int32)
  with pytest.raises(Exception, match=r"(?s)paged_flash_attention_kernel.*wait"):
    jax.block_until_ready(m.paged_attention(q, kp, vp, lengths, tables,
                                            pages_per_compute_block=2, megacore_mode=mode,
                                            inline_seq_dim=inline))


@tpu_op
def test_tpu_paged_attention_int8_pages():
  m = op("tpu/paged_attention")
  qu = op("tpu/paged_attention/quantization_utils")
  q, kp, vp, tables = _tpu_paged_inputs(4)
  kq, vq = qu.quantize_to_int8(kp), qu.quantize_to_int8(vp)
  lengths = jnp.asarray([51, 23], jnp.int32)
  got = m.paged_attention(q, kq, vq, lengths, tables, pages_per_compute_block=2)
  want = ref.paged_attention(q, kq.weight, vq.weight, tables, lengths,
                             k_scales=kq.scales / 127.5, v_scales=vq.scales / 127.5)
  assert_close(got, want, **ATTENTION_TOL)


def _splash_blocks(m, fused=False):
  dq = {} if fused else dict(block_q_dq=128, block_kv_dq=128)
  return m.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128,
                      block_kv_dkv=128, block_kv_dkv_compute=128,
                      use_fused_bwd_kernel=fused, **dq)


SPLASH_CASES = [
    pytest.param(dict(mask="causal"), id="causal"),
    pytest.param(dict(mask="local"), id="local"),
    pytest.param(dict(mask="causal", segments=True), id="causal-segment_ids"),
    pytest.param(dict(mask="causal", kv_heads=1), id="causal-gqa"),
    pytest.param(dict(mask="local", mqa=True), id="local-mqa"),
    pytest.param(dict(mask="causal", fused=True), id="causal-fused-bwd"),
]
SEQ = 256


def _splash_call(case):
  m = op("tpu/splash_attention")
  heads, kv_heads = 2, case.get("kv_heads", 2)
  if case["mask"] == "causal":
    head_mask, dense = m.CausalMask((SEQ, SEQ)), ref.causal_mask(SEQ, SEQ)
  else:
    head_mask = m.LocalMask((SEQ, SEQ), window_size=(100, 20), offset=0)
    dense = ref.local_mask(SEQ, SEQ, 100, 20)
  make = m.make_splash_mqa if case.get("mqa") else m.make_splash_mha
  kernel = make(m.MultiHeadMask([head_mask] * heads), block_sizes=_splash_blocks(
      m, case.get("fused", False)), head_shards=1, q_seq_shards=1)
  q = random_array((heads, SEQ, 64))
  kv_shape = (SEQ, 64) if case.get("mqa") else (kv_heads, SEQ, 64)
  k, v = random_array(kv_shape), random_array(kv_shape)
  seg = segments(1, SEQ, (90, 170))[0] if case.get("segments") else None
  mask = dense if seg is None else dense & ref.segment_mask(seg, seg)
  kv = (lambda x: x[None]) if case.get("mqa") else (lambda x: x)
  run = lambda q, k, v: kernel(q, k, v, None if seg is None else m.SegmentIds(seg, seg))
  reference = lambda q, k, v: ref.attention(q, kv(k), kv(v), mask=mask)
  return run, reference, (q, k, v)


@tpu_op
@pytest.mark.parametrize("case", SPLASH_CASES)
def test_tpu_splash_attention_forward(case):
  kernel, reference, args = _splash_call(case)
  assert_close(kernel(*args), reference(*args), **ATTENTION_TOL)


@tpu_op
@pytest.mark.parametrize("case", slow_except(SPLASH_CASES, "causal", "local"))
def test_tpu_splash_attention_grad(case):
  kernel, reference, args = _splash_call(case)
  ct = random_array(args[0].shape)
  assert_close(grads(kernel, args, ct, (0, 1, 2)), grads(reference, args, ct, (0, 1, 2)),
               **GRAD_TOL)


KEY = (0x1234ABCD, 0x9E3779B9)
RANDOM_SHAPES = [(), (7,), (3, 300), (1, 256, 256)]


@tpu_op
@pytest.mark.parametrize("shape", RANDOM_SHAPES, ids=str)
def test_tpu_philox_counter_mode(shape):
  """Output words 0 and 1 of Philox-4x32-10 at counter (0, offset + flat index, 0, 0)."""
  m = op("tpu/random/philox")
  key = jnp.asarray(KEY, jnp.uint32)
  offset = 1000
  count = np.arange(int(np.prod(shape)), dtype=np.uint32).reshape(shape) + offset
  zero = np.zeros_like(count)
  w0, w1, _, _ = ref.philox4x32((zero, count, zero, zero), KEY)
  halves = m.philox_4x32_count(key, shape, offset=offset, fuse_output=False)
  np.testing.assert_array_equal(np.asarray(halves), np.stack([w0, w1]))
  fused = m.philox_4x32_count(key, shape, offset=offset)
  np.testing.assert_array_equal(np.asarray(fused), w0 ^ w1)


@tpu_op
@SLOW
def test_tpu_philox_prng_impl():
  """The registered `pallas_philox4x32` PRNG: deterministic, key-dependent, uniform bits."""
  m = op("tpu/random/philox")
  key = jax.random.key(42, impl=m.plphilox_prng_impl)
  bits = np.asarray(jax.random.bits(key, (256, 256), jnp.uint32))
  np.testing.assert_array_equal(bits, np.asarray(m.philox_random_bits(
      jax.random.key_data(key), 32, (256, 256))))
  np.testing.assert_array_equal(bits, np.asarray(jax.random.bits(key, (256, 256), jnp.uint32)))
  k1, k2 = jax.random.split(key)
  assert not np.array_equal(np.asarray(jax.random.bits(k1, (64,))),
                            np.asarray(jax.random.bits(k2, (64,))))
  per_bit = np.unpackbits(bits.view(np.uint8)).reshape(-1, 32).mean(axis=0)
  np.testing.assert_allclose(per_bit, 0.5, atol=0.01)   # 5 sigma for 65536 draws
  u = np.asarray(jax.random.uniform(key, (65536,)))
  assert abs(u.mean() - 0.5) < 0.006 and abs(u.var() - 1 / 12) < 0.003


@tpu_op
@pytest.mark.parametrize("shape", RANDOM_SHAPES, ids=str)
def test_tpu_threefry_matches_jax_random(shape):
  """The kernel fuses jax's threefry counter mode: bits equal jax.random.bits'."""
  m = op("tpu/random/threefry")
  key_data = jnp.asarray(KEY, jnp.uint32)
  with jax.threefry_partitionable(True):
    want = jax.random.bits(jax.random.wrap_key_data(key_data, impl="threefry2x32"), shape,
                           jnp.uint32)
  np.testing.assert_array_equal(np.asarray(m.plthreefry_random_bits(key_data, 32, shape)),
                                np.asarray(want))


@tpu_op
@SLOW
def test_tpu_threefry_prng_impl():
  m = op("tpu/random/threefry")
  with jax.threefry_partitionable(True):
    ours = jax.random.key(7, impl=m.plthreefry_prng_impl)
    theirs = jax.random.key(7, impl="threefry2x32")
    for f in (lambda k: jax.random.bits(k, (300, 5)),
              lambda k: jax.random.uniform(k, (300, 5)),
              lambda k: jax.random.bits(jax.random.split(k)[1], (9, 260))):
      np.testing.assert_array_equal(np.asarray(f(ours)), np.asarray(f(theirs)))
    # The normal's erf_inv is XLA's float code, not the kernel's: XLA fuses it with the
    # kernel's (plain HLO) bits differently than with jax's threefry, which moves some
    # results by a few ulps. The bits and uniforms above are the kernel's contract.
    np.testing.assert_array_max_ulp(np.asarray(jax.random.normal(ours, (300, 5))),
                                    np.asarray(jax.random.normal(theirs, (300, 5))), maxulp=4)
