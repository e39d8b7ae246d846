"""Stores whose value reads the same ref elsewhere (shifts, flips, rolls, transposes,
DMAs between pages of one buffer): XLA:CPU runs such an update in place while still
reading the array (openxla/xla#49176), so the XLA backend writes them as a select
(backends/xla/self_updates.py). Kernels against NumPy; the rewrite itself on jaxprs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core.primitives import closed_call_p

import pallet as pl
import pallet.tpu as pltpu
from helpers import current_test_backend, pallas_call, random_array, sds
from pallet.backends.xla import self_updates

xla_only = pytest.mark.skipif(current_test_backend() != "xla",
                              reason="the XLA backend's discharge (Triton runs no XLA program)")


@xla_only
def test_a_flip_of_a_rolled_block_written_into_part_of_it():
  """overlaps fuzz seed 224: 12 of 48 elements wrong on a vectorized grid."""
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.roll(x_ref[...].reshape(16), 6).reshape(1, 4, 4)
    o_ref[0:1, 1:4, :] = jnp.flip(o_ref[0:1, 0:3, :], 1) * 2

  x = random_array((3, 4, 4))
  spec = pl.BlockSpec((1, 4, 4), lambda i: (i, 0, 0))
  out = pallas_call(kernel, grid=(3,), in_specs=[spec], out_specs=spec, out_shape=sds(x))(x)
  want = np.stack([np.roll(r, 6) for r in np.asarray(x).reshape(3, 16)]).reshape(3, 4, 4)
  want[:, 1:4, :] = want[:, 0:3, :][:, ::-1, :] * 2
  np.testing.assert_array_equal(np.asarray(out), want)


@xla_only
def test_a_scratch_shifted_flipped_and_summed_in_place():
  """overlaps fuzz seed 253: a vectorized grid, a scratch updated from itself four
  times (a program-id shift, a flip through a reshape, a sum)."""
  def kernel(x_ref, o_ref, s):
    i = pl.program_id(0)
    s[...] = x_ref[...]
    s[0:1, 1:5, 0:1] = s[0:1, pl.ds((i * 3) % 2, 4), 0:1] * 2
    s[...] = (jnp.flip(s[...].reshape(5), 0) * 2).reshape(1, 5, 1)
    s[0, 1:2, 0:1] = jnp.sum(s[0:1, 0:5, 0], axis=-1, keepdims=True) - 5
    o_ref[...] = s[...]

  x = random_array((2, 5, 1), jnp.int32)
  spec = pl.BlockSpec((1, 5, 1), lambda i: (i, 0, 0))
  out = pallas_call(kernel, grid=(2,), in_specs=[spec], out_specs=spec, out_shape=sds(x),
                    scratch_shapes=[pltpu.VMEM((1, 5, 1), jnp.int32)])(x)
  want = np.asarray(x).copy()
  for i in range(2):
    s = want[i].copy()
    s[1:5, 0] = s[(i * 3) % 2:(i * 3) % 2 + 4, 0] * 2
    s = (s.reshape(5)[::-1] * 2).reshape(5, 1)
    s[1, 0] = s[:, 0].sum() - 5
    want[i] = s
  np.testing.assert_array_equal(np.asarray(out), want)


@xla_only
@pytest.mark.parametrize("copies", [((20, 25), (0, 3), (22, 25)),
                                    ((13, 13), (8, 3), (10, 18), (24, 25))])
def test_dmas_between_pages_of_one_cache(copies):
  """Static-size DMAs within one HBM buffer seen as (pages * page, d): 384 elements
  wrong before (the copy into the buffer read the buffer it updated)."""
  rows = 6

  def kernel(c_in, c, sem):
    flat = c.reshape(32, 128)
    for src, dst in copies:
      copy = pltpu.make_async_copy(flat.at[pl.ds(src, rows)], flat.at[pl.ds(dst, rows)], sem)
      copy.start()
      copy.wait()

  cache = random_array((4, 8, 128), jnp.int32)
  out = pallas_call(kernel, out_shape=sds(cache), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                    out_specs=pl.BlockSpec(memory_space=pl.ANY),
                    scratch_shapes=[pltpu.SemaphoreType.DMA], input_output_aliases={0: 0})(cache)
  want = np.asarray(cache).reshape(32, 128).copy()
  for src, dst in copies:
    want[dst:dst + rows] = want[src:src + rows].copy()
  np.testing.assert_array_equal(np.asarray(out).reshape(32, 128), want)


def _guarded(fn, *avals):
  closed = jax.make_jaxpr(fn)(*avals)
  return closed, self_updates.guard(closed)


def _selects(closed) -> int:
  return sum(e.primitive is closed_call_p for e in closed.jaxpr.eqns)


def test_updates_reading_their_own_window_element_by_element_are_kept():
  """Accumulators (`acc[i] = acc[i] * a + b`, the start computed twice as discharge
  computes it) stay in-place updates: the program of every attention kernel."""
  def accumulate(acc, b, i):
    start = jnp.where(i < 0, i + 8, i)
    again = jnp.where(i < 0, i + 8, i)
    old = lax.dynamic_slice(acc, (again, 0), (2, 16))
    return lax.dynamic_update_slice(acc, old * 0.5 + b, (start, 0))

  closed, guarded = _guarded(accumulate, jnp.zeros((8, 16)), jnp.ones((2, 16)), 3)
  assert guarded is closed


@pytest.mark.parametrize("read", ["shifted", "transposed", "through a reshape", "reduced"])
def test_updates_reading_elsewhere_become_selects(read):
  def update(x):
    if read == "shifted":
      value = x[0:2] + 1
    elif read == "transposed":
      value = x[2:4, 0:2].T
    elif read == "through a reshape":
      value = x.reshape(4, 8)[0:1].reshape(2, 4) * 3
    else:
      value = jnp.broadcast_to(x[2:4].sum(), (2, 4))
    return lax.dynamic_update_slice(x, value[:, :4] if value.shape[1] > 4 else value, (2, 0))

  x = random_array((8, 4))
  closed, guarded = _guarded(update, x)
  assert _selects(guarded) == 1
  np.testing.assert_array_equal(jax.jit(lambda a: jax.core.eval_jaxpr(
      guarded.jaxpr, guarded.consts, a)[0])(x), update(x))


def test_updates_inside_loops_are_guarded():
  def shifts(x):
    return lax.fori_loop(0, 3, lambda i, a: lax.dynamic_update_slice(a, a[:-1], (1,)), x)

  closed, guarded = _guarded(shifts, jnp.arange(6.0))
  assert guarded is not closed
  np.testing.assert_array_equal(
      jax.jit(lambda a: jax.core.eval_jaxpr(guarded.jaxpr, guarded.consts, a)[0])(
          jnp.arange(6.0)), [0, 0, 0, 0, 1, 2])
