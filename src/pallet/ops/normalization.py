"""Layer norm and RMS norm over the last axis, with an optional fused residual add.

`layer_norm(x, w, b)` = (x - mean) / sqrt(var + eps) * w + b and `rms_norm(x, w)` =
x / sqrt(mean(x^2) + eps) * w, both computed in float32 and returned in x's dtype.
With `residual=`, the kernel first forms h = x + residual and returns (norm(h), h):
the pre-norm transformer step in one pass over memory.

Forward: one kernel over blocks of whole rows, saving per-row mean and 1/std.
Backward: one kernel over the same row blocks giving dx (and the residual's
cotangent) plus per-block partial sums of dw and db, which a final sum over the
(few) blocks turns into the weight gradients. Grid steps are independent in both.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

import pallet as pl
from pallet.ops import launch_table
from pallet.ops._common import F32, as_rows, cdiv, check_float, check_shape
from pallet.ops._common import fail, row_mask, row_plan

__all__ = ["layer_norm", "rms_norm", "layer_norm_reference", "rms_norm_reference"]


# ------------------------------------------------------------------ references
def layer_norm_reference(x: jax.Array, weight: jax.Array | None = None,
                         bias: jax.Array | None = None, residual: jax.Array | None = None,
                         *, eps: float = 1e-5) -> Any:
  """jax.numpy layer norm over the last axis (float32 math); (y, x + residual) with
  a residual."""
  h = x if residual is None else x + residual
  hf = h.astype(F32)
  mean = jnp.mean(hf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(hf - mean), axis=-1, keepdims=True)
  y = (hf - mean) * jax.lax.rsqrt(var + eps)
  if weight is not None:
    y = y * weight.astype(F32)
  if bias is not None:
    y = y + bias.astype(F32)
  y = y.astype(x.dtype)
  return y if residual is None else (y, h)


def rms_norm_reference(x: jax.Array, weight: jax.Array | None = None,
                       residual: jax.Array | None = None, *, eps: float = 1e-6) -> Any:
  """jax.numpy RMS norm over the last axis (float32 math); (y, x + residual) with a
  residual."""
  h = x if residual is None else x + residual
  hf = h.astype(F32)
  y = hf * jax.lax.rsqrt(jnp.mean(jnp.square(hf), axis=-1, keepdims=True) + eps)
  if weight is not None:
    y = y * weight.astype(F32)
  y = y.astype(x.dtype)
  return y if residual is None else (y, h)


# ------------------------------------------------------------------ kernels
def _normalized(h: jax.Array, rms: bool, eps: float):
  """(xhat, mean, rstd) of float32 rows h (mean is None for RMS norm)."""
  if rms:
    rstd = jax.lax.rsqrt(jnp.mean(h * h, axis=1, keepdims=True) + eps)
    return h * rstd, None, rstd
  mean = jnp.mean(h, axis=1, keepdims=True)
  centered = h - mean
  rstd = jax.lax.rsqrt(jnp.mean(centered * centered, axis=1, keepdims=True) + eps)
  return centered * rstd, mean, rstd


def _forward_kernel(rms: bool, eps: float, has_residual: bool):
  def kernel(*refs):
    refs = list(refs)
    x_ref = refs.pop(0)
    r_ref = refs.pop(0) if has_residual else None
    w_ref, b_ref = refs.pop(0), (None if rms else refs.pop(0))
    y_ref = refs.pop(0)
    h_ref = refs.pop(0) if has_residual else None
    mean_ref = None if rms else refs.pop(0)
    rstd_ref = refs.pop(0)
    h = x_ref[...].astype(F32)
    if has_residual:
      h = h + r_ref[...].astype(F32)
      h_ref[...] = h.astype(h_ref.dtype)
    xhat, mean, rstd = _normalized(h, rms, eps)
    y = xhat * w_ref[...].astype(F32)[None, :]
    if not rms:
      y = y + b_ref[...].astype(F32)[None, :]
      mean_ref[...] = mean[:, 0]
    y_ref[...] = y.astype(y_ref.dtype)
    rstd_ref[...] = rstd[:, 0]

  return kernel


def _backward_kernel(rms: bool, rows: int, block_rows: int, has_residual: bool):
  def kernel(*refs):
    refs = list(refs)
    dy_ref, h_ref, w_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    mean_ref = None if rms else refs.pop(0)
    rstd_ref = refs.pop(0)
    dh_ref = refs.pop(0) if has_residual else None
    dx_ref = refs.pop(0)
    dr_ref = refs.pop(0) if has_residual else None
    dw_ref, db_ref = refs.pop(0), (None if rms else refs.pop(0))
    # Rows past the array's edge hold unspecified values: keep them out of the
    # weight-gradient sums (only where the blocks do not divide the rows: the
    # select costs the CPU backend a fused pass).
    ragged = rows % block_rows != 0
    valid = row_mask(block_rows, rows, pl.program_id(0)) if ragged else None
    dy = dy_ref[...].astype(F32)
    if ragged:
      dy = jnp.where(valid, dy, 0.0)
    h = h_ref[...].astype(F32)
    rstd = rstd_ref[...][:, None]
    xhat = (h if rms else h - mean_ref[...][:, None]) * rstd
    wdy = dy * w_ref[...].astype(F32)[None, :]
    c1 = jnp.mean(xhat * wdy, axis=1, keepdims=True)
    if rms:
      dh = (wdy - xhat * c1) * rstd
    else:
      dh = (wdy - xhat * c1 - jnp.mean(wdy, axis=1, keepdims=True)) * rstd
    if has_residual:
      dh = dh + dh_ref[...].astype(F32)
      dr_ref[...] = dh.astype(dr_ref.dtype)
    dx_ref[...] = dh.astype(dx_ref.dtype)
    dw_ref[...] = jnp.sum(jnp.where(valid, dy * xhat, 0.0) if ragged else dy * xhat, axis=0)
    if not rms:
      db_ref[...] = jnp.sum(dy, axis=0)

  return kernel


# ------------------------------------------------------------------ launches
def _row_specs(block_rows: int, width: int):
  rows = pl.BlockSpec((block_rows, width), lambda i: (i, 0))
  stat = pl.BlockSpec((block_rows,), lambda i: (i,))
  vector = pl.BlockSpec((width,), lambda i: (0,))
  partial = pl.BlockSpec((None, width), lambda i: (i, 0))
  return rows, stat, vector, partial


def _forward(x, w, b, r, rms, eps, plan):
  block_rows, params = plan[0], plan[1]
  n, d = x.shape
  rows, stat, vector, _ = _row_specs(block_rows, d)
  has_residual = r is not None
  inputs = [x] + ([r] if has_residual else []) + [w] + ([] if rms else [b])
  in_specs = [rows] + ([rows] if has_residual else []) + [vector] + ([] if rms else [vector])
  out_shape = [jax.ShapeDtypeStruct((n, d), x.dtype)]
  out_specs = [rows]
  if has_residual:
    out_shape.append(jax.ShapeDtypeStruct((n, d), x.dtype))
    out_specs.append(rows)
  stats = 1 if rms else 2
  out_shape += [jax.ShapeDtypeStruct((n,), F32)] * stats
  out_specs += [stat] * stats
  outs = pl.pallas_call(_forward_kernel(rms, eps, has_residual), out_shape=out_shape,
                        grid=(cdiv(n, block_rows),), in_specs=in_specs,
                        out_specs=out_specs, name="rms_norm_fwd" if rms else "layer_norm_fwd",
                        compiler_params=params)(*inputs)
  y, rest = outs[0], list(outs[1:])
  h = rest.pop(0) if has_residual else x
  mean = None if rms else rest.pop(0)
  return y, h, mean, rest.pop(0)


def _backward(dy, h, w, mean, rstd, dh_out, rms, plan):
  block_rows, params = plan[0], plan[2]
  n, d = h.shape
  rows, stat, vector, partial = _row_specs(block_rows, d)
  has_residual = dh_out is not None
  blocks = cdiv(n, block_rows)
  inputs = [dy, h, w] + ([] if rms else [mean]) + [rstd] + ([dh_out] if has_residual else [])
  in_specs = [rows, rows, vector] + ([] if rms else [stat]) + [stat] + (
      [rows] if has_residual else [])
  out_shape = [jax.ShapeDtypeStruct((n, d), h.dtype)]
  out_specs = [rows]
  if has_residual:
    out_shape.append(jax.ShapeDtypeStruct((n, d), h.dtype))
    out_specs.append(rows)
  sums = 1 if rms else 2
  out_shape += [jax.ShapeDtypeStruct((blocks, d), F32)] * sums
  out_specs += [partial] * sums
  outs = pl.pallas_call(_backward_kernel(rms, n, block_rows, has_residual),
                        out_shape=out_shape, grid=(blocks,), in_specs=in_specs,
                        out_specs=out_specs,
                        name="rms_norm_bwd" if rms else "layer_norm_bwd",
                        compiler_params=params)(*inputs)
  outs = list(outs)
  dx = outs.pop(0)
  dr = outs.pop(0) if has_residual else None
  dw = jnp.sum(outs.pop(0), axis=0)
  db = None if rms else jnp.sum(outs.pop(0), axis=0)
  return dx, dr, dw, db


# plan: (block_rows, forward compiler params, backward compiler params)
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _norm(x, w, b, r, rms, eps, plan):
  y, h, _, _ = _forward(x, w, b, r, rms, eps, plan)
  return y if r is None else (y, h)


def _norm_fwd(x, w, b, r, rms, eps, plan):
  y, h, mean, rstd = _forward(x, w, b, r, rms, eps, plan)
  out = y if r is None else (y, h)
  return out, (h, w, b, mean, rstd)


def _norm_bwd(rms, eps, plan, saved, cotangent):
  del eps
  h, w, b, mean, rstd = saved
  dy, dh_out = cotangent if isinstance(cotangent, tuple) else (cotangent, None)
  dx, dr, dw, db = _backward(dy, h, w, mean, rstd, dh_out, rms, plan)
  db = None if b is None else db.astype(b.dtype)
  return dx, dw.astype(w.dtype), db, dr


_norm.defvjp(_norm_fwd, _norm_bwd)


def _normalize(op: str, x, weight, bias, residual, rms, eps, block_rows):
  check_float(op, "x", x)
  if x.ndim < 1 or x.shape[-1] == 0:
    raise fail(op, f"x needs a non-empty last axis to normalize, got shape {x.shape}")
  d = x.shape[-1]
  for name, v in (("weight", weight), ("bias", bias)):
    if v is not None:
      check_float(op, name, v)
      check_shape(op, name, v, (d,))
  if residual is not None:
    check_float(op, "residual", residual)
    check_shape(op, "residual", residual, x.shape)
    if residual.dtype != x.dtype:
      raise fail(op, f"residual has dtype {residual.dtype}, expected x's dtype {x.dtype}")
  launch = launch_table.lookup(op, width=d, itemsize=jnp.dtype(x.dtype).itemsize)
  plan = row_plan(op, launch, d, x.size // d, block_rows)
  w = jnp.ones((d,), x.dtype) if weight is None else weight
  b = None if rms else (jnp.zeros((d,), x.dtype) if bias is None else bias)
  out = _norm(as_rows(x), w, b, None if residual is None else as_rows(residual), rms,
              float(eps), plan)
  if residual is None:
    return out.reshape(x.shape)
  return out[0].reshape(x.shape), out[1].reshape(x.shape)


def layer_norm(x: jax.Array, weight: jax.Array | None = None, bias: jax.Array | None = None,
               residual: jax.Array | None = None, *, eps: float = 1e-5,
               block_rows: int | None = None) -> Any:
  """Layer norm of x over its last axis, times `weight`, plus `bias` (both optional).

  With `residual` (x's shape), normalizes h = x + residual and returns (y, h).
  `block_rows`: rows per grid step (default: a power of two fitting the launch table's
  `elements` per step, ~4K, dividing the rows if it can).
  Differentiable in every array argument; the backward pass runs as kernels too.
  """
  return _normalize("layer_norm", x, weight, bias, residual, False, eps, block_rows)


def rms_norm(x: jax.Array, weight: jax.Array | None = None,
             residual: jax.Array | None = None, *, eps: float = 1e-6,
             block_rows: int | None = None) -> Any:
  """RMS norm of x over its last axis, times `weight` (optional).

  With `residual` (x's shape), normalizes h = x + residual and returns (y, h).
  `block_rows`: rows per grid step (default: a power of two fitting the launch table's
  `elements` per step, ~4K, dividing the rows if it can).
  """
  return _normalize("rms_norm", x, weight, None, residual, True, eps, block_rows)
