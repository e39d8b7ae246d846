"""Ragged dot (grouped matrix multiplication, the MoE expert layer), forward and backward.

lhs (m, k) holds the rows of `num_groups` groups one after another: group g owns rows
[offsets[g], offsets[g+1]) with offsets the running sum of `group_sizes` clipped to m,
and out[rows of g] = lhs[rows of g] @ rhs[g]; rows after the last group give 0 (what
`jax.lax.ragged_dot` computes, also when the sizes sum past m).

Kernels (the group offsets are small whole-array inputs read inside the body; no
index map depends on them, so every backend keeps a static grid):
- gmm on a GPU, grid (tile table entries, column tiles): the row tiles are cut per
  group, `block_m` rows from each group's first row, so a tile never holds another
  group's rows, and listed before the kernel in a tile table (group, first row, end
  row), with the rows after the last group as tiles of zeros. A program reads its
  entry and runs a plain k-loop matmul (lhs rows x rhs[group], no mask inside the
  loop) and stores its rows (a masked store: the tile's last rows may belong to the
  next tile). At most cdiv(m, block_m) + num_groups entries are live (the grid's
  static size; the rest exit at once): FLOPs executed are sum over groups of
  cdiv(size, block_m) * block_m * 2kn, against m * 2kn useful, so at most
  num_groups * block_m rows of padding in all. Every program owns its rows: no
  revisits, no races.
- gmm on the CPU, grid (row tiles, column tiles): a row tile finds the range of
  groups its rows touch from the offsets and loops over the non-empty ones, each
  group's product taken over the tile's rows with the other groups' rows zeroed
  (vectorized over the tiles by the CPU backend, where the masked stores of the GPU
  form would be scatters).
- tgmm, grid (groups, k tiles, n tiles): the gradient of rhs, per group the sum over
  its row tiles (cut from the group's first row) of lhs_tile^T @ dout_tile, the last,
  partial one masked; a group without rows loops zero times and writes zeros.
The backward pass is gmm(dout, rhs^T) for lhs (the same kernels reading rhs
transposed) and tgmm for rhs; group_sizes get no gradient. Contraction and row loops
whose tile does not divide the length clamp the last tile to end at the edge and mask
the rows or columns an earlier tile already counted, so nothing is padded.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import pallet as pl
from pallet.ops import launch_table
from pallet.ops._common import F32, cdiv, check_block, check_float, fail

__all__ = ["ragged_dot", "grouped_matmul", "ragged_dot_reference"]

_NN = (((1,), (0,)), ((), ()))   # a @ b
_NT = (((1,), (1,)), ((), ()))   # a @ b^T
_TN = (((0,), (0,)), ((), ()))   # a^T @ b


@dataclasses.dataclass(frozen=True)
class _Tiles:
  """The tiles of one pass in the forward's terms: block_m rows, block_k of k, block_n of
  n (the dlhs gmm contracts over n in block_n pieces into block_k columns), and the
  pass's compiler params (None: the backend's own)."""
  block_m: int
  block_k: int
  block_n: int
  params: Any = None


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static facts of one call (hashable: a custom_vjp non-differentiable argument).
  `tile_table`: gmm runs over per-group row tiles listed in a tile table (the GPU
  form) rather than over fixed row tiles looping over groups (the CPU form)."""
  out_dtype: Any
  fwd: _Tiles
  dlhs: _Tiles
  drhs: _Tiles
  tile_table: bool = False


# ------------------------------------------------------------------ reference
def ragged_dot_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                         preferred_element_type: Any = None) -> jax.Array:
  """`jax.lax.ragged_dot` in float32 (HIGHEST precision), cast to the output dtype."""
  out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
  return lax.ragged_dot(lhs.astype(F32), rhs.astype(F32), group_sizes,
                        precision=lax.Precision.HIGHEST).astype(out_dtype)


# ------------------------------------------------------------------ kernels
def _clamped(step, block: int, length: int):
  """Start of tile `step` of `block` along `length`, moved back to end at the edge."""
  return jnp.minimum(step * block, length - block)


