"""Vector addition: the first pallet kernel.

You will learn how a kernel reads and writes Refs, how `pallas_call` cuts arrays into
blocks with `BlockSpec`s over a grid, and how to check a kernel against jax.numpy.
Run it: `python examples/vector_add.py`.
"""
# %%
import statistics
import time

import jax
import jax.numpy as jnp
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
    got, want = add(x, y), x + y
    np.testing.assert_allclose(got, want, rtol=1e-6)
    print(f"vector add of {n} floats matches jax.numpy: max |difference| "
          f"{float(jnp.max(jnp.abs(got - want))):.1e}")


# %% Timing against the same computation in jax.numpy (median of `reps` runs after a
# warm-up that compiles).
def median_ms(fn, *args, reps: int = 7) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def benchmark(sizes=(1 << 16, 1 << 20, 1 << 22), reps: int = 7) -> None:
  reference = jax.jit(lambda x, y: x + y)
  print(f"{'n':>10}{'pallet ms':>12}{'jax.numpy ms':>14}")
  for n in sizes:
    x = jax.random.normal(jax.random.key(0), (n,))
    y = jax.random.normal(jax.random.key(1), (n,))
    print(f"{n:>10}{median_ms(add, x, y, reps=reps):>12.3f}"
          f"{median_ms(reference, x, y, reps=reps):>14.3f}")


if __name__ == "__main__":
  check()
  benchmark()
