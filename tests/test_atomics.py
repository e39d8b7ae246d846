"""Atomics follow sequential semantics: every update happens, in some order, even when
several programs (or several lanes of one call) hit the same element."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
import pallet.triton as pltriton
from helpers import assert_close, current_test_backend, pallas_call, random_array

i32 = jnp.int32


def _histogram(values: jax.Array, bins: int, block: int, atomic=pl.atomic_add) -> jax.Array:
  def kernel(x_ref, h_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      h_ref[...] = jnp.zeros(h_ref.shape, i32)
    atomic(h_ref, (x_ref[...],), jnp.ones((block,), i32))

  return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((bins,), i32),
                     grid=(values.shape[0] // block,),
                     in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
                     out_specs=pl.BlockSpec((bins,), lambda i: (0,)))(values)


@pytest.mark.parametrize("atomic", [pl.atomic_add, pltriton.atomic_add])
def test_histogram_with_duplicate_bins(atomic):
  values = random_array((96,), i32, low=0, high=6)
  out = _histogram(values, bins=7, block=16, atomic=atomic)
  np.testing.assert_array_equal(out, np.bincount(np.asarray(values), minlength=7))


def test_histogram_all_in_one_bin():
  values = jnp.full((64,), 3, i32)
  out = _histogram(values, bins=5, block=32)
  np.testing.assert_array_equal(out, [0, 0, 0, 64, 0])


def test_float_atomic_add_accumulates_across_programs():
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)
    pl.atomic_add(o_ref, (pl.ds(0, 4),), x_ref[...])

  x = random_array((8, 4))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32), grid=(8,),
                    in_specs=[pl.BlockSpec((None, 4), lambda i: (i, 0))],
                    out_specs=pl.BlockSpec((4,), lambda i: (0,)))(x)
  assert_close(out, x.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op,combine", [
    ("max", np.maximum), ("min", np.minimum), ("add", np.add),
    ("and", np.bitwise_and), ("or", np.bitwise_or), ("xor", np.bitwise_xor),
    ("xchg", lambda old, v: v)])
def test_atomic_ops_return_old_values_and_update(op, combine):
  atomic = getattr(pl, f"atomic_{op}")

  def kernel(init_ref, v_ref, o_ref, old_ref):
    o_ref[...] = init_ref[...]
    old_ref[...] = atomic(o_ref, (pl.ds(0, 8),), v_ref[...])

  init, v = random_array((8,), i32), random_array((8,), i32)
  out, old = pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((8,), i32),) * 2)(init, v)
  np.testing.assert_array_equal(old, init)
  np.testing.assert_array_equal(out, combine(np.asarray(init), np.asarray(v)))


@pytest.mark.parametrize("op,combine", [("max", np.maximum), ("min", np.minimum)])
def test_atomic_max_min_with_duplicate_indices(op, combine):
  atomic = getattr(pl, f"atomic_{op}")
  idx = np.array([0, 2, 0, 2, 1, 0])

  def kernel(v_ref, o_ref):
    o_ref[...] = jnp.zeros(o_ref.shape, i32)
    atomic(o_ref, (jnp.asarray(idx),), v_ref[...])

  v = random_array((6,), i32)
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((3,), i32))(v)
  expected = np.zeros(3, np.int32)
  for i, val in zip(idx, np.asarray(v)):
    expected[i] = combine(expected[i], val)
  np.testing.assert_array_equal(out, expected)


def test_atomic_add_with_mask():
  def kernel(v_ref, o_ref):
    o_ref[...] = jnp.full(o_ref.shape, 100, i32)
    pl.atomic_add(o_ref, (pl.ds(0, 6),), v_ref[...], mask=jnp.arange(6) % 2 == 1)

  v = random_array((6,), i32)
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((6,), i32))(v)
  np.testing.assert_array_equal(out, np.where(np.arange(6) % 2 == 1, 100 + np.asarray(v), 100))


@pytest.mark.parametrize("op,ufunc", [("add", np.add), ("max", np.maximum),
                                       ("min", np.minimum)])
def test_atomics_whose_results_go_unread_still_update(op, ufunc):
  """Unread results let the XLA backend scatter without sorting the lanes for their
  old values: duplicate and masked-out lanes must still update as in sequence."""
  atomic = getattr(pl, f"atomic_{op}")

  def kernel(i_ref, v_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.zeros(o_ref.shape, i32)
    v = v_ref[...]
    atomic(o_ref, (i_ref[...],), v, mask=v % 3 != 0)

  idx, v = random_array((64,), i32, low=0, high=4), random_array((64,), i32)
  call = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((5,), i32), grid=(4,),
                     in_specs=[pl.BlockSpec((16,), lambda i: (i,))] * 2,
                     out_specs=pl.BlockSpec((5,), lambda i: (0,)))
  expected = np.zeros(5, np.int32)
  keep = np.asarray(v) % 3 != 0
  ufunc.at(expected, np.asarray(idx)[keep], np.asarray(v)[keep])
  np.testing.assert_array_equal(call(idx, v), expected)
  if current_test_backend() == "xla":
    assert "stablehlo.sort" not in jax.jit(call).lower(idx, v).as_text()


def test_atomic_cas_elementwise():
  def kernel(init_ref, cmp_ref, o_ref, old_ref):
    o_ref[...] = init_ref[...]
    old_ref[...] = pl.atomic_cas(o_ref, (pl.ds(0, 8),), cmp_ref[...], jnp.full((8,), -1, i32))

  init = random_array((8,), i32, low=0, high=3)
  cmp = random_array((8,), i32, low=0, high=3)
  out, old = pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((8,), i32),) * 2)(init, cmp)
  np.testing.assert_array_equal(old, init)
  np.testing.assert_array_equal(out, np.where(init == cmp, -1, init))


def test_atomic_cas_as_a_lock_across_programs():
  # Every program tries to claim slot 0 with its id + 1; only the first (in any
  # sequential order) succeeds, and each program sees whether it won.
  def kernel(o_ref, won_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[0] = jnp.int32(0)
    old = pl.atomic_cas(o_ref, 0, jnp.int32(0), pl.program_id(0) + 1)
    won_ref[0] = (old == 0).astype(i32)

  owner, won = pallas_call(
      kernel, grid=(6,),
      out_shape=(jax.ShapeDtypeStruct((1,), i32), jax.ShapeDtypeStruct((6,), i32)),
      out_specs=(pl.BlockSpec((1,), lambda i: (0,)), pl.BlockSpec((1,), lambda i: (i,))))()
  assert int(won.sum()) == 1
  assert int(owner[0]) == int(np.argmax(np.asarray(won))) + 1


@pytest.mark.parametrize("init,cmp", [(0, 0), (5, 0)])
def test_scalar_atomic_cas_on_an_aliased_0d_ref(init, cmp):
  """A 0-d lock passed in and aliased to a 0-d output (JAX's triton_pallas_test)."""
  def kernel(_, lock_ref, old_ref):
    old_ref[()] = pltriton.atomic_cas(lock_ref, cmp, 7)

  lock, old = pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((), i32),) * 2,
                          input_output_aliases={0: 0})(jnp.int32(init))
  assert lock.shape == old.shape == ()
  assert int(lock) == (7 if init == cmp else init) and int(old) == init


