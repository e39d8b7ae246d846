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

from pallet.bench.case import Benchmark, Size

SIZES: dict[Size, dict[str, int]] = {
    "full": dict(rows=4096, cols=1024, block_rows=8),
    "test": dict(rows=1024, cols=256, block_rows=8),
    "small": dict(rows=512, cols=256, block_rows=8),
    "tiny": dict(rows=32, cols=128, block_rows=8),
}
# Row counts that are no multiple of the block: the last block overhangs the array.
EDGE_SIZES: dict[Size, dict[str, int]] = {
    "full": dict(rows=4100, cols=1000, block_rows=8),
    "test": dict(rows=1028, cols=250, block_rows=8),
    "small": dict(rows=516, cols=250, block_rows=8),
    "tiny": dict(rows=37, cols=128, block_rows=8),
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


def _softmax_rows_f32(x: jax.Array) -> jax.Array:
  """bf16 in and out, computed in f32 (what a kernel and its twin both do)."""
  return _softmax_rows(x.astype(jnp.float32)).astype(x.dtype)


def softmax_kernel(pl: ModuleType):
  del pl

  def kernel(x_ref, o_ref):
    o_ref[...] = _softmax_rows(x_ref[...])

  return kernel


def softmax_f32_kernel(pl: ModuleType):
  del pl

  def kernel(x_ref, o_ref):
    o_ref[...] = _softmax_rows_f32(x_ref[...])

  return kernel


def layer_norm_kernel(pl: ModuleType):
  del pl

  def kernel(x_ref, gamma_ref, beta_ref, o_ref):
    o_ref[...] = _layer_norm_rows(x_ref[...], gamma_ref[...], beta_ref[...])

  return kernel


def row_softmax(pl: ModuleType, *, rows: int, cols: int, block_rows: int,
                dtype: Any = jnp.float32, **call_kwargs: Any):
  spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
  kernel = softmax_kernel(pl) if dtype == jnp.float32 else softmax_f32_kernel(pl)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((rows, cols), dtype),
      grid=(pl.cdiv(rows, block_rows),),
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


def _softmax_inputs(rows: int, cols: int, key: jax.Array,
                    dtype: Any = jnp.float32) -> tuple[jax.Array, ...]:
  return ((3.0 * jax.random.normal(key, (rows, cols), jnp.float32)).astype(dtype),)


def _layer_norm_inputs(rows: int, cols: int, key: jax.Array) -> tuple[jax.Array, ...]:
  kx, kg, kb = jax.random.split(key, 3)
  return (2.0 * jax.random.normal(kx, (rows, cols), jnp.float32) + 0.5,
          1.0 + 0.1 * jax.random.normal(kg, (cols,), jnp.float32),
          0.1 * jax.random.normal(kb, (cols,), jnp.float32))


def benchmarks(size: Size) -> list[Benchmark]:
  s = SIZES[size]
  rows, cols, br = s["rows"], s["cols"], s["block_rows"]
  shapes = f"{rows}x{cols} f32, {br}-row blocks"
  e = EDGE_SIZES[size]
  er, ec = e["rows"], e["cols"]
  return [
      Benchmark(
          name="softmax_edge",
          family="rowwise",
          grid=(-(-er // br),),
          shapes=f"{er}x{ec} f32, {br}-row blocks, the last one overhanging",
          make_inputs=functools.partial(_softmax_inputs, er, ec),
          reference=_softmax_rows,
          build_pallas=functools.partial(row_softmax, **e),
          rtol=1e-5,
          atol=1e-6,
      ),
      Benchmark(
          name="softmax_bf16",
          family="rowwise",
          grid=(rows // br,),
          shapes=f"{rows}x{cols} bf16 (computed in f32), {br}-row blocks",
          make_inputs=functools.partial(_softmax_inputs, rows, cols, dtype=jnp.bfloat16),
          reference=_softmax_rows_f32,
          build_pallas=functools.partial(row_softmax, **s, dtype=jnp.bfloat16),
          rtol=1e-2,
          atol=1e-2,
      ),
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
