"""Fused linear + cross-entropy: loss_i = logsumexp(h_i W) - (h_i W)[label_i], without
ever holding the float32 (rows, vocabulary) logits.

Backward, with p = softmax(logits) and d logits = (p - onehot(label)) * g:
  dh = d logits @ W^T  and  dW = h^T @ d logits.

CPU: the forward has grid (row blocks, vocabulary blocks); each step multiplies a
block of rows of h by one (hidden, block_v) slab of W and folds it into a running max,
a running sum of exponentials (online logsumexp) and the label's logit, kept per row
across the vocabulary axis (sequential; row blocks are independent). One gradient
kernel (grid: row blocks, in order) recomputes each block's logits over the whole
vocabulary (`block_n` rows at a time, fewer for a large vocabulary) with their
log-sum-exp, and gives that block's dh and its term of dW (resident across the grid):
four matrix products with the forward, against the three of a twin that holds the
logits. The VJP saves only the inputs, so where only the gradients are used XLA drops
the forward kernel. With reduction="sum" or "mean" the cotangent is one scalar, so the
forward pass under differentiation runs the gradient kernel for a cotangent of one,
giving loss and gradients in one pass, and the backward pass only scales them: three
products, as the twin.

GPU (6nhv FLOPs for n rows, hidden h, vocabulary v, as the logits-holding twin):
the forward is a tiled matmul h @ W (grid: vocabulary tiles x row tiles, every tile
independent) whose epilogue reduces each (rows, block_v) tile of logits to per-row
statistics (max m, sum of e = exp(logits - m), the label's logit), combined after the
kernel into the log-sum-exp; under differentiation it also stores e, rounded to the
inputs' dtype (values in (0, 1]: the same relative error as the rounded gradient
itself), a (rows, vocabulary) array at a quarter (bf16) of the float32 logits the twin
holds, and nothing else of that size. The backward turns e into d logits in place with
one elementwise kernel (d = e * exp(m - lse) * g - onehot * g: no exponential, no
recomputed product) and takes dh and dW as two dense XLA dots (cuBLAS on NVIDIA GPUs).
A plain forward call stores no e.
Labels < 0 are ignored (loss 0, no gradient), as with ignore_index=-100 elsewhere.
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
from pallet.ops._common import F32, cdiv, check_block, check_float, check_shape, fail

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference"]

_CONTRACT_LAST = (((1,), (1,)), ((), ()))    # a @ b^T
_CONTRACT_FIRST = (((0,), (0,)), ((), ()))   # a^T @ b


REDUCTIONS = ("none", "sum", "mean")


def linear_cross_entropy_reference(h: jax.Array, w: jax.Array, labels: jax.Array, *,
                                   reduction: str = "none") -> jax.Array:
  """jax.numpy twin: per-row loss (float32) from the full logits h @ w (float32 math:
  XLA's CPU runtime has no bf16 x bf16 -> f32 product for the transposed dots),
  reduced as `linear_cross_entropy` does."""
  logits = jnp.dot(h.astype(F32), w.astype(F32))
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[:, None], axis=-1)[:, 0]
  return _reduce(jnp.where(labels >= 0, lse - picked, 0.0), labels, reduction)


def _reduce(losses: jax.Array, labels: jax.Array, reduction: str) -> jax.Array:
  """Per-row losses summed, or averaged over the rows not ignored (NaN when all are)."""
  if reduction == "none":
    return losses
  total = jnp.sum(losses)
  return total if reduction == "sum" else total / _counted(labels)


def _counted(labels: jax.Array) -> jax.Array:
  return jnp.sum(labels >= 0).astype(F32)


def _columns(block_n: int, block_v: int, step):
  return step * block_v + lax.broadcasted_iota(jnp.int32, (block_n, block_v), 1)


def _logits(h_ref, w_ref, block_h: int) -> jax.Array:
  """h @ w for one block in float32, `block_h` hidden units at a time (a GPU program
  then holds (rows, block_h) and (block_h, block_v) tiles, not whole hidden rows)."""
  hidden = h_ref.shape[1]
  if block_h >= hidden:
    return jnp.dot(h_ref[...], w_ref[...], preferred_element_type=F32)

  def step(k, acc):
    part = pl.ds(k * block_h, block_h)
    return acc + jnp.dot(h_ref[:, part], w_ref[part, :], preferred_element_type=F32)

  init = jnp.zeros((h_ref.shape[0], w_ref.shape[1]), F32)
  return lax.fori_loop(0, hidden // block_h, step, init)


def _over_hidden(block_h: int, hidden: int, update) -> None:
  """update(slice) for each `block_h` chunk of the hidden axis (one whole chunk when
  block_h covers it)."""
  if block_h >= hidden:
    update(slice(None))
    return

  def step(k, carry):
    update(pl.ds(k * block_h, block_h))
    return carry

  lax.fori_loop(0, hidden // block_h, step, 0)


def _forward_kernel(vocab: int, block_v: int, block_h: int):
  def kernel(h_ref, w_ref, labels_ref, m_ref, l_ref, t_ref):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
      m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, F32)
      l_ref[...] = jnp.zeros(l_ref.shape, F32)
      t_ref[...] = jnp.zeros(t_ref.shape, F32)

    s = _logits(h_ref, w_ref, block_h)
    cols = _columns(s.shape[0], block_v, j)
    if vocab % block_v:
      s = jnp.where(cols < vocab, s, -jnp.inf)
    m_old = m_ref[...]
    m_new = jnp.maximum(m_old, jnp.max(s, axis=1))
    l_ref[...] = l_ref[...] * jnp.exp(m_old - m_new) + jnp.sum(jnp.exp(s - m_new[:, None]),
                                                               axis=1)
    m_ref[...] = m_new
    t_ref[...] += jnp.sum(jnp.where(cols == labels_ref[...][:, None], s, 0.0), axis=1)

  return kernel


def _tile_kernel(vocab: int, block_v: int, block_h: int, store: bool):
  """GPU forward: one (rows, vocabulary) tile of logits in float32 from h @ W, `block_h`
  hidden units a step, reduced to the tile's row max m, sum of e = exp(logits - m) and
  label logit; `store`: e is written too (rounded to the inputs' dtype: values in (0,
  1], as exact as the gradient's own rounding), the backward's softmax up to a factor
  exp(m - lse) per row and tile."""
  def kernel(h_ref, w_ref, labels_ref, *outs):
    e_ref, (m_ref, l_ref, t_ref) = (outs[0], outs[1:]) if store else (None, outs)
    j = pl.program_id(0)
    s = _logits(h_ref, w_ref, block_h)
    cols = _columns(s.shape[0], block_v, j)
    if vocab % block_v:
      s = jnp.where(cols < vocab, s, -jnp.inf)
    m = jnp.max(s, axis=1)
    e = jnp.exp(s - m[:, None])
    m_ref[...] = m
    l_ref[...] = jnp.sum(e, axis=1)
    t_ref[...] = jnp.sum(jnp.where(cols == labels_ref[...][:, None], s, 0.0), axis=1)
    if store:
      e_ref[...] = e.astype(e_ref.dtype)

  return kernel


def _dlogits_kernel(block_v: int):
  """d logits = softmax - onehot(label), times the row's cotangent g, from the stored
  e = exp(logits - m) of a tile: e * exp(m - lse) * g (`scale`, per row and tile)."""
  def kernel(e_ref, scale_ref, labels_ref, g_ref, d_ref):
    cols = _columns(e_ref.shape[0], block_v, pl.program_id(1))
    onehot = cols == labels_ref[...][:, None]
    d = e_ref[...].astype(F32) * scale_ref[...][:, None] - jnp.where(
        onehot, g_ref[...][:, None], 0.0)
    d_ref[...] = d.astype(d_ref.dtype)

  return kernel


def _rows_kernel(rows: int, block_n: int, block_h: int, weighted: bool):
  """Loss, dh and dW of whole vocabulary rows: one product for the logits, one each
  for dh and dW (dW accumulates over the row blocks). The cotangent is g per row
  (weighted: an input) or one (the reduced losses' forward)."""
  ragged = rows % block_n != 0

  def kernel(h_ref, w_ref, labels_ref, *refs):
    g_ref, (loss_ref, dh_ref, dw_ref) = (refs[0], refs[1:]) if weighted else (None, refs)
    i = pl.program_id(0)

    @pl.when(i == 0)
    def _():
      dw_ref[...] = jnp.zeros(dw_ref.shape, F32)

    s = _logits(h_ref, w_ref, block_h)
    m = jnp.max(s, axis=1, keepdims=True)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=1, keepdims=True)
    labels = labels_ref[...][:, None]
    onehot = lax.broadcasted_iota(jnp.int32, s.shape, 1) == labels
    picked = jnp.sum(jnp.where(onehot, s, 0.0), axis=1, keepdims=True)
    counted = labels >= 0
    if ragged:  # the block's rows past the array are unspecified
      counted &= i * block_n + lax.broadcasted_iota(jnp.int32, labels.shape, 0) < rows
    loss_ref[...] = jnp.where(counted, m + jnp.log(total) - picked, 0.0)[:, 0]
    d = e / total - onehot.astype(F32)
    if weighted:
      d = d * g_ref[...][:, None]
    # after the weighting: g past the last row is unspecified (NaN when poisoned)
    d = jnp.where(counted, d, 0.0)

    def update(part):
      h, w = h_ref[:, part].astype(F32), w_ref[part, :].astype(F32)
      if ragged:
        h = jnp.where(counted, h, 0.0)
      dh_ref[:, part] = lax.dot_general(d, w, _CONTRACT_LAST, preferred_element_type=F32)
      dw_ref[part, :] += lax.dot_general(h, d, _CONTRACT_FIRST, preferred_element_type=F32)

    _over_hidden(block_h, h_ref.shape[1], update)

  return kernel


def _specs(n_axis: int, v_axis: int, block_n: int, block_v: int, hidden: int):
  """BlockSpecs for (h, w, per-row vectors) on a 2-D grid with the given axis roles."""
  rows = pl.BlockSpec((block_n, hidden), lambda *g: (g[n_axis], 0))
  slab = pl.BlockSpec((hidden, block_v), lambda *g: (0, g[v_axis]))
  vector = pl.BlockSpec((block_n,), lambda *g: (g[n_axis],))
  return rows, slab, vector


def _forward(h, w, labels, plan):
  """(per-row losses, log-sum-exp) on the CPU: grid (row blocks, vocabulary blocks),
  the vocabulary axis folded in order into a running max, sum and label logit."""
  t = plan.fwd
  block_n, block_v, block_h = t.block_n, t.block_v, t.block_h
  n, hidden = h.shape
  vocab = w.shape[1]
  rows, slab, vector = _specs(0, 1, block_n, block_v, hidden)
  stat = jax.ShapeDtypeStruct((n,), F32)
  m, l, t = pl.pallas_call(
      _forward_kernel(vocab, block_v, block_h), out_shape=[stat] * 3,
      grid=(cdiv(n, block_n), cdiv(vocab, block_v)), in_specs=[rows, slab, vector],
      out_specs=[vector] * 3, name="linear_cross_entropy_fwd",
      compiler_params=t.params,
  )(h, w, labels)
  lse = m + jnp.log(l)
  return jnp.where(labels >= 0, lse - t, 0.0), lse


def _tiles(h, w, labels, plan, store: bool):
  """GPU forward: (per-row losses, e tiles or None, per-tile row max m (tiles, rows),
  log-sum-exp). Grid (vocabulary tiles, row tiles), every tile independent (rows
  fastest, so programs running together share a slab of W and h stays in L2); the
  tiles' statistics are combined after the kernel (a few MB)."""
  t = plan.fwd
  n, hidden = h.shape
  vocab = w.shape[1]
  tiles = cdiv(vocab, t.block_v)
  rows = pl.BlockSpec((t.block_n, hidden), lambda j, i: (i, 0))
  slab = pl.BlockSpec((hidden, t.block_v), lambda j, i: (0, j))
  vector = pl.BlockSpec((t.block_n,), lambda j, i: (i,))
  stat = pl.BlockSpec((None, t.block_n), lambda j, i: (j, i))
  stats = [jax.ShapeDtypeStruct((tiles, n), F32)] * 3
  out_shape, out_specs = stats, [stat] * 3
  if store:
    out_shape = [jax.ShapeDtypeStruct((n, vocab), jnp.result_type(h, w))] + out_shape
    out_specs = [pl.BlockSpec((t.block_n, t.block_v), lambda j, i: (i, j))] + out_specs
  outs = pl.pallas_call(
      _tile_kernel(vocab, t.block_v, t.block_h, store), out_shape=out_shape,
      grid=(tiles, cdiv(n, t.block_n)), in_specs=[rows, slab, vector],
      out_specs=out_specs, name="linear_cross_entropy_fwd", compiler_params=t.params,
  )(h, w, labels)
  e, (m, l, picked) = (outs[0], outs[1:]) if store else (None, outs)
  top = jnp.max(m, axis=0)
  lse = top + jnp.log(jnp.sum(l * jnp.exp(m - top[None, :]), axis=0))
  return jnp.where(labels >= 0, lse - jnp.sum(picked, axis=0), 0.0), e, m, lse


def _gpu_gradients(h, w, labels, e, m, lse, g, plan):
  """dh, dW from the forward's e tiles: d logits (in place of e, in the inputs' dtype)
  by one elementwise kernel, then dh = d W^T and dW = h^T d as XLA dots (cuBLAS on
  NVIDIA GPUs, float32 accumulation)."""
  n, vocab = e.shape
  block_v = plan.fwd.block_v          # e's tiles: one scale per row and tile
  block_n = plan.dlogits.block_n
  scale = jnp.exp(m - lse[None, :]) * g[None, :]
  tile = pl.BlockSpec((block_n, block_v), lambda i, j: (i, j))
  vector = pl.BlockSpec((block_n,), lambda i, j: (i,))
  d = pl.pallas_call(
      _dlogits_kernel(block_v), out_shape=jax.ShapeDtypeStruct(e.shape, e.dtype),
      grid=(cdiv(n, block_n), cdiv(vocab, block_v)),
      in_specs=[tile, pl.BlockSpec((None, block_n), lambda i, j: (j, i)), vector, vector],
      out_specs=tile, input_output_aliases={0: 0}, name="linear_cross_entropy_dlogits",
      compiler_params=plan.dlogits.params,
  )(e, scale, labels, g)
  dh = lax.dot_general(d, w.astype(d.dtype), _CONTRACT_LAST)
  dw = lax.dot_general(h.astype(d.dtype), d, _CONTRACT_FIRST)
  return dh, dw


def _by_rows(h, w, labels, g, plan):
  """(losses, dh, dW) in float32 from whole vocabulary rows, for a cotangent of g per
  row (None: one): the CPU backend's gradient kernel."""
  block_n, block_h = plan.fwd.block_n, plan.fwd.block_h
  n, hidden = h.shape
  vocab = w.shape[1]
  block_n = min(block_n, _ROWS_OF_LOGITS // vocab) or 1
  rows = pl.BlockSpec((block_n, hidden), lambda i: (i, 0))
  vector = pl.BlockSpec((block_n,), lambda i: (i,))
  whole = pl.BlockSpec((hidden, vocab), lambda i: (0, 0))
  weighted = g is not None
  return pl.pallas_call(
      _rows_kernel(n, block_n, block_h, weighted),
      out_shape=[jax.ShapeDtypeStruct((n,), F32), jax.ShapeDtypeStruct((n, hidden), F32),
                 jax.ShapeDtypeStruct((hidden, vocab), F32)],
      grid=(cdiv(n, block_n),), in_specs=[rows, whole, vector] + [vector] * weighted,
      out_specs=[vector, rows, whole], name="linear_cross_entropy_rows",
      compiler_params=pl.CompilerParams(dimension_semantics=("arbitrary",)),
  )(h, w, labels, *([g] if weighted else []))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _loss(h, w, labels, plan):
  if plan.gpu:
    return _tiles(h, w, labels, plan, store=False)[0]
  return _forward(h, w, labels, plan)[0]


def _loss_fwd(h, w, labels, plan):
  if plan.gpu:
    loss, e, m, lse = _tiles(h, w, labels, plan, store=True)
    return loss, (h, w, labels, (e, m, lse))
  # The CPU backward recomputes the log-sum-exp along with the logits: saving only the
  # inputs lets XLA drop this forward kernel where only the gradients are used.
  return _forward(h, w, labels, plan)[0], (h, w, labels, None)


def _loss_bwd(plan, saved, g):
  h, w, labels, tiles = saved
  g = jnp.where(labels >= 0, g.astype(F32), 0.0)
  if tiles is None:
    _, dh, dw = _by_rows(h, w, labels, g, plan)
  else:
    dh, dw = _gpu_gradients(h, w, labels, *tiles, g, plan)
  return dh.astype(h.dtype), dw.astype(w.dtype), None


_loss.defvjp(_loss_fwd, _loss_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _reduced(h, w, labels, reduction, plan):
  """A summed or averaged loss (CPU): its gradient is that of a cotangent of one
  (or 1/count) per row, so the forward under differentiation computes it already,
  from logits it holds for `block_n` rows at a time: three products in all."""
  return _reduce(_forward(h, w, labels, plan)[0], labels, reduction)


def _reduced_fwd(h, w, labels, reduction, plan):
  losses, dh, dw = _by_rows(h, w, labels, None, plan)   # whole vocabulary rows per step
  scale = jnp.ones((), F32) if reduction == "sum" else 1.0 / _counted(labels)
  return _reduce(losses, labels, reduction), (dh.astype(h.dtype), dw.astype(w.dtype), scale)


def _reduced_bwd(reduction, plan, saved, g):
  dh, dw, scale = saved
  g = g.astype(F32) * scale
  return (g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), None


_reduced.defvjp(_reduced_fwd, _reduced_bwd)

# Logits one step of the CPU gradient kernel holds at most (4 MiB of float32): its row
# block shrinks to fit a large vocabulary.
_ROWS_OF_LOGITS = 1 << 20


@dataclasses.dataclass(frozen=True)
class _Tiles:
  """The blocks and compiler params of one kernel (its launch-table section)."""
  block_n: int
  block_v: int
  block_h: int
  params: Any


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Blocks and launch parameters of one call, per kernel (hashable: a custom_vjp
  argument). On the CPU every kernel takes the same blocks."""
  gpu: bool
  fwd: _Tiles
  dlogits: _Tiles   # GPU: block_n rows of the forward's block_v-wide tiles


def _plan(launch: launch_table.Launch, hidden: int, block_n, block_v, block_h) -> _Plan:
  explicit = any(b is not None for b in (block_n, block_v, block_h))

  def tiles(section: str, semantics: tuple[str, ...]) -> _Tiles:
    bn = block_n or launch.get(section, "block_n", 128)
    bv = block_v or launch.get(section, "block_v", 512)
    bh = block_h or launch.get(section, "block_h", hidden)
    for name, value in (("block_n", bn), ("block_v", bv), ("block_h", bh)):
      check_block("linear_cross_entropy", name, value)
    params = (launch.compiler_params(section, explicit=explicit,
                                     dimension_semantics=semantics) if launch.on_gpu
              else pl.CompilerParams(dimension_semantics=semantics))
    return _Tiles(bn, bv, hidden if hidden % bh else bh, params)

  if not launch.on_gpu:   # the vocabulary axis folds in order into running statistics
    cpu = tiles("fwd", ("parallel", "arbitrary"))
    return _Plan(False, cpu, cpu)
  fwd = tiles("fwd", ("parallel", "parallel"))
  dlogits = tiles("dlogits", ("parallel", "parallel"))
  return _Plan(True, fwd, dlogits)


def linear_cross_entropy(h: jax.Array, w: jax.Array, labels: jax.Array, *,
                         reduction: str = "none", block_n: int | None = None,
                         block_v: int | None = None, block_h: int | None = None) -> jax.Array:
  """Cross-entropy loss (float32) of logits h @ w against integer `labels`, computed
  without materializing the float32 logits.

  h: (rows, hidden); w: (hidden, vocabulary); labels: (rows,) ints, < 0 to ignore a row.
  `reduction`: "none" (the loss per row, shape (rows,)), "sum", or "mean" (over the
  rows not ignored; NaN if all are). With "sum" or "mean" on the CPU, the forward pass
  under differentiation also computes the gradients: one matrix product fewer than
  "none" needs where the loss is used.
  `block_n` rows and `block_v` vocabulary entries per grid step; products over the
  hidden axis go `block_h` units at a time (must divide hidden; the whole axis at
  once if not). Defaults: (128, 512, hidden) on the CPU; on Triton from the GPU's launch
  table (pallet.ops.launch_table, with each kernel's num_warps/num_stages). On the CPU
  the gradient kernel takes `block_n` rows (fewer for a vocabulary over 8K)
  over the whole vocabulary per step. Differentiable in h and w (on the CPU the
  backward pass recomputes the logits; on a GPU the forward under differentiation
  keeps exp(logits - tile max) in the inputs' dtype for it).
  """
  op = "linear_cross_entropy"
  if reduction not in REDUCTIONS:
    raise fail(op, f"reduction {reduction!r} is not one of {list(REDUCTIONS)}")
  check_float(op, "h", h)
  check_float(op, "w", w)
  if h.ndim != 2 or w.ndim != 2:
    raise fail(op, f"h and w must be 2-D (rows, hidden) and (hidden, vocabulary), got "
                   f"shapes {h.shape} and {w.shape}")
  if w.shape[0] != h.shape[1]:
    raise fail(op, f"w has shape {w.shape}, expected ({h.shape[1]}, vocabulary) to match "
                   f"h's hidden size {h.shape[1]}")
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise fail(op, f"labels must be integers, got {labels.dtype}")
  check_shape(op, "labels", labels, (h.shape[0],))
  hidden = h.shape[1]
  launch = launch_table.lookup(op, hidden=hidden, vocab=w.shape[1],
                               itemsize=jnp.dtype(h.dtype).itemsize)
  plan = _plan(launch, hidden, block_n, block_v, block_h)
  labels = labels.astype(jnp.int32)
  if reduction != "none" and not plan.gpu:
    return _reduced(h, w, labels, reduction, plan)
  return _reduce(_loss(h, w, labels, plan), labels, reduction)
