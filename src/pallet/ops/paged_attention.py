"""Paged attention: decode attention (one new query token per sequence) over a KV cache
stored in fixed-size pages shared by all sequences, addressed through block tables.

q (batch, heads, d); k_pages, v_pages (kv_heads, total_pages, page_size, d); lengths
(batch,) ints; page_indices (batch, pages_per_sequence) ints: token t of sequence b is
row t % page_size of page page_indices[b, t // page_size]. One program per (batch, kv
head, split) takes the group's heads // kv_heads query rows together (padded to a
tensor-core tile on a GPU) and loops over its share of the compute blocks
(pages_per_compute_block pages each) below the sequence's length, gathering each
block's key/value rows through the block table (online softmax; only the block
holding the last token is masked); a second kernel combines the splits (flash
decoding, pallet.ops.flash_decoding: enough programs to fill a GPU). Reads each used
page of K and V once. Inference only: no VJP.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

import pallet as pl
from pallet.ops import flash_decoding, launch_table
from pallet.ops._common import (F32, cdiv, check_block, check_float, fail,
                                online_softmax_start, online_softmax_step)

__all__ = ["paged_attention", "paged_attention_reference"]


def _invalid(lengths: jax.Array, page_indices: jax.Array, total_pages: int,
             page_size: int) -> jax.Array:
  """(batch,) bool: sequences that use a block-table entry (one below their length)
  naming no page; their output is NaN, never another page's data."""
  used = jnp.arange(page_indices.shape[1])[None, :] * page_size < lengths[:, None]
  out_of_range = (page_indices < 0) | (page_indices >= total_pages)
  return jnp.any(used & out_of_range, axis=1)


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                              lengths: jax.Array, page_indices: jax.Array, *,
                              scale: float | None = None,
                              softcap: float | None = None) -> jax.Array:
  """jax.numpy twin: gathers every sequence's pages, masks by length (float32 math, q's
  dtype out; 0 for a sequence of length 0, NaN for one using an out-of-range page)."""
  b, h, d = q.shape
  hkv, total_pages, page_size, _ = k_pages.shape
  groups = h // hkv
  cap = page_indices.shape[1] * page_size
  scale = 1.0 / math.sqrt(d) if scale is None else scale

  def gather(pages):   # (hkv, b, cap, d)
    taken = jnp.take(pages, page_indices, axis=1, mode="clip")
    return taken.reshape(hkv, b, cap, d).astype(F32)

  qg = q.reshape(b, hkv, groups, d).astype(F32)
  s = jnp.einsum("bkgd,kbsd->bkgs", qg, gather(k_pages), precision=lax.Precision.HIGHEST)
  s = s * scale
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  valid = (jnp.arange(cap)[None, :] < lengths[:, None])[:, None, None, :]
  p = jnp.where(valid, jnp.exp(s - jnp.max(jnp.where(valid, s, -jnp.inf), -1, keepdims=True)), 0)
  l = jnp.sum(p, -1, keepdims=True)
  o = jnp.einsum("bkgs,kbsd->bkgd", p, gather(v_pages), precision=lax.Precision.HIGHEST)
  o = (o / jnp.where(l == 0, 1.0, l)).reshape(b, h, d)
  bad = _invalid(lengths, page_indices, total_pages, page_size)
  return jnp.where(bad[:, None, None], jnp.nan, o).astype(q.dtype)


