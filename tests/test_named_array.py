"""NamedArray: construction, alignment by name, indexing, reductions, pytree behaviour."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet.named as pn

A, B, C = pn.make_axes(a=3, b=4, c=5)


def rand(axes, seed=0, dtype=jnp.float32):
  return pn.random.normal(jax.random.PRNGKey(seed), axes, dtype)


def test_axis_and_make_axes():
  assert pn.make_axes(x=2, y=3) == (pn.Axis("x", 2), pn.Axis("y", 3))
  assert A.resize(7) == pn.Axis("a", 7)
  assert hash(A) == hash(pn.Axis("a", 3))
  with pytest.raises(TypeError, match="size must be a non-negative int"):
    pn.Axis("a", -1)
  with pytest.raises(TypeError, match="non-empty string"):
    pn.Axis("", 2)


def test_named_attaches_names_and_checks_sizes():
  raw = jnp.arange(12.).reshape(3, 4)
  x = pn.named(raw, ("a", B))
  assert x.axes == (A, B) and x.shape == {"a": 3, "b": 4} and x.ndim == 2
  assert x.dtype == jnp.float32
  with pytest.raises(ValueError, match="axis 'b' has size 4 but the array has 5"):
    pn.named(jnp.zeros((3, 5)), (A, B))
  with pytest.raises(ValueError, match="needs 2 names"):
    pn.named(raw, ("a",))
  with pytest.raises(ValueError, match="'a' appears twice"):
    pn.NamedArray(raw.reshape(3, 4), (A, A.resize(4)))
  with pytest.raises(ValueError, match="does not match axes"):
    pn.NamedArray(raw, (B, A))


def test_constructors():
  np.testing.assert_array_equal(pn.zeros((A, B)).array, np.zeros((3, 4)))
  np.testing.assert_array_equal(pn.ones((A,), jnp.int32).array, np.ones(3, np.int32))
  np.testing.assert_array_equal(pn.full({"a": 3}, 2.5).array, np.full(3, 2.5))
  x = rand((A, B))
  assert pn.zeros_like(x).axes == x.axes and pn.ones_like(x).dtype == x.dtype
  assert float(pn.ones_like(x).sum().array) == 12
  np.testing.assert_array_equal(pn.arange(C, start=2, step=3).array, 2 + 3 * np.arange(5))
  assert pn.arange(C, dtype=jnp.int32).dtype == jnp.int32
  u = pn.random.uniform(jax.random.PRNGKey(1), (A, B), minval=2.0, maxval=3.0)
  assert u.axes == (A, B) and bool(((u.array >= 2) & (u.array < 3)).all())
  np.testing.assert_array_equal(
      rand((A, B), seed=3).array, jax.random.normal(jax.random.PRNGKey(3), (3, 4)))


def test_arithmetic_aligns_by_name_and_broadcasts():
  x, y, z = rand((A, B), 0), rand((B, A), 1), rand((C, B), 2)
  np.testing.assert_allclose((x + y).array, x.array + y.array.T)
  assert (x + y).axes == (A, B)
  w = x * z  # union of axes: x's, then z's new ones
  assert w.axes == (A, B, C)
  np.testing.assert_allclose(w.array, x.array[:, :, None] * z.array.T[None], rtol=1e-6)
  np.testing.assert_allclose((2.0 - x).array, 2.0 - x.array)
  np.testing.assert_allclose((x / jnp.float32(2)).array, x.array / 2)
  np.testing.assert_array_equal((x < y).array, x.array < y.array.T)
  np.testing.assert_array_equal((x == x).array, np.ones((3, 4), bool))
  np.testing.assert_allclose((-x).array, -x.array)
  np.testing.assert_allclose((x ** 2).array, x.array ** 2, rtol=1e-6)


def test_arithmetic_errors():
  x = rand((A, B))
  with pytest.raises(ValueError, match="axis 'b' has size 4 in one operand and 6"):
    x + rand((B.resize(6),))
  with pytest.raises(TypeError, match="unnamed array of shape \\(3, 4\\)"):
    x + jnp.ones((3, 4))


def test_rearrange_astype_rename_broadcast():
  x = rand((A, B, C))
  y = x.rearrange(("c", "a", "b"))
  assert y.axes == (C, A, B)
  np.testing.assert_array_equal(y.array, np.transpose(x.array, (2, 0, 1)))
  assert x.rearrange((C, ...)).axes == (C, A, B)
  assert x.rearrange((..., "a")).axes == (B, C, A)
  with pytest.raises(ValueError, match="axes \\('c',\\) are missing"):
    x.rearrange(("a", "b"))
  with pytest.raises(ValueError, match="unknown axis 'd'"):
    x.rearrange(("a", "b", "d"))
  assert x.astype(jnp.bfloat16).dtype == jnp.bfloat16
  assert x.rename({"a": "z"}).names == ("z", "b", "c")
  v = rand((B,)).broadcast_to((A, B))
  np.testing.assert_array_equal(v.array[0], v.array[2])
  with pytest.raises(ValueError, match="axis 'c' is not in the target"):
    x.broadcast_to((A, B))


def test_reductions():
  x = rand((A, B, C))
  np.testing.assert_allclose(pn.sum(x, "b").array, x.array.sum(1), rtol=1e-5)
  assert pn.sum(x, "b").axes == (A, C)
  np.testing.assert_allclose(pn.mean(x, (A, C)).array, x.array.mean((0, 2)), rtol=1e-5)
  np.testing.assert_allclose(pn.max(x, C).array, x.array.max(2))
  np.testing.assert_allclose(x.min().array, x.array.min())
  assert x.sum().axes == ()
  with pytest.raises(ValueError, match="unknown axis 'q'"):
    pn.sum(x, "q")


def test_elementwise_functions():
  x = rand((A, B))
  for fn, ref in [(pn.sin, jnp.sin), (pn.cos, jnp.cos), (pn.exp, jnp.exp), (pn.tanh, jnp.tanh),
                  (pn.abs, jnp.abs), (pn.square, jnp.square)]:
    np.testing.assert_allclose(fn(x).array, ref(x.array), rtol=1e-6)
    assert fn(x).axes == x.axes
  np.testing.assert_allclose(pn.sqrt(pn.abs(x)).array, jnp.sqrt(jnp.abs(x.array)), rtol=1e-6)
  np.testing.assert_allclose(pn.maximum(x, 0.0).array, np.maximum(x.array, 0))
  np.testing.assert_allclose(pn.where(x > 0, x, rand((B,), 5)).array,
                             np.where(x.array > 0, x.array, rand((B,), 5).array[None]))
  with pytest.raises(TypeError, match="sin: expected a NamedArray"):
    pn.sin(jnp.ones(3))


def test_dot_contracts_by_name():
  q, k = rand((A, C), 0), rand((B, C), 1)
  s = pn.dot(q, k, axis="c")
  assert s.axes == (A, B)
  np.testing.assert_allclose(s.array, q.array @ k.array.T, rtol=1e-5, atol=1e-5)
  batched = pn.dot(rand((C, A, B), 2), rand((B, C), 3), axis=B)
  np.testing.assert_allclose(batched.array, jnp.einsum("cab,bc->ca", rand((C, A, B), 2).array,
                                                       rand((B, C), 3).array), rtol=1e-5)
  with pytest.raises(ValueError, match="dot: axis 'z' is in none of the operands"):
    pn.dot(q, k, axis="z")


def test_dict_indexing_follows_numpy():
  x = rand((A, B, C))
  raw = np.asarray(x.array)
  np.testing.assert_array_equal(x[{"b": 1}].array, raw[:, 1])
  assert x[{"b": 1}].axes == (A, C)
  y = x[{"c": slice(1, 5, 2), "a": -1}]
  assert y.axes == (B, C.resize(2))
  np.testing.assert_array_equal(y.array, raw[-1, :, 1:5:2])
  np.testing.assert_array_equal(x[..., 2].array, raw[..., 2])
  idx = pn.named(jnp.array([2, 0, 1, 1, 0, 2]), ("k",))
  g = x[{"a": idx, "c": 3}]  # advanced a and c are not adjacent: broadcast axis goes first
  assert g.names == ("k", "b")
  np.testing.assert_array_equal(g.array, raw[np.array([2, 0, 1, 1, 0, 2]), :, 3])
  assert x[{"b": idx.astype(jnp.int32) % 4, "c": 3}].names == ("a", "k")
  np.testing.assert_array_equal(x[{"b": [3, 1]}].array, raw[:, [3, 1]])
  assert x[{"b": [3, 1]}].axes == (A, B.resize(2), C)


def test_indexing_with_traced_start():
  x = rand((A, B, C))

  @jax.jit
  def f(x, i):
    return x[{"c": pn.ds(i, 2), "b": i}]
  np.testing.assert_array_equal(f(x, 1).array, np.asarray(x.array)[:, 1, 1:3])


def test_pytree_round_trip_and_jit():
  x = rand((A, B))
  leaves, tree = jax.tree_util.tree_flatten(x)
  assert len(leaves) == 1 and leaves[0] is x.array
  back = jax.tree_util.tree_unflatten(tree, leaves)
  assert back.axes == x.axes and back.array is x.array
  doubled = jax.jit(lambda v: v * 2)(x)
  assert doubled.axes == x.axes
  np.testing.assert_allclose(doubled.array, 2 * x.array)


def test_vmap_over_functions_that_name_their_inputs():
  raw = jax.random.normal(jax.random.PRNGKey(4), (2, 3, 4))
  out = jax.vmap(lambda v: pn.sum(pn.named(v, (A, B)) * 2, "b").array)(raw)
  np.testing.assert_allclose(out, 2 * raw.sum(2), rtol=1e-5)


def test_remaining_errors_name_what_was_expected():
  x = rand((A, B))
  with pytest.raises(TypeError, match="expected an Axis, a sequence of Axis or a"):
    pn.zeros("a")
  with pytest.raises(TypeError, match="expected a sequence of Axis, got element 3"):
    pn.zeros((A, 3))
  with pytest.raises(TypeError, match="NamedArray axes must be Axis objects"):
    pn.NamedArray(jnp.zeros(3), ("a",))
  with pytest.raises(ValueError, match="rearrange: at most one"):
    x.rearrange((..., "a", ...))
  with pytest.raises(ValueError, match="rearrange: axis 'a' is listed twice"):
    x.rearrange(("a", "a", "b"))
  with pytest.raises(ValueError, match="axis 'b' has size 4, the target has 9"):
    x.broadcast_to((A, B.resize(9)))
  with pytest.raises(ValueError, match="unknown axis 'q'"):
    x.rename({"q": "z"})
  with pytest.raises(ValueError, match="dot: axis 'b' has sizes 4 and 2"):
    pn.dot(x, rand((B.resize(2),)), axis="a")
  with pytest.raises(TypeError, match="len\\(\\) of a NamedArray is ambiguous"):
    len(x)
  with pytest.raises(TypeError, match="iterating a NamedArray is ambiguous"):
    iter(x)
  with pytest.raises(TypeError, match="expected an Axis or an axis name"):
    pn.sum(x, 0)
