"""What kernel bodies may contain: jnp math, reductions, matmuls, broadcasting, control
flow (fori_loop, while_loop, cond, pl.when), closures, partial parameters, hints."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallet as pl
import pallet.tpu as pltpu
from helpers import assert_close, pallas_call, random_array, sds

f32 = jnp.float32


def _rowwise(kernel, x, out_cols=None, out_dtype=None, rows=4):
  """Runs `kernel` over blocks of `rows` rows of x."""
  cols = x.shape[1] if out_cols is None else out_cols
  out = jax.ShapeDtypeStruct((x.shape[0], cols), out_dtype or x.dtype)
  return pallas_call(kernel, out_shape=out, grid=(x.shape[0] // rows,),
                     in_specs=[pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))],
                     out_specs=pl.BlockSpec((rows, cols), lambda i: (i, 0)))(x)


def test_elementwise_math():
  def kernel(x_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = jnp.tanh(x) * jnp.exp(-x * x) + jnp.abs(x) ** 0.5 - jnp.log1p(x * x)

  x = random_array((8, 16))
  expected = jnp.tanh(x) * jnp.exp(-x * x) + jnp.abs(x) ** 0.5 - jnp.log1p(x * x)
  assert_close(_rowwise(kernel, x), expected, rtol=1e-5, atol=1e-5)


def test_softmax_with_reductions_and_broadcasting():
  def kernel(x_ref, o_ref):
    x = x_ref[...]
    m = jnp.max(x, axis=1, keepdims=True)
    e = jnp.exp(x - m)
    o_ref[...] = e / jnp.sum(e, axis=1, keepdims=True)

  x = random_array((16, 24))
  assert_close(_rowwise(kernel, x), jax.nn.softmax(x, axis=1), rtol=1e-5, atol=1e-6)


def test_reductions_to_columns():
  def kernel(x_ref, o_ref):
    x = x_ref[...]
    o_ref[:, 0] = jnp.sum(x, axis=1)
    o_ref[:, 1] = jnp.min(x, axis=1)
    o_ref[:, 2] = jnp.argmax(x, axis=1).astype(f32)
    o_ref[:, 3] = jnp.mean(x * x, axis=1)

  x = random_array((8, 10))
  expected = jnp.stack([x.sum(1), x.min(1), jnp.argmax(x, 1).astype(f32),
                        (x * x).mean(1)], axis=1)
  assert_close(_rowwise(kernel, x, out_cols=4), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dot_and_matmul_operator_with_preferred_element_type(dtype):
  def kernel(x_ref, y_ref, a_ref, b_ref):
    a_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)
    b_ref[...] = (x_ref[...] @ y_ref[...]).astype(jnp.float32)

  x, y = random_array((16, 32), dtype), random_array((32, 8), dtype)
  a, b = pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((16, 8), f32),) * 2)(x, y)
  ref = jnp.dot(x, y, preferred_element_type=jnp.float32)
  assert_close(a, ref, matmul=True)
  tol = {"rtol": 2e-2, "atol": 5e-2} if dtype != jnp.float32 else {}
  assert_close(b, (x @ y).astype(f32), matmul=True, **tol)


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_pl_dot_transposes(trans_a, trans_b):
  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = pl.dot(a_ref[...], b_ref[...], trans_a=trans_a, trans_b=trans_b)

  a = random_array((12, 8) if trans_a else (8, 12))
  b = random_array((6, 12) if trans_b else (12, 6))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 6), f32))(a, b)
  ref = (a.T if trans_a else a) @ (b.T if trans_b else b)
  assert_close(out, ref, matmul=True)


def test_pl_dot_of_bf16_accumulates_in_f32():
  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = pl.dot(a_ref[...], b_ref[...])

  a, b = random_array((8, 64), jnp.bfloat16), random_array((64, 8), jnp.bfloat16)
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 8), f32))(a, b)
  assert_close(out, jnp.dot(a, b, preferred_element_type=f32), matmul=True)


def test_broadcast_to():
  def kernel(r_ref, c_ref, o_ref):
    o_ref[...] = pl.broadcast_to(r_ref[...], (5, 4)) * jnp.broadcast_to(c_ref[...], (5, 4))

  r, c = random_array((4,)), random_array((5, 1))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((5, 4), f32))(r, c)
  assert_close(out, r[None, :] * c)


def test_fori_loop_over_ref_rows():
  def kernel(x_ref, o_ref):
    def body(r, acc):
      o_ref[r, :] = acc + x_ref[r, :]
      return acc + x_ref[r, :]
    lax.fori_loop(0, x_ref.shape[0], body, jnp.zeros((x_ref.shape[1],), f32))

  x = random_array((8, 6))
  out = pallas_call(kernel, out_shape=sds(x))(x)
  assert_close(out, jnp.cumsum(x, axis=0), rtol=1e-5, atol=1e-5)


def test_while_loop_with_data_dependent_trip_count():
  # Each program halves its block until the max drops below 1.
  def kernel(x_ref, o_ref, n_ref):
    def cond(c):
      return jnp.max(jnp.abs(c[0])) >= 1.0

    def body(c):
      return c[0] / 2, c[1] + 1
    v, n = lax.while_loop(cond, body, (x_ref[...], jnp.int32(0)))
    o_ref[...] = v
    n_ref[0] = n

  x = random_array((4, 8)) * 20
  spec = pl.BlockSpec((None, 8), lambda i: (i, 0))
  out, n = pallas_call(kernel, out_shape=(sds(x), jax.ShapeDtypeStruct((4, 1), jnp.int32)),
                       grid=(4,), in_specs=[spec],
                       out_specs=(spec, pl.BlockSpec((None, 1), lambda i: (i, 0))))(x)
  m = np.max(np.abs(np.asarray(x)), axis=1)
  expected_n = np.where(m >= 1, np.floor(np.log2(m)) + 1, 0).astype(int)
  np.testing.assert_array_equal(n[:, 0], expected_n)
  assert_close(out, x / (2.0 ** expected_n)[:, None])


def test_lax_cond_on_program_id():
  def kernel(x_ref, o_ref):
    o_ref[...] = lax.cond(pl.program_id(0) % 2 == 0, lambda v: v * 10, lambda v: -v,
                          x_ref[...])

  x = random_array((6, 3))
  spec = pl.BlockSpec((None, 3), lambda i: (i, 0))
  out = pallas_call(kernel, out_shape=sds(x), grid=(6,), in_specs=[spec], out_specs=spec)(x)
  sign = jnp.where(jnp.arange(6) % 2 == 0, 10.0, -1.0)[:, None]
  assert_close(out, x * sign)


def test_cond_with_ref_writes_in_branches():
  def kernel(x_ref, o_ref):
    def pos():
      o_ref[...] = x_ref[...] + 100

    def neg():
      o_ref[...] = x_ref[...] - 100
    lax.cond(jnp.sum(x_ref[...]) > 0, pos, neg)

  x = random_array((5, 4))
  spec = pl.BlockSpec((None, 4), lambda i: (i, 0))
  out = pallas_call(kernel, out_shape=sds(x), grid=(5,), in_specs=[spec], out_specs=spec)(x)
  assert_close(out, jnp.where(x.sum(1, keepdims=True) > 0, x + 100, x - 100))


def test_pl_when_traced_and_static_conditions():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

    @pl.when(pl.program_id(0) >= 2)
    def _():
      o_ref[...] = o_ref[...] * -1

    @pl.when(True)
    def _():
      o_ref[...] += 0.5

    @pl.when(False)
    def _():
      o_ref[...] = jnp.full(o_ref.shape, jnp.nan)

  x = random_array((4, 3))
  spec = pl.BlockSpec((None, 3), lambda i: (i, 0))
  out = pallas_call(kernel, out_shape=sds(x), grid=(4,), in_specs=[spec], out_specs=spec)(x)
  sign = jnp.where(jnp.arange(4) >= 2, -1.0, 1.0)[:, None]
  assert_close(out, x * sign + 0.5)


def test_closures_and_helper_functions():
  def make_kernel(activation):
    def apply(v):
      return activation(v) * 2

    def kernel(x_ref, o_ref):
      o_ref[...] = apply(x_ref[...])
    return kernel

  x = random_array((8,))
  for act in (jnp.sin, jax.nn.relu):
    assert_close(pallas_call(make_kernel(act), out_shape=sds(x))(x), act(x) * 2)


def test_partial_with_static_python_branching():
  def kernel(x_ref, o_ref, *, power, add_one):
    v = x_ref[...] ** power
    if add_one:
      v = v + 1
    o_ref[...] = v

  x = random_array((7,))
  for power, add_one in [(2, False), (3, True)]:
    out = pallas_call(functools.partial(kernel, power=power, add_one=add_one),
                      out_shape=sds(x))(x)
    assert_close(out, x ** power + (1 if add_one else 0), rtol=1e-5, atol=1e-5)


def test_iota_and_type_conversions():
  def kernel(x_ref, o_ref):
    idx = lax.broadcasted_iota(jnp.int32, x_ref.shape, 1)
    o_ref[...] = (x_ref[...] * idx.astype(jnp.bfloat16)).astype(jnp.float32)

  x = random_array((3, 8), jnp.bfloat16)
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((3, 8), f32))(x)
  # XLA may keep the bf16 product in f32 before the cast: bf16 tolerance.
  assert_close(out, (x * jnp.arange(8, dtype=jnp.bfloat16)).astype(f32), rtol=1e-2, atol=1e-2)


FLOAT8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]


@pytest.mark.parametrize("src", [f32, jnp.bfloat16, jnp.float16, jnp.int32, *FLOAT8],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dst", FLOAT8, ids=lambda d: jnp.dtype(d).name)
def test_conversions_to_float8_round_like_xla(src, dst):
  """Round to nearest even, a carry out of the mantissa included (7.78 -> 8 in e4m3);
  results are compared bit for bit with XLA's conversion."""
  x = (random_array((16, 128)) * 8.0).astype(src)

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...].astype(o_ref.dtype)
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, dst))(x)
  want = x.astype(dst)
  np.testing.assert_array_equal(jax.lax.bitcast_convert_type(out, jnp.uint8),
                                jax.lax.bitcast_convert_type(want, jnp.uint8))


