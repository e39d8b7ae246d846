"""pallas_call under JAX transformations: jit, vmap (any axis, unbatched operands,
nesting), grad and jvp."""
from __future__ import annotations

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import pytest

import pallet as pl
import pallet.tpu as pltpu
from helpers import assert_close, pallas_call, random_array, sds

f32 = jnp.float32


def _elementwise(x, y):
  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.sin(x_ref[...]) * y_ref[...] + x_ref[...] ** 2

  spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
  return pallas_call(kernel, out_shape=sds(x), grid=(x.shape[0] // 4,),
                     in_specs=[spec, spec], out_specs=spec)(x, y)


def _elementwise_ref(x, y):
  return jnp.sin(x) * y + x ** 2


def _matmul(x, y, bm=8, bn=8, bk=8):
  def kernel(x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      o_ref[...] = jnp.zeros(o_ref.shape, f32)
    o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=f32)

  m, k = x.shape
  n = y.shape[1]
  return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((m, n), f32),
                     grid=(m // bm, n // bn, k // bk),
                     in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                               pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
                     out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)))(x, y)


# ------------------------------------------------------------ jit
def test_jit_of_pallas_call_and_retrace_with_new_shapes():
  f = jax.jit(_elementwise)
  for rows in (8, 16):
    x, y = random_array((rows, 8)), random_array((rows, 8))
    assert_close(f(x, y), _elementwise_ref(x, y), rtol=1e-5, atol=1e-5)


def test_pallas_call_inside_larger_jitted_program():
  @jax.jit
  def f(x, y):
    return jnp.sum(_elementwise(x * 2, y) - 1, axis=0)

  x, y = random_array((8, 8)), random_array((8, 8))
  assert_close(f(x, y), jnp.sum(_elementwise_ref(x * 2, y) - 1, axis=0), rtol=1e-5,
               atol=1e-4)


# ------------------------------------------------------------ vmap
def test_vmap_leading_axis():
  x, y = random_array((3, 8, 8)), random_array((3, 8, 8))
  assert_close(jax.vmap(_elementwise)(x, y), _elementwise_ref(x, y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis", [1, 2, -1])
def test_vmap_non_leading_axes(axis):
  x = random_array((8, 8, 3) if axis in (2, -1) else (8, 3, 8))
  y = random_array((8, 8))
  out = jax.vmap(_elementwise, in_axes=(axis, None))(x, y)
  expected = jax.vmap(_elementwise_ref, in_axes=(axis, None))(x, y)
  assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_vmap_out_axes_and_unbatched_argument():
  x = random_array((2, 8, 8))
  y = random_array((8, 8))
  out = jax.vmap(_elementwise, in_axes=(0, None), out_axes=1)(x, y)
  assert out.shape == (8, 2, 8)
  assert_close(out, jnp.moveaxis(_elementwise_ref(x, y[None]), 0, 1), rtol=1e-5, atol=1e-5)


def test_nested_vmap():
  x, y = random_array((2, 3, 8, 8)), random_array((3, 8, 8))
  out = jax.vmap(jax.vmap(_elementwise), in_axes=(0, None))(x, y)
  assert_close(out, _elementwise_ref(x, y[None]), rtol=1e-5, atol=1e-5)


def test_vmap_of_blocked_matmul_with_reduction_axis():
  x, y = random_array((4, 16, 16)), random_array((16, 8))
  out = jax.vmap(_matmul, in_axes=(0, None))(x, y)
  assert_close(out, jnp.einsum("bij,jk->bik", x, y), matmul=True)


def test_vmap_with_scratch_and_resident_output():
  def kernel(x_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      acc_ref[...] = jnp.zeros(acc_ref.shape, f32)
    acc_ref[...] += x_ref[...]
    o_ref[...] = acc_ref[...] * 2

  def f(x):
    return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4,), f32), grid=(3,),
                       in_specs=[pl.BlockSpec((None, 4), lambda k: (k, 0))],
                       out_specs=pl.BlockSpec((4,), lambda k: (0,)),
                       scratch_shapes=[pltpu.VMEM((4,), f32)])(x)

  x = random_array((5, 3, 4))
  assert_close(jax.vmap(f)(x), x.sum(1) * 2, rtol=1e-5, atol=1e-5)