def _gmm_kernel(block_m: int, block_c: int, contraction: int, transpose_rhs: bool):
  """out tile = sum over the groups g its rows touch of (lhs rows of g) @ rhs[g]
  (rhs[g]^T with transpose_rhs), the contraction in `block_c` pieces."""
  c_tiles = cdiv(contraction, block_c)
  ragged_c = contraction % block_c != 0
  dims = _NT if transpose_rhs else _NN

  def kernel(off_ref, lhs_ref, rhs_ref, o_ref):
    groups = off_ref.shape[0] - 1
    row0 = pl.program_id(0) * block_m
    # Groups touching rows [row0, row0 + block_m): those ending after row0 and
    # starting before row0 + block_m (a range, groups being in row order).
    g_lo = jnp.sum((off_ref[pl.ds(1, groups)] <= row0).astype(jnp.int32))
    g_hi = jnp.sum((off_ref[pl.ds(0, groups)] < row0 + block_m).astype(jnp.int32))
    rows = row0 + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)

    def group(g, acc):
      mine = (rows >= off_ref[g]) & (rows < off_ref[g + 1])

      def piece(c, acc):
        start = _clamped(c, block_c, contraction)
        keep = mine
        if ragged_c:   # the clamped last piece: drop columns an earlier piece counted
          cols = start + lax.broadcasted_iota(jnp.int32, (1, block_c), 1)
          keep = keep & (cols >= c * block_c)
        x = lhs_ref[:, pl.ds(start, block_c)]
        x = jnp.where(keep, x, jnp.zeros_like(x))
        w = rhs_ref[g, :, pl.ds(start, block_c)] if transpose_rhs else \
            rhs_ref[g, pl.ds(start, block_c), :]
        return acc + lax.dot_general(x, w, dims, preferred_element_type=F32)

      # An empty group inside the tile's range (between two groups that meet in it)
      # would add a product of zeros: skip it.
      return lax.cond(off_ref[g] < off_ref[g + 1],
                      lambda acc: lax.fori_loop(0, c_tiles, piece, acc), lambda acc: acc, acc)

    acc = lax.fori_loop(g_lo, g_hi, group, jnp.zeros(o_ref.shape, F32))
    o_ref[...] = acc.astype(o_ref.dtype)

  return kernel


def _contract(block_c: int, contraction: int, product, acc):
  """acc + the sum over `block_c` pieces of the contraction of product(start, keep):
  whole pieces unmasked, then the last, clamped to end at the edge, with `keep` the
  columns no earlier piece counted (None: all)."""
  whole = contraction // block_c
  acc = lax.fori_loop(0, whole, lambda c, acc: acc + product(c * block_c, None), acc)
  if contraction % block_c:
    start = contraction - block_c
    cols = start + lax.broadcasted_iota(jnp.int32, (1, block_c), 1)
    acc = acc + product(start, cols >= whole * block_c)
  return acc


def _gmm_tiles_kernel(block_m: int, block_c: int, rows_total: int, contraction: int,
                      transpose_rhs: bool):
  """out rows of one tile-table entry = lhs rows @ rhs[group] (rhs[group]^T with
  transpose_rhs), the contraction in `block_c` pieces; a group of -1 writes zeros."""
  dims = _NT if transpose_rhs else _NN

  def kernel(table_ref, lhs_ref, rhs_ref, o_ref):
    t = pl.program_id(0)
    g, first, end = table_ref[t, 0], table_ref[t, 1], table_ref[t, 2]

    @pl.when(end > first)   # entries past the live tiles: nothing to do
    def _():
      start = jnp.minimum(first, rows_total - block_m)   # read inside the array
      rows = start + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)

      def product(c0, keep):
        x = lhs_ref[pl.ds(start, block_m), pl.ds(c0, block_c)]
        if keep is not None:
          x = jnp.where(keep, x, jnp.zeros_like(x))
        w = rhs_ref[jnp.maximum(g, 0), :, pl.ds(c0, block_c)] if transpose_rhs else \
            rhs_ref[jnp.maximum(g, 0), pl.ds(c0, block_c), :]
        return lax.dot_general(x, w, dims, preferred_element_type=F32)

      acc = jnp.zeros((block_m, o_ref.shape[1]), F32)
      acc = lax.cond(g >= 0, lambda acc: _contract(block_c, contraction, product, acc),
                     lambda acc: acc, acc)
      pl.store(o_ref, (pl.ds(start, block_m), slice(None)), acc.astype(o_ref.dtype),
               mask=(rows >= first) & (rows < end))

  return kernel


