"""Lanes a kernel pads onto its data are dropped only where nothing observes them.

`padded_lanes.narrow` rewrites a discharged body to compute on the real lanes of a
padded block (Triton-style power-of-two blocks over a narrower row). The oracle
for the rewrite is the body itself: Hypothesis draws programs over a padded value
(masks that end before, at or after the real width, pads of 0, -inf or 1, sums,
maxima, products over the padded axis, values observed whole) and the rewritten
program must compute what the original does. Kernels in the Triton style are
checked against jax.numpy on widths that are not powers of two.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax

import pallet as pl
from pallet import triton as plgpu
from pallet.backends.xla import padded_lanes, plan_of
from helpers import assert_close, poisoned, random_array

pytestmark = pytest.mark.cpu_only   # a pass of the XLA backend, and the programs it emits

f32 = jnp.float32


def _primitives(closed) -> list[str]:
  return [e.primitive.name for e in closed.jaxpr.eqns]


def _run(closed, *args):
  return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


# ------------------------------------------------------------------ the rewrite
_STEPS = ("mask", "square", "add", "exp", "center", "scale", "shifted_mask", "iota_select",
          "transpose_back", "one_lane", "center_flat", "exp_raw", "inverse_mask", "isnan")


@st.composite
def _programs(draw):
  rows = draw(st.integers(1, 3))
  width = draw(st.integers(1, 40))
  padded = width + draw(st.integers(1, 24))
  fill = draw(st.sampled_from([0.0, -np.inf, 1.0]))
  steps = draw(st.lists(st.tuples(st.sampled_from(_STEPS), st.integers(-2, 2),
                                  st.sampled_from([0.0, -np.inf, 1.0, 2.5])),
                        min_size=0, max_size=6))
  ends = draw(st.lists(st.sampled_from(["sum", "max", "min", "slice", "whole", "dot",
                                        "column_sum"]), min_size=1, max_size=3))
  return rows, width, padded, fill, steps, ends


def _where(mask, v, other):
  """jnp.where without its `jit` (the bodies pallet emits have their calls inlined)."""
  return lax.select(mask, v, jnp.full_like(v, other))


def _program(rows, width, padded, fill, steps, ends):
  def f(x, y):
    cols = lax.broadcasted_iota(jnp.int32, (rows, padded), 1)
    v = lax.pad(x, f32(fill), [(0, 0, 0), (0, padded - width, 0)])
    values = [v]
    for step, shift, other in steps:
      v = values[-1]
      if step == "mask":
        v = _where(cols < width, v, other)
      elif step == "shifted_mask":
        v = _where(cols < width + shift, v, other)
      elif step == "one_lane":   # every lane but one, which may lie in the padding
        v = _where(cols != width + shift, v, other)
      elif step == "exp_raw":   # softmax's exp(x - max(x)) needs the exp itself
        v = jnp.exp(v)
      elif step == "inverse_mask":   # real lanes replaced, padding kept
        v = lax.select(cols < width, jnp.full_like(v, other), v)
      elif step == "isnan":
        v = (v != v).astype(f32)
      elif step == "square":
        v = v * v
      elif step == "add":
        v = v + values[0]
      elif step == "exp":   # bounded: sums of overflowing values depend on their order
        v = jnp.exp(jnp.tanh(v))
      elif step == "center":
        v = v - jnp.max(v, axis=1, keepdims=True)
      elif step == "center_flat":
        v = v - jnp.broadcast_to(jnp.max(v, axis=1)[:, None], v.shape)
      elif step == "scale":
        v = v * jnp.tanh(jnp.sum(v, axis=1, keepdims=True))
      elif step == "iota_select":
        v = lax.select(cols >= width, jnp.full_like(v, other), v)
      elif step == "transpose_back":
        v = jnp.transpose(jnp.transpose(v) * f32(2))
      values.append(v)
    v = values[-1]
    outs = []
    for end in ends:
      if end == "sum":
        outs.append(jnp.sum(v, axis=1))
      elif end == "max":
        outs.append(jnp.max(v, axis=1))
      elif end == "min":
        outs.append(jnp.min(v, axis=1))
      elif end == "slice":
        outs.append(v[:, :width])
      elif end == "whole":
        outs.append(v)
      elif end == "column_sum":
        outs.append(jnp.sum(v, axis=0)[:width])
      elif end == "dot":
        w = lax.pad(y, f32(0), [(0, padded - width, 0), (0, 0, 0)])
        outs.append(lax.dot(v, w, precision=lax.Precision.HIGHEST))
    return outs
  return f


@settings(max_examples=300, deadline=None)
@given(_programs(), st.integers(0, 2**31 - 1))
def test_narrowed_programs_compute_what_the_originals_do(program, seed):
  rows, width, padded, *_ = program
  f = _program(*program)
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, width)).astype(np.float32)
  for r in range(rows):   # rows of -inf or NaN, and single infinities or NaNs
    kind = rng.integers(6)
    if kind < 3:
      x[r] = [-np.inf, np.nan, np.inf][kind]
    elif kind == 3:
      x[r, rng.integers(width)] = rng.choice([-np.inf, np.inf, np.nan])
  y = rng.standard_normal((width, 3)).astype(np.float32)
  closed = jax.make_jaxpr(f)(x, y)
  narrowed = padded_lanes.narrow(closed)
  for got, want in zip(_run(narrowed, x, y), _run(closed, x, y)):
    assert got.shape == want.shape
    got, want = np.asarray(got), np.asarray(want)
    # sums over fewer lanes round in another order: tolerance on the values' scale
    scale = np.max(np.abs(want[np.isfinite(want)]), initial=0.0) + 1.0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale, equal_nan=True)


@pytest.mark.parametrize("fill,steps,narrowed", [
    (-np.inf, [("center", 0, 0.0), ("exp_raw", 0, 0.0)], True),      # softmax's sum
    (0.0, [("center", 0, 0.0), ("exp_raw", 0, 0.0)], False),          # 0 - max: unknown
    (-np.inf, [("center", 0, 0.0), ("exp_raw", 0, 0.0), ("inverse_mask", 0, 1.0)], False),
    (-np.inf, [("center", 0, 0.0), ("isnan", 0, 0.0)], False),        # NaN rows differ
])
def test_rows_minus_their_max_on_rows_of_nan_and_infinity(fill, steps, narrowed):
  x = random_array((4, 5), seed=7)
  x = x.at[1].set(-jnp.inf).at[2].set(jnp.nan).at[3, 2].set(jnp.inf)
  y = random_array((5, 3), seed=8)
  closed = jax.make_jaxpr(_program(4, 5, 8, fill, steps, ["sum", "slice"]))(x, y)
  rewritten = padded_lanes.narrow(closed)
  assert ("pad" not in _primitives(rewritten)) == narrowed
  for got, want in zip(_run(rewritten, x, y), _run(closed, x, y)):
    np.testing.assert_allclose(got, want, rtol=1e-5, equal_nan=True)


def test_a_row_norm_runs_on_real_lanes_only():
  f = _program(2, 192, 256, 0.0, [("mask", 0, 0.0), ("square", 0, 0.0)], ["sum", "slice"])
  x, y = np.ones((2, 192), np.float32), np.ones((192, 3), np.float32)
  closed = jax.make_jaxpr(f)(x, y)
  narrowed = padded_lanes.narrow(closed)
  assert "pad" in _primitives(closed) and "pad" not in _primitives(narrowed)


@pytest.mark.parametrize("ends,steps", [
    (["whole"], [("mask", 0, 2.5)]),                 # every lane observed, tail known
    (["sum"], [("shifted_mask", 1, 0.0)]),           # the mask lets a lane through
    (["sum"], [("exp", 0, 0.0)]),                     # exp(0) = 1 is no sum's identity
])
def test_observed_padding_is_kept(ends, steps):
  f = _program(2, 5, 8, 0.0, steps, ends)
  x, y = random_array((2, 5)), random_array((5, 3))
  closed = jax.make_jaxpr(f)(x, y)
  narrowed = padded_lanes.narrow(closed)
  assert "pad" in _primitives(narrowed)
  for got, want in zip(_run(narrowed, x, y), _run(closed, x, y)):
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_unknown_tails_read_whole_leave_the_body_alone():
  def f(x):
    v = lax.pad(x, f32(0), [(0, 3, 0)])
    v = v * x[0]   # a scalar of unknown value: the tail is 0 * x[0], NaN for inf
    return jnp.sum(v), v
  closed = jax.make_jaxpr(f)(random_array((5,)))
  assert padded_lanes.narrow(closed) is closed


# ------------------------------------------------------------------ kernels
def _row_kernel(kind: str, n: int, block: int):
  """A Triton-style row norm: the row in chunks of `block` lanes, the last one masked
  (one chunk of the next power of two, or several)."""
  chunks = pl.cdiv(n, block)

  def load(ref, j):
    cols = j * block + jnp.arange(block)
    return plgpu.load(ref.at[cols], mask=cols < n, other=0.0), cols < n

  def kernel(x_ref, w_ref, o_ref):
    total = lax.fori_loop(0, chunks, lambda j, acc: acc + load(x_ref, j)[0],
                          jnp.zeros(block, f32))
    mean = jnp.sum(total) / n if kind == "layer" else 0.0

    def square(j, acc):
      x, mask = load(x_ref, j)
      xc = jnp.where(mask, x - mean, 0.0)
      return acc + xc * xc

    squares = lax.fori_loop(0, chunks, square, jnp.zeros(block, f32))
    rstd = lax.rsqrt(jnp.sum(squares) / n + 1e-5)

    @pl.loop(0, chunks)
    def _(j):
      x, mask = load(x_ref, j)
      w, _ = load(w_ref, j)
      cols = j * block + jnp.arange(block)
      plgpu.store(o_ref.at[cols], (x - mean) * rstd * w, mask=mask)
  return kernel


def _rows(kind, x, w, block):
  rows, n = x.shape
  return pl.pallas_call(
      lambda x_ref, w_ref, p_ref, o_ref: _row_kernel(kind, n, block)(x_ref, w_ref, o_ref),
      out_shape=jax.ShapeDtypeStruct(x.shape, f32), grid=(rows,),
      in_specs=[pl.BlockSpec((None, n), lambda i: (i, 0)), pl.BlockSpec((n,), lambda i: (0,)),
                pl.BlockSpec((None, n), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((None, n), lambda i: (i, 0)),
      input_output_aliases={2: 0})(x, w, poisoned(x.shape))


def _reference(kind, x, w):
  if kind == "rms":
    return x * lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + 1e-5) * w
  xc = x - jnp.mean(x, axis=1, keepdims=True)
  return xc * lax.rsqrt(jnp.mean(xc * xc, axis=1, keepdims=True) + 1e-5) * w


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(["rms", "layer"]), st.integers(1, 6), st.integers(1, 300),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_triton_style_row_kernels_on_widths_that_are_not_powers_of_two(kind, rows, n, one,
                                                                       seed):
  block = pl.next_power_of_2(n) if one else 32
  x = random_array((rows, n), seed=seed)
  w = random_array((n,), seed=seed + 1)
  assert_close(jax.jit(lambda x, w: _rows(kind, x, w, block))(x, w), _reference(kind, x, w),
               rtol=2e-5, atol=2e-5)


def test_a_one_chunk_row_norm_emits_no_pad():
  x, w = random_array((4, 192), seed=3), random_array((192,), seed=4)
  text = jax.jit(lambda x, w: _rows("layer", x, w, 256)).lower(x, w).as_text()
  assert "pad" not in text
  eqns = jax.make_jaxpr(lambda x, w: _rows("layer", x, w, 256))(x, w).eqns
  kernel = next(e for e in eqns if e.primitive.name == "pallas_call").params["kernel"]
  assert any("padded lanes dropped" in r for r in plan_of(kernel).reasons)
  assert_close(jax.jit(lambda x, w: _rows("layer", x, w, 256))(x, w),
               _reference("layer", x, w), rtol=2e-5, atol=2e-5)


def _softmax_rows(x):
  rows, n = x.shape
  block = pl.next_power_of_2(n)

  def kernel(x_ref, p_ref, o_ref):   # the Triton tutorial's fused softmax
    cols = jnp.arange(block)
    x = plgpu.load(x_ref.at[cols], mask=cols < n, other=-jnp.inf)
    e = jnp.exp((x - jnp.max(x)).astype(f32))   # bfloat16 rows in float32
    plgpu.store(o_ref.at[cols], (e / jnp.sum(e)).astype(o_ref.dtype), mask=cols < n)

  spec = pl.BlockSpec((None, n), lambda i: (i, 0))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(rows,), in_specs=[spec, spec], out_specs=spec,
                        input_output_aliases={1: 0})(x, poisoned(x.shape, x.dtype))


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 5), st.integers(1, 300), st.sampled_from([jnp.float32, jnp.bfloat16]),
       st.integers(0, 2**31 - 1))
def test_triton_style_softmax_on_widths_that_are_not_powers_of_two(rows, n, dtype, seed):
  x = random_array((rows, n), dtype, seed=seed)
  want = jax.nn.softmax(x.astype(f32), axis=1).astype(dtype)
  tol = dict(rtol=2e-5, atol=2e-6) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-3)
  assert_close(jax.jit(_softmax_rows)(x), want, **tol)
  assert "pad" not in jax.jit(_softmax_rows).lower(x).as_text()


def test_softmax_rows_of_minus_infinity_or_nan_stay_nan():
  x = random_array((4, 100), seed=5)
  x = x.at[1].set(-jnp.inf).at[2].set(jnp.nan).at[3, 7].set(jnp.inf)
  assert "pad" not in jax.jit(_softmax_rows).lower(x).as_text()
  got, want = jax.jit(_softmax_rows)(x), jax.nn.softmax(x, axis=1)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  assert_close(jnp.nan_to_num(got), jnp.nan_to_num(want), rtol=2e-5, atol=2e-6)


# ------------------------------------------------------------------ JAX's interpreter
def _random_row_kernel(pl_mod, gpu_mod, n, other, steps, mask_end):
  """A Triton-style row kernel drawn from `steps`, written for either library."""
  block = pl.next_power_of_2(n)

  def kernel(x_ref, o_ref, s_ref):
    cols = jnp.arange(block)
    mask = cols < mask_end
    y = gpu_mod.load(x_ref.at[cols], mask=cols < n, other=other)
    for step in steps:
      if step == "center":
        y = y - jnp.max(y)
      elif step == "exp":
        y = jnp.exp(y)
      elif step == "square":
        y = y * y
      elif step == "where":
        y = jnp.where(mask, y, 0.0)
    gpu_mod.store(o_ref.at[cols], y, mask=cols < n)
    s_ref[...] = jnp.stack([jnp.sum(y), jnp.max(y)])

  return lambda x: pl_mod.pallas_call(
      kernel, grid=(x.shape[0],),
      out_shape=(jax.ShapeDtypeStruct(x.shape, f32), jax.ShapeDtypeStruct((x.shape[0], 2), f32)),
      in_specs=[pl_mod.BlockSpec((None, n), lambda i: (i, 0))],
      out_specs=(pl_mod.BlockSpec((None, n), lambda i: (i, 0)),
                 pl_mod.BlockSpec((None, 2), lambda i: (i, 0))),
      **({} if pl_mod is pl else dict(interpret=True)))(x)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.sampled_from([0.0, -np.inf, 1.0]),
       st.lists(st.sampled_from(["center", "exp", "square", "where"]), max_size=4),
       st.integers(-1, 1), st.integers(0, 2**31 - 1))
def test_random_row_kernels_match_jax_pallas_interpreter(n, other, steps, shift, seed):
  jax_pl = pytest.importorskip("jax.experimental.pallas")
  jax_plgpu = pytest.importorskip("jax.experimental.pallas.triton")
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((4, n)).astype(np.float32)
  x[1] = -np.inf
  x[2, rng.integers(n)] = np.nan
  ours = jax.jit(_random_row_kernel(pl, plgpu, n, other, steps, n + shift))(x)
  theirs = _random_row_kernel(jax_pl, jax_plgpu, n, other, steps, n + shift)(x)
  for got, want in zip(ours, theirs):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5,
                               equal_nan=True)
