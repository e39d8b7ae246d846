"""Vector addition: the first pallet kernel.

You will learn how a kernel reads and writes Refs, how `pallas_call` cuts arrays into
blocks with `BlockSpec`s over a grid, and how to check a kernel against jax.numpy.
Run it: `python examples/vector_add.py`.
"""
# %%
import time

import jax
import numpy as np

import pallet as pl


# %% [markdown]
# The kernel sees one block of each operand. `x_ref[...]` reads the whole block into a
# jax.Array; `o_ref[...] = ...` writes it back.
# %%
def add_kernel(x_ref, y_ref, o_ref):
  # x_ref, y_ref: the current input blocks; o_ref: the current output block.
  o_ref[...] = x_ref[...] + y_ref[...]


# %% [markdown]
# The host wrapper: one grid step per block of `block` elements. The index map says
# that grid step `i` sees block `i`. A last, partial block is fine: reads past the end
# are unspecified and writes past the end are dropped.
# %%
@jax.jit
def add(x: jax.Array, y: jax.Array) -> jax.Array:
  block = 1024
  spec = pl.BlockSpec((block,), lambda i: (i,))
  return pl.pallas_call(add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(pl.cdiv(x.shape[0], block),),
                        in_specs=[spec, spec], out_specs=spec)(x, y)


# %% Correctness against jax.numpy, on sizes that do and do not divide into blocks.
def check() -> None:
  for n in (4096, 5000):
    kx, ky = jax.random.split(jax.random.key(n))
    x, y = jax.random.normal(kx, (n,)), jax.random.normal(ky, (n,))
    np.testing.assert_allclose(add(x, y), x + y, rtol=1e-6)


# %% Timing against the same computation in jax.numpy.
def benchmark(n: int = 1 << 22, reps: int = 7) -> None:
  x = jax.random.normal(jax.random.key(0), (n,))
  y = jax.random.normal(jax.random.key(1), (n,))
  ref = jax.jit(lambda x, y: x + y)
  for name, fn in (("pallet", add), ("jax.numpy", ref)):
    jax.block_until_ready(fn(x, y))
    times = []
    for _ in range(reps):
      t = time.perf_counter()
      jax.block_until_ready(fn(x, y))
      times.append(time.perf_counter() - t)
    print(f"{name:>10}: {1e3 * sorted(times)[reps // 2]:.2f} ms")


if __name__ == "__main__":
  check()
  print("vector add matches jax.numpy")
  benchmark()
