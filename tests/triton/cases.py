"""Kernels that exercise the Triton backend's code generator, each with its reference.

`CASES` maps a name to `make(interpret) -> (fn, args, expected)`: `fn` is a
pallas_call on backend="triton" (interpreted or compiled), `expected` what
jax.numpy computes. test_interpret.py runs them under Triton's interpreter;
test_compile.py compiles every one for the three reference GPU targets.
Shapes are deliberately not all powers of two, to exercise padding and masks.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallet as pl
import pallet.tpu as pltpu
import pallet.triton as plt
from helpers import random_array, sds


@dataclasses.dataclass(frozen=True)
class Case:
  make: Callable[[bool], tuple[Callable, tuple, Any]]
  tol: dict | None = None
  bf16: bool = False      # also checked by compiling (the interpreter holds bf16 in f32)


CASES: dict[str, Case] = {}


def case(name: str, **kw: Any):
  def register(make):
    CASES[name] = Case(make, **kw)
    return make
  return register


def call(kernel, out_shape, interpret, **kw):
  return pl.pallas_call(kernel, out_shape, backend="triton", interpret=interpret, **kw)


def rows(block_rows: int, cols: int):
  """A BlockSpec over row blocks of a (n, cols) array."""
  return pl.BlockSpec((block_rows, cols), lambda i: (i, 0))


# ------------------------------------------------------------------ elementwise math
_UNIT = lambda x: jnp.tanh(x) * 0.9          # inside (-1, 1)
_POSITIVE = lambda x: jnp.abs(x) + 0.1
_UNARY = {
    "abs": (jnp.abs, None), "neg": (jnp.negative, None), "sin": (jnp.sin, None),
    "cos": (jnp.cos, None), "tan": (jnp.tan, _UNIT), "asin": (jnp.arcsin, _UNIT),
    "acos": (jnp.arccos, _UNIT), "atan": (jnp.arctan, None), "sinh": (jnp.sinh, None),
    "cosh": (jnp.cosh, None), "tanh": (jnp.tanh, None), "asinh": (jnp.arcsinh, None),
    "acosh": (jnp.arccosh, lambda x: jnp.abs(x) + 1.0), "atanh": (jnp.arctanh, _UNIT),
    "exp": (jnp.exp, None), "exp2": (jnp.exp2, None), "expm1": (jnp.expm1, None),
    "log": (jnp.log, _POSITIVE), "log1p": (jnp.log1p, _POSITIVE),
    "log2": (jnp.log2, _POSITIVE), "logistic": (jax.nn.sigmoid, None),
    "sqrt": (jnp.sqrt, _POSITIVE), "rsqrt": (lax.rsqrt, _POSITIVE), "cbrt": (jnp.cbrt, None),
    "sign": (jnp.sign, None), "floor": (jnp.floor, lambda x: x * 3),
    "ceil": (jnp.ceil, lambda x: x * 3), "round": (jnp.round, lambda x: x * 3),
    "round_away": (lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO), lambda x: x * 3),
    "erf": (lax.erf, None), "erfc": (lax.erfc, None), "erf_inv": (lax.erf_inv, _UNIT),
    "is_finite": (lambda x: jnp.isfinite(x).astype(jnp.float32), lambda x: 1 / (x * 0 + jnp.sign(x))),
    "integer_pow": (lambda x: x ** 3, None), "integer_pow_negative": (lambda x: x ** -2, _POSITIVE),
    "square": (jnp.square, None), "relu_where": (lambda x: jnp.where(x > 0, x, 0.0), None),
}


def _unary_case(fn, domain):
  def make(interpret):
    x = random_array((16, 100))
    if domain is not None:
      x = domain(x)
    def kernel(x_ref, o_ref):
      o_ref[...] = fn(x_ref[...])
    f = call(kernel, sds(x), interpret, grid=(2,), in_specs=[rows(8, 100)],
             out_specs=rows(8, 100))
    return f, (x,), fn(x)
  return make


for _name, (_fn, _domain) in _UNARY.items():
  case(f"unary_{_name}", tol=dict(rtol=2e-5, atol=2e-5))(_unary_case(_fn, _domain))

_BINARY = {
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "div": jnp.divide,
    "max": jnp.maximum, "min": jnp.minimum, "pow": lambda a, b: jnp.power(jnp.abs(a) + 0.5, b),
    "atan2": jnp.arctan2, "rem": lax.rem, "nextafter": jnp.nextafter,
    "clamp": lambda a, b: lax.clamp(-0.5, a, 0.5) + b, "lt": lambda a, b: (a < b) * 1.0,
    "ge_select": lambda a, b: jnp.where(a >= b, a, b), "eq_ne": lambda a, b: (a == a) * (a != b) * 1.0,
}


def _binary_case(fn):
  def make(interpret):
    x, y = random_array((16, 24)), random_array((16, 24))
    def kernel(x_ref, y_ref, o_ref):
      o_ref[...] = fn(x_ref[...], y_ref[...])
    f = call(kernel, sds(x), interpret, grid=(2,), in_specs=[rows(8, 24)] * 2,
             out_specs=rows(8, 24))
    return f, (x, y), fn(x, y)
  return make


for _name, _fn in _BINARY.items():
  case(f"binary_{_name}", tol=dict(rtol=2e-5, atol=2e-5))(_binary_case(_fn))


# ------------------------------------------------------------------ integers and bits
_INT_OPS = {
    "shifts": lambda a, s: (a << s) + (a >> s) + lax.shift_right_logical(a, s),
    "shift_out_of_range": lambda a, s: (a << (s + 30)) + lax.shift_right_logical(a, s + 30),
    "popcount_clz": lambda a, s: lax.population_count(a) * 100 + lax.clz(a),
    "bitwise": lambda a, s: (a & s) | (a ^ 5) + ~a,
    "div_rem": lambda a, s: lax.div(a, s + 1) * 1000 + lax.rem(a, s + 1),
    "floor_divide": lambda a, s: a // (s + 1) + a % (s + 1),
    "compare": lambda a, s: (a < s).astype(jnp.int32) + 2 * (a == s) + 4 * (a >= -s),
    "max_min": lambda a, s: jnp.maximum(a, s) - jnp.minimum(a, -s),
    "abs_sign_neg": lambda a, s: jnp.abs(a) * 10 + jnp.sign(a) - a,
}


def _int_case(fn, dtype=jnp.int32):
  def make(interpret):
    a = random_array((8, 48), dtype, low=-1000, high=1000)
    s = random_array((8, 48), dtype, low=0, high=31)
    def kernel(a_ref, s_ref, o_ref):
      o_ref[...] = fn(a_ref[...], s_ref[...])
    f = call(kernel, sds(a), interpret)
    return f, (a, s), fn(a, s)
  return make


for _name, _fn in _INT_OPS.items():
  case(f"int_{_name}")(_int_case(_fn))
case("int8_popcount_clz")(_int_case(lambda a, s: lax.population_count(a) * 10 + lax.clz(a),
                                    jnp.int8))
case("uint32_shift_compare")(_int_case(
    lambda a, s: (a >> (s % 8)) + (a > s).astype(jnp.uint32), jnp.uint32))


@case("casts_and_bitcasts")
def _casts(interpret):
  x = random_array((8, 40)) * 100
  def fn(x):
    i = x.astype(jnp.int32)
    u = lax.bitcast_convert_type(x, jnp.int32)
    h = x.astype(jnp.float16).astype(jnp.float32)
    b = (x > 0).astype(jnp.float32)
    return i.astype(jnp.float32) + (u & 0xFF).astype(jnp.float32) + h + b
  def kernel(x_ref, o_ref):
    o_ref[...] = fn(x_ref[...])
  return call(kernel, sds(x), interpret), (x,), fn(x)


@case("iota_and_select_n")
def _iota(interpret):
  x = random_array((12, 20))
  def fn(x):
    r = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    c = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    which = (r + c) % 3
    return lax.select_n(which, x, -x, x * 2) + r.astype(jnp.float32)
  def kernel(x_ref, o_ref):
    o_ref[...] = fn(x_ref[...])
  return call(kernel, sds(x), interpret), (x,), fn(x)


# ------------------------------------------------------------------ reductions and scans
_REDUCTIONS = {
    "sum": lambda x: jnp.sum(x, axis=1), "max": lambda x: jnp.max(x, axis=0),
    "min": lambda x: jnp.min(x, axis=1), "prod": lambda x: jnp.prod(1 + 0.01 * x, axis=1),
    "argmax": lambda x: jnp.argmax(x, axis=1).astype(jnp.float32),
    "argmin": lambda x: jnp.argmin(x, axis=0).astype(jnp.float32),
    "all_any": lambda x: jnp.all(x > -2, axis=1) * 1.0 + jnp.any(x > 2, axis=1) * 2.0,
    "sum_all": lambda x: jnp.sum(x).reshape(1),
    "cumsum": lambda x: jnp.cumsum(x, axis=1), "cumsum_reverse": lambda x: lax.cumsum(x, 1, reverse=True),
    "cumprod": lambda x: jnp.cumprod(1 + 0.01 * x, axis=0), "cummax": lambda x: lax.cummax(x, 1),
    "cummin_reverse": lambda x: lax.cummin(x, 0, reverse=True),
    "softmax": lambda x: jax.nn.softmax(x, axis=-1),
}


def _reduction_case(fn):
  def make(interpret):
    x = random_array((12, 50))   # neither dimension a power of two
    expected = fn(x)
    def kernel(x_ref, o_ref):
      o_ref[...] = fn(x_ref[...])
    return call(kernel, sds(expected), interpret), (x,), expected
  return make


for _name, _fn in _REDUCTIONS.items():
  case(f"reduce_{_name}", tol=dict(rtol=1e-5, atol=1e-5))(_reduction_case(_fn))


# ------------------------------------------------------------------ dot_general
@case("matmul_accumulate_over_sequential_axis", tol=dict(rtol=1e-4, atol=1e-4))
def _matmul(interpret, m=96, n=64, k=80, bm=32, bn=32, bk=16):
  x, y = random_array((m, k)), random_array((k, n))
  def kernel(x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32,
                          precision=lax.Precision.HIGHEST)
  f = call(kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), interpret,
           grid=(m // bm, n // bn, k // bk),
           in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                     pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
           out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)))
  return f, (x, y), jnp.dot(x, y, precision=lax.Precision.HIGHEST)


@case("matmul_reduction_axis_first", tol=dict(rtol=1e-4, atol=1e-4))
def _matmul_k_first(interpret, m=64, n=32, k=48, bm=32, bk=16):
  x, y = random_array((m, k)), random_array((k, n))
  def kernel(x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += jnp.dot(x_ref[...], y_ref[...], precision=lax.Precision.HIGHEST)
  f = call(kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), interpret,
           grid=(k // bk, m // bm),
           in_specs=[pl.BlockSpec((bm, bk), lambda kk, i: (i, kk)),
                     pl.BlockSpec((bk, n), lambda kk, i: (kk, 0))],
           out_specs=pl.BlockSpec((bm, n), lambda kk, i: (i, 0)))
  return f, (x, y), jnp.dot(x, y, precision=lax.Precision.HIGHEST)


_DOTS = {
    "transposed_lhs": ((24, 20), (24, 16), lambda a, b: lax.dot_general(a, b, (((0,), (0,)), ((), ())))),
    "transposed_rhs": ((20, 24), (16, 24), lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ())))),
    "batched": ((2, 16, 24), (2, 24, 32), lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b)),
    "matrix_vector": ((20, 24), (24,), lambda a, b: a @ b),
    "small_non_power_of_two": ((3, 5), (5, 7), lambda a, b: a @ b),
    "tensor_core_sized_padded": ((20, 40), (40, 24), lambda a, b: a @ b),
}


def _dot_case(sa, sb, fn):
  def make(interpret):
    a, b = random_array(sa), random_array(sb)
    with jax.default_matmul_precision("highest"):
      expected = fn(a, b)
    def kernel(a_ref, b_ref, o_ref):
      with jax.default_matmul_precision("highest"):
        o_ref[...] = fn(a_ref[...], b_ref[...])
    return call(kernel, sds(expected), interpret), (a, b), expected
  return make


for _name, (_sa, _sb, _fn) in _DOTS.items():
  case(f"dot_{_name}", tol=dict(rtol=1e-4, atol=1e-4))(_dot_case(_sa, _sb, _fn))


@case("dot_bf16_inputs_f32_accumulation", bf16=True, tol=dict(rtol=2e-2, atol=2e-2))
def _dot_bf16(interpret):
  a, b = random_array((32, 64), jnp.bfloat16), random_array((64, 32), jnp.bfloat16)
  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)
  return (call(kernel, jax.ShapeDtypeStruct((32, 32), jnp.float32), interpret), (a, b),
          jnp.dot(a, b, preferred_element_type=jnp.float32))


@case("bf16_exp_is_upcast", bf16=True, tol=dict(rtol=2e-2, atol=2e-2))
def _bf16_exp(interpret):
  x = random_array((16, 64), jnp.bfloat16)
  fn = lambda x: jnp.exp(x) + jnp.tanh(x) * jnp.sqrt(jnp.abs(x))
  def kernel(x_ref, o_ref):
    o_ref[...] = fn(x_ref[...])
  return call(kernel, sds(x), interpret), (x,), fn(x)


@case("f16_math", tol=dict(rtol=3e-3, atol=3e-3))
def _f16(interpret):
  x = random_array((16, 64), jnp.float16)
  fn = lambda x: jnp.exp(x * 0.5) + jnp.log1p(jnp.abs(x)) + jnp.sum(x, axis=1, keepdims=True)
  def kernel(x_ref, o_ref):
    o_ref[...] = fn(x_ref[...])
  return call(kernel, sds(x), interpret), (x,), fn(x)


# ------------------------------------------------------------------ shapes
_SHAPE_OPS = {
    "broadcast": ((8, 1), lambda x: jnp.broadcast_to(x, (8, 16)) + jnp.arange(16.0)),
    "reshape_split": ((8, 16), lambda x: x.reshape(8, 4, 4).sum(axis=2)),
    "reshape_unit_dims": ((6, 10), lambda x: x.reshape(6, 1, 10)[:, 0, :] * 2),
    "transpose": ((8, 16), lambda x: x.T * 2),
    "transpose_3d": ((2, 4, 8), lambda x: jnp.transpose(x, (2, 0, 1)) + 1),
    "concatenate": ((8, 16), lambda x: jnp.concatenate([x, -x], axis=1)),
    "concatenate_rows": ((8, 16), lambda x: jnp.concatenate([x, x * 2, -x, x * 3], axis=0)),
    "static_slice": ((8, 20), lambda x: x[1:5, 3:17:2]),
    "flip": ((8, 20), lambda x: jnp.flip(x, axis=1)),
    "squeeze_expand": ((1, 16), lambda x: jnp.expand_dims(jnp.squeeze(x, 0), 1) * 3),
}


def _shape_case(shape, fn):
  def make(interpret):
    x = random_array(shape)
    expected = fn(x)
    def kernel(x_ref, o_ref):
      o_ref[...] = fn(x_ref[...])
    return call(kernel, sds(expected), interpret), (x,), expected
  return make


for _name, (_shape, _fn) in _SHAPE_OPS.items():
  case(f"shape_{_name}")(_shape_case(_shape, _fn))


# ------------------------------------------------------------------ control flow
@case("cond_with_values_and_ref_writes")
def _cond(interpret):
  x = random_array((4, 16))
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    v = lax.cond(i % 2 == 0, lambda a: a * 2, lambda a: a - 1, x_ref[...])
    o_ref[...] = v
    @pl.when(i == 3)
    def _():
      o_ref[...] += 100.0
  f = call(kernel, sds(x), interpret, grid=(4,), in_specs=[rows(1, 16)], out_specs=rows(1, 16))
  expected = jnp.where((jnp.arange(4) % 2 == 0)[:, None], x * 2, x - 1)
  return f, (x,), expected.at[3].add(100.0)


@case("switch_three_branches")
def _switch(interpret):
  x = random_array((6, 8))
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[...] = lax.switch(i % 3, [lambda a: a, lambda a: -a, lambda a: a * 10], x_ref[...])
  f = call(kernel, sds(x), interpret, grid=(6,), in_specs=[rows(1, 8)], out_specs=rows(1, 8))
  scale = jnp.array([1.0, -1.0, 10.0])[jnp.arange(6) % 3]
  return f, (x,), x * scale[:, None]


@case("while_data_dependent")
def _while(interpret):
  x = jnp.abs(random_array((4, 8))) + 1
  def kernel(x_ref, o_ref):
    def cond(c):
      return jnp.max(c[1]) < 100.0
    def body(c):
      return c[0] + 1, c[1] * 2
    n, v = lax.while_loop(cond, body, (0, x_ref[...]))
    o_ref[...] = v + n.astype(jnp.float32)
  def ref(x):
    out = []
    for r in np.asarray(x):
      n = 0
      while r.max() < 100:
        r, n = r * 2, n + 1
      out.append(r + n)
    return jnp.asarray(np.stack(out))
  f = call(kernel, sds(x), interpret, grid=(4,), in_specs=[rows(1, 8)], out_specs=rows(1, 8))
  return f, (x,), ref(x)


@case("fori_loop_with_ds_reads")
def _fori(interpret):
  x = random_array((64, 16))
  def kernel(x_ref, o_ref):
    def step(k, acc):
      return acc + x_ref[pl.ds(k * 8, 8), :]
    o_ref[...] = lax.fori_loop(0, 8, step, jnp.zeros((8, 16), jnp.float32))
  return (call(kernel, jax.ShapeDtypeStruct((8, 16), jnp.float32), interpret), (x,),
          x.reshape(8, 8, 16).sum(0))


@case("fori_loop_traced_trip_count")
def _fori_traced(interpret):
  # Program i sums row blocks 0..i: the trip count is traced, so the loop is a
  # counted while loop (generated as a `for` over a range).
  x = random_array((32, 16))
  def kernel(x_ref, o_ref):
    def step(k, acc):
      return acc + x_ref[pl.ds(k * 8, 8), :]
    o_ref[...] = lax.fori_loop(0, pl.program_id(0) + 1, step, jnp.zeros((8, 16), jnp.float32))
  f = call(kernel, jax.ShapeDtypeStruct((4, 8, 16), jnp.float32), interpret, grid=(4,),
           in_specs=[pl.BlockSpec((32, 16), lambda i: (0, 0))],
           out_specs=pl.BlockSpec((None, 8, 16), lambda i: (i, 0, 0)))
  return f, (x,), jnp.cumsum(x.reshape(4, 8, 16), axis=0)


@case("while_counted_final_index")
def _while_counted(interpret):
  # Traced start and bound, one program with no iterations, and the loop's final
  # index and bound read after it (max(start, bound) and bound).
  x = random_array((4, 8))
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    def body(c):
      return c[0] + 1, c[1], c[2] * 0.5 + c[0].astype(jnp.float32)
    k, n, acc = lax.while_loop(lambda c: c[0] < c[1], body, (i, 5 - i, x_ref[...]))
    o_ref[...] = acc + 10.0 * k.astype(jnp.float32) + 100.0 * n.astype(jnp.float32)
  def ref(x):
    out = []
    for i, r in enumerate(np.asarray(x)):
      k, n = i, 5 - i
      while k < n:
        r, k = r * 0.5 + k, k + 1
      out.append(r + 10.0 * k + 100.0 * n)
    return jnp.asarray(np.stack(out))
  f = call(kernel, sds(x), interpret, grid=(4,), in_specs=[rows(1, 8)], out_specs=rows(1, 8))
  return f, (x,), ref(x)


@case("while_counted_bound_from_a_register_ref")
def _while_counted_register_bound(interpret):
  # The bound is read from scratch held in registers, which the body then changes:
  # the loop's bound, read in the body and after the loop, must not change with it.
  x = random_array((4, 8))
  def kernel(x_ref, o_ref, n_ref):
    n_ref[...] = pl.program_id(0) + 2
    def body(c):
      n_ref[...] = n_ref[...] + 10
      return c[0] + 1, c[1], c[2] + c[1].astype(jnp.float32)
    k, _, acc = lax.while_loop(lambda c: c[0] < c[1], body, (jnp.int32(0), n_ref[...], x_ref[...]))
    o_ref[...] = acc + 10.0 * k.astype(jnp.float32) + 100.0 * n_ref[...].astype(jnp.float32)
  n = np.arange(4, dtype=np.float32)[:, None] + 2
  f = call(kernel, sds(x), interpret, grid=(4,), in_specs=[rows(1, 8)], out_specs=rows(1, 8),
           scratch_shapes=[pl.ScratchShape((), jnp.int32)])
  return f, (x,), x + n * n + 10.0 * n + 100.0 * (11 * n)


@case("program_id_num_programs_hints")
def _program_id(interpret):
  x = random_array((6, 32))
  def kernel(x_ref, o_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    start = pl.multiple_of(j * 16, 16)
    cols = pl.max_contiguous(start + jnp.arange(16), 16)
    o_ref[...] = x_ref[...] + (i * pl.num_programs(1) + j).astype(jnp.float32) + cols[None, :]
  f = call(kernel, sds(x), interpret, grid=(3, 2),
           in_specs=[pl.BlockSpec((2, 16), lambda i, j: (i, j))],
           out_specs=pl.BlockSpec((2, 16), lambda i, j: (i, j)))
  ids = (jnp.arange(6)[:, None] // 2) * 2 + jnp.arange(32)[None, :] // 16
  return f, (x,), x + ids + jnp.arange(32)[None, :]


# ------------------------------------------------------------------ blocks and refs
@case("overhanging_blocks_and_padding")
def _overhang(interpret):
  x = random_array((10, 37))
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2 + jnp.sum(x_ref[...], axis=1, keepdims=True)
  f = call(kernel, sds(x), interpret, grid=(3, 2),
           in_specs=[pl.BlockSpec((4, 24), lambda i, j: (i, j))],
           out_specs=pl.BlockSpec((4, 24), lambda i, j: (i, j)))
  # Each block sums its own (masked) columns.
  blocks = jnp.pad(x, ((0, 2), (0, 11))).reshape(3, 4, 2, 24)
  sums = blocks.sum(-1, keepdims=True)
  out = (blocks * 2 + sums).reshape(12, 48)[:10, :37]
  return f, (x,), out


@case("squeezed_and_element_dims")
def _element(interpret):
  x = random_array((3, 40))
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2   # a window of 10 elements starting at element 4*j - 2
  # (Element offsets count in the padded array, as in Pallas; the Triton backend
  # reads zeros in the padding.)
  f = call(kernel, jax.ShapeDtypeStruct((3, 9, 10), jnp.float32), interpret, grid=(3, 9),
           in_specs=[pl.BlockSpec((None, pl.Element(10, (2, 2))),
                                  lambda i, j: (i, 4 * j))],
           out_specs=pl.BlockSpec((None, None, 10), lambda i, j: (i, j, 0)))
  padded = jnp.pad(x, ((0, 0), (2, 2)))
  windows = jnp.stack([padded[:, 4 * j:4 * j + 10] for j in range(9)], axis=1)
  return f, (x,), windows * 2


@case("ref_indexing_views_and_strides")
def _indexing(interpret):
  x = random_array((8, 12))
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[0, :] = x_ref[1, :]
    o_ref[1:3, ::2] = x_ref[2:4, 1::2]
    view = o_ref.at[4:8]
    view[pl.ds(1, 2), :] = x_ref[pl.ds(pl.program_id(0) + 5, 2), :] * 3
    o_ref[7, -1] = x_ref[-1, -1]
  f = call(kernel, sds(x), interpret, grid=(1,))
  out = jnp.zeros_like(x).at[0].set(x[1]).at[1:3, ::2].set(x[2:4, 1::2])
  out = out.at[5:7].set(x[5:7] * 3).at[7, -1].set(x[-1, -1])
  return f, (x,), out


@case("gather_and_scatter")
def _gather(interpret):
  x = random_array((16,))
  idx = jnp.array([3, 0, 15, 7, 7, 2, 9, 1], jnp.int32)
  def kernel(x_ref, i_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[i_ref[...]] = x_ref[i_ref[...]] * 2
  f = call(kernel, sds(x), interpret)
  return f, (x, idx), jnp.zeros_like(x).at[idx].set(x[idx] * 2)


@case("masked_load_store_other")
def _masked(interpret):
  x = random_array((40,))
  poison = jnp.full((48,), jnp.nan, jnp.float32)
  def kernel(x_ref, o_in_ref, o_ref):
    del o_in_ref    # aliased with o_ref: the poison shows where nothing was stored
    i = pl.program_id(0)
    offs = i * 16 + jnp.arange(16)
    v = plt.load(x_ref.at[pl.ds(i * 16, 16)], mask=offs < 40, other=-1.0)
    plt.store(o_ref.at[pl.ds(i * 16, 16)], (slice(None),), v * 2, mask=offs % 3 != 0)
  f = call(kernel, sds(poison), interpret, grid=(3,), input_output_aliases={1: 0})
  padded_x = jnp.concatenate([x, jnp.full((8,), -1.0)])
  expected = jnp.where(jnp.arange(48) % 3 != 0, padded_x * 2, jnp.nan)
  return (lambda x: f(x, poison)), (x,), expected


@case("input_output_aliases_add_in_place")
def _aliases(interpret):
  x, y = random_array((8, 16)), random_array((8, 16))
  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] += y_ref[...]
  f = call(kernel, sds(x), interpret, input_output_aliases={0: 0})
  return f, (x, y), x + y


@case("scratch_persists_across_sequential_steps")
def _scratch(interpret):
  x = random_array((4, 32))
  def kernel(x_ref, o_ref, acc_ref):
    k = pl.program_id(1)
    @pl.when(k == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += x_ref[...]
    @pl.when(k == pl.num_programs(1) - 1)
    def _():
      o_ref[...] = acc_ref[...]
  f = call(kernel, jax.ShapeDtypeStruct((4, 8), jnp.float32), interpret, grid=(2, 4),
           in_specs=[pl.BlockSpec((2, 8), lambda i, k: (i, k))],
           out_specs=pl.BlockSpec((2, 8), lambda i, k: (i, 0)),
           scratch_shapes=[pl.ScratchShape((2, 8), jnp.float32)])
  return f, (x,), x.reshape(4, 4, 8).sum(1)


@case("scratch_indexed_in_memory_and_run_scoped")
def _scratch_memory(interpret):
  x = random_array((8, 16))
  def kernel(x_ref, o_ref, s_ref):
    s_ref[0:4, :] = x_ref[4:8, :]
    s_ref[4:8, :] = x_ref[0:4, :]
    def body(tmp_ref):
      tmp_ref[...] = s_ref[...] * 2
      o_ref[...] = tmp_ref[...]
      o_ref[pl.ds(0, 1), :] = tmp_ref[pl.ds(7, 1), :]
    pl.run_scoped(body, pl.ScratchShape((8, 16), jnp.float32))
  f = call(kernel, sds(x), interpret, scratch_shapes=[pl.ScratchShape((8, 16), jnp.float32)])
  swapped = jnp.concatenate([x[4:], x[:4]]) * 2
  return f, (x,), swapped.at[0].set(swapped[7])


@case("scalar_prefetch_selects_blocks")
def _prefetch(interpret):
  x = random_array((4, 16))
  order = jnp.array([2, 0, 3, 1], jnp.int32)
  def kernel(order_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] + order_ref[pl.program_id(0)].astype(jnp.float32)
  spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(4,),
      in_specs=[pl.BlockSpec((1, 16), lambda i, o: (o[i], 0))],
      out_specs=pl.BlockSpec((1, 16), lambda i, o: (i, 0)))
  f = call(kernel, sds(x), interpret, grid_spec=spec)
  return f, (order, x), x[order] + order[:, None]


@case("closed_over_constant_array")
def _constant(interpret):
  x = random_array((4, 6))
  table = np.array([[1.0, -2.0, 3.5, 0.0, 7.0, -1.0]], np.float32)
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * jnp.asarray(table)
  return call(kernel, sds(x), interpret), (x,), x * table


@case("compiler_params_warps_stages")
def _params(interpret):
  x = random_array((64, 64))
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 3
  f = call(kernel, sds(x), interpret, grid=(2,), in_specs=[rows(32, 64)],
           out_specs=rows(32, 64), compiler_params=plt.CompilerParams(num_warps=8, num_stages=2))
  return f, (x,), x * 3


# ------------------------------------------------------------------ atomics
_ATOMICS = {"add": ("atomic_add", lambda o, v: o + v), "max": ("atomic_max", jnp.maximum),
            "min": ("atomic_min", jnp.minimum), "and": ("atomic_and", jnp.bitwise_and),
            "or": ("atomic_or", jnp.bitwise_or), "xor": ("atomic_xor", jnp.bitwise_xor),
            "xchg": ("atomic_xchg", lambda o, v: v)}


def _atomic_case(fn_name, combine):
  def make(interpret):
    x = random_array((4, 8), jnp.int32, low=0, high=100)
    init = random_array((8,), jnp.int32, low=0, high=100)
    def kernel(x_ref, init_ref, o_ref, old_ref):
      i = pl.program_id(0)
      @pl.when(i == 0)
      def _():
        o_ref[...] = init_ref[...]
      old_ref[...] = getattr(pl, fn_name)(o_ref, (slice(None),), x_ref[...])
    # One program per row, each updating all 8 cells: the grid axis is sequential
    # (the outputs do not move along it), so programs apply their updates in order.
    f = call(kernel, (sds(init), jax.ShapeDtypeStruct((4, 8), jnp.int32)), interpret,
             grid=(4,), in_specs=[pl.BlockSpec((None, 8), lambda i: (i, 0)), None],
             out_specs=(pl.BlockSpec((8,), lambda i: (0,)),
                        pl.BlockSpec((None, 8), lambda i: (i, 0))))
    state, olds = init, []
    for r in range(4):
      olds.append(state)
      state = combine(state, x[r])
    return f, (x, init), (state, jnp.stack(olds))
  return make


for _name, (_fn_name, _combine) in _ATOMICS.items():
  case(f"atomic_{_name}")(_atomic_case(_fn_name, _combine))


@case("atomic_xchg_float")
def _xchg_float(interpret):
  # Triton's interpreter has no float atomic_xchg; the exchange is of bits, so the
  # backend exchanges them as integers (found by tests/fuzz, atomics).
  init, v = random_array((8,)), random_array((8,))
  def kernel(init_ref, v_ref, o_ref, old_ref):
    o_ref[...] = init_ref[...]
    old_ref[...] = pl.atomic_xchg(o_ref, (slice(None),), v_ref[...])
  f = call(kernel, (sds(init), sds(init)), interpret)
  return f, (init, v), (v, init)


@case("atomic_cas_scalar")
def _cas(interpret):
  x = jnp.array([5, 9], jnp.int32)
  def kernel(x_ref, o_ref, old_ref):
    o_ref[...] = x_ref[...]
    a = pl.atomic_cas(o_ref, 0, 5, 11)      # matches: stores 11
    b = pl.atomic_cas(o_ref, 1, 5, 12)      # does not match
    old_ref[0] = a
    old_ref[1] = b
  f = call(kernel, (sds(x), sds(x)), interpret)
  return f, (x,), (jnp.array([11, 9], jnp.int32), x)


@case("atomic_add_float_from_parallel_programs", tol=dict(rtol=1e-5, atol=1e-5))
def _atomic_parallel(interpret):
  x = random_array((8, 16))
  def kernel(x_ref, total_in_ref, o_ref, total_ref):
    del total_in_ref    # aliased with total_ref
    o_ref[...] = x_ref[...]
    pl.atomic_add(total_ref, (slice(None),), jnp.sum(x_ref[...], axis=0))
  f = call(kernel, (sds(x), jax.ShapeDtypeStruct((16,), jnp.float32)), interpret, grid=(8,),
           in_specs=[rows(1, 16), pl.BlockSpec((16,), lambda i: (0,))], out_specs=(rows(1, 16), pl.BlockSpec((16,), lambda i: (0,))),
           input_output_aliases={1: 1},
           compiler_params=plt.CompilerParams(dimension_semantics=("parallel",)))
  zeros = jnp.zeros((16,), jnp.float32)
  return (lambda x: f(x, zeros)), (x,), (x, x.sum(0))


@case("debug_print_compiles_and_runs")
def _print(interpret):
  x = random_array((4,))
  def kernel(x_ref, o_ref):
    pl.debug_print("first value {}", x_ref[0])
    o_ref[...] = x_ref[...]
  return call(kernel, sds(x), interpret), (x,), x


# ------------------------------------------------------------------ JAX 0.12 primitives
@case("stack_and_unstack_of_padded_pieces")
def _stack(interpret):
  x = random_array((3, 6))
  def kernel(x_ref, o_ref, u_ref):
    v = x_ref[...]
    o_ref[...] = jnp.stack([v, v * 2, -v], axis=1)
    a, b, c = lax.unstack(v, axis=0)
    u_ref[...] = a + b * 10 + c * 100
  f = call(kernel, (jax.ShapeDtypeStruct((3, 3, 6), jnp.float32),
                    jax.ShapeDtypeStruct((6,), jnp.float32)), interpret)
  return f, (x,), (jnp.stack([x, x * 2, -x], axis=1), x[0] + x[1] * 10 + x[2] * 100)


@case("tile_power_of_two_and_padded")
def _tile(interpret):
  x, y = random_array((4, 8)), random_array((3, 5))
  def kernel(x_ref, y_ref, o_ref, p_ref):
    o_ref[...] = jnp.tile(x_ref[...], (2, 4))
    p_ref[...] = jnp.tile(y_ref[...], (3, 2))
  f = call(kernel, (jax.ShapeDtypeStruct((8, 32), jnp.float32),
                    jax.ShapeDtypeStruct((9, 10), jnp.float32)), interpret)
  return f, (x, y), (jnp.tile(x, (2, 4)), jnp.tile(y, (3, 2)))


@case("threefry2x32_random_bits")
def _threefry(interpret):
  from jax.extend.random import threefry2x32_p
  key = jnp.array([0xDEADBEEF, 7], jnp.uint32)
  counts = jnp.arange(2 * 5 * 24, dtype=jnp.uint32).reshape(2, 5, 24) * jnp.uint32(2654435761)
  def kernel(k_ref, c_ref, hi_ref, lo_ref):
    hi_ref[...], lo_ref[...] = threefry2x32_p.bind(
        jnp.full((1, 24), k_ref[0]), jnp.full((5, 1), k_ref[1]), c_ref[0], c_ref[1])
  out = jax.ShapeDtypeStruct((5, 24), jnp.uint32)
  expected = threefry2x32_p.bind(key[0], key[1], counts[0], counts[1])
  return call(kernel, (out, out), interpret), (key, counts), tuple(expected)


@case("debug_barrier_and_a_check_that_holds")
def _barrier(interpret):
  x = random_array((16, 32))
  def kernel(x_ref, o_ref, s_ref):
    s_ref[...] = x_ref[...] + 1
    plt.debug_barrier()
    with pl.enable_debug_checks(True):
      pl.debug_check(jnp.all(s_ref[...] > x_ref[...]), "scratch holds x + 1")
    o_ref[:8, :] = s_ref[8:, :]
    o_ref[8:, :] = s_ref[:8, :]
  import pallet.tpu as pltpu
  f = call(kernel, sds(x), interpret, scratch_shapes=[pltpu.VMEM((16, 32), jnp.float32)])
  return f, (x,), jnp.concatenate([x[8:], x[:8]]) + 1


@case("split_pad_and_dynamic_update_slice")
def _split_pad(interpret):
  x, u = random_array((5, 12)), random_array((2, 3))
  i = jnp.array([3, 20], jnp.int32)        # the second start is clamped, as XLA does
  def kernel(x_ref, u_ref, i_ref, a_ref, b_ref, p_ref, d_ref):
    a, b = jnp.split(x_ref[...], [7], axis=1)
    a_ref[...], b_ref[...] = a, b * 2
    p_ref[...] = lax.pad(x_ref[...], -1.5, ((1, -2, 1), (3, 1, 0)))
    d_ref[...] = lax.dynamic_update_slice(x_ref[...], u_ref[...], (i_ref[0], i_ref[1]))
  shapes = (jax.ShapeDtypeStruct((5, 7), jnp.float32), jax.ShapeDtypeStruct((5, 5), jnp.float32),
            jax.ShapeDtypeStruct((8, 16), jnp.float32), sds(x))
  expected = (x[:, :7], x[:, 7:] * 2, lax.pad(x, -1.5, ((1, -2, 1), (3, 1, 0))),
              lax.dynamic_update_slice(x, u, (3, 20)))
  return call(kernel, shapes, interpret), (x, u, i), expected


@case("reshape_across_padding")
def _reshape_padded(interpret):
  x, y = random_array((3, 6)), random_array((2, 24))
  def kernel(x_ref, y_ref, o_ref, p_ref):
    o_ref[...] = x_ref[...].reshape(2, 9) + 1
    p_ref[...] = y_ref[...].reshape(2, 3, 8).sum(axis=1)     # page rows gathered as pages
  f = call(kernel, (jax.ShapeDtypeStruct((2, 9), jnp.float32),
                    jax.ShapeDtypeStruct((2, 8), jnp.float32)), interpret)
  return f, (x, y), (x.reshape(2, 9) + 1, y.reshape(2, 3, 8).sum(axis=1))


@case("bitcast_between_widths")
def _bitcast_widths(interpret):
  x = random_array((4, 6))
  b = random_array((5, 3, 4), jnp.int8, low=-128, high=127)
  def kernel(x_ref, b_ref, halves_ref, words_ref, back_ref):
    halves_ref[...] = lax.bitcast_convert_type(x_ref[...], jnp.bfloat16)
    words_ref[...] = lax.bitcast_convert_type(b_ref[...], jnp.int32)
    back_ref[...] = lax.bitcast_convert_type(lax.bitcast_convert_type(x_ref[...], jnp.uint16),
                                             jnp.float32)
  f = call(kernel, (jax.ShapeDtypeStruct((4, 6, 2), jnp.bfloat16),
                    jax.ShapeDtypeStruct((5, 3), jnp.int32), sds(x)), interpret)
  return f, (x, b), (lax.bitcast_convert_type(x, jnp.bfloat16),
                     lax.bitcast_convert_type(b, jnp.int32), x)


@case("int8_dot_below_the_tensor_core_k")
def _int8_dot(interpret):
  a = random_array((16, 16), jnp.int8, low=-8, high=8)
  b = random_array((16, 32), jnp.int8, low=-8, high=8)
  def kernel(a_ref, b_ref, o_ref):     # K = 16: too short for an int8 tensor-core dot
    o_ref[...] = plt.dot(a_ref[...], b_ref[...])
  f = call(kernel, jax.ShapeDtypeStruct((16, 32), jnp.int32), interpret)
  return f, (a, b), jnp.dot(a, b, preferred_element_type=jnp.int32)


# ------------------------------------------------------------------ dots of mixed dtypes
# (lhs dtype, rhs dtype, preferred_element_type, how the kernel asks for the product).
# XLA multiplies a mixed pair converted to the result dtype; the generated code converts
# too (quantized weights: activations by int8 weights), where it used to hand Triton's
# dot two dtypes and crash Triton's interpreter with no location.
_MIXED_DOTS = {
    "bf16_by_int8": (jnp.bfloat16, jnp.int8, None, "jnp.dot"),
    "bf16_by_int8_to_f32": (jnp.bfloat16, jnp.int8, jnp.float32, "jnp.dot"),
    "int8_by_bf16": (jnp.int8, jnp.bfloat16, None, "dot_general"),
    "f16_by_int8": (jnp.float16, jnp.int8, None, "dot_general"),
    "f16_by_int8_to_f32": (jnp.float16, jnp.int8, jnp.float32, "dot_general"),
    "int8_by_int8_to_int32": (jnp.int8, jnp.int8, jnp.int32, "dot_general"),
    "int8_by_int8_to_f32": (jnp.int8, jnp.int8, jnp.float32, "dot_general"),
    "int8_by_int8_to_bf16": (jnp.int8, jnp.int8, jnp.bfloat16, "dot_general"),
    "f32_by_bf16": (jnp.float32, jnp.bfloat16, None, "dot_general"),
    "f32_by_int8_to_bf16": (jnp.float32, jnp.int8, jnp.bfloat16, "dot_general"),
    "e4m3_by_bf16_to_f32": (jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32, "dot_general"),
    "e5m2_by_int8": (jnp.float8_e5m2, jnp.int8, None, "dot_general"),
    "e4m3_by_e5m2_to_f32": (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float32, "dot_general"),
    "pl_dot_bf16_by_int8": (jnp.bfloat16, jnp.int8, None, "plgpu.dot"),
    "bf16_by_int8_cast_in_kernel": (jnp.bfloat16, jnp.int8, None, "astype"),
}
MIXED_DOT_CASES = tuple(f"dot_mixed_{n}" for n in _MIXED_DOTS)


def _mixed_product(how, pet):
  if how == "jnp.dot":
    return lambda a, b: jnp.dot(a, b, preferred_element_type=pet)
  if how == "plgpu.dot":
    return plt.dot
  if how == "astype":
    return lambda a, b: jnp.dot(a, b.astype(a.dtype))
  return lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                      preferred_element_type=pet)


def _mixed_dot_case(a_dtype, b_dtype, pet, how):
  def make(interpret):
    # M and N padded to powers of two, K = 80 padded to 128 (masked to zero)
    a, b = random_array((24, 80), a_dtype), random_array((80, 40), b_dtype)
    fn = _mixed_product(how, pet)
    expected = fn(a, b)
    def kernel(a_ref, b_ref, o_ref):
      o_ref[...] = fn(a_ref[...], b_ref[...])
    return call(kernel, sds(expected), interpret), (a, b), expected
  return make


def _mixed_tolerance(a_dtype, b_dtype, pet, how):
  out = jax.eval_shape(_mixed_product(how, pet), jax.ShapeDtypeStruct((2, 2), a_dtype),
                       jax.ShapeDtypeStruct((2, 2), b_dtype)).dtype
  if jnp.issubdtype(out, jnp.integer):
    return None
  if a_dtype == jnp.float32 and out == jnp.bfloat16:
    # XLA rounds the float32 operand to bf16; the interpreter holds bf16 in float32
    # and does not (interpreter.py): products differ by ~2**-9 of their size.
    return dict(rtol=2e-2, atol=4.0)
  # A sum of 80 products of size ~50 in the result's precision (fp8 results: e5m2's
  # 2 mantissa bits; inputs rounded to bf16 where XLA rounds them too).
  return {"float8_e5m2": dict(rtol=0.25, atol=1.0), "bfloat16": dict(rtol=2e-2, atol=0.5),
          "float16": dict(rtol=2e-3, atol=0.25)}.get(jnp.dtype(out).name,
                                                     dict(rtol=1e-4, atol=1e-3))


for _name, _spec in _MIXED_DOTS.items():
  case(f"dot_mixed_{_name}", tol=_mixed_tolerance(*_spec))(_mixed_dot_case(*_spec))


# ------------------------------------------------------------------ grid sizes known at run time
# `fn(x, n)` with n traced: the grid size is an operand of the launch.
DYNAMIC_GRID_CASES = ("dynamic_grid_parallel_axis_past_its_bound",
                      "dynamic_grid_sequential_reduction_axis",
                      "dynamic_grid_grouped_matmul_over_active_tiles")


@case("dynamic_grid_parallel_axis_past_its_bound")
def _dynamic_parallel(interpret):
  # 5 row blocks on a bound of 3: programs p take row blocks p and p + 3; rows past the
  # 5 blocks keep the aliased input.
  x, n = random_array((64, 32)), 5
  def kernel(x_ref, o_ref):
    o_ref[...] = (x_ref[...] * 2 + pl.program_id(0).astype(jnp.float32) * 100
                  + pl.num_programs(0).astype(jnp.float32))
  spec = pl.BlockSpec((8, 16), lambda i, j: (i, j))
  params = plt.CompilerParams(dimension_semantics=("parallel", "parallel"),
                              grid_bounds=(3, None))
  fn = jax.jit(lambda x, n: call(kernel, sds(x), interpret, grid=(n, 2), in_specs=[spec],
                                 out_specs=spec, input_output_aliases={0: 0},
                                 compiler_params=params)(x))
  rows = jnp.arange(64)[:, None]
  expected = jnp.where(rows < 8 * n, x * 2 + (rows // 8) * 100.0 + n, x)
  return fn, (x, jnp.int32(n)), expected


@case("dynamic_grid_sequential_reduction_axis", tol=dict(rtol=1e-5, atol=1e-5))
def _dynamic_reduction(interpret):
  # Row sums of the first n column blocks: a reduction axis of traced length (a loop
  # with that trip count in every program), a scratch accumulator, num_programs.
  x, n = random_array((32, 64)), 3
  def kernel(x_ref, o_ref, acc_ref):
    k = pl.program_id(1)
    @pl.when(k == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += jnp.sum(x_ref[...], axis=1, keepdims=True)
    @pl.when(k == pl.num_programs(1) - 1)
    def _():
      o_ref[...] = acc_ref[...]
  fn = jax.jit(lambda x, n: call(
      kernel, jax.ShapeDtypeStruct((32, 1), jnp.float32), interpret, grid=(4, n),
      in_specs=[pl.BlockSpec((8, 16), lambda i, k: (i, k))],
      out_specs=pl.BlockSpec((8, 1), lambda i, k: (i, 0)),
      scratch_shapes=[pl.ScratchShape((8, 1), jnp.float32)],
      compiler_params=plt.CompilerParams(dimension_semantics=("parallel", "arbitrary")))(x))
  return fn, (x, jnp.int32(n)), jnp.sum(x[:, :16 * n], axis=1, keepdims=True)


def grouped_matmul(interpret, compiler_params, call_fn=None):
  """A megablox-style grouped matmul: rows in groups (tiles of 16 rows each in one
  group), out[tile] = x[tile] @ w[group of tile] for the first `active` tiles, a traced
  count; the tiles' groups come as scalar prefetch."""
  def kernel(group_ref, x_ref, w_ref, o_ref):
    del group_ref
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...], precision=lax.Precision.HIGHEST)
  launch = call_fn or (lambda k, o, **kw: call(k, o, interpret, **kw))

  def fn(groups, x, w, poison, active):
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(w.shape[2] // 32, active),
        in_specs=[pl.BlockSpec((16, x.shape[1]), lambda j, t, g: (t, 0)),
                  pl.BlockSpec((None, w.shape[1], 32), lambda j, t, g: (g[t], 0, j)),
                  pl.BlockSpec((16, 32), lambda j, t, g: (t, j))],
        out_specs=pl.BlockSpec((16, 32), lambda j, t, g: (t, j)))
    return launch(lambda g, x_ref, w_ref, p_ref, o_ref: kernel(g, x_ref, w_ref, o_ref),
                  sds(poison), grid_spec=spec, input_output_aliases={3: 0},
                  compiler_params=compiler_params)(groups, x, w, poison)
  return fn