def tile_table(offsets: jax.Array, rows_total: int, block_m: int) -> jax.Array:
  """(cdiv(rows_total, block_m) + groups, 3) int32 rows (group, first row, end row):
  each group's rows cut into tiles of `block_m` from its first row, then the rows after
  the last group as tiles of group -1 (zeros), then empty entries (first = end = 0)
  up to the static size (the most tiles any group sizes can need)."""
  groups = offsets.shape[0] - 1
  size = cdiv(rows_total, block_m) + groups
  seg_first = offsets                                            # groups, then the tail
  seg_end = jnp.concatenate([offsets[1:], jnp.full((1,), rows_total, jnp.int32)])
  seg_group = jnp.concatenate([jnp.arange(groups, dtype=jnp.int32),
                               jnp.full((1,), -1, jnp.int32)])
  seg_tiles = (seg_end - seg_first + block_m - 1) // block_m
  ends = jnp.cumsum(seg_tiles)                                   # tiles before each end
  t = jnp.arange(size, dtype=jnp.int32)
  seg = jnp.minimum(jnp.sum(ends[None, :] <= t[:, None], axis=1), groups)
  first = seg_first[seg] + (t - (ends[seg] - seg_tiles[seg])) * block_m
  end = jnp.minimum(first + block_m, seg_end[seg])
  live = t < ends[-1]
  return jnp.stack([seg_group[seg], jnp.where(live, first, 0), jnp.where(live, end, 0)],
                   axis=1).astype(jnp.int32)


