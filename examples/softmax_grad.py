"""Row softmax, then its gradient.

You will learn that a `pallas_call` is differentiable: `jax.grad` works through the
kernel (pallet differentiates the kernel's pure, discharged form). Run it:
`python examples/softmax_grad.py`.
"""
# %%
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallet as pl


# %%
def softmax_kernel(x_ref, o_ref):
  # x_ref, o_ref: a block of `rows` full rows.
  x = x_ref[...]
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  o_ref[...] = e / jnp.sum(e, axis=-1, keepdims=True)


def softmax(x: jax.Array, rows: int = 8) -> jax.Array:
  spec = pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))
  return pl.pallas_call(softmax_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(pl.cdiv(x.shape[0], rows),), in_specs=[spec],
                        out_specs=spec)(x)


# %%
def loss(f, w):
  return lambda x: jnp.sum(f(x) * w)


def reference(x: jax.Array) -> jax.Array:
  return jax.nn.softmax(x, axis=-1)


def check() -> None:
  x = jax.random.normal(jax.random.key(0), (64, 128))
  w = jax.random.normal(jax.random.key(1), (64, 128))
  got, want = softmax(x), reference(x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  print(f"softmax of 64x128 matches jax.numpy: max |difference| "
        f"{float(jnp.max(jnp.abs(got - want))):.1e}")
  got = jax.grad(loss(softmax, w))(x)
  want = jax.grad(loss(reference, w))(x)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  print(f"its gradient matches jax.numpy's: max |difference| "
        f"{float(jnp.max(jnp.abs(got - want))):.1e}")


# %% Timing of the forward pass and the gradient against jax.numpy (median of `reps`
# runs after a warm-up that compiles).
def median_ms(fn, *args, reps: int = 7) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def benchmark(rows=(256, 1024, 4096), reps: int = 7) -> None:
  print(f"{'rows x 1024':>12}{'pallet ms':>12}{'jax.numpy ms':>14}"
        f"{'pallet grad ms':>16}{'jax.numpy grad ms':>19}")
  for n in rows:
    x = jax.random.normal(jax.random.key(2), (n, 1024))
    w = jax.random.normal(jax.random.key(3), (n, 1024))
    times = [median_ms(jax.jit(f), x, reps=reps)
             for f in (softmax, reference, jax.grad(loss(softmax, w)),
                       jax.grad(loss(reference, w)))]
    print(f"{n:>12}{times[0]:>12.3f}{times[1]:>14.3f}{times[2]:>16.3f}{times[3]:>19.3f}")


if __name__ == "__main__":
  check()
  benchmark()