def grouped_matmul_reference(groups, x, w, poison, active):
  tiles = x.reshape(-1, 16, x.shape[1])
  out = jnp.einsum("tik,tkn->tin", tiles, w[groups], precision=lax.Precision.HIGHEST)
  keep = (jnp.arange(tiles.shape[0]) < active)[:, None, None]
  return jnp.where(keep, out, poison.reshape(out.shape)).reshape(poison.shape)


@case("dynamic_grid_grouped_matmul_over_active_tiles", tol=dict(rtol=1e-4, atol=1e-4))
def _grouped_matmul(interpret):
  groups = jnp.array([2, 0, 0, 1, 2], jnp.int32)    # 5 tiles of 16 rows, 4 active
  x, w = random_array((80, 32)), random_array((3, 32, 64))
  poison = jnp.full((80, 64), jnp.nan, jnp.float32)
  fn = jax.jit(grouped_matmul(interpret, plt.CompilerParams(
      dimension_semantics=("parallel", "parallel"))))
  args = (groups, x, w, poison, jnp.int32(4))
  return fn, args, grouped_matmul_reference(*args)


# ------------------------------------------------------------------ DMAs and semaphores
import pallet.tpu as pltpu    # noqa: E402  (the DMA API lives with the TPU names)

DMA_CASES = ("dma_windows_semaphores_and_sync_copy", "dma_parallel_grid_axis",
             "dma_copies_in_a_loop")