def test_multiple_of_and_max_contiguous_are_identities():
  def kernel(x_ref, o_ref):
    start = pl.multiple_of(pl.program_id(0) * 8, 8)
    offs = pl.max_contiguous(start + jnp.arange(8), 8)
    o_ref[offs] = x_ref[pl.ds(start, 8)] * 2
    assert pl.multiple_of(jnp.arange(4), [4]).shape == (4,)

  x = random_array((32,))
  out = pallas_call(kernel, out_shape=sds(x), grid=(4,))(x)
  assert_close(out, x * 2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.int8])
@pytest.mark.parametrize("lhs_transposed", [True, False])
def test_narrow_products_accumulated_wide_over_a_k_axis(dtype, lhs_transposed):
  """`dot(x.T, y)` of bfloat16 blocks into float32 (int8 into int32), summed in scratch
  over a k grid axis, as backward kernels compute `dW = x.T @ dy`. Vectorized over the
  column blocks, the product has a right operand of two free dimensions, which XLA:CPU
  compiled into a product its runtime refuses for bfloat16; pallet runs it as 2-D."""
  M, N, K, bm, bn, bk = 16, 68, 48, 16, 32, 16
  wide = jnp.int32 if dtype == jnp.int8 else f32
  x = random_array((K, M) if lhs_transposed else (M, K), dtype)
  y = random_array((K, N), dtype)

  def kernel(x_ref, y_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    contract = 0 if lhs_transposed else 1
    acc_ref[...] += lax.dot_general(x_ref[...], y_ref[...], (((contract,), (0,)), ((), ())),
                                    preferred_element_type=wide)
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)

  x_spec = (pl.BlockSpec((bk, bm), lambda j, i, k: (k, i)) if lhs_transposed
            else pl.BlockSpec((bm, bk), lambda j, i, k: (i, k)))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((M, N), dtype if dtype != jnp.int8 else wide),
                    grid=(pl.cdiv(N, bn), M // bm, K // bk),
                    in_specs=[x_spec, pl.BlockSpec((bk, bn), lambda j, i, k: (k, j))],
                    out_specs=pl.BlockSpec((bm, bn), lambda j, i, k: (i, j)),
                    scratch_shapes=[pltpu.VMEM((bm, bn), wide)])(x, y)
  lhs = x.T if lhs_transposed else x
  expected = jnp.dot(lhs.astype(wide), y.astype(wide),
                     precision=lax.Precision.HIGHEST).astype(out.dtype)
  tol = 0 if dtype == jnp.int8 else 3e-2
  assert_close(out, expected, rtol=tol, atol=tol)


