"""A kernel's own algorithm written in jax.numpy: how much of a row's ratio is the algorithm.

The jax.numpy twin of a row (`jax_op_cases.py`) is the plainest program for the op's
result. Some kernels compute that result by an algorithm built for a GPU's parallelism
that does more work on any machine. JAX's GPU decode attention is one: it pads each kv
head's query heads up to `block_h` rows (16) and splits the keys into `k_splits` partial
softmaxes, which a log-sum-exp step after the kernel combines (flash decoding). At the
size of JAX's tests that is 2x (mqa: 8 heads in a block of 16) or 4x (gqa: 4 query heads
per kv head in a block of 16) the plain twin's arithmetic, in smaller products.

JAX's TPU flash attention and splash attention, causal, compute softmax attention block
by block: for each 128-row query block, an online softmax (running max, sum and output,
rescaled at every key block) over the 128-key blocks at or below the diagonal, the
blocks above it skipped. That is fewer flops than the plain twin's full masked softmax
but in many small products with a rescale per block.

This module writes those algorithms in jax.numpy, with no pallet and no Pallas, so that a
row's ratio splits into pallet/algorithm (what pallet adds) and algorithm/plain (what the
kernel's algorithm costs on this machine):

    python -m pallet.bench.algorithm_twins --size test --rounds 21
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallet.bench import jax_op_cases
from pallet.bench.case import SIZES, Benchmark, Size

HIGHEST = jax.lax.Precision.HIGHEST


def split_decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                           block_h: int, k_splits: int, sm_scale: float) -> jax.Array:
  """Flash decoding as JAX's GPU decode kernel computes it, for every kv head at once.

  q: [batch, kv_heads, heads_per_kv, d]; k, v: [batch, kv_heads, seq, d]; lengths: [batch].
  Query heads are padded to a multiple of `block_h`, keys are cut into `k_splits` equal
  splits, each split's masked softmax is kept unnormalised with its max and sum, and the
  splits are combined by their maxima (the op's own step after its `pallas_call`).
  """
  batch, kv_heads, heads, d = q.shape
  seq = k.shape[2]
  padded = -(-heads // block_h) * block_h
  q = jnp.pad(q, ((0, 0), (0, 0), (0, padded - heads), (0, 0)))
  split = seq // k_splits
  k = k.reshape(batch, kv_heads, k_splits, split, d)
  v = v.reshape(batch, kv_heads, k_splits, split, d)
  logits = jnp.einsum("bghd,bgjsd->bgjhs", q, k, precision=HIGHEST) * sm_scale
  positions = jnp.arange(seq).reshape(k_splits, split)
  visible = positions[None, :, None, :] < lengths[:, None, None, None]
  logits = jnp.where(visible[:, None], logits, 0.7 * jnp.finfo(jnp.float32).min)
  split_max = logits.max(-1)
  weights = jnp.exp(logits - split_max[..., None])
  split_sum = weights.sum(-1)
  split_out = jnp.einsum("bgjhs,bgjsd->bgjhd", weights, v, precision=HIGHEST)
  overall_max = jax.lax.optimization_barrier(split_max.max(2))
  correction = jnp.exp(split_max - overall_max[:, :, None])
  total = (split_sum * correction).sum(2)
  out = (split_out * correction[..., None]).sum(2)
  return (out / (total[..., None] + jnp.finfo(jnp.float32).eps))[:, :, :heads]


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block_q: int,
                        block_k: int, scale: float = 1.0, causal: bool = True,
                        segment_ids: jax.Array | None = None) -> jax.Array:
  """Softmax attention as the TPU flash / splash kernels compute it: key block by key block.

  q, k, v: [..., seq, d]. For each key block in order, every query block that sees it
  (causal: those at or below the diagonal; blocks above it are skipped, as the kernels'
  `pl.when` and block masks skip them) updates its running max, sum and unnormalised
  output (online softmax); the output is divided by the sum at the end. All query
  blocks are computed together, as the kernels' parallel query axis runs them.
  `segment_ids` ([batch, seq], q and k [batch, heads, seq, d]): a query sees only keys
  of its own segment, masked per block as the kernel masks them.
  """
  *lead, seq, d = q.shape
  n_q = seq // block_q
  q_blocks = q.reshape(*lead, n_q, block_q, d)
  rows = jnp.arange(seq).reshape(n_q, block_q)
  masked = 0.7 * jnp.finfo(jnp.float32).min
  m = jnp.full((*lead, n_q, block_q), -jnp.inf, jnp.float32)
  total = jnp.zeros((*lead, n_q, block_q), jnp.float32)
  acc = jnp.zeros((*lead, n_q, block_q, d), jnp.float32)
  for j in range(seq // block_k):
    first = (j * block_k) // block_q if causal else 0   # first query block that sees block j
    keys = slice(j * block_k, (j + 1) * block_k)
    s = jnp.einsum("...iqd,...kd->...iqk", q_blocks[..., first:, :, :], k[..., keys, :],
                   precision=HIGHEST) * scale
    if causal:
      visible = rows[first:, :, None] >= jnp.arange(keys.start, keys.stop)
      s = jnp.where(visible, s, masked)
    if segment_ids is not None:
      q_ids = segment_ids.reshape(-1, n_q, block_q)[:, first:]
      same = q_ids[..., None] == segment_ids[:, None, None, keys]   # [batch, n_q, bq, bk]
      s = jnp.where(same[:, None], s, masked)
    m_new = jnp.maximum(m[..., first:, :], s.max(-1))
    correction = jnp.exp(m[..., first:, :] - m_new)
    p = jnp.exp(s - m_new[..., None])
    total = total.at[..., first:, :].set(correction * total[..., first:, :] + p.sum(-1))
    acc = acc.at[..., first:, :, :].set(
        correction[..., None] * acc[..., first:, :, :]
        + jnp.einsum("...iqk,...kd->...iqd", p, v[..., keys, :], precision=HIGHEST))
    m = m.at[..., first:, :].set(m_new)
  return (acc / total[..., None]).reshape(*lead, seq, d).astype(q.dtype)


def _tpu_flash(size: Size, *, causal: bool, segments: bool = False) -> Callable[..., jax.Array]:
  def twin(q, k, v):
    ids = jax_op_cases.segment_halves(q.shape[0], q.shape[2]) if segments else None
    return blockwise_attention(q, k, v, block_q=jax_op_cases.TPU_ATTENTION_BLOCK,
                               block_k=jax_op_cases.TPU_ATTENTION_BLOCK,
                               scale=q.shape[-1] ** -0.5, causal=causal, segment_ids=ids)
  return twin


def _tpu_splash_causal(size: Size) -> Callable[..., jax.Array]:
  def twin(q, k, v):   # the splash kernel does not scale the logits
    return blockwise_attention(q, k, v, block_q=jax_op_cases.TPU_ATTENTION_BLOCK,
                               block_k=jax_op_cases.TPU_ATTENTION_BLOCK)
  return twin


def _mqa(size: Size) -> Callable[..., jax.Array]:
  splits = jax_op_cases.DECODE_MQA_SIZES[size][4]

  def twin(q, k, v, lengths):   # one kv head
    return split_decode_attention(q[:, None], k[:, None], v[:, None], lengths,
                                  block_h=jax_op_cases.DECODE_BLOCK_H, k_splits=splits,
                                  sm_scale=q.shape[-1] ** -0.5)[:, 0]
  return twin


def _gqa(size: Size) -> Callable[..., jax.Array]:
  splits = jax_op_cases.DECODE_GQA_SIZES[size][5]

  def twin(q, k, v, lengths):
    batch, heads, d = q.shape
    kv_heads = k.shape[2]
    out = split_decode_attention(q.reshape(batch, kv_heads, heads // kv_heads, d),
                                 jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), lengths,
                                 block_h=jax_op_cases.DECODE_BLOCK_H, k_splits=splits,
                                 sm_scale=d ** -0.5)
    return out.reshape(batch, heads, d)
  return twin


def padded_blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                               mask: jax.Array | None, *, sm_scale: float,
                               block_k: int) -> jax.Array:
  """Flash attention as JAX's GPU `mha` kernel computes it (not causal), every query at once.

  q: [batch, seq, heads, d]; k, v: [batch, keys, heads, d]; mask: None or
  [batch, 1, seq, keys] (True = attend).
  The head dim is zero-padded to the next power of two (the kernel's masked loads), and
  the keys are visited in blocks of `block_k` by a sequential loop keeping a running max
  and sum in base 2 (the kernel's `fori_loop`); the padded lanes are cut at the end.
  """
  batch, seq, heads, d = q.shape
  padded = 1 << (d - 1).bit_length()
  to_heads = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0),) * 3 + ((0, padded - d),))
  q, k, v = to_heads(q), to_heads(k), to_heads(v)   # [batch, heads, seq, padded]
  blocks = k.shape[2] // block_k
  k_blocks = jnp.moveaxis(k.reshape(batch, heads, blocks, block_k, padded), 2, 0)
  v_blocks = jnp.moveaxis(v.reshape(batch, heads, blocks, block_k, padded), 2, 0)
  mask_blocks = (None if mask is None else
                 jnp.moveaxis(mask.reshape(batch, 1, seq, blocks, block_k), 3, 0))
  scale = sm_scale * np.log2(np.e)

  def step(carry, block):
    acc, running_max, running_sum = carry
    k_b, v_b, mask_b = block
    logits = jnp.einsum("bhqd,bhkd->bhqk", q, k_b, precision=HIGHEST) * scale
    if mask_b is not None:
      logits = jnp.where(mask_b, logits, -0.7 * float(np.finfo(np.float32).max))
    new_max = jnp.maximum(running_max, logits.max(-1))
    correction = jnp.exp2(running_max - new_max)
    weights = jnp.exp2(logits - new_max[..., None])
    acc = acc * correction[..., None] + jnp.einsum("bhqk,bhkd->bhqd", weights, v_b,
                                                   precision=HIGHEST)
    return (acc, new_max, running_sum * correction + weights.sum(-1)), None

  start = (jnp.zeros((batch, heads, seq, padded), jnp.float32),
           jnp.full((batch, heads, seq), -jnp.inf, jnp.float32),
           jnp.zeros((batch, heads, seq), jnp.float32))
  (acc, _, total), _ = jax.lax.scan(step, start, (k_blocks, v_blocks, mask_blocks))
  return jnp.swapaxes(acc / total[..., None], 1, 2)[..., :d]


def causal_padded_blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                                      sm_scale: float, block_q: int,
                                      block_k: int) -> jax.Array:
  """Causal flash attention as JAX's GPU `mha` kernel computes it: each query block
  loops over the key blocks up to its diagonal (its own trip count), masking every one.

  q, k, v: [batch, seq, heads, d]; the query blocks run one after another here (the
  kernel runs them as parallel programs; a jax.numpy batch needs one trip count)."""
  seq = q.shape[1]
  keys = jnp.arange(seq)
  outs = []
  for start in range(0, seq, block_q):
    n_keys = -(-(start + block_q) // block_k) * block_k    # whole key blocks to the diagonal
    rows = jnp.arange(start, start + block_q)
    mask = jnp.broadcast_to(rows[:, None] >= keys[None, :n_keys], (q.shape[0], 1, block_q, n_keys))
    outs.append(padded_blockwise_attention(q[:, start:start + block_q], k[:, :n_keys],
                                           v[:, :n_keys], mask, sm_scale=sm_scale,
                                           block_k=block_k))
  return jnp.concatenate(outs, axis=1)


def _mha(size: Size, *, segments: bool = False, causal: bool = False) -> Callable[..., jax.Array]:
  batch, seq, _, _, block = jax_op_cases.MHA_SIZES[size]
  if causal:
    return lambda q, k, v: causal_padded_blockwise_attention(
        q, k, v, sm_scale=q.shape[-1] ** -0.5, block_q=block, block_k=block)
  mask = None
  if segments:
    ids = jax_op_cases.segment_halves(batch, seq)
    mask = (ids[:, :, None] == ids[:, None, :])[:, None]
  return lambda q, k, v: padded_blockwise_attention(q, k, v, mask,
                                                    sm_scale=q.shape[-1] ** -0.5,
                                                    block_k=block)


def _paged(size: Size) -> Callable[..., jax.Array]:
  """Pages gathered per sequence, then flash decoding over the op's `k_splits` (no scale)."""
  splits = jax_op_cases.gpu_paged_splits(size)[0]

  def twin(q, k_pages, v_pages, tables, lengths):
    kv_heads, _, page, d = k_pages.shape
    batch, per_seq = tables.shape
    gather = lambda pages: jnp.swapaxes(pages[:, tables], 0, 1).reshape(
        batch, kv_heads, per_seq * page, d)
    out = split_decode_attention(q.reshape(batch, kv_heads, -1, d), gather(k_pages),
                                 gather(v_pages), lengths, block_h=jax_op_cases.DECODE_BLOCK_H,
                                 k_splits=splits, sm_scale=1.0)
    return out.reshape(q.shape)
  return twin


# row name -> (size -> the row's kernel algorithm in jax.numpy: the row's inputs, its result)
ALGORITHM_TWINS: dict[str, Callable[[Size], Callable[..., jax.Array]]] = {
    "op_gpu_decode_mqa": _mqa,
    "op_gpu_decode_gqa": _gqa,
    "op_gpu_mha": lambda size: _mha(size, causal=True),
    "op_gpu_mha_d72": lambda size: _mha(size, segments=False),
    "op_gpu_mha_segment_ids": lambda size: _mha(size, segments=True),
    "op_gpu_paged_attention": _paged,
    "op_tpu_flash_attention": lambda size: _tpu_flash(size, causal=True),
    "op_tpu_flash_attention_plain": lambda size: _tpu_flash(size, causal=False),
    "op_tpu_flash_attention_segment_ids": lambda size: _tpu_flash(size, causal=False,
                                                                  segments=True),
    "op_tpu_splash_attention": _tpu_splash_causal,
}


def rows(size: Size) -> list[Benchmark]:
  """The rows of `jax_op_cases` at `size` that have an algorithm twin (none before JAX 0.12)."""
  return [b for b in jax_op_cases.benchmarks(size) if b.name in ALGORITHM_TWINS]


def _median_seconds(fn: Callable, args: tuple, calls: int) -> float:
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls


def measure(bench: Benchmark, size: Size, rounds: int, calls: int = 20,
            seed: int = 0) -> dict[str, float]:
  """Median seconds of pallet, the plain twin and the algorithm twin, interleaved per round."""
  import pallet   # the benchmark's subject; imported here so the module loads without it
  args = bench.make_inputs(jax.random.key(seed))
  programs = {"pallet": jax.jit(bench.build_pallas(pallet)), "plain": jax.jit(bench.reference),
              "algorithm": jax.jit(ALGORITHM_TWINS[bench.name](size))}
  expected = programs["plain"](*args)
  for name in ("pallet", "algorithm"):
    np.testing.assert_allclose(programs[name](*args), expected, rtol=bench.rtol, atol=bench.atol,
                               err_msg=f"{bench.name}: {name} differs from the plain twin")
  times: dict[str, list[float]] = {name: [] for name in programs}
  for _ in range(rounds):
    for name, fn in programs.items():
      times[name].append(_median_seconds(fn, args, calls))
  return {name: float(np.median(t)) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m pallet.bench.algorithm_twins",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=SIZES, default="test")
  parser.add_argument("--rounds", type=int, default=21)
  parser.add_argument("--only", action="append", choices=sorted(ALGORITHM_TWINS),
                      help="measure only this row (repeatable)")
  args = parser.parse_args(argv)
  print(f"{'row':<24}{'pallet us':>11}{'plain us':>10}{'algorithm us':>14}"
        f"{'pallet/plain':>14}{'pallet/algorithm':>18}{'algorithm/plain':>17}")
  for bench in rows(args.size):
    if args.only and bench.name not in args.only:
      continue
    t = measure(bench, args.size, args.rounds)
    print(f"{bench.name:<24}{t['pallet'] * 1e6:>11.0f}{t['plain'] * 1e6:>10.0f}"
          f"{t['algorithm'] * 1e6:>14.0f}{t['pallet'] / t['plain']:>14.2f}"
          f"{t['pallet'] / t['algorithm']:>18.2f}{t['algorithm'] / t['plain']:>17.2f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
