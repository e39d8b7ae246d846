"""Flash attention (forward and backward kernels) with causal masks, segment ids,
grouped-query / multi-query heads, a sliding window and a logit soft-cap.

q: (batch, heads, q_len, head_dim); k, v: (batch, kv_heads, kv_len, head_dim), with
heads a multiple of kv_heads (query head h reads kv head h // (heads // kv_heads)).
Scores s = q k^T * scale, then cap * tanh(s / cap) with a soft-cap, masked where a key
is after the query (causal), at least `window` positions before it, or in another
segment; rows with no visible key give 0. Positions count from 0 in q and in k.

Forward: grid (batch, heads, query blocks), every step independent; a loop over the
key blocks the masks leave visible keeps a running max, sum and output (online
softmax) and saves the row log-sum-exp. Backward (FlashAttention-2): a dq kernel over
(batch, head, query block) looping over key blocks, which also forms delta = rowsum(o *
do) once per query block and saves it, and a dk/dv kernel over (batch, kv head, key
block) looping over the query blocks of every query head in the group, its scores
computed transposed (keys along the rows, as its products p^T do and ds^T q take
them); both recompute the probabilities from the saved log-sum-exp.
Every pass visits only the blocks a causal mask or window leaves visible (loop bounds
from the block indices), and masks only the blocks on a mask's edge (the diagonal,
the window's far edge, the block holding the last key; every block with segment ids):
the blocks in between run without building a mask.
FLOPs per visible (query, key) pair, head_dim d: forward 4d (q k^T, p v); dq 6d
(q k^T and do v^T recomputed, ds k); dk/dv 8d (k q^T, v do^T, p^T do, ds^T q).
Sequences that the blocks do not divide are padded (and masked) to whole blocks.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

import pallet as pl
from pallet.ops import launch_table
from pallet.ops._common import (F32, cdiv, check_block, check_float, fail,
                                online_softmax_start, online_softmax_step)

__all__ = ["flash_attention", "attention_reference"]

_NT = (((1,), (1,)), ((), ()))   # a @ b^T
_TN = (((0,), (0,)), ((), ()))   # a^T @ b


@dataclasses.dataclass(frozen=True)
class _Pass:
  """The tiles and launch parameters of one kernel (forward, dq or dk/dv)."""
  block_q: int
  block_k: int
  params: object = None   # the pallas_call's compiler params (None: the backend's own)


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static facts of one call (hashable: a custom_vjp non-differentiable argument).
  block_q/block_k are those of the kernel being built: `for_pass` switches them."""
  scale: float
  causal: bool
  window: int | None
  softcap: float | None
  q_len: int
  kv_len: int
  groups: int
  block_q: int
  block_k: int
  segments: bool
  fwd: _Pass
  dq: _Pass
  dkv: _Pass

  def for_pass(self, p: _Pass) -> "_Config":
    return dataclasses.replace(self, block_q=p.block_q, block_k=p.block_k)


# ------------------------------------------------------------------ reference
def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *,
                        q_segment_ids: jax.Array | None = None,
                        kv_segment_ids: jax.Array | None = None, causal: bool = False,
                        window: int | None = None, softcap: float | None = None,
                        scale: float | None = None) -> jax.Array:
  """jax.numpy attention with the same masks (float32 math, q's dtype out)."""
  b, h, t, d = q.shape
  groups = h // k.shape[1]
  scale = 1.0 / math.sqrt(d) if scale is None else scale
  kf = jnp.repeat(k.astype(F32), groups, axis=1)
  vf = jnp.repeat(v.astype(F32), groups, axis=1)
  s = jnp.einsum("bhtd,bhsd->bhts", q.astype(F32), kf, precision=lax.Precision.HIGHEST) * scale
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  mask = _mask(jnp.arange(t)[:, None], jnp.arange(k.shape[2])[None, :], causal, window)
  mask = jnp.broadcast_to(mask, (b, 1, t, k.shape[2]))
  if q_segment_ids is not None:
    mask = mask & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bhts,bhsd->bhtd", p, vf, precision=lax.Precision.HIGHEST)
  return (o / jnp.where(l == 0, 1.0, l)).astype(q.dtype)