def _kernel(scale: float, softcap: float | None, page_size: int, block: int, capacity: int,
            splits: int):
  def kernel(len_ref, table_ref, q_ref, k_ref, v_ref, *out_refs):
    length = jnp.minimum(len_ref[0], capacity)
    q = q_ref[...]
    rows, d = q.shape

    def step(masked):
      def body(j, carry):
        pos = j * block + lax.broadcasted_iota(jnp.int32, (block,), 0)
        tokens = table_ref[pos // page_size] * page_size + pos % page_size
        s = lax.dot_general(q, k_ref[tokens, :], (((1,), (1,)), ((), ())),
                            preferred_element_type=F32) * scale
        if softcap is not None:
          s = softcap * jnp.tanh(s / softcap)
        if masked:
          s = jnp.where((pos < length)[None, :], s, -jnp.inf)
        return online_softmax_step(carry, s, v_ref[tokens, :])
      return body

    first, last = flash_decoding.split_blocks((length + block - 1) // block, splits)
    carry = flash_decoding.masked_blocks(first, last, length // block, step,
                                         online_softmax_start(rows, d))
    flash_decoding.write(out_refs, carry, splits)

  return kernel


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                    page_indices: jax.Array, *, scale: float | None = None,
                    softcap: float | None = None,
                    pages_per_compute_block: int | None = None,
                    k_splits: int | None = None) -> jax.Array:
  """Attention of one query per sequence over its first `lengths[b]` tokens, stored in
  the pages its block table names.

  q (batch, heads, d); k_pages, v_pages (kv_heads, total_pages, page_size, d), heads a
  multiple of kv_heads; lengths (batch,) ints; page_indices (batch, pages_per_sequence)
  ints, entries past a sequence's length ignored (any value). A sequence whose used
  entries name no page (< 0 or >= total_pages) gets NaN. `softcap`: scores become
  softcap * tanh(s / softcap). Default scale 1/sqrt(d). `pages_per_compute_block`:
  pages per loop step (default: 128 tokens' worth on the CPU; on Triton the launch
  table's `block_tokens`, see pallet.ops.launch_table). `k_splits`: programs that
  share one sequence's blocks, their partial softmaxes combined by a second kernel, so
  a GPU has enough programs (default: 1 on the CPU; on Triton enough to fill the GPU,
  see pallet.ops.flash_decoding).
  """
  op = "paged_attention"
  for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
    check_float(op, name, x)
  if q.ndim != 3 or k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
    raise fail(op, f"expected q (batch, heads, d) and k_pages, v_pages (kv_heads, total_pages, "
                   f"page_size, d) of one shape, got {q.shape}, {k_pages.shape}, "
                   f"{v_pages.shape}")
  b, h, d = q.shape
  hkv, total_pages, page_size, _ = k_pages.shape
  if k_pages.shape[3] != d or h % hkv or not total_pages * page_size:
    raise fail(op, f"k_pages {k_pages.shape} does not fit q {q.shape}: head_dim must match, "
                   f"heads must be a multiple of kv_heads, and pages must hold tokens")
  if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise fail(op, f"lengths must be ({b},) ints, got {lengths.shape} {lengths.dtype}")
  if (page_indices.ndim != 2 or page_indices.shape[0] != b or not page_indices.shape[1]
      or not jnp.issubdtype(page_indices.dtype, jnp.integer)):
    raise fail(op, f"page_indices must be ({b}, pages_per_sequence >= 1) ints, got "
                   f"{page_indices.shape} {page_indices.dtype}")
  if softcap is not None and not softcap > 0:
    raise fail(op, f"softcap must be positive or None, got {softcap!r}")
  launch = launch_table.lookup(op, head_dim=d, groups=h // hkv, page_size=page_size,
                               itemsize=jnp.dtype(q.dtype).itemsize)
  params = launch.compiler_params("fwd", explicit=pages_per_compute_block is not None)
  if pages_per_compute_block is None:
    pages_per_compute_block = max(1, launch.get("fwd", "block_tokens", 128) // page_size)
  check_block(op, "pages_per_compute_block", pages_per_compute_block)
  pages = page_indices.shape[1]
  pages_per_block = min(pages, pages_per_compute_block)
  blocks = cdiv(pages, pages_per_block)
  if k_splits is None:
    k_splits = flash_decoding.split_count(launch, b * hkv, pages * page_size)
  check_block(op, "k_splits", k_splits)
  splits = min(k_splits, blocks)
  lengths = lengths.astype(jnp.int32)
  table = jnp.clip(page_indices.astype(jnp.int32), 0, total_pages - 1)
  if blocks * pages_per_block != pages:
    table = jnp.pad(table, ((0, 0), (0, blocks * pages_per_block - pages)))
  groups = h // hkv
  rows = flash_decoding.query_rows(launch, groups)
  kernel = _kernel(float(1.0 / math.sqrt(d) if scale is None else scale),
                   None if softcap is None else float(softcap), page_size,
                   pages_per_block * page_size, pages * page_size, splits)
  grid = (b, hkv, splits) if splits > 1 else (b, hkv)
  whole = pl.BlockSpec((None, total_pages * page_size, d), lambda bi, hi, *_: (hi, 0, 0))
  out_shape, out_specs = flash_decoding.outputs(b, hkv, splits, rows, d, q.dtype)
  out = pl.pallas_call(
      kernel, grid=grid, out_shape=out_shape,
      in_specs=[pl.BlockSpec((1,), lambda bi, *_: (bi,)),
                pl.BlockSpec((None, blocks * pages_per_block), lambda bi, *_: (bi, 0)),
                pl.BlockSpec((None, None, rows, d), lambda bi, hi, *_: (bi, hi, 0, 0)),
                whole, whole],
      out_specs=out_specs, name="paged_attention", compiler_params=params,
  )(lengths, table, flash_decoding.pad_rows(q.reshape(b, hkv, groups, d), rows),
    k_pages.reshape(hkv, -1, d), v_pages.reshape(hkv, -1, d))
  if splits > 1:
    out = flash_decoding.combine(*out, q.dtype, launch.compiler_params("combine"))
  out = out[:, :, :groups].reshape(b, h, d)
  bad = _invalid(lengths, page_indices, total_pages, page_size)
  return jnp.where(bad[:, None, None], jnp.nan, out)
