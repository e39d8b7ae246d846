"""Gated linear units: glu(a, b) = act(a) * b, with act = silu (SwiGLU), gelu (tanh
approximation, GeGLU) or sigmoid (the original GLU).

Forward and backward are elementwise kernels over 2-D (rows, features) tiles; the
backward computes da = dy * b * act'(a) and db = dy * act(a) in one pass. The VJP
saves only a and b, so where the primal output is unused XLA drops the forward kernel.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

import pallet as pl
from pallet.ops import launch_table
from pallet.ops._common import F32, as_rows, cdiv, check_block, check_float, check_shape, fail
from pallet.core.helpers import next_power_of_2

__all__ = ["glu", "swiglu", "glu_reference", "swiglu_reference", "ACTIVATIONS"]

_GELU_C = math.sqrt(2.0 / math.pi)


def _silu(a):
  s = jax.nn.sigmoid(a)
  return a * s, s * (1.0 + a * (1.0 - s))


def _sigmoid(a):
  s = jax.nn.sigmoid(a)
  return s, s * (1.0 - s)


def _gelu(a):
  inner = _GELU_C * (a + 0.044715 * a * a * a)
  t = jnp.tanh(inner)
  value = 0.5 * a * (1.0 + t)
  slope = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * a * a)
  return value, slope


# name -> f32 array -> (act(a), act'(a))
ACTIVATIONS = {"silu": _silu, "gelu": _gelu, "sigmoid": _sigmoid}
_REFERENCE = {"silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid,
              "gelu": functools.partial(jax.nn.gelu, approximate=True)}


def glu_reference(a: jax.Array, b: jax.Array, *, activation: str = "silu") -> jax.Array:
  """jax.numpy act(a) * b in float32, a's dtype out."""
  return (_REFERENCE[activation](a.astype(F32)) * b.astype(F32)).astype(a.dtype)


def swiglu_reference(a: jax.Array, b: jax.Array) -> jax.Array:
  return glu_reference(a, b, activation="silu")


def _forward_kernel(activation):
  def kernel(a_ref, b_ref, o_ref):
    value, _ = ACTIVATIONS[activation](a_ref[...].astype(F32))
    o_ref[...] = (value * b_ref[...].astype(F32)).astype(o_ref.dtype)
  return kernel


def _backward_kernel(activation):
  def kernel(a_ref, b_ref, dy_ref, da_ref, db_ref):
    value, slope = ACTIVATIONS[activation](a_ref[...].astype(F32))
    dy = dy_ref[...].astype(F32)
    da_ref[...] = (dy * b_ref[...].astype(F32) * slope).astype(da_ref.dtype)
    db_ref[...] = (dy * value).astype(db_ref.dtype)
  return kernel


def _launch(kernel, name, blocks, params, arrays, outputs):
  n, f = arrays[0].shape
  spec = pl.BlockSpec(blocks, lambda i, j: (i, j))
  shapes = [jax.ShapeDtypeStruct((n, f), a.dtype) for a in arrays[:outputs]]
  out = pl.pallas_call(kernel, out_shape=shapes, grid=(cdiv(n, blocks[0]), cdiv(f, blocks[1])),
                       in_specs=[spec] * len(arrays), out_specs=[spec] * outputs,
                       name=name, compiler_params=params)(*arrays)
  return out


# plan: ((block_rows, block_cols), forward compiler params, backward compiler params)
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _glu(a, b, activation, plan):
  return _launch(_forward_kernel(activation), f"glu_{activation}_fwd", plan[0], plan[1],
                 (a, b), 1)[0]


def _glu_fwd(a, b, activation, plan):
  return _glu(a, b, activation, plan), (a, b)


def _glu_bwd(activation, plan, saved, dy):
  a, b = saved
  da, db = _launch(_backward_kernel(activation), f"glu_{activation}_bwd", plan[0], plan[2],
                   (a, b, dy), 2)
  return da, db


_glu.defvjp(_glu_fwd, _glu_bwd)


def glu(a: jax.Array, b: jax.Array, *, activation: str = "silu", block_rows: int | None = None,
        block_cols: int | None = None) -> jax.Array:
  """act(a) * b elementwise (float32 math, a's dtype out); a and b of one shape and dtype,
  e.g. the gate and up projections of a transformer MLP.

  `activation`: "silu" (SwiGLU), "gelu" (GeGLU, tanh approximation) or "sigmoid".
  Tiles of (`block_rows`, `block_cols`) over (rows, last axis); defaults: the whole
  array on the CPU; on a GPU up to the launch table's `max_cols` columns and
  `elements` per tile (pallet.ops.launch_table).
  Differentiable in a and b.
  """
  op = "glu"
  if activation not in ACTIVATIONS:
    raise fail(op, f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
  check_float(op, "a", a)
  check_float(op, "b", b)
  check_shape(op, "b", b, a.shape)
  if b.dtype != a.dtype:
    raise fail(op, f"b has dtype {b.dtype}, expected a's dtype {a.dtype}")
  if a.ndim < 1 or a.size == 0:
    raise fail(op, f"a must be a non-empty array, got shape {a.shape}")
  rows, f = as_rows(a).shape
  launch = launch_table.lookup(op, width=f, itemsize=jnp.dtype(a.dtype).itemsize)
  explicit = block_rows is not None or block_cols is not None
  if not launch.on_gpu:
    # One block: XLA fuses the whole elementwise pass; smaller blocks only add a
    # vectorized (blocks, rows, cols) layout whose temporaries get buffers of their own.
    block_cols, block_rows = block_cols or f, block_rows or rows
  block_cols = block_cols or min(launch.get("fwd", "max_cols"), next_power_of_2(f))
  block_rows = block_rows or max(1, launch.get("fwd", "elements") // block_cols)
  check_block(op, "block_rows", block_rows)
  check_block(op, "block_cols", block_cols)
  plan = ((block_rows, block_cols), launch.compiler_params("fwd", explicit=explicit),
          launch.compiler_params("bwd", explicit=explicit))
  return _glu(as_rows(a), as_rows(b), activation, plan).reshape(a.shape)


def swiglu(a: jax.Array, b: jax.Array, **blocks: int | None) -> jax.Array:
  """silu(a) * b: glu with the SiLU activation."""
  return glu(a, b, activation="silu", **blocks)
