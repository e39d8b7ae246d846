"""Kernels that close over refs (of an enclosing `pl.run_state`, or `jax.new_ref`
arrays) and traced scalars: they become operands of the call (pallet/core/closed_over.py)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallet as pl
from pallet import tpu as pltpu
from helpers import assert_close, current_test_backend, pallas_call, random_array, sds

f32 = jnp.float32
ANY = pl.BlockSpec(memory_space=pl.ANY)
xla_only = pytest.mark.skipif(current_test_backend() != "xla",
                              reason="DMAs between ANY refs run on the XLA backend")


def test_refs_of_an_enclosing_run_state_are_read_and_written():
  # The kernel reads x_ref and accumulates into acc_ref, both closed over; it has a
  # grid and an input of its own, so the lifted operands sit beside blocked ones.
  x, w, acc0 = random_array((16, 8)), random_array((16, 8)), random_array((16, 8))

  def kernel(x_ref, acc_ref, w_ref, o_ref):
    i = pl.program_id(0)
    rows = pl.ds(i * 4, 4)
    acc_ref[rows, :] = acc_ref[rows, :] + x_ref[rows, :] * w_ref[...]
    o_ref[...] = w_ref[...] * 2.0

  @jax.jit
  def f(x, w, acc):
    def stateful(refs):
      x_ref, acc_ref, o_ref = refs
      o_ref[...] = pallas_call(functools.partial(kernel, x_ref, acc_ref), out_shape=sds(w),
                               grid=(4,), in_specs=[pl.BlockSpec((4, 8), lambda i: (i, 0))],
                               out_specs=pl.BlockSpec((4, 8), lambda i: (i, 0)))(w)
    return pl.run_state(stateful)((x, acc, jnp.full_like(w, jnp.nan)))

  x_out, acc, o = f(x, w, acc0)
  assert_close(x_out, x)
  assert_close(acc, acc0 + x * w, rtol=1e-6, atol=1e-6)
  assert_close(o, w * 2.0)


def test_a_ref_the_kernel_only_partly_writes_keeps_the_rest():
  acc0 = random_array((8, 8))

  def kernel(acc_ref):
    acc_ref[2:4, :] = jnp.ones((2, 8), f32)

  def f(acc):
    def stateful(acc_ref):
      pallas_call(functools.partial(kernel, acc_ref), out_shape=[])()
    return pl.run_state(stateful)(acc)

  assert_close(jax.jit(f)(acc0), acc0.at[2:4].set(1.0))


@pytest.mark.parametrize("checked", [False, pytest.param(True, marks=xla_only)])
def test_new_ref_arrays_closed_over_eagerly(checked):
  x = random_array((8, 128))
  counter = jax.new_ref(x)
  options = dict(interpret=pl.InterpretParams(uninitialized_memory="nan")) if checked else {}

  def kernel(o_ref):
    o_ref[...] = counter[...] * 2.0
    counter[...] = counter[...] + 1.0

  out = pallas_call(kernel, out_shape=sds(x), **options)()
  assert_close(out, x * 2.0)
  assert_close(counter[...], x + 1.0)
  out = pallas_call(kernel, out_shape=sds(x), **options)()     # reads the updated ref
  assert_close(out, (x + 1.0) * 2.0)
  assert_close(counter[...], x + 2.0)


def test_kernels_around_different_refs_write_their_own_ref():
  # The trace cache keys a closed-over jax.new_ref by identity: a kernel built the
  # same way around another ref with equal contents must not reuse the first one.
  x = random_array((8, 128))

  def make(ref):
    def kernel(o_ref):
      o_ref[...] = ref[...]
      ref[...] = ref[...] * 2.0
    return kernel

  a, b = jax.new_ref(x), jax.new_ref(x)
  pallas_call(make(a), out_shape=sds(x))()
  a[...] = x                  # equal contents again
  pallas_call(make(b), out_shape=sds(x))()
  assert_close(a[...], x)
  assert_close(b[...], x * 2.0)


def test_user_aliases_keep_their_indices():
  x, y = random_array((8, 8)), random_array((8, 8))
  acc0 = random_array((8, 8))

  def kernel(acc_ref, x_ref, y_ref, o_ref):
    acc_ref[...] += y_ref[...]
    o_ref[...] = o_ref[...] + x_ref[...]

  @jax.jit
  def f(x, y, acc):
    def stateful(refs):
      acc_ref, o_ref = refs
      o_ref[...] = pallas_call(functools.partial(kernel, acc_ref), out_shape=sds(x),
                               input_output_aliases={0: 0})(x, y)
    return pl.run_state(stateful)((acc, jnp.full_like(x, jnp.nan)))

  acc, out = f(x, y, acc0)
  assert_close(out, x + x)
  assert_close(acc, acc0 + y)


@pytest.mark.parametrize("i", [0, 3])
def test_traced_scalars_closed_over(i):
  # A jit argument and a fori_loop index, closed over as scalars.
  x = random_array((4, 8, 128))

  @jax.jit
  def f(x, i, scale):
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[i] * scale
    return pallas_call(kernel, out_shape=sds(x[0]))(x)

  assert_close(f(x, i, 1.5), x[i] * 1.5)

  def g(x):
    def step(j, total):
      def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * j.astype(f32)
      return total + pallas_call(kernel, out_shape=sds(x))(x)
    return lax.fori_loop(0, 4, step, jnp.zeros_like(x))
  assert_close(jax.jit(g)(x[i]), x[i] * 6.0, rtol=1e-6, atol=1e-5)


@xla_only
def test_dma_between_closed_over_refs():
  # As JAX's stateful-kernel tests: the kernel copies one closed-over ref to another
  # with a DMA and a semaphore of its own.
  x = jnp.arange(8 * 128, dtype=jnp.int32).reshape(8, 128) * 3 - 7

  def kernel(x_ref, y_ref):
    def body(sem):
      pltpu.make_async_copy(x_ref, y_ref, sem).start()
      pltpu.make_async_copy(x_ref, y_ref, sem).wait()
    pl.run_scoped(body, pltpu.SemaphoreType.DMA)

  @jax.jit
  def f(x):
    def stateful(refs):
      x_ref, y_ref = refs
      pl.pallas_call(functools.partial(kernel, x_ref, y_ref), out_shape=[])()
    return pl.run_state(stateful)((x, jnp.full_like(x, -1)))[1]

  np.testing.assert_array_equal(f(x), x)


def test_closed_over_scalars_under_vmap_and_grad():
  # The scalar is an operand, so pallas_call's own vmap and jvp rules carry it.
  x = random_array((8, 128))

  def f(x, s):
    def kernel(x_ref, o_ref):
      o_ref[...] = jnp.sin(x_ref[...]) * s
    return pallas_call(kernel, out_shape=sds(x))(x)

  scales = jnp.array([1.0, -2.0, 3.5], f32)
  assert_close(jax.vmap(f, (None, 0))(x, scales), jnp.sin(x)[None] * scales[:, None, None],
               rtol=1e-5, atol=1e-5)
  assert_close(jax.grad(lambda s: f(x, s).sum())(2.0), jnp.sin(x).sum(), rtol=1e-4, atol=1e-4)
  assert_close(jax.grad(lambda x: f(x, 2.0).sum())(x), 2.0 * jnp.cos(x), rtol=1e-5, atol=1e-5)


def test_an_index_map_closing_over_a_ref_is_an_error():
  # Index maps are evaluated while the grid is planned: a ref's later values would be
  # ignored, so reading one there is an error (scalar prefetch is the way).
  x = random_array((4, 8))
  row = jax.new_ref(jnp.array([1], jnp.int32))

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  with pytest.raises(pl.PalletError, match=r"in_specs\[0\].*the index_map reads a ref it "
                     r"closes over; pass the values as a scalar-prefetch operand"):
    pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1, 8), f32),
                in_specs=[pl.BlockSpec((1, 8), lambda: (row[0], 0))],
                out_specs=pl.BlockSpec((1, 8), lambda: (0, 0)))(x)
