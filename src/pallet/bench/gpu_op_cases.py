"""The GPU op programs of issue 24: each pallet.ops call (and a user's k-loop matmul) at
the issue's shapes and two smaller ones, with what a user would call instead (cuDNN,
XLA, cuBLAS), a jax.numpy reference, and the FLOPs and bytes one call must move.

Shared by `python -m pallet.bench.gpu` (times them) and `python -m
pallet.bench.gpu_compile_stats` (compiles their kernels for sm_90, sm_80 and gfx942
without a GPU). Everything here is plain JAX 0.10-0.12 (the GPU machine runs 0.11).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import pallet as pl
from pallet import ops

BF16, F32 = jnp.bfloat16, jnp.float32
SIZES = ("full", "medium", "small", "tiny")   # full: the shapes; tiny: CPU smoke


def _same(*args):
  return args


def _unchanged(out):
  return out


@dataclasses.dataclass(frozen=True)
class Baseline:
  """What a user would call instead. `prepare` (untimed) puts the inputs in its layout,
  `finish` (untimed) its output in the reference's, for the check; `checked=False`:
  another computation of the same size (a dense matmul beside ragged_dot), timed only."""
  name: str
  run: Callable[..., Any]
  prepare: Callable[..., tuple] = _same
  finish: Callable[[Any], Any] = _unchanged
  gpu_only: bool = False   # cuDNN: no CPU implementation
  checked: bool = True


@dataclasses.dataclass(frozen=True)
class OpCase:
  """One program at one size. `unit` is "TFLOP/s" (rated by `flops`) or "GB/s" (by
  `bytes`). `kernels` names the pallas_calls the pallet program launches, in order,
  with the launch-table section each reads and its FLOPs (compile statistics)."""
  name: str
  op: str
  shape: str
  inputs: Callable[[jax.Array], tuple]
  pallet: Callable[..., Any]
  reference: Callable[..., Any]
  baselines: tuple[Baseline, ...]
  flops: float
  bytes: float
  unit: str
  tolerance: float = 2e-2
  kernels: tuple[tuple[str, str, float], ...] = ()

  def abstract_inputs(self) -> tuple:
    """The inputs as ShapeDtypeStructs (to trace without allocating)."""
    return jax.eval_shape(self.inputs, jax.random.key(0))


def _normal(key, shape, dtype=BF16, scale=1.0):
  return (jax.random.normal(key, shape, F32) * scale).astype(dtype)


def _nbytes(*shapes_dtypes) -> float:
  return float(sum(math.prod(s) * jnp.dtype(d).itemsize for s, d in shapes_dtypes))


def _fwd_bwd(fn: Callable[..., Any], n_diff: int) -> Callable[..., Any]:
  """fn's output and its VJP w.r.t. the first `n_diff` arguments for the cotangent
  passed last."""
  def run(*args):
    diff, rest, cot = args[:n_diff], args[n_diff:-1], args[-1]
    out, pull = jax.vjp(lambda *d: fn(*d, *rest), *diff)
    return out, pull(cot)
  return run


# ------------------------------------------------------------------ flash attention
_ATTN = {"full": (4, 16, 4096, 128), "medium": (4, 16, 1024, 128), "small": (2, 8, 512, 64),
         "tiny": (1, 2, 64, 32)}


def _bthd(*arrays):
  """pallet's (batch, heads, seq, d) <-> jax.nn.dot_product_attention's (batch, seq,
  heads, d), for every array of a pytree."""
  return jax.tree.map(lambda x: jnp.swapaxes(x, 1, 2), arrays)


def _bthd_out(out):
  return jax.tree.map(lambda x: jnp.swapaxes(x, 1, 2), out)


def _sdpa(implementation: str, causal: bool, backward: bool) -> Callable[..., Any]:
  def attend(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                        implementation=implementation)
  return _fwd_bwd(attend, 3) if backward else attend


def attention_cases(size: str) -> list[OpCase]:
  b, h, t, d = _ATTN[size]
  shape = f"B{b} H{h} T{t} D{d} bf16"
  pairs = t * (t + 1) / 2
  out = []
  for causal in (False, True):
    visible = pairs if causal else float(t * t)
    fwd_flops = 4.0 * b * h * d * visible
    io = _nbytes(*[((b, h, t, d), BF16)] * 4)
    tag = " causal" if causal else ""

    def inputs(key, backward=False):
      keys = jax.random.split(key, 4)
      qkv = tuple(_normal(k_, (b, h, t, d)) for k_ in keys[:3])
      return qkv + ((_normal(keys[3], (b, h, t, d)),) if backward else ())

    def pallet_fwd(q, k, v, causal=causal):
      return ops.flash_attention(q, k, v, causal=causal)

    def reference(q, k, v, causal=causal):
      return ops.attention_reference(q, k, v, causal=causal)

    out.append(OpCase(
        f"flash_attention fwd{tag}", "flash_attention", shape, inputs, pallet_fwd, reference,
        (Baseline("cuDNN", _sdpa("cudnn", causal, False), _bthd, _bthd_out, gpu_only=True),
         Baseline("XLA", _sdpa("xla", causal, False), _bthd, _bthd_out)),
        fwd_flops, io, "TFLOP/s",
        kernels=(("flash_attention_fwd", "fwd", fwd_flops),)))
    # fwd+bwd counted as 3.5x the forward (2.5x for the backward: its four products
    # and the recomputed scores), the convention of FlashAttention's and Triton's
    # benchmarks, for pallet and cuDNN alike.
    out.append(OpCase(
        f"flash_attention fwd+bwd{tag}", "flash_attention", shape,
        lambda key: inputs(key, True), _fwd_bwd(pallet_fwd, 3), _fwd_bwd(reference, 3),
        (Baseline("cuDNN", _sdpa("cudnn", causal, True), _bthd, _bthd_out, gpu_only=True),
         Baseline("XLA", _sdpa("xla", causal, True), _bthd, _bthd_out)),
        3.5 * fwd_flops, 2 * io + _nbytes(*[((b, h, t, d), BF16)] * 3), "TFLOP/s",
        tolerance=5e-2,
        kernels=(("flash_attention_fwd", "fwd", fwd_flops),
                 ("flash_attention_dq", "dq", 1.5 * fwd_flops),
                 ("flash_attention_dkv", "dkv", 2.0 * fwd_flops))))
  return out


# ------------------------------------------------------------------ linear cross-entropy
_CE = {"full": (4096, 2048, 32768), "medium": (2048, 1024, 16384), "small": (1024, 512, 8192),
       "tiny": (64, 32, 256)}


def _xla_cross_entropy(h, w, labels):
  """What a user writes without pallet: float32 logits held whole (TF32 dots)."""
  def loss(h, w):
    logits = jnp.dot(h, w, preferred_element_type=F32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    return jnp.mean(lse - picked)
  return jax.value_and_grad(loss, argnums=(0, 1))(h, w)


def cross_entropy_cases(size: str) -> list[OpCase]:
  n, hid, vocab = _CE[size]

  def inputs(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return (_normal(k1, (n, hid)), _normal(k2, (hid, vocab), scale=hid ** -0.5),
            jax.random.randint(k3, (n,), 0, vocab))

  def pallet_program(h, w, labels):
    return jax.value_and_grad(
        lambda h, w: ops.linear_cross_entropy(h, w, labels, reduction="mean"),
        argnums=(0, 1))(h, w)

  def reference(h, w, labels):
    return jax.value_and_grad(
        lambda h, w: ops.linear_cross_entropy_reference(h, w, labels, reduction="mean"),
        argnums=(0, 1))(h, w)

  product = 2.0 * n * hid * vocab
  return [OpCase(
      "linear_cross_entropy mean fwd+bwd", "linear_cross_entropy",
      f"n{n} h{hid} v{vocab} bf16", inputs, pallet_program, reference,
      (Baseline("XLA f32 logits", _xla_cross_entropy),),
      3 * product, _nbytes(((n, hid), BF16), ((hid, vocab), BF16)) * 2, "TFLOP/s",
      tolerance=5e-2,
      kernels=(("linear_cross_entropy_fwd", "fwd", product),
               ("linear_cross_entropy_dlogits", "dlogits", 0.0)))]


# ------------------------------------------------------------------ decode and paged attention
_DECODE = {"full": (32, 32, 8, 8192, 128), "medium": (16, 32, 8, 4096, 128),
           "small": (8, 16, 4, 2048, 64), "tiny": (2, 4, 2, 64, 32)}


def _xla_decode(q, k, v, lengths):
  """jax.nn.dot_product_attention (XLA) with one query token and per-sequence lengths."""
  return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                      implementation="xla")[:, 0]


def _decode_layout(q, k, v, lengths):
  return q[:, None], jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), lengths


def decode_cases(size: str) -> list[OpCase]:
  b, h, hkv, s, d = _DECODE[size]

  def inputs(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return (_normal(k1, (b, h, d)), _normal(k2, (b, hkv, s, d)), _normal(k3, (b, hkv, s, d)),
            jnp.full((b,), s, jnp.int32))

  cache = _nbytes(*[((b, hkv, s, d), BF16)] * 2)
  flops = 4.0 * b * h * s * d
  cases = [OpCase(
      "decode_attention", "decode_attention", f"b{b} h{h}/{hkv} s{s} d{d} bf16", inputs,
      ops.decode_attention, ops.decode_attention_reference,
      (Baseline("XLA", _xla_decode, _decode_layout),),
      flops, cache + _nbytes(((b, h, d), BF16)) * 2, "GB/s",
      kernels=(("decode_attention", "fwd", flops), ("flash_decoding_combine", "combine", 0.0)))]
  page = 16
  pages = s // page

  def paged_inputs(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    table = jax.random.permutation(k4, b * pages).reshape(b, pages).astype(jnp.int32)
    return (_normal(k1, (b, h, d)), _normal(k2, (hkv, b * pages, page, d)),
            _normal(k3, (hkv, b * pages, page, d)), jnp.full((b,), s, jnp.int32), table)

  cases.append(OpCase(
      "paged_attention", "paged_attention", f"b{b} h{h}/{hkv} s{s} d{d} page{page} bf16",
      paged_inputs, ops.paged_attention, ops.paged_attention_reference, (),
      flops, cache + _nbytes(((b, h, d), BF16)) * 2, "GB/s",
      kernels=(("paged_attention", "fwd", flops), ("flash_decoding_combine", "combine", 0.0))))
  return cases


# ------------------------------------------------------------------ ragged dot
_RAGGED = {"full": (16384, 4096, 4096, 8), "medium": (8192, 2048, 2048, 8),
           "small": (4096, 1024, 1024, 8), "tiny": (128, 32, 64, 4)}


def ragged_cases(size: str) -> list[OpCase]:
  m, k, n, g = _RAGGED[size]
  # uneven groups (one empty) that fill the m rows
  weights = jnp.array([5, 17, 0, 23, 3, 19, 13, 20][:g], F32)
  sizes = jnp.floor(weights / weights.sum() * m).astype(jnp.int32)
  sizes = sizes.at[-1].add(m - sizes.sum())

  def inputs(key, backward=False):
    k1, k2, k3 = jax.random.split(key, 3)
    args = (_normal(k1, (m, k)), _normal(k2, (g, k, n), scale=k ** -0.5), sizes)
    return args + ((_normal(k3, (m, n)),) if backward else ())

  def dense(lhs, rhs, group_sizes):
    return jnp.dot(lhs, rhs[0], preferred_element_type=F32).astype(BF16)

  def xla_ragged(lhs, rhs, group_sizes):
    return lax.ragged_dot(lhs, rhs, group_sizes)

  flops = 2.0 * m * k * n
  io = _nbytes(((m, k), BF16), ((g, k, n), BF16), ((m, n), BF16))
  shape = f"m{m} k{k} n{n} g{g} bf16"
  return [
      OpCase("ragged_dot", "ragged_dot", shape, inputs, ops.ragged_dot,
             ops.ragged_dot_reference,
             (Baseline("lax.ragged_dot", xla_ragged),
              Baseline("dense cuBLAS", dense, checked=False)),
             flops, io, "TFLOP/s", kernels=(("ragged_dot_gmm", "fwd", flops),)),
      OpCase("ragged_dot fwd+bwd", "ragged_dot", shape, lambda key: inputs(key, True),
             _fwd_bwd_ragged(ops.ragged_dot), _fwd_bwd_ragged(ops.ragged_dot_reference),
             (Baseline("lax.ragged_dot", _fwd_bwd_ragged(xla_ragged)),),
             3 * flops, 3 * io, "TFLOP/s", tolerance=5e-2,
             kernels=(("ragged_dot_gmm", "fwd", flops), ("ragged_dot_gmm", "dlhs", flops),
                      ("ragged_dot_tgmm", "drhs", flops))),
  ]


def _fwd_bwd_ragged(fn):
  def run(lhs, rhs, group_sizes, cot):
    out, pull = jax.vjp(lambda a, b: fn(a, b, group_sizes), lhs, rhs)
    return out, pull(cot)
  return run


# ------------------------------------------------------------------ a user's k-loop matmul
_MATMUL = {"full": (8192, (128, 256, 64)), "medium": (4096, (128, 256, 64)),
           "small": (2048, (128, 128, 64)), "tiny": (128, (32, 32, 16))}


def k_loop_matmul(m: int, tiles: tuple[int, int, int], backend: str | None = None):
  """What a user writes: one program per (tm, tn) output tile, looping over k in tk
  steps, float32 accumulation."""
  tm, tn, tk = tiles

  def kernel(x_ref, y_ref, o_ref):
    def step(kk, acc):
      return acc + jnp.dot(x_ref[:, pl.ds(kk * tk, tk)], y_ref[pl.ds(kk * tk, tk), :],
                           preferred_element_type=F32)
    o_ref[...] = lax.fori_loop(0, m // tk, step, jnp.zeros((tm, tn), F32)).astype(o_ref.dtype)

  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((m, m), BF16), grid=(m // tm, m // tn),
      in_specs=[pl.BlockSpec((tm, m), lambda i, j: (i, 0)),
                pl.BlockSpec((m, tn), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)), name="k_loop_matmul",
      backend=backend)


def matmul_cases(size: str) -> list[OpCase]:
  m, tiles = _MATMUL[size]

  def inputs(key):
    k1, k2 = jax.random.split(key)
    return _normal(k1, (m, m)), _normal(k2, (m, m), scale=m ** -0.5)

  def cublas(x, y):
    return jnp.dot(x, y, preferred_element_type=F32).astype(BF16)

  def reference(x, y):
    return jnp.dot(x.astype(F32), y.astype(F32), precision=lax.Precision.HIGHEST).astype(BF16)

  return [OpCase(f"k-loop matmul {'x'.join(map(str, tiles))}", "matmul", f"{m}^3 bf16", inputs,
                 lambda x, y: k_loop_matmul(m, tiles)(x, y), reference,
                 (Baseline("cuBLAS", cublas),), 2.0 * m ** 3,
                 _nbytes(*[((m, m), BF16)] * 3), "TFLOP/s")]


# ------------------------------------------------------------------ row-wise ops
_ROWS = {"full": (16384, 8192), "medium": (8192, 4096), "small": (4096, 2048), "tiny": (64, 256)}


def row_cases(size: str) -> list[OpCase]:
  n, d = _ROWS[size]
  shape = f"{n}x{d} bf16"

  def inputs(key, backward=False):
    k1, k2, k3 = jax.random.split(key, 3)
    return (_normal(k1, (n, d)), _normal(k2, (d,))) + (
        (_normal(k3, (n, d)),) if backward else ())

  rows = _nbytes(((n, d), BF16))
  programs = {
      "rms_norm": (lambda x, w: ops.rms_norm(x, w), lambda x, w: ops.rms_norm_reference(x, w)),
      "layer_norm": (lambda x, w: ops.layer_norm(x, w, w),
                     lambda x, w: ops.layer_norm_reference(x, w, w)),
      "softmax": (lambda x, w: ops.softmax(x), lambda x, w: ops.softmax_reference(x)),
  }
  out = []
  for name, (run, ref) in programs.items():
    out.append(OpCase(name, name, shape, inputs, run, ref, (Baseline("XLA", ref),),
                      0.0, 2 * rows, "GB/s", kernels=((f"{name}_fwd", "fwd", 0.0),)))
    out.append(OpCase(f"{name} fwd+bwd", name, shape, lambda key: inputs(key, True),
                      _fwd_bwd(run, 2), _fwd_bwd(ref, 2), (Baseline("XLA", _fwd_bwd(ref, 2)),),
                      0.0, 5 * rows, "GB/s", tolerance=5e-2,
                      kernels=((f"{name}_fwd", "fwd", 0.0), (f"{name}_bwd", "bwd", 0.0))))
  a_b = _nbytes(((n, d), BF16))
  out.append(OpCase(
      "swiglu fwd+bwd", "glu", shape,
      lambda key: (_normal(key, (n, d)), _normal(jax.random.fold_in(key, 1), (n, d)),
                   _normal(jax.random.fold_in(key, 2), (n, d))),
      _fwd_bwd(ops.swiglu, 2), _fwd_bwd(ops.swiglu_reference, 2),
      (Baseline("XLA", _fwd_bwd(ops.swiglu_reference, 2)),), 0.0, 8 * a_b, "GB/s",
      tolerance=5e-2, kernels=(("glu_silu_fwd", "fwd", 0.0), ("glu_silu_bwd", "bwd", 0.0))))
  heads = max(1, d // 256)
  rope_shape = (4, n // 4, heads, d // heads)
  out.append(OpCase(
      "rotary_embedding fwd+bwd", "rotary_embedding",
      f"{'x'.join(map(str, rope_shape))} bf16",
      lambda key: (_normal(key, rope_shape), _normal(jax.random.fold_in(key, 1), rope_shape)),
      _fwd_bwd(ops.rotary_embedding, 1), _fwd_bwd(ops.rotary_embedding_reference, 1),
      (Baseline("XLA", _fwd_bwd(ops.rotary_embedding_reference, 1)),), 0.0, 4 * rows,
      "GB/s", tolerance=5e-2, kernels=(("rope_fwd", "fwd", 0.0), ("rope_bwd", "fwd", 0.0))))
  return out


def all_cases(size: str) -> list[OpCase]:
  """Every program at one size, in the order the benchmark prints them."""
  if size not in SIZES:
    raise ValueError(f"size {size!r} is not one of {SIZES}")
  return (attention_cases(size) + cross_entropy_cases(size) + decode_cases(size)
          + ragged_cases(size) + matmul_cases(size) + row_cases(size))