def _mask(q_pos, k_pos, causal, window):
  mask = jnp.ones(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), bool)
  if causal:
    mask = mask & (k_pos <= q_pos)
  if window is not None:
    mask = mask & (q_pos - k_pos < window)
  return mask


# ------------------------------------------------------------------ shared in-kernel math
def _capped(s, c: _Config):
  """Scaled scores, soft-capped, and the cap's tanh (for the backward; None without a cap)."""
  s = s * c.scale
  if c.softcap is None:
    return s, None
  t = jnp.tanh(s / c.softcap)
  return c.softcap * t, t


def _visible(q_pos, k_pos, c: _Config, q_seg, k_seg):
  mask = _mask(q_pos, k_pos, c.causal, c.window) & (k_pos < c.kv_len)
  if c.segments:
    mask = mask & (q_seg == k_seg)
  return mask


def _scores(q, k, c: _Config, masked: bool, q_start, k_start, q_seg=None, k_seg=None):
  """The (block_q, block_k) scores of q against k, soft-capped, and the cap's tanh;
  `masked`: -inf where a key is not visible (only blocks on a mask's edge need it)."""
  s, t = _capped(lax.dot_general(q, k, _NT, preferred_element_type=F32), c)
  if masked:
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, s.shape, 0)
    k_pos = k_start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    segs = (q_seg[:, None], k_seg[None, :]) if c.segments else (None, None)
    s = jnp.where(_visible(q_pos, k_pos, c, *segs), s, -jnp.inf)
  return s, t


def _scores_t(k, q, c: _Config, masked: bool, k_start, q_start, k_seg=None, q_seg=None):
  """The same scores transposed, (block_k, block_q): keys along the rows, so that the
  dk/dv pass's products (p^T do, ds^T q) take them as they are (no register transpose)."""
  s, t = _capped(lax.dot_general(k, q, _NT, preferred_element_type=F32), c)
  if masked:
    k_pos = k_start + lax.broadcasted_iota(jnp.int32, s.shape, 0)
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    segs = (q_seg[None, :], k_seg[:, None]) if c.segments else (None, None)
    s = jnp.where(_visible(q_pos, k_pos, c, *segs), s, -jnp.inf)
  return s, t


# Block ranges. Python ints where they do not depend on the program (no causal mask or
# window): the loops then have static trip counts, and an empty one is not emitted.
def _static(*xs) -> bool:
  return all(isinstance(x, int) for x in xs)


def _min(a, b):
  return min(a, b) if _static(a, b) else jnp.minimum(a, b)


def _max(a, b):
  return max(a, b) if _static(a, b) else jnp.maximum(a, b)