_ANY = pl.BlockSpec(memory_space=pltpu.ANY)


@case("dma_windows_semaphores_and_sync_copy")
def _dma_windows(interpret):
  # .at[] windows at traced offsets, a source semaphore, add=True, static semaphore reads
  x = random_array((4, 16, 8))
  def kernel(x_hbm, o_ref, seen_ref, buf, sems):
    i = pl.program_id(0)
    copy = pltpu.make_async_copy(x_hbm.at[3 - i, pl.ds(4, 8)], buf, sems.at[0],
                                 src_sem=sems.at[1])
    copy.start()
    seen_ref[0] = pl.semaphore_read(sems.at[1])
    copy.wait()
    pltpu.sync_copy(x_hbm.at[i, pl.ds(0, 8)], o_ref)
    pltpu.async_copy(buf, o_ref, sems.at[0], add=True).wait()
    seen_ref[1] = pl.semaphore_read(sems.at[0])
  f = call(kernel, (jax.ShapeDtypeStruct((4, 8, 8), jnp.float32),
                    jax.ShapeDtypeStruct((4, 2), jnp.int32)), interpret, grid=(4,),
           in_specs=[_ANY], out_specs=(pl.BlockSpec((None, 8, 8), lambda i: (i, 0, 0)),
                                       pl.BlockSpec((None, 2), lambda i: (i, 0))),
           scratch_shapes=[pltpu.VMEM((8, 8), jnp.float32), pltpu.SemaphoreType.DMA((2,))])
  seen = jnp.broadcast_to(jnp.array([64, 0], jnp.int32), (4, 2))
  return f, (x,), (x[:, :8] + x[::-1, 4:12], seen)


