"""Windows that loop counters keep inside their ref are read without padding.

`window_ranges.drop_window_padding` rewrites a dynamic slice of a padded ref into a
slice of the ref itself where integer ranges prove the start inside. Two oracles: the
unrewritten program (Hypothesis draws loops whose window starts are affine in the
counter and a grid index, inside or partly outside the ref, and the rewrite must
compute the same values, and fire exactly where the ranges put every start inside),
and, for Triton-style kernels with masked window loads in `fori_loop`s, a NumPy model
of the masked loads and JAX's Pallas interpreter.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st
from jax import lax

import pallet as pl
from pallet import triton as plgpu
from pallet.backends.xla import plan_of, window_ranges
from helpers import assert_close, random_array

pytestmark = pytest.mark.cpu_only   # a pass of the XLA backend, and the programs it emits

f32 = jnp.float32


# ------------------------------------------------------------------ the rewrite
@st.composite
def _loops(draw):
  n = draw(st.integers(1, 12))   # small: starts often land on the ref's ends
  size = draw(st.integers(1, n))
  return dict(n=n, size=size, scale=draw(st.integers(-2, 2)), per_id=draw(st.integers(-2, 2)),
              offset=draw(st.integers(-4, 8)), lower=draw(st.integers(0, 3)),
              trips=draw(st.integers(1, 4)), grid=draw(st.integers(1, 3)),
              traced_bound=draw(st.booleans()), masked=draw(st.booleans()),
              form=draw(st.sampled_from(list(_FORMS))), cut=draw(st.integers(-1, 13)),
              countdown=draw(st.booleans()))


# integer arithmetic between the counter and the start, and its NumPy model
_FORMS = {"affine": (lambda v, n, size: v, lambda v, n, size: v),
          "times": (lambda v, n, size: v * (v - 2), lambda v, n, size: v * (v - 2)),
          "div": (lambda v, n, size: lax.div(v, 2), lambda v, n, size: int(v / 2)),
          "rem": (lambda v, n, size: lax.rem(v, 3), lambda v, n, size: int(np.fmod(v, 3))),
          "clamp": (lambda v, n, size: lax.clamp(-1, v, n - size + 1),
                    lambda v, n, size: min(max(v, -1), n - size + 1)),
          "max": (lambda v, n, size: jnp.maximum(v, 1), lambda v, n, size: max(v, 1)),
          "min": (lambda v, n, size: jnp.minimum(v, n - size), lambda v, n, size: min(v, n - size))}


def _window_loop(n, size, scale, per_id, offset, lower, trips, grid, traced_bound, masked,
                 form="affine", cut=0, countdown=False):
  """A loop summing windows of `x` at `form(scale * i - per_id * pid + offset)`, read as
  pallet discharges a masked window load: from `x` padded by the window on both sides,
  rows outside `x` zeroed; then a kernel's own mask, rows below `cut`. A traced bound
  makes a while loop, a static one a scan; `countdown` scans a counter that falls
  from `lower + trips - 1` to `lower`."""
  del grid

  def window_sum(x, pid, i, acc):
    padded = lax.pad(x, f32(0), [(size, size, 0), (0, 0, 0)])
    start = _FORMS[form][0](scale * i - per_id * pid + offset, n, size)
    window = lax.dynamic_slice(padded, (start + size, 0), (size, x.shape[1]))
    rows = lax.broadcast_in_dim(start + lax.iota(jnp.int32, size), window.shape, (0,))
    if masked:
      window = lax.select((rows >= 0) & (rows < n), window, jnp.zeros_like(window))
    window = lax.select(rows < cut, window, jnp.full_like(window, -1.0))
    return acc + window * (i + 1).astype(f32)

  def f(x, pid):
    zeros = jnp.zeros((size, x.shape[1]), f32)
    if countdown:
      step = lambda c, _: ((c[0] - 1, window_sum(x, pid, c[0], c[1])), None)
      return lax.scan(step, (jnp.int32(lower + trips - 1), zeros), None, length=trips)[0][1]
    upper = pid + lower + trips if traced_bound else lower + trips
    return lax.fori_loop(lower, upper, lambda i, acc: window_sum(x, pid, i, acc), zeros)
  return f


def _start_range(n, size, scale, per_id, offset, lower, trips, grid, traced_bound, masked,
                 form, cut, countdown):
  """The least and greatest start the ranges allow: the counter from `lower` to its
  last value, the grid index from 0 to grid - 1, taken independently."""
  del masked, cut
  last = lower + trips - 1 + (grid - 1 if traced_bound and not countdown else 0)
  starts = [_FORMS[form][1](scale * i - per_id * p + offset, n, size)
            for i in range(lower, last + 1) for p in range(grid)]
  return min(starts), max(starts)


def _run(closed, *args):
  return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


@settings(max_examples=400, deadline=None)
@given(_loops(), st.integers(0, 2**31 - 1))
@example(dict(n=4, size=2, scale=1, per_id=0, offset=0, lower=0, trips=3, grid=1,   # v(v - 2)
              traced_bound=False, masked=False, form="times", cut=9, countdown=False), 0)
def test_windows_are_read_unpadded_exactly_where_their_starts_stay_inside(loop, seed):
  x = random_array((loop["n"], 3), seed=seed)
  closed = jax.make_jaxpr(_window_loop(**loop))(x, jnp.int32(0))
  rewritten = window_ranges.drop_window_padding(closed, [None, (0, loop["grid"] - 1)])
  low, high = _start_range(**loop)
  inside = low >= 0 and high + loop["size"] <= loop["n"]
  if loop["form"] == "affine" and (inside or low >= -loop["size"]):
    assert (rewritten is not closed) == inside   # (below -size, the slice's index wraps)
  elif not inside and low >= -loop["size"]:
    assert rewritten is closed
  for pid in range(loop["grid"]):
    want = _run(closed, x, jnp.int32(pid))
    np.testing.assert_array_equal(_run(rewritten, x, jnp.int32(pid))[0], want[0])


def test_an_unknown_grid_index_keeps_the_padding():
  loop = dict(n=16, size=4, scale=4, per_id=-1, offset=0, lower=0, trips=3, grid=2,
              traced_bound=False, masked=True)
  x = random_array((16, 3), seed=1)
  closed = jax.make_jaxpr(_window_loop(**loop))(x, jnp.int32(0))
  assert window_ranges.drop_window_padding(closed, [None, None]) is closed
  assert window_ranges.drop_window_padding(closed, [None, (0, 1)]) is not closed


def _loop_body(closed):
  eqn = next(e for e in closed.jaxpr.eqns if e.primitive.name in ("scan", "while"))
  body = eqn.params["jaxpr" if eqn.primitive.name == "scan" else "body_jaxpr"]
  return body.jaxpr


@pytest.mark.parametrize("traced_bound", [False, True])
def test_a_rewritten_loop_reads_the_ref_itself(traced_bound):
  loop = dict(n=16, size=4, scale=4, per_id=0, offset=0, lower=0, trips=3, grid=2,
              traced_bound=traced_bound, masked=True)
  closed = jax.make_jaxpr(_window_loop(**loop))(random_array((16, 3), seed=2), jnp.int32(0))
  rewritten = window_ranges.drop_window_padding(closed, [None, (0, 1)])
  assert window_ranges._has_window(_loop_body(closed))
  body = _loop_body(rewritten)
  assert not window_ranges._has_window(body)   # no slice of a pad is left
  assert "select_n" not in str(body)   # nor the select of the rows inside the ref


# ------------------------------------------------------------------ kernels
def _attention_like(pl_mod, gpu_mod, n, block, trips, shift, causal, block_rows=None,
                    interpret=False):
  """Per program, a sum of `trips` windows of K rows, loaded as JAX's GPU attention
  loads its key blocks: `load(k_ref.at[pl.ds(start, block), :], mask=rows < n)`; with
  `causal`, program p loops p + 1 times (a while loop)."""
  def kernel(k_ref, o_ref):
    p = pl_mod.program_id(0)
    rows = jnp.arange(block)

    def body(i, acc):
      start = i * block + shift
      mask = ((start + rows >= 0) & (start + rows < n))[:, None]
      w = gpu_mod.load(k_ref.at[pl_mod.ds(start, block), :], mask=mask, other=0.0)
      return acc + w * (i + 1).astype(f32)

    upper = p + 1 if causal else trips
    o_ref[...] = lax.fori_loop(0, upper, body, jnp.zeros((block, 8), f32))

  programs = trips
  return lambda k: pl_mod.pallas_call(
      kernel, grid=(programs,), out_shape=jax.ShapeDtypeStruct((programs, block, 8), f32),
      in_specs=[pl_mod.BlockSpec((block_rows or n, 8), lambda p: (0, 0))],
      out_specs=pl_mod.BlockSpec((None, block, 8), lambda p: (p, 0, 0)),
      **({} if pl_mod is pl and not interpret else dict(interpret=True)))(k)


def _model(k, block, trips, shift, causal):
  """The masked window loads in NumPy: rows outside `k` read 0."""
  k = np.asarray(k)
  n = k.shape[0]
  out = np.zeros((trips, block, 8), np.float32)
  for p in range(trips):
    for i in range(p + 1 if causal else trips):
      for r in range(block):
        row = i * block + shift + r
        if 0 <= row < n:
          out[p, r] += k[row] * (i + 1)
  return out


def _dropped(fn, *args) -> bool:
  eqns = jax.make_jaxpr(fn)(*args).eqns
  kernel = next(e for e in eqns if e.primitive.name == "pallas_call").params["kernel"]
  return any("window padding dropped" in r for r in plan_of(kernel).reasons)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.sampled_from([4, 8]), st.integers(-3, 3), st.integers(-2, 2),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_masked_window_loads_in_loops_match_a_numpy_model(trips, block, extra, shift, causal,
                                                          seed):
  n = max(1, trips * block + extra)
  k = random_array((n, 8), seed=seed)
  fn = _attention_like(pl, plgpu, n, block, trips, shift, causal)
  assert_close(jax.jit(fn)(k), _model(k, block, trips, shift, causal), rtol=1e-6, atol=1e-6)
  starts = [i * block + shift for i in range(trips)]
  inside = [0 <= s and s + block <= n for s in starts]
  if all(inside) or not any(inside):   # (a short loop may be unrolled: each window alone)
    assert _dropped(fn, k) == all(inside)


@pytest.mark.parametrize("causal", [False, True])
def test_in_bounds_window_loads_match_jax_pallas_interpreter(causal):
  jax_pl = pytest.importorskip("jax.experimental.pallas")
  jax_plgpu = pytest.importorskip("jax.experimental.pallas.triton")
  k = random_array((48, 8), seed=7)
  ours = _attention_like(pl, plgpu, 48, 16, 3, 0, causal)
  theirs = _attention_like(jax_pl, jax_plgpu, 48, 16, 3, 0, causal)
  assert _dropped(ours, k)
  np.testing.assert_allclose(np.asarray(jax.jit(ours)(k)), np.asarray(theirs(k)),
                             rtol=1e-6, atol=1e-6)


def test_a_block_past_the_array_keeps_its_masked_rows_unread():
  """Windows inside a 40-row block over a 36-row array: the rewrite reads the block
  itself, whose last rows are padding (NaN under `interpret=True`), and the kernel's
  own mask must still keep them out."""
  k = random_array((36, 8), seed=3)
  fn = _attention_like(pl, plgpu, 36, 8, 5, 0, False, block_rows=40, interpret=True)
  assert _dropped(fn, k)
  assert_close(jax.jit(fn)(k), _model(k, 8, 5, 0, False), rtol=1e-6, atol=1e-6)
