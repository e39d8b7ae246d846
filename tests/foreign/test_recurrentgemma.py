"""google-deepmind/recurrentgemma's Pallas RG-LRU linear scan (recurrentgemma/jax/pallas.py),
run on pallet: h_t = a_t * h_{t-1} + x_t, forward (both directions, with and without h0) and
its custom VJP, against a jax.numpy sequential scan written here."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.foreign import projects


def scan_reference(x, a, h0=None, reverse=False):
  """h_t = a_t h_{t-1} + x_t over axis -2 (from the end when `reverse`): (y, h_last)."""
  if reverse:
    y, h = scan_reference(x[..., ::-1, :], a[..., ::-1, :], h0)
    return y[..., ::-1, :], h
  h = jnp.zeros(x.shape[:-2] + x.shape[-1:], x.dtype) if h0 is None else h0
  def step(h, xa):
    h = xa[1] * h + xa[0]
    return h, h
  h, ys = jax.lax.scan(step, h, (jnp.moveaxis(x, -2, 0), jnp.moveaxis(a, -2, 0)))
  return jnp.moveaxis(ys, 0, -2), h


def inputs(seed, b, t, d):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k1, (b, t, d), jnp.float32)
  a = jax.random.uniform(k2, (b, t, d), jnp.float32, 0.5, 0.99)   # decays, as the RG-LRU's
  h0 = jax.random.normal(k3, (b, d), jnp.float32)
  return x, a, h0


@pytest.mark.parametrize("b,t,d,reverse,with_h0,block", [
    (2, 64, 128, False, False, 16), (2, 100, 128, False, True, 32),
    (1, 64, 256, True, True, 16), (2, 48, 128, True, False, 256)])
def test_pallas_lru_forward(b, t, d, reverse, with_h0, block):
  m = projects.load("recurrentgemma.jax.pallas")
  x, a, h0 = inputs(0, b, t, d)
  h0 = h0 if with_h0 else None
  y, h_last = m.pallas_lru(x, a, h0, reverse=reverse, max_seq_block_size=block)
  y_ref, h_ref = scan_reference(x, a, h0, reverse)
  np.testing.assert_allclose(y, y_ref, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(h_last, h_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("reverse", [False, True])
def test_pallas_lru_grad(reverse):
  m = projects.load("recurrentgemma.jax.pallas")
  x, a, h0 = inputs(1, 2, 64, 128)
  w = jax.random.normal(jax.random.key(9), x.shape)
  wh = jax.random.normal(jax.random.key(10), h0.shape)
  def loss(fn):
    def f(x, a, h0):
      y, h = fn(x, a, h0)
      return jnp.sum(y * w) + jnp.sum(h * wh)
    return jax.grad(f, argnums=(0, 1, 2))(x, a, h0)
  got = loss(lambda x, a, h0: m.pallas_lru(x, a, h0, reverse=reverse, max_seq_block_size=16))
  want = loss(lambda x, a, h0: scan_reference(x, a, h0, reverse))
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, atol=1e-3, rtol=1e-3)
