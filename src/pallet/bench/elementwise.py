"""Vector add: the smallest kernel, so it measures pure per-grid-step overhead.

Two block sizes over the same array: 1024-element blocks give thousands of grid
steps (overhead dominates), 65536-element blocks give few (bandwidth dominates).
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from pallet.bench.case import Benchmark, Size

SIZES: dict[Size, dict[str, Any]] = {
    "full": dict(n=4 * 1024 * 1024, blocks=(1024, 65536)),
    "test": dict(n=256 * 1024, blocks=(1024, 65536)),
    "small": dict(n=256 * 1024, blocks=(1024, 65536)),
    "tiny": dict(n=128 * 1024, blocks=(1024, 65536)),
}


def add_kernel(pl: ModuleType):
  """o = x + y on one block (the kernel needs nothing from `pl`)."""
  del pl

  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]

  return kernel


def vector_add(pl: ModuleType, *, n: int, block: int, **call_kwargs: Any):
  spec = pl.BlockSpec((block,), lambda i: (i,))
  return pl.pallas_call(
      add_kernel(pl),
      out_shape=jax.ShapeDtypeStruct((n,), jnp.float32),
      grid=(n // block,),
      in_specs=[spec, spec],
      out_specs=spec,
      **call_kwargs,
  )


def vector_add_reference(x: jax.Array, y: jax.Array) -> jax.Array:
  return x + y


def _inputs(n: int, key: jax.Array) -> tuple[jax.Array, ...]:
  kx, ky = jax.random.split(key)
  return (jax.random.normal(kx, (n,), jnp.float32),
          jax.random.normal(ky, (n,), jnp.float32))


def benchmarks(size: Size) -> list[Benchmark]:
  n = SIZES[size]["n"]
  return [
      Benchmark(
          name=f"vadd_b{block}",
          family="vadd",
          grid=(n // block,),
          shapes=f"{n} f32, blocks of {block}",
          make_inputs=functools.partial(_inputs, n),
          reference=vector_add_reference,
          build_pallas=functools.partial(vector_add, n=n, block=block),
          rtol=0.0,
          atol=0.0,
      )
      for block in SIZES[size]["blocks"]
  ]