def _tgmm_kernel(block_m: int, rows_total: int):
  """out[g] tile = sum over group g's row tiles (cut from its first row) of
  lhs_tile^T @ dout_tile; the last, partial tile masked."""

  def kernel(off_ref, lhs_ref, dout_ref, o_ref):
    g = pl.program_id(0)
    start, end = off_ref[g], off_ref[g + 1]

    def tile(masked):
      def body(t, acc):
        first = start + t * block_m
        r0 = jnp.minimum(first, rows_total - block_m) if masked else first
        x = lhs_ref[pl.ds(r0, block_m), :]
        if masked:   # rows of the next group, or counted by an earlier tile: zero
          rows = r0 + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
          x = jnp.where((rows >= first) & (rows < end), x, jnp.zeros_like(x))
        return acc + lax.dot_general(x, dout_ref[pl.ds(r0, block_m), :], _TN,
                                     preferred_element_type=F32)
      return body

    whole = (end - start) // block_m
    acc = lax.fori_loop(0, whole, tile(False), jnp.zeros(o_ref.shape, F32))
    acc = lax.fori_loop(whole, (end - start + block_m - 1) // block_m, tile(True), acc)
    o_ref[...] = acc.astype(o_ref.dtype)

  return kernel


# ------------------------------------------------------------------ launches
def _gmm(lhs, rhs, offsets, block_m, block_c, block_cols, out_dtype, transpose_rhs=False,
         params=None):
  """lhs (m, c) times rhs (G, c, cols) per group ((G, cols, c) with transpose_rhs)."""
  m, c = lhs.shape
  groups = rhs.shape[0]
  cols = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  block_c = min(block_c, c)
  if transpose_rhs:
    rhs_spec = pl.BlockSpec((groups, block_cols, c), lambda i, j: (0, j, 0))
  else:
    rhs_spec = pl.BlockSpec((groups, c, block_cols), lambda i, j: (0, 0, j))
  return pl.pallas_call(
      _gmm_kernel(block_m, block_c, c, transpose_rhs),
      out_shape=jax.ShapeDtypeStruct((m, cols), out_dtype),
      grid=(cdiv(m, block_m), cdiv(cols, block_cols)),
      in_specs=[pl.BlockSpec((groups + 1,), lambda i, j: (0,)),
                pl.BlockSpec((block_m, c), lambda i, j: (i, 0)), rhs_spec],
      out_specs=pl.BlockSpec((block_m, block_cols), lambda i, j: (i, j)),
      name="ragged_dot_gmm", compiler_params=params)(offsets, lhs, rhs)


def _gmm_tiles(lhs, rhs, offsets, block_m, block_c, block_cols, out_dtype,
               transpose_rhs=False, params=None):
  """The GPU form of _gmm: per-group row tiles from a tile table."""
  m, c = lhs.shape
  groups = rhs.shape[0]
  cols = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  block_c = min(block_c, c)
  table = tile_table(offsets, m, block_m)
  if transpose_rhs:
    rhs_spec = pl.BlockSpec((groups, block_cols, c), lambda i, j: (0, j, 0))
  else:
    rhs_spec = pl.BlockSpec((groups, c, block_cols), lambda i, j: (0, 0, j))
  return pl.pallas_call(
      _gmm_tiles_kernel(block_m, block_c, m, c, transpose_rhs),
      out_shape=jax.ShapeDtypeStruct((m, cols), out_dtype),
      grid=(table.shape[0], cdiv(cols, block_cols)),
      in_specs=[pl.BlockSpec(table.shape, lambda i, j: (0, 0)),
                pl.BlockSpec((m, c), lambda i, j: (0, 0)), rhs_spec],
      out_specs=pl.BlockSpec((m, block_cols), lambda i, j: (0, j)),
      name="ragged_dot_gmm", compiler_params=params)(table, lhs, rhs)


def _tgmm(lhs, dout, offsets, block_m, block_k, block_n, out_dtype, params=None):
  """(G, k, n): per group, lhs[rows of g]^T @ dout[rows of g]."""
  m, k = lhs.shape
  n = dout.shape[1]
  groups = offsets.shape[0] - 1
  block_m = min(block_m, m)
  return pl.pallas_call(
      _tgmm_kernel(block_m, m),
      out_shape=jax.ShapeDtypeStruct((groups, k, n), out_dtype),
      grid=(groups, cdiv(k, block_k), cdiv(n, block_n)),
      in_specs=[pl.BlockSpec((groups + 1,), lambda g, a, b: (0,)),
                pl.BlockSpec((m, block_k), lambda g, a, b: (0, a)),
                pl.BlockSpec((m, block_n), lambda g, a, b: (0, b))],
      out_specs=pl.BlockSpec((None, block_k, block_n), lambda g, a, b: (g, a, b)),
      name="ragged_dot_tgmm", compiler_params=params)(offsets, lhs, dout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged_dot(lhs, rhs, offsets, c: _Config):
  t = c.fwd
  gmm = _gmm_tiles if c.tile_table else _gmm
  return gmm(lhs, rhs, offsets, t.block_m, t.block_k, t.block_n, c.out_dtype, params=t.params)


def _ragged_dot_fwd(lhs, rhs, offsets, c):
  return _ragged_dot(lhs, rhs, offsets, c), (lhs, rhs, offsets)


def _ragged_dot_bwd(c, saved, dout):
  lhs, rhs, offsets = saved
  t = c.dlhs
  gmm = _gmm_tiles if c.tile_table else _gmm
  dlhs = gmm(dout, rhs, offsets, t.block_m, t.block_n, t.block_k, lhs.dtype,
              transpose_rhs=True, params=t.params)
  t = c.drhs
  drhs = _tgmm(lhs, dout, offsets, t.block_m, t.block_k, t.block_n, rhs.dtype,
               params=t.params)
  return dlhs, drhs, None


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def _tiles(launch: launch_table.Launch, section: str, m: int, k: int, n: int,
           given: tuple[int | None, int | None, int | None]) -> _Tiles:
  """A pass's tiles: the caller's, else on Triton the GPU's launch table's, else (CPU)
  whole k and n and row tiles of 256: smaller tiles waste less work at group
  boundaries (about groups * block_m extra rows) but pay more per step (measured at
  m 4096, k = n = 1024, 8 groups: 128 rows 1.15x and 512 rows 1.13x the time of 256)."""
  defaults = (launch.get(section, "block_m", 256), launch.get(section, "block_k", k),
              launch.get(section, "block_n", n))
  block_m, block_k, block_n = (g or d for g, d in zip(given, defaults))
  for name, value in (("block_m", block_m), ("block_k", block_k), ("block_n", block_n)):
    check_block("ragged_dot", name, value)
  # Every axis parallel: the GPU gmm's output is a column strip that does not move
  # along the tile-table axis (each program stores its own rows, masked).
  semantics = ("parallel",) * (3 if section == "drhs" else 2)
  return _Tiles(min(block_m, m), min(block_k, k), min(block_n, n),
                launch.compiler_params(section, explicit=any(g is not None for g in given),
                                       dimension_semantics=semantics))


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
               preferred_element_type: Any = None, block_m: int | None = None,
               block_k: int | None = None, block_n: int | None = None) -> jax.Array:
  """out[i] = lhs[i] @ rhs[g(i)], g(i) the group owning row i; see the module docstring.

  lhs (m, k); rhs (num_groups, k, n); group_sizes (num_groups,) non-negative ints, in
  row order (rows past their sum give 0). Output (m, n) of `preferred_element_type`
  (default: the promoted input dtype), accumulated in float32. `block_m` rows per
  tile, `block_k`/`block_n` the k and n tiles of every pass (defaults: 256 and whole k
  and n on the CPU; on Triton per pass from the GPU's launch table,
  pallet.ops.launch_table). Differentiable in lhs and rhs; the backward pass runs as
  kernels too.
  """
  op = "ragged_dot"
  check_float(op, "lhs", lhs)
  check_float(op, "rhs", rhs)
  if lhs.ndim != 2 or rhs.ndim != 3:
    raise fail(op, f"expected lhs (m, k) and rhs (num_groups, k, n), got shapes "
                   f"{lhs.shape} and {rhs.shape}")
  m, k = lhs.shape
  groups, _, n = rhs.shape
  if rhs.shape[1] != k:
    raise fail(op, f"rhs {rhs.shape} does not fit lhs {lhs.shape}: rhs.shape[1] must be "
                   f"lhs's k = {k}")
  if not hasattr(group_sizes, "dtype") or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise fail(op, f"group_sizes must be integers, got "
                   f"{getattr(group_sizes, 'dtype', type(group_sizes).__name__)}")
  if group_sizes.shape != (groups,):
    raise fail(op, f"group_sizes must have shape ({groups},) (one size per group of rhs), "
                   f"got {group_sizes.shape}")
  if preferred_element_type is not None and not jnp.issubdtype(preferred_element_type,
                                                                jnp.floating):
    raise fail(op, f"preferred_element_type must be a floating-point dtype, got "
                   f"{preferred_element_type!r}")
  launch = launch_table.lookup(op, k=k, n=n, itemsize=jnp.dtype(lhs.dtype).itemsize)
  tiles = {s: _tiles(launch, s, m, k, n, (block_m, block_k, block_n))
           for s in ("fwd", "dlhs", "drhs")}
  dtype = jnp.result_type(lhs, rhs)
  out_dtype = jnp.dtype(preferred_element_type or dtype)
  if m == 0 or k == 0 or n == 0 or groups == 0:
    return jnp.zeros((m, n), out_dtype)
  ends = jnp.clip(jnp.cumsum(group_sizes.astype(jnp.int32)), 0, m)
  offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
  c = _Config(out_dtype, **tiles, tile_table=launch.on_gpu)
  return _ragged_dot(lhs.astype(dtype), rhs.astype(dtype), offsets, c)


grouped_matmul = ragged_dot