def test_atomic_and_rejects_float_refs():
  def kernel(o_ref):
    pl.atomic_and(o_ref, 0, 1.0)

  with pytest.raises(TypeError, match="integer"):
    pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.float32))()


def test_triton_namespace_exports_atomics_and_masked_io():
  for name in ["atomic_add", "atomic_and", "atomic_max", "atomic_min",
               "atomic_or", "atomic_xchg", "atomic_xor"]:
    assert getattr(pltriton, name) is getattr(pl, name)
  # load, store and atomic_cas take Pallas-GPU's signatures there (tests/test_plgpu.py).
  assert all(callable(getattr(pltriton, n)) for n in ("load", "store", "atomic_cas"))


# ------------------------------------------------------------ duplicates within one call
_SEQUENTIAL_UPDATE = {
    "add": lambda old, v, c: old + v, "max": lambda old, v, c: max(old, v),
    "min": lambda old, v, c: min(old, v), "and": lambda old, v, c: old & v,
    "or": lambda old, v, c: old | v, "xor": lambda old, v, c: old ^ v,
    "xchg": lambda old, v, c: v, "cas": lambda old, v, c: v if old == c else old,
}


def _some_lane_order_explains(op, init, idx, values, cmps, final, olds) -> bool:
  """Whether running the lanes one at a time, in some order, gives `final` and `olds`."""
  import itertools
  for order in itertools.permutations(range(len(idx))):
    cells, seen = dict(enumerate(init)), [None] * len(idx)
    for lane in order:
      seen[lane] = cells[idx[lane]]
      cells[idx[lane]] = _SEQUENTIAL_UPDATE[op](cells[idx[lane]], values[lane], cmps[lane])
    if seen == list(olds) and [cells[i] for i in range(len(init))] == list(final):
      return True
  return False


def _run_atomic_lanes(op, init, idx, values, cmps):
  def kernel(init_ref, v_ref, c_ref, o_ref, old_ref):
    o_ref[...] = init_ref[...]
    where = (jnp.asarray(np.array(idx)),)
    if op == "cas":
      old_ref[...] = pl.atomic_cas(o_ref, where, c_ref[...], v_ref[...])
    else:
      old_ref[...] = getattr(pl, f"atomic_{op}")(o_ref, where, v_ref[...])

  arr = lambda a: jnp.asarray(np.array(a, np.int32))
  final, olds = pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((len(init),), i32),
                                               jax.ShapeDtypeStruct((len(idx),), i32)))(
                                                   arr(init), arr(values), arr(cmps))
  return np.asarray(final).tolist(), np.asarray(olds).tolist()


@pytest.mark.parametrize("op", sorted(_SEQUENTIAL_UPDATE))
def test_atomic_lanes_on_distinct_cells_are_sequential(op):
  init, idx, values, cmps = [3, 12, 5, 0], [2, 0, 3, 1], [6, 10, 5, 1], [5, 0, 5, 0]
  final, olds = _run_atomic_lanes(op, init, idx, values, cmps)
  assert _some_lane_order_explains(op, init, idx, values, cmps, final, olds), (final, olds)


@pytest.mark.parametrize("op", sorted(_SEQUENTIAL_UPDATE))
def test_atomic_lanes_hitting_one_cell_are_sequential(op):
  # Three lanes hit cell 0, and at least two of them change it whatever the order.
  init, idx, cmps = [6, 9], [0, 1, 0, 0], [6, 9, 3, 6]
  values = [3, 5, 1, 2] if op == "min" else [7, 5, 12, 9]
  final, olds = _run_atomic_lanes(op, init, idx, values, cmps)
  assert _some_lane_order_explains(op, init, idx, values, cmps, final, olds), (final, olds)


def test_atomic_add_lanes_hitting_one_cell_sum_every_update():
  final, _ = _run_atomic_lanes("add", [6, 9], [0, 1, 0, 0], [3, 5, 12, 1], [0] * 4)
  assert final == [6 + 3 + 12 + 1, 9 + 5]
