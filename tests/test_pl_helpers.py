"""The small `pl` helpers real kernels use: integer helpers, pl.loop, empty*, with_scoped,
run_state, reciprocal, estimate_cost, swap, debug_check and poison buffers."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallet as pl
from pallet.core import primitives
from helpers import assert_close, current_test_backend, pallas_call, random_array, sds

f32 = jnp.float32


# ------------------------------------------------------------------ integer helpers
@pytest.mark.parametrize("x, expected", [(0, 1), (1, 1), (2, 2), (3, 4), (64, 64), (65, 128)])
def test_next_power_of_2(x, expected):
  assert pl.next_power_of_2(x) == expected
  assert isinstance(pl.next_power_of_2(np.int64(x)), int)


def test_next_power_of_2_rejects_negative_and_non_ints():
  with pytest.raises(ValueError, match="non-negative"):
    pl.next_power_of_2(-1)
  with pytest.raises(TypeError, match="Python int"):
    pl.next_power_of_2(2.5)


def test_align_to_and_strides_from_shape():
  assert [pl.align_to(a, 4) for a in (0, 1, 4, 5, 8)] == [0, 4, 4, 8, 8]
  assert int(pl.align_to(jnp.int32(5), 4)) == 8
  assert pl.strides_from_shape((2, 3, 4)) == (12, 4, 1)
  assert pl.strides_from_shape(()) == ()
  assert pl.cdiv(7, 2) == 4


# ------------------------------------------------------------------ pl.loop
@pytest.mark.parametrize("lower, upper, step, unroll", [
    (0, 8, 1, None), (1, 8, 3, True), (0, 8, 2, 2), (8, 0, -2, None), (3, 3, 1, None)])
def test_loop_decorator_matches_python_range(lower, upper, step, unroll):
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)

    @pl.loop(lower, upper, step=step, unroll=unroll)
    def _(i):
      o_ref[i] = x_ref[i] * 2 + 1

  x = random_array((9,))
  expected = np.zeros(9, np.float32)
  for i in range(lower, upper, step):
    expected[i] = np.asarray(x)[i] * 2 + 1
  assert_close(pallas_call(kernel, out_shape=sds(x))(x), jnp.asarray(expected))


def test_loop_with_traced_bounds_and_carry():
  def kernel(n_ref, x_ref, o_ref):
    total = pl.loop(0, n_ref[0], init_carry=jnp.zeros((), f32))(
        lambda i, acc: acc + x_ref[i])
    o_ref[...] = jnp.full(o_ref.shape, total)

  x = random_array((16,))
  n = jnp.array([11], jnp.int32)
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4,), f32))(n, x)
  assert_close(out, jnp.full((4,), jnp.sum(x[:11])), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lower, upper, step", [(0, 8, 3), (7, -1, -2), (5, 2, 1)])
def test_loop_with_traced_bounds_and_steps(lower, upper, step):
  def kernel(b_ref, x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)

    @pl.loop(b_ref[0], b_ref[1], step=b_ref[2])
    def _(i):
      o_ref[i] = x_ref[i] + 1

  x = random_array((8,))
  expected = np.zeros(8, np.float32)
  for i in range(lower, upper, step):
    expected[i] = np.asarray(x)[i] + 1
  bounds = jnp.array([lower, upper, step], jnp.int32)
  assert_close(pallas_call(kernel, out_shape=sds(x))(bounds, x), jnp.asarray(expected))


def test_loop_rejects_zero_step():
  with pytest.raises(ValueError, match="step"):
    pl.loop(0, 4, step=0)


# ------------------------------------------------------------------ scoped refs, empty
def test_with_scoped_gives_fresh_refs_after_the_callers_arguments():
  @pl.with_scoped(jax.ShapeDtypeStruct((8,), f32), tmp2=jax.ShapeDtypeStruct((8,), f32))
  def kernel(x_ref, o_ref, tmp, tmp2):
    tmp[...] = x_ref[...] * 3
    tmp2[...] = tmp[...] - 1
    o_ref[...] = tmp2[...]

  x = random_array((8,))
  assert_close(pallas_call(kernel, out_shape=sds(x))(x), x * 3 - 1)


def test_empty_values_are_written_before_read():
  def kernel(x_ref, o_ref):
    acc = pl.empty(x_ref.shape, f32)
    acc = jnp.where(True, x_ref[...], acc)
    ref = pl.empty_ref_like(jax.ShapeDtypeStruct(x_ref.shape, f32))
    ref[...] = acc * 2
    tree = pl.empty_like({"a": jax.ShapeDtypeStruct((2,), jnp.int32)})
    assert tree["a"].shape == (2,) and tree["a"].dtype == jnp.int32
    o_ref[...] = ref[...]

  x = random_array((4, 8))
  assert_close(pallas_call(kernel, out_shape=sds(x))(x), x * 2)


def test_empty_is_poisoned_when_poison_buffers_are_on():
  with pl.enable_poison_buffers(True):
    assert bool(jnp.all(jnp.isnan(pl.empty((3,), f32))))
    assert int(pl.empty((2,), jnp.int32)[0]) == np.iinfo(np.int32).min
  assert not pl.enable_poison_buffers.value
  assert float(jnp.sum(pl.empty((3,), f32))) == 0.0


def test_empty_ref_like_rejects_non_shapes():
  with pytest.raises(TypeError, match="pl.empty_ref_like.*ShapeDtypeStruct"):
    pl.empty_ref_like(3)


# ------------------------------------------------------------------ run_state, reciprocal
def test_run_state_returns_final_values():
  def body(refs):
    a_ref, b_ref = refs
    a_ref[...] = a_ref[...] + b_ref[...]
    b_ref[...] = b_ref[...] * a_ref[...]

  a, b = random_array((5,)), random_array((5,))
  out = pl.run_state(body)((a, b))
  assert_close(out, (a + b, b * (a + b)))
  assert_close(jax.jit(pl.run_state(body))((a, b)), (a + b, b * (a + b)))


@pytest.mark.parametrize("approx", [False, True])
def test_reciprocal(approx):
  def kernel(x_ref, o_ref):
    o_ref[...] = pl.reciprocal(x_ref[...], approx=approx)

  x = random_array((8, 16)) + 5.0
  assert_close(pallas_call(kernel, out_shape=sds(x))(x), 1.0 / x)


# ------------------------------------------------------------------ estimate_cost
def test_estimate_cost_counts_flops_of_the_function():
  def f(a, b, *, scale):
    return (a @ b) * scale

  est = pl.estimate_cost(f, jax.ShapeDtypeStruct((8, 16), f32), random_array((16, 4)),
                         scale=2.0)
  assert isinstance(est, pl.CostEstimate)
  assert est.flops >= 2 * 8 * 16 * 4
  assert est.bytes_accessed >= 4 * (8 * 16 + 16 * 4 + 8 * 4)
  assert pl.estimate_cost(lambda a, b: jnp.exp(a), random_array((4,)), None).transcendentals == 4


# ------------------------------------------------------------------ load / store / swap
def test_primitives_load_store_swap_with_jax_signatures():
  def kernel(x_ref, y_ref, o_ref, old_ref):
    idx = pl.ds(0, 8)
    mask = lax.iota(jnp.int32, 8) < 5
    v = primitives.load(x_ref, (idx,), mask=mask, other=-1.0)
    primitives.store(o_ref, (idx,), v)
    old_ref[...] = primitives.swap(o_ref, (pl.ds(2, 4),), y_ref[pl.ds(0, 4)])
    pl.store(o_ref, pl.ds(6, 2), pl.load(y_ref, pl.ds(4, 2)))   # the old top-level forms

  x, y = random_array((8,)), random_array((8,))
  out, old = pallas_call(kernel, out_shape=(sds(x), jax.ShapeDtypeStruct((4,), f32)))(x, y)
  first = jnp.where(jnp.arange(8) < 5, x, -1.0)
  assert_close(old, first[2:6])
  assert_close(out, jnp.concatenate([first[:2], y[:4], y[4:6]]))


def test_masked_swap_keeps_masked_out_elements():
  def kernel(x_ref, o_ref, old_ref):
    o_ref[...] = x_ref[...]
    mask = lax.iota(jnp.int32, 8) % 2 == 0
    old = primitives.swap(o_ref, (pl.ds(0, 8),), jnp.zeros((8,), f32), mask=mask)
    old_ref[...] = jnp.where(mask, old, 0.0)

  x = random_array((8,))
  out, old = pallas_call(kernel, out_shape=(sds(x), sds(x)))(x)
  even = jnp.arange(8) % 2 == 0
  assert_close(out, jnp.where(even, 0.0, x))
  assert_close(old, jnp.where(even, x, 0.0))


# ------------------------------------------------------------------ debug checks
def _checked_kernel(x_ref, o_ref):
  pl.debug_check(jnp.all(x_ref[...] > 0), "x must be positive")
  o_ref[...] = jnp.sqrt(x_ref[...])


def _checked_call():
  return pallas_call(_checked_kernel, out_shape=jax.ShapeDtypeStruct((16,), f32), grid=(4,),
                     in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
                     out_specs=pl.BlockSpec((4,), lambda i: (i,)))


_CHECK_FAILED = re.compile(r"pl\.debug_check failed in kernel '_checked_kernel' at "
                           r".*test_pl_helpers\.py:\d+: x must be positive", re.S)


def test_debug_check_disabled_emits_nothing():
  x = -random_array((16,)) ** 2 - 1
  out = _checked_call()(x)          # not checked: NaNs, no error
  assert bool(jnp.all(jnp.isnan(out)))
  kernel_jaxpr = jax.make_jaxpr(_checked_call())(x)
  assert "pallet_check" not in str(kernel_jaxpr.eqns[0].params["kernel"].jaxpr)


def test_debug_check_passes_and_fails_at_run_time():
  x = random_array((16,)) ** 2 + 0.5
  with pl.enable_debug_checks(True):
    assert_close(_checked_call()(x), jnp.sqrt(x))
    bad = x.at[13].set(-1.0)
    with pytest.raises(Exception, match=_CHECK_FAILED):
      jax.block_until_ready(_checked_call()(bad))
  assert not pl.enable_debug_checks.value


def test_debug_check_under_vmap_jit_and_in_loops():
  def kernel(x_ref, o_ref):
    @pl.loop(0, 4)
    def _(i):
      pl.debug_check(x_ref[i] < 100.0, "element too large")
      o_ref[i] = x_ref[i] + 1

  call = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4,), f32))
  xs = random_array((3, 4))
  pl.enable_debug_checks(True)
  try:
    assert_close(jax.jit(jax.vmap(call))(xs), xs + 1)
    with pytest.raises(Exception, match="kernel 'kernel'.*element too large"):
      jax.block_until_ready(jax.vmap(call)(xs.at[2, 1].set(1e4)))
  finally:
    pl.enable_debug_checks(False)


def test_enable_debug_checks_as_context_and_setter():
  assert not pl.enable_debug_checks.value
  with pl.enable_debug_checks(True):
    assert pl.enable_debug_checks.value
    with pl.enable_debug_checks(False):
      assert not pl.enable_debug_checks.value
    assert pl.enable_debug_checks.value
  assert not pl.enable_debug_checks.value


def test_debug_checks_setting_retraces_jitted_callers():
  f = jax.jit(_checked_call())
  bad = -random_array((16,)) ** 2 - 1
  assert bool(jnp.all(jnp.isnan(f(bad))))          # traced with checks off
  with pl.enable_debug_checks(True):
    with pytest.raises(Exception, match=_CHECK_FAILED):
      jax.block_until_ready(f(bad))


def test_poison_buffers_fill_scoped_refs():
  def kernel(x_ref, o_ref):
    def body(tmp):
      o_ref[...] = jnp.where(jnp.arange(8) < 4, tmp[...], x_ref[...])  # half unwritten
    pl.run_scoped(body, jax.ShapeDtypeStruct((8,), f32))

  x = random_array((8,))
  with pl.enable_poison_buffers(True):
    out = pallas_call(kernel, out_shape=sds(x))(x)
  assert bool(jnp.all(jnp.isnan(out[:4])))
  assert_close(out[4:], x[4:])


def test_poison_buffers_show_unwritten_output_blocks():
  if current_test_backend() != "xla":
    pytest.skip("only the XLA backend poisons fresh outputs (docs/semantics.md section 14)")

  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = x_ref[...]

  x = random_array((8,))
  spec = pl.BlockSpec((4,), lambda i: (i,))
  with pl.enable_poison_buffers(True):
    out = pallas_call(kernel, out_shape=sds(x), grid=(2,), in_specs=[spec], out_specs=spec)(x)
  assert_close(out[:4], x[:4])
  assert bool(jnp.all(jnp.isnan(out[4:])))