def test_vmap_with_aliased_unbatched_input():
  def kernel(x_ref, buf_ref, o_ref):
    o_ref[pl.ds(0, 2)] = x_ref[...]

  def f(x, buf):
    return pallas_call(kernel, out_shape=sds(buf), input_output_aliases={1: 0},
                       in_specs=[None, None],
                       out_specs=pl.BlockSpec(memory_space=pl.ANY))(x, buf)

  x, buf = random_array((3, 2)), random_array((5,))
  out = jax.vmap(f, in_axes=(0, None))(x, buf)
  expected = jnp.broadcast_to(buf, (3, 5)).at[:, :2].set(x)
  assert_close(out, expected)


def test_vmap_with_scalar_prefetch():
  out = jax.vmap(_gather_rows, in_axes=(0, None))(
      jnp.array([[2, 0, 1], [1, 1, 0]], jnp.int32), random_array((3, 4), seed=5))
  x = random_array((3, 4), seed=5)
  expected = jnp.stack([x[jnp.array([2, 0, 1])], x[jnp.array([1, 1, 0])]])
  assert_close(out, expected)


def _gather_rows(idx, x):
  def kernel(idx_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...]

  return pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((idx.shape[0], x.shape[1]), x.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(idx.shape[0],),
          in_specs=[pl.BlockSpec((None, x.shape[1]), lambda i, idx_ref: (idx_ref[i], 0))],
          out_specs=pl.BlockSpec((None, x.shape[1]), lambda i, idx_ref: (i, 0))))(idx, x)


def test_vmap_with_unbatched_prefetch_and_batched_data():
  idx = jnp.array([2, 2, 0], jnp.int32)
  x = random_array((4, 3, 5))
  out = jax.vmap(_gather_rows, in_axes=(None, 0))(idx, x)
  assert_close(out, x[:, idx])


# ------------------------------------------------------------ differentiation
def test_jvp_elementwise():
  x, y = random_array((8, 8)), random_array((8, 8))
  tx, ty = random_array((8, 8)), random_array((8, 8))
  out, tangent = jax.jvp(_elementwise, (x, y), (tx, ty))
  ref_out, ref_tangent = jax.jvp(_elementwise_ref, (x, y), (tx, ty))
  assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
  assert_close(tangent, ref_tangent, rtol=1e-5, atol=1e-5)


def test_grad_elementwise():
  x, y = random_array((8, 8)), random_array((8, 8))
  loss = lambda f: (lambda x, y: jnp.sum(f(x, y) ** 2))
  g = jax.grad(loss(_elementwise), argnums=(0, 1))(x, y)
  g_ref = jax.grad(loss(_elementwise_ref), argnums=(0, 1))(x, y)
  assert_close(g, g_ref, rtol=1e-4, atol=1e-4)


def test_grad_matmul():
  x, y = random_array((16, 16)), random_array((16, 8))
  loss = lambda f: (lambda x, y: jnp.sum(jnp.tanh(f(x, y))))
  g = jax.grad(loss(_matmul), argnums=(0, 1))(x, y)
  g_ref = jax.grad(loss(lambda a, b: a @ b), argnums=(0, 1))(x, y)
  assert_close(g, g_ref, rtol=1e-4, atol=1e-4)


def test_jvp_matmul():
  x, y = random_array((16, 16)), random_array((16, 8))
  tx, ty = random_array((16, 16)), random_array((16, 8))
  _, tangent = jax.jvp(_matmul, (x, y), (tx, ty))
  assert_close(tangent, tx @ y + x @ ty, matmul=True)


def test_jit_of_grad_without_grid():
  def f(x):
    return pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., jnp.sin(x_ref[...])),
                       out_shape=sds(x))(x)

  x = random_array((8,))
  assert_close(jax.jit(jax.grad(lambda x: jnp.sum(f(x))))(x), jnp.cos(x))


def test_jit_of_grad_with_grid():
  # The jvp rule plans the kernel while tracing; planning must stay concrete.
  x, y = random_array((16, 16)), random_array((16, 8))
  g = jax.jit(jax.grad(lambda x: jnp.sum(_matmul(x, y))))(x)
  assert_close(g, jnp.broadcast_to(y.sum(1), (16, 16)), matmul=True)


