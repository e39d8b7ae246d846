"""Row-wise normalisations: softmax and layer norm over 8-row blocks.

Each grid step owns whole rows, so the kernels are independent across the grid;
they measure how well a backend batches many small, reduction-heavy steps.
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.case import Benchmark, Size

SIZES: dict[Size, dict[str, int]] = {
    "full": dict(rows=4096, cols=1024, block_rows=8),
    "small": dict(rows=512, cols=256, block_rows=8),
    "tiny": dict(rows=32, cols=128, block_rows=8),
}
LAYER_NORM_EPS = 1e-5


def _softmax_rows(x: jax.Array) -> jax.Array:
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  return e / jnp.sum(e, axis=-1, keepdims=True)


def _layer_norm_rows(x: jax.Array, gamma: jax.Array, beta: jax.Array) -> jax.Array:
  mean = jnp.mean(x, axis=-1, keepdims=True)
  centered = x - mean
  var = jnp.mean(centered * centered, axis=-1, keepdims=True)
  return centered * jax.lax.rsqrt(var + LAYER_NORM_EPS) * gamma + beta


def softmax_kernel(pl: ModuleType):
  del pl

  def kernel(x_ref, o_ref):
    o_ref[...] = _softmax_rows(x_ref[...])

  return kernel


def layer_norm_kernel(pl: ModuleType):
  del pl

  def kernel(x_ref, gamma_ref, beta_ref, o_ref):
    o_ref[...] = _layer_norm_rows(x_ref[...], gamma_ref[...], beta_ref[...])

  return kernel


def row_softmax(pl: ModuleType, *, rows: int, cols: int, block_rows: int,
                **call_kwargs: Any):
  spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
  return pl.pallas_call(
      softmax_kernel(pl),
      out_shape=jax.ShapeDtypeStruct((rows, cols), jnp.float32),
      grid=(rows // block_rows,),
      in_specs=[spec],
      out_specs=spec,
      **call_kwargs,
  )


def layer_norm(pl: ModuleType, *, rows: int, cols: int, block_rows: int,
               **call_kwargs: Any):
  rows_spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
  vector_spec = pl.BlockSpec((cols,), lambda i: (0,))
  return pl.pallas_call(
      layer_norm_kernel(pl),
      out_shape=jax.ShapeDtypeStruct((rows, cols), jnp.float32),
      grid=(rows // block_rows,),
      in_specs=[rows_spec, vector_spec, vector_spec],
      out_specs=rows_spec,
      **call_kwargs,
  )


def _softmax_inputs(rows: int, cols: int, key: jax.Array) -> tuple[jax.Array, ...]:
  return (3.0 * jax.random.normal(key, (rows, cols), jnp.float32),)


def _layer_norm_inputs(rows: int, cols: int, key: jax.Array) -> tuple[jax.Array, ...]:
  kx, kg, kb = jax.random.split(key, 3)
  return (2.0 * jax.random.normal(kx, (rows, cols), jnp.float32) + 0.5,
          1.0 + 0.1 * jax.random.normal(kg, (cols,), jnp.float32),
          0.1 * jax.random.normal(kb, (cols,), jnp.float32))


def benchmarks(size: Size) -> list[Benchmark]:
  s = SIZES[size]
  rows, cols, br = s["rows"], s["cols"], s["block_rows"]
  shapes = f"{rows}x{cols} f32, {br}-row blocks"
  return [
      Benchmark(
          name="softmax",
          family="rowwise",
          grid=(rows // br,),
          shapes=shapes,
          make_inputs=functools.partial(_softmax_inputs, rows, cols),
          reference=_softmax_rows,
          build_pallas=functools.partial(row_softmax, **s),
          rtol=1e-5,
          atol=1e-6,
      ),
      Benchmark(
          name="layernorm",
          family="rowwise",
          grid=(rows // br,),
          shapes=shapes,
          make_inputs=functools.partial(_layer_norm_inputs, rows, cols),
          reference=_layer_norm_rows,
          build_pallas=functools.partial(layer_norm, **s),
          rtol=1e-5,
          atol=1e-5,
      ),
  ]
