"""5-point stencil (discrete Laplacian, zero boundary) over row blocks.

Halo choice: the program zero-pads the input by one cell on every side, passes
the padded array as a single whole-array block, and each grid step reads five
shifted (block_rows, width) windows of it with `pl.ds`. Every window has the
same shape as the output block, so the same kernel also suits Triton, which
needs power-of-two block shapes. Both the Pallas and the jax.numpy program pad,
so the padding is part of what is timed on both sides.
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from pallet.bench.case import Benchmark, Size

SIZES: dict[Size, dict[str, int]] = {
    "full": dict(height=2048, width=2048, block_rows=32),
    "test": dict(height=512, width=512, block_rows=32),
    "small": dict(height=512, width=512, block_rows=32),
    "tiny": dict(height=64, width=128, block_rows=16),
}


def _laplacian(center, up, down, left, right):
  return 4.0 * center - up - down - left - right


def stencil_kernel(pl: ModuleType):
  """o = 4*x - (x above + below + left + right), read from the padded whole array."""

  def kernel(xp_ref, o_ref):
    rows, width = o_ref.shape
    top = pl.program_id(0) * rows  # first padded row of this block's halo

    def window(row_shift, col_shift):
      return xp_ref[pl.ds(top + row_shift, rows), pl.ds(col_shift, width)]

    o_ref[...] = _laplacian(window(1, 1), window(0, 1), window(2, 1),
                            window(1, 0), window(1, 2))

  return kernel


def stencil5(pl: ModuleType, *, height: int, width: int, block_rows: int,
             **call_kwargs: Any):
  call = pl.pallas_call(
      stencil_kernel(pl),
      out_shape=jax.ShapeDtypeStruct((height, width), jnp.float32),
      grid=(height // block_rows,),
      in_specs=[pl.BlockSpec((height + 2, width + 2), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((block_rows, width), lambda i: (i, 0)),
      **call_kwargs,
  )
  return lambda x: call(jnp.pad(x, 1))


def stencil_reference(x: jax.Array) -> jax.Array:
  xp = jnp.pad(x, 1)
  return _laplacian(xp[1:-1, 1:-1], xp[:-2, 1:-1], xp[2:, 1:-1],
                    xp[1:-1, :-2], xp[1:-1, 2:])


def _inputs(height: int, width: int, key: jax.Array) -> tuple[jax.Array, ...]:
  return (jax.random.normal(key, (height, width), jnp.float32),)


def benchmarks(size: Size) -> list[Benchmark]:
  s = SIZES[size]
  h, w, br = s["height"], s["width"], s["block_rows"]
  return [Benchmark(
      name="stencil5",
      family="stencil",
      grid=(h // br,),
      shapes=f"{h}x{w} f32, {br}-row blocks, halo from padded whole-array ref",
      make_inputs=functools.partial(_inputs, h, w),
      reference=stencil_reference,
      build_pallas=functools.partial(stencil5, **s),
      rtol=1e-5,
      atol=1e-5,
  )]
