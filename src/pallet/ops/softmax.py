"""Softmax over the last axis: forward and backward kernels over blocks of whole rows.

y = exp(x - max x) / sum exp(x - max x) in float32, returned in x's dtype; the
backward kernel computes dx = y * (dy - sum(dy * y)) from the saved output, so the
input is not kept. Grid steps are independent.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallet as pl
from pallet.ops import launch_table
from pallet.ops._common import F32, as_rows, cdiv, check_float, fail, row_plan

__all__ = ["softmax", "softmax_reference"]


def softmax_reference(x: jax.Array) -> jax.Array:
  """jax.numpy softmax over the last axis (float32 math, x's dtype out)."""
  return jax.nn.softmax(x.astype(F32), axis=-1).astype(x.dtype)


def _forward_kernel(x_ref, y_ref):
  x = x_ref[...].astype(F32)
  e = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
  y_ref[...] = (e / jnp.sum(e, axis=1, keepdims=True)).astype(y_ref.dtype)


def _backward_kernel(y_ref, dy_ref, dx_ref):
  y, dy = y_ref[...].astype(F32), dy_ref[...].astype(F32)
  dx_ref[...] = (y * (dy - jnp.sum(dy * y, axis=1, keepdims=True))).astype(dx_ref.dtype)


def _rowwise(kernel, name, block_rows, params, *arrays):
  n, d = arrays[0].shape
  spec = pl.BlockSpec((block_rows, d), lambda i: (i, 0))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n, d), arrays[0].dtype),
                        grid=(cdiv(n, block_rows),), in_specs=[spec] * len(arrays),
                        out_specs=spec, name=name, compiler_params=params)(*arrays)


# plan: (block_rows, forward compiler params, backward compiler params)
@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _softmax(x, plan):
  return _rowwise(_forward_kernel, "softmax_fwd", plan[0], plan[1], x)


def _softmax_fwd(x, plan):
  y = _softmax(x, plan)
  return y, y


def _softmax_bwd(plan, y, dy):
  return (_rowwise(_backward_kernel, "softmax_bwd", plan[0], plan[2], y, dy),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def softmax(x: jax.Array, *, block_rows: int | None = None) -> jax.Array:
  """Softmax of x over its last axis (float32 math, x's dtype out).

  `block_rows`: rows per grid step (default: a power of two fitting the launch table's
  `elements` per step, ~4K).
  Each step holds whole rows, so very wide rows (beyond ~16K) cost registers on GPUs.
  """
  check_float("softmax", "x", x)
  if x.ndim < 1 or x.shape[-1] == 0:
    raise fail("softmax", f"x needs a non-empty last axis, got shape {x.shape}")
  d = x.shape[-1]
  launch = launch_table.lookup("softmax", width=d, itemsize=jnp.dtype(x.dtype).itemsize)
  plan = row_plan("softmax", launch, d, x.size // d, block_rows)
  return _softmax(as_rows(x), plan).reshape(x.shape)
