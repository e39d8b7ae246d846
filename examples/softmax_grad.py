"""Row softmax, then its gradient.

You will learn that a `pallas_call` is differentiable: `jax.grad` works through the
kernel (pallet differentiates the kernel's pure, discharged form). Run it:
`python examples/softmax_grad.py`.
"""
# %%
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
def check() -> None:
  x = jax.random.normal(jax.random.key(0), (64, 128))
  w = jax.random.normal(jax.random.key(1), (64, 128))
  np.testing.assert_allclose(softmax(x), jax.nn.softmax(x, axis=-1), rtol=1e-5, atol=1e-6)
  loss = lambda f: (lambda x: jnp.sum(f(x) * w))
  got = jax.grad(loss(softmax))(x)
  want = jax.grad(loss(lambda x: jax.nn.softmax(x, axis=-1)))(x)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
  check()
  print("softmax and its gradient match jax.numpy")
