"""Column sum of squares with a reduction grid axis.

The grid is (column blocks, row blocks); the output block depends only on the
column block, so the row-block axis is a reduction the backend must run in
order, keeping the output block resident (zeroed at the first row block).
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from pallet.bench.case import Benchmark, Size

SIZES: dict[Size, dict[str, int]] = {
    "full": dict(rows=8192, cols=1024, block_rows=256, block_cols=128),
    "test": dict(rows=2048, cols=256, block_rows=256, block_cols=128),
    "small": dict(rows=2048, cols=256, block_rows=256, block_cols=128),
    "tiny": dict(rows=128, cols=64, block_rows=32, block_cols=32),
}


def column_sum_squares_kernel(pl: ModuleType):
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(1) == 0)
    def _zero():
      o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    x = x_ref[...]
    o_ref[...] += jnp.sum(x * x, axis=0)

  return kernel


def column_sum_squares(pl: ModuleType, *, rows: int, cols: int, block_rows: int,
                       block_cols: int, **call_kwargs: Any):
  return pl.pallas_call(
      column_sum_squares_kernel(pl),
      out_shape=jax.ShapeDtypeStruct((cols,), jnp.float32),
      grid=(cols // block_cols, rows // block_rows),
      in_specs=[pl.BlockSpec((block_rows, block_cols), lambda j, i: (i, j))],
      out_specs=pl.BlockSpec((block_cols,), lambda j, i: (j,)),
      **call_kwargs,
  )


def column_sum_squares_reference(x: jax.Array) -> jax.Array:
  return jnp.sum(x * x, axis=0)


def _inputs(rows: int, cols: int, key: jax.Array) -> tuple[jax.Array, ...]:
  return (jax.random.normal(key, (rows, cols), jnp.float32),)


def benchmarks(size: Size) -> list[Benchmark]:
  s = SIZES[size]
  return [Benchmark(
      name="colsumsq",
      family="reduction",
      grid=(s["cols"] // s["block_cols"], s["rows"] // s["block_rows"]),
      shapes=(f"{s['rows']}x{s['cols']} f32, "
              f"{s['block_rows']}x{s['block_cols']} blocks"),
      make_inputs=functools.partial(_inputs, s["rows"], s["cols"]),
      reference=column_sum_squares_reference,
      build_pallas=functools.partial(column_sum_squares, **s),
      # Sums of `rows` squares of unit normals (~rows), in a different order.
      rtol=1e-4,
      atol=0.0,
  )]
