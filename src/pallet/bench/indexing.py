"""Data-dependent addressing: a gather through an int array read from a ref, and
a histogram built with `pl.atomic_add`.

Gather: each grid step reads a block of row indices from `idx_ref` and indexes
the whole table ref with that int array (`table_ref[idx]`).
Histogram: each grid step scatter-adds ones at its block of values. The counts
start from a zero array aliased to the output (`input_output_aliases`) rather
than a `pl.when` on the first step, which is what makes the kernel correct on a
GPU too, where grid steps run concurrently.
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from pallet.bench.case import Benchmark, Size

GATHER_SIZES: dict[Size, dict[str, int]] = {
    "full": dict(table_rows=8192, row_width=128, num_indices=65536, block=256),
    "test": dict(table_rows=1024, row_width=128, num_indices=8192, block=256),
    "small": dict(table_rows=1024, row_width=128, num_indices=8192, block=256),
    "tiny": dict(table_rows=64, row_width=32, num_indices=256, block=32),
}
HISTOGRAM_SIZES: dict[Size, dict[str, int]] = {
    "full": dict(num_values=1024 * 1024, bins=256, block=1024),
    "test": dict(num_values=128 * 1024, bins=256, block=1024),
    "small": dict(num_values=128 * 1024, bins=256, block=1024),
    "tiny": dict(num_values=4096, bins=64, block=256),
}


# jax.experimental.pallas (interpret) discharges atomic_add as
# `ref.at[idx].set(ref[idx] + val)`, so repeated indices in one call count once.
PEER_ATOMIC_DUPLICATES = ("peer interpret drops repeated indices within one "
                          "atomic_add (discharged as ref.at[idx].set)")


def gather_kernel(pl: ModuleType):
  del pl

  def kernel(table_ref, idx_ref, o_ref):
    o_ref[...] = table_ref[idx_ref[...]]

  return kernel


def gather_rows(pl: ModuleType, *, table_rows: int, row_width: int,
                num_indices: int, block: int, **call_kwargs: Any):
  return pl.pallas_call(
      gather_kernel(pl),
      out_shape=jax.ShapeDtypeStruct((num_indices, row_width), jnp.float32),
      grid=(num_indices // block,),
      in_specs=[pl.BlockSpec((table_rows, row_width), lambda i: (0, 0)),
                pl.BlockSpec((block,), lambda i: (i,))],
      out_specs=pl.BlockSpec((block, row_width), lambda i: (i, 0)),
      **call_kwargs,
  )


def gather_reference(table: jax.Array, idx: jax.Array) -> jax.Array:
  return table[idx]


def histogram_kernel(pl: ModuleType):
  def kernel(values_ref, counts_in_ref, counts_ref):
    del counts_in_ref  # aliased to counts_ref: only supplies the zero start
    values = values_ref[...]
    pl.atomic_add(counts_ref, values, jnp.ones(values.shape, jnp.int32))

  return kernel


def histogram(pl: ModuleType, *, num_values: int, bins: int, block: int,
              **call_kwargs: Any):
  counts_spec = pl.BlockSpec((bins,), lambda i: (0,))
  call = pl.pallas_call(
      histogram_kernel(pl),
      out_shape=jax.ShapeDtypeStruct((bins,), jnp.int32),
      grid=(num_values // block,),
      in_specs=[pl.BlockSpec((block,), lambda i: (i,)), counts_spec],
      out_specs=counts_spec,
      input_output_aliases={1: 0},
      **call_kwargs,
  )
  return lambda values: call(values, jnp.zeros((bins,), jnp.int32))


def histogram_reference(values: jax.Array, *, bins: int) -> jax.Array:
  return jnp.bincount(values, length=bins).astype(jnp.int32)


def _gather_inputs(table_rows: int, row_width: int, num_indices: int,
                   key: jax.Array) -> tuple[jax.Array, ...]:
  kt, ki = jax.random.split(key)
  return (jax.random.normal(kt, (table_rows, row_width), jnp.float32),
          jax.random.randint(ki, (num_indices,), 0, table_rows, jnp.int32))


def _histogram_inputs(num_values: int, bins: int, key: jax.Array) -> tuple[jax.Array, ...]:
  # Skewed (squared uniform) so some bins collect many hits from one block.
  u = jax.random.uniform(key, (num_values,), jnp.float32)
  return (jnp.minimum((u * u * bins).astype(jnp.int32), bins - 1),)


def benchmarks(size: Size) -> list[Benchmark]:
  g, h = GATHER_SIZES[size], HISTOGRAM_SIZES[size]
  return [
      Benchmark(
          name="gather",
          family="indexing",
          grid=(g["num_indices"] // g["block"],),
          shapes=(f"{g['num_indices']} rows of a {g['table_rows']}x{g['row_width']} "
                  f"f32 table, {g['block']}-index blocks"),
          make_inputs=functools.partial(_gather_inputs, g["table_rows"],
                                        g["row_width"], g["num_indices"]),
          reference=gather_reference,
          build_pallas=functools.partial(gather_rows, **g),
          rtol=0.0,
          atol=0.0,
      ),
      Benchmark(
          name="histogram",
          family="indexing",
          grid=(h["num_values"] // h["block"],),
          shapes=f"{h['num_values']} int32 values, {h['bins']} bins, blocks of {h['block']}",
          make_inputs=functools.partial(_histogram_inputs, h["num_values"], h["bins"]),
          reference=functools.partial(histogram_reference, bins=h["bins"]),
          build_pallas=functools.partial(histogram, **h),
          rtol=0.0,
          atol=0.0,
          peer_known_issue=PEER_ATOMIC_DUPLICATES,
      ),
  ]
