"""Blocked matrix multiplication with an accumulating grid axis.

You will learn the standard accumulate-over-a-grid-axis pattern: the output block
(i, j) stays resident while the k axis runs, is zeroed at k == 0 with `pl.when`, and
receives `+=` at every step. Run it: `python examples/matmul.py`.
"""
# %%
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallet as pl


# %%
def matmul_kernel(x_ref, y_ref, o_ref, *, activation):
  # x_ref: (bm, bk) block of x; y_ref: (bk, bn) block of y; o_ref: (bm, bn) output block.
  k = pl.program_id(2)

  @pl.when(k == 0)
  def _init():
    o_ref[...] = jnp.zeros_like(o_ref)

  o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

  @pl.when(k == pl.num_programs(2) - 1)
  def _finish():
    if activation == "relu":
      o_ref[...] = jnp.maximum(o_ref[...], 0)


# %% The grid is (m/bm, n/bn, k/bk); the k axis is the reduction axis.
@functools.partial(jax.jit, static_argnames=("activation", "block"))
def matmul(x, y, *, activation=None, block=128):
  m, k = x.shape
  _, n = y.shape
  return pl.pallas_call(
      functools.partial(matmul_kernel, activation=activation),
      out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
      grid=(m // block, n // block, k // block),
      in_specs=[pl.BlockSpec((block, block), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((block, block), lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec((block, block), lambda i, j, kk: (i, j)),
      debug=False)(x, y)


# %%
def _report(what: str, got: jax.Array, want: jax.Array) -> None:
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
  print(f"{what} matches jax.numpy: max |difference| "
        f"{float(jnp.max(jnp.abs(got - want))):.1e}")


def check() -> None:
  kx, ky = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (256, 384), jnp.float32)
  y = jax.random.normal(ky, (384, 512), jnp.float32)
  want = jnp.dot(x, y, preferred_element_type=jnp.float32)
  _report("matmul 256x384 @ 384x512", matmul(x, y), want)
  _report("matmul + relu", matmul(x, y, activation="relu"), jnp.maximum(want, 0))
  # vmap adds a grid axis: a batch of matmuls.
  xb = jax.random.normal(kx, (3, 128, 256))
  yb = jax.random.normal(ky, (3, 256, 128))
  _report("vmapped matmul (3 x 128x256 @ 256x128)", jax.vmap(matmul)(xb, yb),
          jnp.einsum("bij,bjk->bik", xb, yb))


# %% Timing against jnp.dot (median of `reps` runs after a warm-up that compiles).
def median_ms(fn, *args, reps: int = 7) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def benchmark(sizes=(256, 512, 1024), reps: int = 7) -> None:
  reference = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
  print(f"{'m = n = k':>10}{'pallet ms':>12}{'jax.numpy ms':>14}")
  for n in sizes:
    x = jax.random.normal(jax.random.key(1), (n, n))
    y = jax.random.normal(jax.random.key(2), (n, n))
    print(f"{n:>10}{median_ms(matmul, x, y, reps=reps):>12.3f}"
          f"{median_ms(reference, x, y, reps=reps):>14.3f}")


if __name__ == "__main__":
  check()
  benchmark()