def test_grad_through_vmap():
  x, y = random_array((2, 8, 8)), random_array((2, 8, 8))
  g = jax.grad(lambda x: jnp.sum(jax.vmap(_elementwise)(x, y)))(x)
  g_ref = jax.grad(lambda x: jnp.sum(_elementwise_ref(x, y)))(x)
  assert_close(g, g_ref, rtol=1e-5, atol=1e-5)


def test_grad_with_respect_to_one_of_two_inputs_and_partial_kernel():
  def kernel(x_ref, w_ref, o_ref, *, scale):
    o_ref[...] = jnp.exp(x_ref[...] * w_ref[...]) * scale

  def f(x, w):
    return pallas_call(functools.partial(kernel, scale=0.5), out_shape=sds(x))(x, w)

  x, w = random_array((6,)), random_array((6,))
  g = jax.grad(lambda w: jnp.sum(f(x, w)))(w)
  assert_close(g, x * jnp.exp(x * w) * 0.5, rtol=1e-5, atol=1e-5)


def test_vmap_of_element_blocks():
  def f(x):
    return pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2),
                       out_shape=jax.ShapeDtypeStruct((4,), f32), grid=(2,),
                       in_specs=[pl.BlockSpec((pl.Element(2),), lambda i: (3 * i + 1,))],
                       out_specs=pl.BlockSpec((2,), lambda i: (i,)))(x)

  x = random_array((3, 7))
  expected = jnp.concatenate([x[:, 1:3], x[:, 4:6]], axis=1) * 2
  assert_close(jax.vmap(f)(x), expected)


# ------------------------------------------------------------ products in gradients
def _dot_operand_ranks(fn, *args) -> list[tuple[int, int]]:
  """Ranks of the operands of every dot_general in `fn`'s jaxpr (nested ones too)."""
  ranks = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        ranks.append(tuple(len(v.aval.shape) for v in eqn.invars))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return ranks


@pytest.mark.parametrize("blocks", [(8, 8, 8), (4, 16, 8)])
def test_grad_of_blocked_matmul_uses_plain_matrix_products(blocks):
  # Vectorized programs give the products extra free dimensions; JAX's derivatives
  # then contract over split dimensions, which XLA:CPU compiles 10-30x slower.
  x, y = random_array((32, 16)), random_array((16, 32))
  ct = random_array((32, 32))
  f = lambda x, y: _matmul(x, y, *blocks)
  grad = lambda x, y: jax.vjp(f, x, y)[1](ct)
  got = grad(x, y)
  want = jax.vjp(lambda a, b: a @ b, x, y)[1](ct)
  for g, w in zip(got, want):
    assert_close(g, w, matmul=True)
  assert _dot_operand_ranks(grad, x, y) and all(
      r == (2, 2) for r in _dot_operand_ranks(grad, x, y))
  per_example = jax.vmap(jax.grad(lambda x, y: jnp.sum(jnp.tanh(f(x, y)))), (0, None))
  xs = random_array((3, 32, 16))
  want = jax.vmap(jax.grad(lambda x, y: jnp.sum(jnp.tanh(x @ y))), (0, None))(xs, y)
  assert_close(per_example(xs, y), want, matmul=True)


def test_grad_of_row_block_mlp_kernel():
  def mlp(x, w1, w2):
    def kernel(x_ref, w1_ref, w2_ref, o_ref):
      h = jnp.tanh(jnp.dot(x_ref[...], w1_ref[...], preferred_element_type=f32))
      o_ref[...] = jnp.dot(h, w2_ref[...], preferred_element_type=f32)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0, 0))
    return pallas_call(kernel, out_shape=sds(x), grid=(x.shape[0] // 8, 1),
                       in_specs=[pl.BlockSpec((8, 16), lambda i, j: (i, 0)), whole(w1),
                                 whole(w2)],
                       out_specs=pl.BlockSpec((8, 16), lambda i, j: (i, 0)))(x, w1, w2)

  x, w1, w2 = random_array((32, 16)), random_array((16, 24)), random_array((24, 16))
  ref = lambda x, w1, w2: jnp.tanh(x @ w1) @ w2
  loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))
  got = jax.grad(loss(mlp), argnums=(0, 1, 2))(x, w1, w2)
  want = jax.grad(loss(ref), argnums=(0, 1, 2))(x, w1, w2)
  for g, w in zip(got, want):
    assert_close(g, w, matmul=True)