@case("dma_parallel_grid_axis")
def _dma_parallel(interpret):
  x = random_array((4, 8, 128))
  def kernel(x_hbm, o_hbm, buf, sems):
    i = pl.program_id(0)
    pltpu.async_copy(x_hbm.at[3 - i], buf, sems.at[0]).wait()
    buf[...] = jnp.exp(buf[...]) + i.astype(jnp.float32)
    pltpu.async_copy(buf, o_hbm.at[pl.ds(i * 8, 8)], sems.at[1]).wait()
  f = call(kernel, jax.ShapeDtypeStruct((32, 128), jnp.float32), interpret, grid=(4,),
           in_specs=[_ANY], out_specs=_ANY,
           scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA((2,))],
           compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))
  expected = jnp.exp(x[::-1]) + jnp.arange(4, dtype=jnp.float32)[:, None, None]
  return f, (x,), expected.reshape(32, 128)


@case("dma_copies_in_a_loop")
def _dma_loop(interpret):
  x, y = random_array((64, 16)), random_array((64, 16))
  def kernel(x_hbm, y_hbm, o_hbm, buf, sem):
    def step(k, carry):
      rows = pl.ds(pl.multiple_of(k * 8, 8), 8)
      pltpu.sync_copy(x_hbm.at[rows], buf)
      buf[...] = buf[...] * 2.0
      pltpu.async_copy(buf, o_hbm.at[rows], sem).wait()
      pltpu.async_copy(y_hbm.at[rows], o_hbm.at[rows], sem, add=True).wait()
      return carry
    lax.fori_loop(0, 8, step, 0)
  f = call(kernel, sds(x), interpret, in_specs=[_ANY, _ANY], out_specs=_ANY,
           scratch_shapes=[pltpu.VMEM((8, 16), jnp.float32), pltpu.SemaphoreType.DMA])
  return f, (x, y), 2.0 * x + y


@case("float8_reductions_of_padded_rows")
def _float8_reductions(interpret):
  # 20 columns padded to 32: the padding must not win a max or min (float8_e4m3fn has
  # no infinity), and the block loads at the array edge fill float8 with 0.0.
  x = random_array((4, 20)).astype(jnp.float8_e4m3fn)
  fn = lambda x: (jnp.max(x, axis=1), jnp.min(x, axis=1),
                  jnp.argmin(x, axis=1).astype(jnp.int32))
  def kernel(x_ref, max_ref, min_ref, arg_ref):
    max_ref[...], min_ref[...], arg_ref[...] = fn(x_ref[...])
  expected = fn(x)
  return call(kernel, tuple(sds(e) for e in expected), interpret), (x,), expected
