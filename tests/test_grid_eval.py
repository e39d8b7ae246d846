"""grid_eval: NumPy evaluation of trace-time integer programs agrees with JAX's, and
refuses (Unsupported) where NumPy's and XLA's results would differ."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Literal

from pallet.core import grid_eval
from pallet.core.grid_analysis import apply_equation


def _scalar_fn(i, j):
  k = (i * 7 - j) // 3 + jnp.where(i % 2 == 0, j, -j)
  k = jnp.maximum(k, 1) - jnp.minimum(i, j) * 2
  return k % 5, (k << 2) >> 1, jnp.clip(k, 0, 9).astype(jnp.int32), k > 3


@pytest.mark.parametrize("grid", [(4, 5), (1, 7), (3, 1)])
def test_over_grid_matches_jax(grid):
  closed = jax.make_jaxpr(_scalar_fn)(jnp.int32(0), jnp.int32(0))
  got = grid_eval.over_grid(closed.jaxpr, closed.consts, grid)
  ids = np.indices(grid).reshape(2, -1).astype(np.int32)
  want = jax.vmap(_scalar_fn)(*ids)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype
    np.testing.assert_array_equal(g, np.asarray(w).reshape(grid))


@pytest.mark.parametrize("fn, why", [
    (lambda i: i // (i - i), "division by zero"),
    (lambda i: jax.lax.rem(i, i * 0), "division by zero"),
    (lambda i: i << 40, "bit width"),
    (lambda i: (i.astype(jnp.float32) * 1e10).astype(jnp.int32), "integer range"),
])
def test_refuses_where_numpy_differs_from_xla(fn, why):
  closed = jax.make_jaxpr(fn)(jnp.int32(0))
  with pytest.raises(grid_eval.Unsupported, match=why):
    grid_eval.over_grid(closed.jaxpr, closed.consts, (4,))


def _array_fn():
  rows = lax_iota((8, 4), 0)
  cols = lax_iota((8, 4), 1)
  flat = (rows * 4 + cols).reshape(32)
  mask = (flat % 3 != 0) & (flat < 30)
  picked = jnp.where(mask, flat // 2, -1)
  halves = jnp.concatenate([flat[:, None], rows.reshape(32, 1)], axis=1)
  return (picked.reshape(4, 8).T, jnp.broadcast_to(picked[None, :5].squeeze(0)[:, None], (5, 3)),
          halves, jnp.full((3, 2), 1.5, jnp.bfloat16))


def lax_iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def test_array_equations_match_jax():
  closed = jax.make_jaxpr(_array_fn)()
  env, folded = {}, 0
  read = lambda x: np.asarray(x.val, x.aval.dtype) if isinstance(x, Literal) else env[x]
  for eqn in closed.jaxpr.eqns:
    ins = [read(x) for x in eqn.invars]
    try:
      outs = grid_eval.apply_array_equation(eqn, ins)
      folded += 1
    except grid_eval.Unsupported:   # e.g. the slice: JAX's path runs it
      outs = [np.asarray(o) for o in apply_equation(eqn, ins)]
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
  assert folded >= 10
  for got, want in zip([read(v) for v in closed.jaxpr.outvars], _array_fn()):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, np.asarray(want))


def test_array_equations_refuse_floats():
  closed = jax.make_jaxpr(lambda x: x * 2.0)(jnp.zeros(3))
  with pytest.raises(grid_eval.Unsupported):
    grid_eval.apply_array_equation(closed.jaxpr.eqns[0], [np.zeros(3, np.float32)])


@pytest.mark.parametrize("mode, fill", [("fill", -1), ("fill", None), ("clip", None),
                                        ("promise_in_bounds", None)])
def test_pointwise_gather_matches_jax(mode, fill):
  x = np.arange(20, dtype=np.int32).reshape(4, 5) * 3 - 7
  i = np.array([[0, 0], [3, 4], [4, 0], [-1, 2], [2, 7], [1, 1]], np.int32)
  closed = jax.make_jaxpr(
      lambda x, i: x.at[i[:, 0], i[:, 1]].get(mode=mode, fill_value=fill))(x, i)
  env = dict(zip(closed.jaxpr.invars, [x, i]))
  read = lambda v: np.asarray(v.val, v.aval.dtype) if isinstance(v, Literal) else env[v]
  checked = 0
  for eqn in closed.jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    want = [np.asarray(o) for o in apply_equation(eqn, ins)]
    if eqn.primitive.name == "gather":
      got = grid_eval.apply_array_equation(eqn, ins)
      assert got[0].dtype == want[0].dtype
      np.testing.assert_array_equal(got[0], want[0])
      checked += 1
    env.update(zip(eqn.outvars, want))
  assert checked == 1
