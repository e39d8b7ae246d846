"""Flash decoding: the plumbing decode and paged attention share.

One query token per sequence reads the sequence's whole KV cache once: the work is
memory-bound, and a grid of (batch, kv heads) programs gives a GPU too few programs,
each too long, to keep its memory busy. So each sequence's key blocks are split among
`splits` programs (grid (batch, kv heads, splits)); each leaves its unnormalized
output with its running max and sum (a partial online softmax), and a second kernel
(`flash_decoding_combine`, grid (batch, kv heads)) rescales the splits to their
common max and sums them. The split count comes from the GPU: enough programs to fill
its multiprocessors `programs_per_sm` times over (launch table), but never splits of
fewer than `split_keys` keys (the combine's traffic and each program's start-up must
stay small against the keys it reads). A split takes an equal share of its own
sequence's blocks (its length, not the cache's), so short sequences are split as
evenly as long ones.

The query heads of one kv head (the group) are the rows of one program's query tile,
so K and V are read once per kv head; on a GPU the tile is padded with zero rows to
`query_rows` (16: the least M of a tensor-core product, below which a product is a
broadcast and a sum in registers).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import pallet as pl
from pallet.ops import launch_table
from pallet.ops._common import F32, cdiv

__all__ = ["query_rows", "pad_rows", "split_count", "split_blocks", "masked_blocks", "finish",
           "outputs", "write", "combine"]


def query_rows(launch: launch_table.Launch, groups: int) -> int:
  """Rows of a program's query tile: the group's heads, at least the launch table's
  `query_rows` on a GPU (none on the CPU, where padding rows would only add work)."""
  return max(groups, launch.get("fwd", "query_rows", 1))


def pad_rows(x: jax.Array, rows: int) -> jax.Array:
  """x (batch, kv heads, group, d) with zero rows appended up to `rows`."""
  extra = rows - x.shape[2]
  return x if extra == 0 else jnp.pad(x, ((0, 0), (0, 0), (0, extra), (0, 0)))


def split_count(launch: launch_table.Launch, programs: int, cache_len: int) -> int:
  """How many programs share one sequence's keys: enough that all of them fill the
  GPU `programs_per_sm` times over (`programs`: the (batch, kv head) pairs), at most
  one per `split_keys` keys of the cache; 1 on the CPU."""
  if not launch.on_gpu:
    return 1
  target = launch.get("fwd", "programs_per_sm", 1) * launch_table.multiprocessors()
  most = max(1, cache_len // launch.get("fwd", "split_keys", cache_len))
  return max(1, min(cdiv(target, programs), most))


def split_blocks(blocks, splits: int):
  """[first, last) of this program's share of a sequence's `blocks` key blocks (the
  split is grid axis 2; the whole range when there is one split)."""
  if splits == 1:
    return 0, blocks
  per = (blocks + splits - 1) // splits
  first = pl.program_id(2) * per
  return first, jnp.minimum(blocks, first + per)


def finish(carry) -> jax.Array:
  """The output of a whole online softmax (0 for a row that saw no key)."""
  _, l, acc = carry
  return acc / jnp.where(l == 0, 1.0, l)[:, None]


def _combine_kernel(acc_ref, m_ref, l_ref, o_ref):
  m = m_ref[...]                                      # (splits, rows)
  top = jnp.max(m, axis=0)
  w = jnp.exp(m - jnp.where(top == -jnp.inf, 0.0, top)[None, :])  # 0: a split without keys
  total = jnp.sum(w * l_ref[...], axis=0)
  acc = jnp.sum(w[:, :, None] * acc_ref[...], axis=0)
  o_ref[...] = (acc / jnp.where(total == 0, 1.0, total)[:, None]).astype(o_ref.dtype)


def combine(acc: jax.Array, m: jax.Array, l: jax.Array, dtype, params=None) -> jax.Array:
  """(batch, kv heads, rows, d) outputs from the splits' partial softmaxes: acc
  (batch, kv heads, splits, rows, d), m and l (batch, kv heads, splits, rows)."""
  b, hkv, splits, rows, d = acc.shape
  stat = pl.BlockSpec((None, None, splits, rows), lambda bi, hi: (bi, hi, 0, 0))
  return pl.pallas_call(
      _combine_kernel, out_shape=jax.ShapeDtypeStruct((b, hkv, rows, d), dtype),
      grid=(b, hkv),
      in_specs=[pl.BlockSpec((None, None, splits, rows, d), lambda bi, hi: (bi, hi, 0, 0, 0)),
                stat, stat],
      out_specs=pl.BlockSpec((None, None, rows, d), lambda bi, hi: (bi, hi, 0, 0)),
      name="flash_decoding_combine", compiler_params=params)(acc, m, l)


def outputs(b: int, hkv: int, splits: int, rows: int, d: int, dtype):
  """(out_shape, out_specs) of a decoding kernel: the normalized output with one split,
  else the partial accumulator, max and sum per split."""
  if splits == 1:
    return (jax.ShapeDtypeStruct((b, hkv, rows, d), dtype),
            pl.BlockSpec((None, None, rows, d), lambda bi, hi: (bi, hi, 0, 0)))
  part = lambda bi, hi, si: (bi, hi, si, 0)           # noqa: E731
  return ([jax.ShapeDtypeStruct((b, hkv, splits, rows, d), F32),
           jax.ShapeDtypeStruct((b, hkv, splits, rows), F32),
           jax.ShapeDtypeStruct((b, hkv, splits, rows), F32)],
          [pl.BlockSpec((None, None, None, rows, d), lambda *i: part(*i) + (0,)),
           pl.BlockSpec((None, None, None, rows), part),
           pl.BlockSpec((None, None, None, rows), part)])


def write(out_refs, carry, splits: int) -> None:
  """Stores a program's result: normalized (one split) or partial."""
  if splits == 1:
    (o_ref,) = out_refs
    o_ref[...] = finish(carry).astype(o_ref.dtype)
  else:
    acc_ref, m_ref, l_ref = out_refs
    m_ref[...], l_ref[...], acc_ref[...] = carry


def masked_blocks(first, last, full, step, carry):
  """step(masked) over blocks [first, last): unmasked below `full` (the blocks wholly
  inside the sequence), masked from there (the one block holding its last key)."""
  edge = jnp.minimum(last, jnp.maximum(first, full))
  carry = lax.fori_loop(first, edge, step(False), carry)
  return lax.fori_loop(edge, last, step(True), carry)