def test_gradient_of_a_narrow_product_accumulated_wide():
  """jax.grad through `dot(x.T, y)` of bfloat16 blocks summed into a float32 output over
  a k grid axis: the derived products are widened as the forward ones are."""
  M, N, K, bm, bn, bk = 16, 64, 48, 16, 32, 16
  x, y = random_array((K, M), jnp.bfloat16), random_array((K, N), jnp.bfloat16)

  def kernel(x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += lax.dot_general(x_ref[...], y_ref[...], (((0,), (0,)), ((), ())),
                                  preferred_element_type=f32)

  f = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((M, N), f32), grid=(2, 1, 3),
                  in_specs=[pl.BlockSpec((bk, bm), lambda j, i, k: (k, i)),
                            pl.BlockSpec((bk, bn), lambda j, i, k: (k, j))],
                  out_specs=pl.BlockSpec((bm, bn), lambda j, i, k: (i, j)))
  loss = lambda g: lambda x, y: (g(x, y) ** 2).sum()
  plain = lambda x, y: lax.dot_general(x.astype(f32), y.astype(f32), (((0,), (0,)), ((), ())),
                                       precision=lax.Precision.HIGHEST)
  got = jax.grad(loss(f), argnums=(0, 1))(x, y)
  want = jax.grad(loss(plain), argnums=(0, 1))(x, y)
  for g, w in zip(got, want):
    assert_close(g, w, rtol=3e-2, atol=3e-2 * float(jnp.max(jnp.abs(w.astype(f32)))))
