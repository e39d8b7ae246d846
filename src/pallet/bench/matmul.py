"""Blocked matmul with a k grid axis that accumulates into a resident output block.

This is the canonical Pallas reduction-over-the-grid pattern: the output block
index ignores k, the block is zeroed at k == 0 with `pl.when` and `+=` at every
step, so a backend must keep the block resident across the k axis.

`matmul_scratch` is the TPU form of the same product (JAX's ops/tpu/matmul.py and
the Pallas TPU docs): an f32 scratch buffer is zeroed at k == 0 and `+=` every
step, and the output block is written from it (a cast) on the last k step only.
"""
from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from pallet.bench.case import Benchmark, Size

SIZES: dict[Size, dict[str, int]] = {
    "full": dict(m=1024, n=1024, k=1024, block=128),
    "test": dict(m=512, n=512, k=512, block=128),
    "small": dict(m=256, n=256, k=256, block=64),
    "tiny": dict(m=64, n=32, k=64, block=16),
}


def matmul_kernel(pl: ModuleType):
  """o[i, j] += x[i, k] @ y[k, j], zeroed on the first k step."""

  def kernel(x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _zero():
      o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    o_ref[...] += jnp.dot(x_ref[...], y_ref[...],
                          preferred_element_type=jnp.float32)

  return kernel


def scratch_matmul_kernel(pl: ModuleType):
  """acc += x[i, k] @ y[k, j] in a scratch buffer; o = acc on the last k step."""

  def kernel(x_ref, y_ref, o_ref, acc_ref):
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _zero():
      acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(k == pl.num_programs(2) - 1)
    def _store():
      o_ref[...] = acc_ref[...].astype(o_ref.dtype)

  return kernel


def blocked_matmul(pl: ModuleType, *, m: int, n: int, k: int, block: int,
                   **call_kwargs: Any):
  return pl.pallas_call(
      matmul_kernel(pl),
      out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
      grid=(m // block, n // block, k // block),
      in_specs=[pl.BlockSpec((block, block), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((block, block), lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec((block, block), lambda i, j, kk: (i, j)),
      **call_kwargs,
  )


def scratch_matmul(pl: ModuleType, *, m: int, n: int, k: int, block: int,
                   **call_kwargs: Any):
  return pl.pallas_call(
      scratch_matmul_kernel(pl),
      out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
      grid=(m // block, n // block, k // block),
      in_specs=[pl.BlockSpec((block, block), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((block, block), lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec((block, block), lambda i, j, kk: (i, j)),
      # The TPU namespace (pallet.tpu / pltpu) is a submodule: import it, do not rely on
      # something else having done so.
      scratch_shapes=[importlib.import_module(f"{pl.__name__}.tpu").VMEM((block, block),
                                                                    jnp.float32)],
      **call_kwargs,
  )


def matmul_reference(x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.dot(x, y, preferred_element_type=jnp.float32)


def _inputs(m: int, n: int, k: int, key: jax.Array) -> tuple[jax.Array, ...]:
  kx, ky = jax.random.split(key)
  return (jax.random.normal(kx, (m, k), jnp.float32),
          jax.random.normal(ky, (k, n), jnp.float32))


def benchmarks(size: Size) -> list[Benchmark]:
  s = SIZES[size]
  m, n, k, b = s["m"], s["n"], s["k"], s["block"]
  # f32 sums of k products of unit normals: entries ~ sqrt(k), summed in a different
  # order than XLA's dot.
  common = dict(family="matmul", grid=(m // b, n // b, k // b),
                make_inputs=functools.partial(_inputs, m, n, k), reference=matmul_reference,
                rtol=1e-4, atol=1e-4 * k ** 0.5)
  return [
      Benchmark(name="matmul", shapes=f"{m}x{k} @ {k}x{n} f32, {b}x{b} blocks",
                build_pallas=functools.partial(blocked_matmul, **s), **common),
      Benchmark(name="matmul_scratch",
                shapes=f"{m}x{k} @ {k}x{n} f32, {b}x{b} blocks, f32 scratch accumulator",
                build_pallas=functools.partial(scratch_matmul, **s), **common),
  ]
