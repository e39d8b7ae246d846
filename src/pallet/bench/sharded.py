"""Kernels on arrays sharded across 4 devices, against jax.numpy under the same sharding.

The inputs are split by rows over a 4-device mesh; the kernel and its jax.numpy twin
are jitted on them as they are. pallet runs the kernel shard-locally (see
docs/distributed.md, "Automatic partitioning"): the layer norm through XLA's own
partitioner, the pairwise kernel (whose plan loops over chunks of rows) through
custom partitioning. Needs at least 4 devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=4` on a CPU); with fewer, the
family is empty, so the default single-device suite is unchanged.
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallet.bench import rowwise
from pallet.bench.case import Benchmark, Size

DEVICES = 4
SIZES: dict[Size, dict[str, dict[str, int]]] = {
    "full": dict(layernorm=dict(rows=4096, cols=1024, block_rows=8),
                 pairwise=dict(rows=256, cols=256, block_rows=8)),
    "test": dict(layernorm=dict(rows=512, cols=256, block_rows=8),
                 pairwise=dict(rows=128, cols=384, block_rows=8)),
    "small": dict(layernorm=dict(rows=512, cols=256, block_rows=8),
                  pairwise=dict(rows=128, cols=384, block_rows=8)),
    "tiny": dict(layernorm=dict(rows=64, cols=128, block_rows=8),
                 pairwise=dict(rows=64, cols=512, block_rows=8)),
}


def _pairwise_rows(x: jax.Array) -> jax.Array:
  """Per row r: sum_j tanh(r * r_j); large per-block intermediates (block x cols x cols)."""
  return jnp.sum(jnp.tanh(x[:, :, None] * x[:, None, :]), axis=2)


def pairwise(pl: ModuleType, *, rows: int, cols: int, block_rows: int, **call_kwargs: Any):
  def kernel(x_ref, o_ref):
    o_ref[...] = _pairwise_rows(x_ref[...])

  spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((rows, cols), jnp.float32),
                        grid=(rows // block_rows,), in_specs=[spec], out_specs=spec,
                        **call_kwargs)


def _row_sharded(make_inputs, key: jax.Array) -> tuple[jax.Array, ...]:
  """The inputs with their first (row) dimension split over the mesh; vectors replicated."""
  mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))
  return tuple(jax.device_put(a, NamedSharding(mesh, PartitionSpec("data") if a.ndim > 1
                                                else PartitionSpec()))
               for a in make_inputs(key))


def _pairwise_inputs(rows: int, cols: int, key: jax.Array) -> tuple[jax.Array, ...]:
  return (jax.random.normal(key, (rows, cols), jnp.float32),)


def benchmarks(size: Size) -> list[Benchmark]:
  if len(jax.devices()) < DEVICES:
    return []
  ln, pw = SIZES[size]["layernorm"], SIZES[size]["pairwise"]
  return [
      Benchmark(
          name="sharded_layernorm",
          family="sharded",
          grid=(ln["rows"] // ln["block_rows"],),
          shapes=f"{ln['rows']}x{ln['cols']} f32 rows over {DEVICES} devices",
          make_inputs=functools.partial(
              _row_sharded, functools.partial(rowwise._layer_norm_inputs, ln["rows"],
                                              ln["cols"])),
          reference=rowwise._layer_norm_rows,
          build_pallas=functools.partial(rowwise.layer_norm, **ln),
          rtol=1e-5,
          atol=1e-5,
      ),
      Benchmark(
          name="sharded_pairwise",
          family="sharded",
          grid=(pw["rows"] // pw["block_rows"],),
          shapes=f"{pw['rows']}x{pw['cols']} f32 rows over {DEVICES} devices",
          make_inputs=functools.partial(
              _row_sharded, functools.partial(_pairwise_inputs, pw["rows"], pw["cols"])),
          reference=_pairwise_rows,
          build_pallas=functools.partial(pairwise, **pw),
          rtol=1e-4,
          atol=1e-3,
      ),
  ]