def _ceil(a, b: int):
  """ceil(a / b) for an int or traced int a of any sign."""
  return -((-a) // b)


def _ordered(lo, full_lo, full_hi, hi):
  """The ranges clamped so that lo <= full_lo <= full_hi <= hi."""
  hi = _max(hi, lo)
  full_lo = _min(_max(full_lo, lo), hi)
  full_hi = _min(_max(full_hi, full_lo), hi)
  return lo, full_lo, full_hi, hi


def _key_ranges(c: _Config, i, num_k_blocks: int):
  """(lo, full_lo, full_hi, hi) for query block i: it sees key blocks [lo, hi), and
  every query of it sees every key of blocks [full_lo, full_hi) (no mask needed);
  blocks past the last key are skipped."""
  bq, bk = c.block_q, c.block_k
  lo, full_lo = 0, 0
  hi, full_hi = min(num_k_blocks, cdiv(c.kv_len, bk)), c.kv_len // bk
  if c.causal:      # keys at or before the query: up to the block's last row
    hi = _min(hi, _ceil((i + 1) * bq, bk))
    full_hi = _min(full_hi, (i * bq + 1) // bk)
  if c.window is not None:   # keys after query - window: from the block's first row
    lo = _max(0, (i * bq - c.window + 1) // bk)
    full_lo = _max(0, _ceil(i * bq + bq - c.window, bk))
  if c.segments:    # segment ids can hide any key: every block is masked
    full_lo = full_hi = hi
  return _ordered(lo, full_lo, full_hi, hi)


def _query_ranges(c: _Config, j, num_q_blocks: int, num_k_blocks: int):
  """(lo, full_lo, full_hi, hi) for key block j: the query blocks that see any of its
  keys are [lo, hi), those whose every query sees all of them [full_lo, full_hi).
  Query blocks wholly past q_len and key blocks wholly past kv_len (padding) are
  skipped."""
  bq, bk = c.block_q, c.block_k
  lo, full_lo = 0, 0
  hi = full_hi = min(num_q_blocks, cdiv(c.q_len, bq))
  if c.causal:
    lo = (j * bk) // bq
    full_lo = _ceil(j * bk + bk - 1, bq)
  if c.window is not None:
    hi = _min(hi, _ceil(j * bk + bk + c.window - 1, bq))
    full_hi = _min(full_hi, _ceil(j * bk + c.window - bq + 1, bq))
  if c.kv_len % bk:   # the block holding the last key: masked for every query
    full_hi = jnp.where((j + 1) * bk > c.kv_len, 0, full_hi)
  if num_k_blocks > cdiv(c.kv_len, bk):   # blocks of padding only: seen by none
    hi = jnp.where(j * bk >= c.kv_len, lo, hi)
  if c.segments:
    full_lo = full_hi = hi
  return _ordered(lo, full_lo, full_hi, hi)


def _loop(lo, hi, body, carry):
  """fori_loop(lo, hi, body, carry), nothing where the range is statically empty."""
  if _static(lo, hi) and hi <= lo:
    return carry
  return lax.fori_loop(lo, hi, body, carry)


def _masked_loops(ranges, step, carry):
  """step(masked)'s body over the blocks of `ranges`: masked on the edges, unmasked
  in between."""
  lo, full_lo, full_hi, hi = ranges
  carry = _loop(lo, full_lo, step(True), carry)
  carry = _loop(full_lo, full_hi, step(False), carry)
  return _loop(full_hi, hi, step(True), carry)


# ------------------------------------------------------------------ forward
def _forward_kernel(c: _Config):
  def kernel(*refs):
    if c.segments:
      q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref = refs
    else:
      (q_ref, k_ref, v_ref, o_ref, lse_ref), qs_ref, ks_ref = refs, None, None
    i = pl.program_id(2)
    q = q_ref[...]
    q_seg = qs_ref[...] if c.segments else None
    bq, d = q.shape

    def step(masked):
      def body(j, carry):
        keys = pl.ds(j * c.block_k, c.block_k)
        s, _ = _scores(q, k_ref[keys, :], c, masked, i * c.block_q, j * c.block_k, q_seg,
                       ks_ref[keys] if c.segments else None)
        return online_softmax_step(carry, s, v_ref[keys, :])
      return body

    ranges = _key_ranges(c, i, k_ref.shape[0] // c.block_k)
    m, l, acc = _masked_loops(ranges, step, online_softmax_start(bq, d))
    empty = l == 0.0
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    # Rows with no visible key: +inf makes every recomputed probability exp(s - lse) 0.
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))

  return kernel


def _segment_args(c, q_seg, kv_seg, q_spec, kv_spec):
  if not c.segments:
    return [], []
  return [q_seg, kv_seg], [q_spec, kv_spec]


def _forward(q, k, v, q_seg, kv_seg, c: _Config):
  c = c.for_pass(c.fwd)
  b, h, t, d = q.shape
  s = k.shape[2]
  q_spec = pl.BlockSpec((None, None, c.block_q, d), lambda bi, hi, i: (bi, hi, i, 0))
  kv_spec = pl.BlockSpec((None, None, s, d), lambda bi, hi, i: (bi, hi // c.groups, 0, 0))
  lse_spec = pl.BlockSpec((None, None, c.block_q), lambda bi, hi, i: (bi, hi, i))
  seg_args, seg_specs = _segment_args(
      c, q_seg, kv_seg, pl.BlockSpec((None, c.block_q), lambda bi, hi, i: (bi, i)),
      pl.BlockSpec((None, s), lambda bi, hi, i: (bi, 0)))
  return pl.pallas_call(
      _forward_kernel(c),
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t), F32)],
      grid=(b, h, t // c.block_q), in_specs=[q_spec, kv_spec, kv_spec, *seg_specs],
      out_specs=[q_spec, lse_spec], name="flash_attention_fwd",
      compiler_params=c.fwd.params)(q, k, v, *seg_args)


# ------------------------------------------------------------------ backward
def _dq_kernel(c: _Config):
  def kernel(*refs):
    q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref = refs[:6]
    qs_ref, ks_ref = (refs[6], refs[7]) if c.segments else (None, None)
    dq_ref, delta_ref = refs[-2:]
    i = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    # delta = rowsum(do * o), once per query block; the dk/dv pass reads it from here.
    delta = jnp.sum(o_ref[...].astype(F32) * do.astype(F32), axis=1)
    delta_ref[...] = delta
    lse = lse_ref[...]
    q_seg = qs_ref[...] if c.segments else None

    def step(masked):
      def body(j, dq):
        keys = pl.ds(j * c.block_k, c.block_k)
        k = k_ref[keys, :]
        s, t = _scores(q, k, c, masked, i * c.block_q, j * c.block_k, q_seg,
                       ks_ref[keys] if c.segments else None)
        p = jnp.exp(s - lse[:, None])
        dp = lax.dot_general(do, v_ref[keys, :], _NT, preferred_element_type=F32)
        ds = p * (dp - delta[:, None])
        if t is not None:
          ds = ds * (1.0 - t * t)
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=F32)
      return body

    ranges = _key_ranges(c, i, k_ref.shape[0] // c.block_k)
    dq = _masked_loops(ranges, step, jnp.zeros(q.shape, F32))
    dq_ref[...] = (dq * c.scale).astype(dq_ref.dtype)

  return kernel


def _dkv_kernel(c: _Config):
  def kernel(*refs):
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    qs_ref, ks_ref = (refs[6], refs[7]) if c.segments else (None, None)
    dk_ref, dv_ref = refs[-2:]
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    k_seg = ks_ref[...] if c.segments else None
    ranges = _query_ranges(c, j, q_ref.shape[1] // c.block_q,
                            pl.num_programs(2))

    def step(g, masked):
      def body(i, carry):
        dk, dv = carry
        rows = pl.ds(i * c.block_q, c.block_q)
        q, do = q_ref[g, rows, :], do_ref[g, rows, :]
        st, tt = _scores_t(k, q, c, masked, j * c.block_k, i * c.block_q, k_seg,
                           qs_ref[rows] if c.segments else None)
        pt = jnp.exp(st - lse_ref[g, rows][None, :])
        dv = dv + jnp.dot(pt.astype(do.dtype), do, preferred_element_type=F32)
        dpt = lax.dot_general(v, do, _NT, preferred_element_type=F32)
        dst = pt * (dpt - delta_ref[g, rows][None, :])
        if tt is not None:
          dst = dst * (1.0 - tt * tt)
        return dk + jnp.dot(dst.astype(q.dtype), q, preferred_element_type=F32), dv
      return body

    def group(g, carry):   # the query heads sharing this kv head, one after another
      return _masked_loops(ranges, functools.partial(step, g), carry)

    zeros = jnp.zeros(k.shape, F32)
    if c.groups == 1:
      dk, dv = group(0, (zeros, zeros))
    else:
      dk, dv = lax.fori_loop(0, c.groups, group, (zeros, zeros))
    dk_ref[...] = (dk * c.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)

  return kernel


def _backward(q, k, v, o, lse, do, q_seg, kv_seg, config: _Config):
  b, h, t, d = q.shape
  hkv, s = k.shape[1], k.shape[2]
  g = config.groups
  c = config.for_pass(config.dq)
  # dq (and delta): one program per (batch, head, query block), looping over key blocks.
  q_spec = pl.BlockSpec((None, None, c.block_q, d), lambda bi, hi, i: (bi, hi, i, 0))
  kv_spec = pl.BlockSpec((None, None, s, d), lambda bi, hi, i: (bi, hi // g, 0, 0))
  row_spec = pl.BlockSpec((None, None, c.block_q), lambda bi, hi, i: (bi, hi, i))
  seg_args, seg_specs = _segment_args(
      c, q_seg, kv_seg, pl.BlockSpec((None, c.block_q), lambda bi, hi, i: (bi, i)),
      pl.BlockSpec((None, s), lambda bi, hi, i: (bi, 0)))
  dq, delta = pl.pallas_call(
      _dq_kernel(c), out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                                jax.ShapeDtypeStruct((b, h, t), F32)],
      grid=(b, h, t // c.block_q),
      in_specs=[q_spec, kv_spec, kv_spec, q_spec, q_spec, row_spec, *seg_specs],
      out_specs=[q_spec, row_spec], name="flash_attention_dq",
      compiler_params=c.dq.params)(q, k, v, o, do, lse, *seg_args)
  # dk, dv: one program per (batch, kv head, key block), looping over the group's
  # query heads and the query blocks that see the key block.
  c = config.for_pass(config.dkv)
  group_spec = pl.BlockSpec((None, g, t, d), lambda bi, hi, j: (bi, hi, 0, 0))
  group_rows = pl.BlockSpec((None, g, t), lambda bi, hi, j: (bi, hi, 0))
  kv_block = pl.BlockSpec((None, None, c.block_k, d), lambda bi, hi, j: (bi, hi, j, 0))
  seg_args, seg_specs = _segment_args(
      c, q_seg, kv_seg, pl.BlockSpec((None, t), lambda bi, hi, j: (bi, 0)),
      pl.BlockSpec((None, c.block_k), lambda bi, hi, j: (bi, j)))
  dk, dv = pl.pallas_call(
      _dkv_kernel(c), out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      grid=(b, hkv, s // c.block_k),
      in_specs=[group_spec, kv_block, kv_block, group_spec, group_rows, group_rows,
                *seg_specs],
      out_specs=[kv_block, kv_block], name="flash_attention_dkv",
      compiler_params=c.dkv.params)(q, k, v, do, lse, delta, *seg_args)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, q_seg, kv_seg, c):
  return _forward(q, k, v, q_seg, kv_seg, c)[0]


def _attention_fwd(q, k, v, q_seg, kv_seg, c):
  o, lse = _forward(q, k, v, q_seg, kv_seg, c)
  return o, (q, k, v, q_seg, kv_seg, o, lse)


def _attention_bwd(c, saved, do):
  q, k, v, q_seg, kv_seg, o, lse = saved
  dq, dk, dv = _backward(q, k, v, o, lse, do, q_seg, kv_seg, c)
  return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# The CPU backend's blocks (the Triton backend's come from pallet.ops.launch_table): a
# sequence of up to _CPU_WHOLE_ROWS rows is one block, a longer one is cut into
# _CPU_BLOCK rows. Short sequences cut into 128-row blocks ran no faster (their block
# skipping saves little) but compiled 3-4x slower: each query block's masked and
# unmasked key loops are XLA while loops (docs/ops/flash_attention.md, measured at 256
# to 1024 rows); from 512 rows one block runs 1.3x slower and more.
_CPU_BLOCK = 128
_CPU_WHOLE_ROWS = 384


def cpu_block(rows: int) -> int:
  """The CPU backend's default block of a sequence of `rows` rows."""
  return rows if rows <= _CPU_WHOLE_ROWS else _CPU_BLOCK


def _padded(length: int, blocks: list[int]) -> int:
  """`length` rounded up to a multiple of every block."""
  step = functools.reduce(math.lcm, blocks)
  return cdiv(length, step) * step


def _pad(x, axis, size, value=0):
  if x is None or x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                    q_segment_ids: jax.Array | None = None,
                    kv_segment_ids: jax.Array | None = None, causal: bool = False,
                    window: int | None = None, softcap: float | None = None,
                    scale: float | None = None, block_q: int | None = None,
                    block_k: int | None = None) -> jax.Array:
  """softmax(mask(cap(q k^T * scale))) v per head; see the module docstring.

  q (batch, heads, q_len, d); k, v (batch, kv_heads, kv_len, d), heads a multiple of
  kv_heads (GQA; kv_heads=1 is MQA). `q_segment_ids` (batch, q_len) and
  `kv_segment_ids` (batch, kv_len): a query sees only keys of its segment.
  `window`: a query at position i sees keys at i - window < j (and j <= i if causal).
  `softcap`: scores become softcap * tanh(s / softcap). Default scale 1/sqrt(d).
  `block_q`/`block_k`: query/key rows per tile of every pass (forward, dq, dk/dv);
  by default on the CPU the whole sequence up to 384 rows, else 128, and, on Triton, per pass from the GPU's launch table
  (pallet.ops.launch_table, docs/ops/gpu_defaults.md) with its num_warps/num_stages.
  Differentiable in q, k and v.
  """
  op = "flash_attention"
  for name, x in (("q", q), ("k", k), ("v", v)):
    check_float(op, name, x)
    if x.ndim != 4:
      raise fail(op, f"{name} must be (batch, heads, seq, head_dim), got shape {x.shape}")
  b, h, t, d = q.shape
  if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
    raise fail(op, f"k and v must both be (batch={b}, kv_heads, kv_len, head_dim={d}), got "
                   f"{k.shape} and {v.shape}")
  if h % k.shape[1]:
    raise fail(op, f"q's {h} heads are not a multiple of k's {k.shape[1]} kv heads")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise fail(op, "give both q_segment_ids and kv_segment_ids, or neither")
  s = k.shape[2]
  if q_segment_ids is not None:
    if q_segment_ids.shape != (b, t) or kv_segment_ids.shape != (b, s):
      raise fail(op, f"segment ids must be ({b}, {t}) and ({b}, {s}), got "
                     f"{q_segment_ids.shape} and {kv_segment_ids.shape}")
  if window is not None and (not isinstance(window, int) or window < 1):
    raise fail(op, f"window must be a positive int or None, got {window!r}")
  if softcap is not None and not softcap > 0:
    raise fail(op, f"softcap must be positive or None, got {softcap!r}")
  for name, value in (("block_q", block_q), ("block_k", block_k)):
    if value is not None:
      check_block(op, name, value)
  launch = launch_table.lookup(op, causal=bool(causal or window is not None), head_dim=d,
                               itemsize=jnp.dtype(q.dtype).itemsize)
  explicit = block_q is not None or block_k is not None
  passes = {}
  for section in ("fwd", "dq", "dkv"):
    passes[section] = _Pass(block_q or launch.get(section, "block_q", cpu_block(t)),
                            block_k or launch.get(section, "block_k", cpu_block(s)),
                            launch.compiler_params(section, explicit=explicit))
  # Padded to whole blocks of every pass (powers of two divide the largest).
  t_pad = _padded(t, [p.block_q for p in passes.values()])
  s_pad = _padded(s, [p.block_k for p in passes.values()])
  fwd = passes["fwd"]
  c = _Config(scale=float(1.0 / math.sqrt(d) if scale is None else scale), causal=bool(causal),
              window=window, softcap=None if softcap is None else float(softcap), q_len=t,
              kv_len=s, groups=h // k.shape[1], block_q=fwd.block_q, block_k=fwd.block_k,
              segments=q_segment_ids is not None, **passes)
  segs = (None, None)
  if c.segments:
    segs = (_pad(q_segment_ids.astype(jnp.int32), 1, t_pad),
            _pad(kv_segment_ids.astype(jnp.int32), 1, s_pad))
  o = _attention(_pad(q, 2, t_pad), _pad(k, 2, s_pad), _pad(v, 2, s_pad), *segs, c)
  return o[:, :, :t]
