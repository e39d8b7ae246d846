"""Blocks that run past their array's end compute on the array's lanes only.

A Triton-style kernel pads a head dimension of 72 to a block of 128 (`BlockSpec((bq,
128))` over an array of 72 columns), masks every load and store with `lanes < 72`, and
works in loops. The executor tells `padded_lanes.narrow` which blocks overhang
(`plan.overhang`) and the body is rewritten to compute on the 72 real lanes, inside
loops too. The oracle for the rewrite is the body itself: Hypothesis draws bodies
(masked loads that end before, at or past the array's edge, contractions over lanes,
products along them, loops with carries, unmasked reads of the padding) with garbage
in the padding, and the rewritten body must give the same real lanes. Kernels are
checked against jax.numpy with their outputs poisoned.
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
from pallet.backends.xla import padded_lanes, plan_of
from pallet.backends.xla.plan import overhang
from helpers import assert_close, random_array

pytestmark = pytest.mark.cpu_only   # a pass of the XLA backend, and the programs it emits

f32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST


def _run(closed, *args):
  return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


def _plan(call, *args):
  """The XLA backend's plan of the one pallas_call in `call(*args)`, once built."""
  eqns = jax.make_jaxpr(call)(*args).eqns
  kernel = next(e for e in eqns if e.primitive.name == "pallas_call").params["kernel"]
  jax.jit(call).lower(*args)
  return plan_of(kernel)


def _select(mask, v, other):
  return lax.select(jnp.broadcast_to(mask, v.shape), v, jnp.full_like(v, other))


# ------------------------------------------------------------------ the rewrite
_LOOP_STEPS = ("scores", "accumulate", "row_sum", "row_max", "rescale", "passthrough",
               "replace")


@st.composite
def _bodies(draw):
  width = draw(st.integers(1, 20))
  padded = width + draw(st.integers(1, 12))
  edge = st.sampled_from([width - 1, width, width + 1, padded]).filter(lambda c: c >= 0)
  return dict(
      rows=draw(st.integers(1, 3)), width=width, padded=padded,
      q_mask=draw(st.one_of(st.none(), edge)), q_other=draw(st.sampled_from([0.0, 1.0])),
      k_mask=draw(st.one_of(st.none(), edge)),
      k_pad=draw(st.sampled_from([None, 0.0, 1.0])),
      loop=draw(st.sampled_from(["none", "scan", "while"])),
      steps=draw(st.lists(st.sampled_from(_LOOP_STEPS), min_size=1, max_size=4)),
      store_mask=draw(st.one_of(st.none(), edge)),
      garbage=draw(st.sampled_from(["normal", "nan", "inf", "huge"])))


def _body(b):
  """(q, k, o, n) -> (q, k, o, stats): q and o blocks of `padded` lanes, k of 2 rows
  per window, the array's lanes the first `width`; `n` a loop bound known at run time."""
  lanes = lax.broadcasted_iota(jnp.int32, (1, b["padded"]), 1)

  def masked(v, end, other=0.0):
    return v if end is None else _select(lanes < end, v, other)

  def f(q, k, o, n):
    qv = masked(q, b["q_mask"], b["q_other"])

    def step(j, carry):
      acc, stat, k_ref = carry
      kw = masked(lax.dynamic_slice_in_dim(k_ref, 2 * j, 2, axis=0), b["k_mask"])
      if b["k_pad"] is not None:   # rows of the padding value, on every lane
        kw = lax.pad(kw, f32(b["k_pad"]), [(1, 1, 0), (0, 0, 0)])
      for s in b["steps"]:
        if s == "scores":
          stat = stat + jnp.sum(lax.dot(qv, kw.T, precision=HIGHEST), axis=1)
        elif s == "accumulate":
          p = jnp.tanh(lax.dot(qv, kw.T, precision=HIGHEST))
          acc = acc + lax.dot(p, kw, precision=HIGHEST)
        elif s == "row_sum":
          stat = stat + jnp.sum(kw * qv[:, :1].sum(), axis=1).sum()
        elif s == "row_max":   # summed: a difference at any step stays
          stat = stat + jnp.max(acc, axis=1)
        elif s == "rescale":
          acc = acc * jnp.exp(-jnp.abs(stat))[:, None]
        elif s == "passthrough":
          acc = acc + qv
        elif s == "replace":   # the carry's padding now differs from its initial value's
          acc = qv * 2.0
      return acc, stat, k_ref

    carry = (jnp.zeros_like(q), jnp.zeros((q.shape[0],), f32), k)
    if b["loop"] == "none":
      acc, stat, k = step(0, carry)
    elif b["loop"] == "scan":
      acc, stat, k = lax.fori_loop(0, k.shape[0] // 2, step, carry)
    else:
      acc, stat, k = lax.fori_loop(0, n, step, carry)
    end = b["store_mask"]
    o = acc if end is None else lax.select(jnp.broadcast_to(lanes < end, o.shape), acc, o)
    return q, k, o, stat
  return f


def _with_garbage(x, width, kind, rng):
  x = np.array(x)
  tail = x[:, width:]
  if kind == "nan":
    tail[...] = np.nan
  elif kind == "inf":
    tail[...] = rng.choice([np.inf, -np.inf], tail.shape)
  elif kind == "huge":
    tail[...] = 3e38
  else:
    tail[...] = rng.standard_normal(tail.shape)
  return x


BOUNDARY = lambda width: padded_lanes.Boundary(
    seeds={0: (1, width), 1: (1, width), 2: (1, width)}, sinks={0: 0, 1: 1, 2: 2})


@settings(max_examples=300, deadline=None)
@given(_bodies(), st.integers(0, 2**31 - 1))
@example(dict(rows=2, width=5, padded=8, q_mask=5, q_other=0.0, k_mask=5, k_pad=None,
              loop="scan", steps=["scores", "accumulate"], store_mask=5, garbage="nan"), 0)
@example(dict(rows=2, width=5, padded=8, q_mask=5, q_other=1.0, k_mask=5, k_pad=None,
              loop="scan", steps=["scores", "passthrough", "row_max"], store_mask=5,
              garbage="normal"), 1)   # a carry's tail changes along the loop
@example(dict(rows=2, width=5, padded=8, q_mask=5, q_other=1.0, k_mask=5, k_pad=1.0,
              loop="none", steps=["scores"], store_mask=5, garbage="normal"), 2)
@example(dict(rows=2, width=5, padded=8, q_mask=5, q_other=1.0, k_mask=5, k_pad=None,
              loop="scan", steps=["row_max", "scores", "replace"], store_mask=5,
              garbage="normal"), 3)   # the initial value's padding joined in
def test_rewritten_bodies_give_the_real_lanes_the_originals_do(b, seed):
  rng = np.random.default_rng(seed)
  width, padded, rows = b["width"], b["padded"], b["rows"]
  q = _with_garbage(rng.standard_normal((rows, padded)).astype(np.float32), width,
                    b["garbage"], rng)
  k = _with_garbage(rng.standard_normal((6, padded)).astype(np.float32), width,
                    b["garbage"], rng)
  o = _with_garbage(rng.standard_normal((rows, padded)).astype(np.float32), width,
                    b["garbage"], rng)
  n = np.int32(rng.integers(0, 4))
  closed = jax.make_jaxpr(_body(b))(q, k, o, n)
  rewritten = padded_lanes.narrow(closed, BOUNDARY(width))
  got, want = _run(rewritten, q, k, o, n), _run(closed, q, k, o, n)
  for i, (g, w) in enumerate(zip(got, want)):
    g, w = np.asarray(g), np.asarray(w)
    if i < 3:   # blocks: their lanes past the width lie past the array's end
      g, w = g[:, :width], w[:, :width]
    scale = np.max(np.abs(w[np.isfinite(w)]), initial=0.0) + 1.0
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * scale, equal_nan=True)


def _attention_body(width, padded, loop):
  b = dict(rows=4, width=width, padded=padded, q_mask=width, q_other=0.0, k_mask=width,
           k_pad=None, loop=loop, steps=["scores", "accumulate"], store_mask=width, garbage="nan")
  q = np.zeros((4, padded), np.float32)
  return jax.make_jaxpr(_body(b))(q, np.zeros((6, padded), np.float32), q, np.int32(3))


@pytest.mark.parametrize("loop", ["none", "scan", "while"])
def test_masked_attention_bodies_compute_on_real_lanes(loop):
  closed = _attention_body(5, 8, loop)
  rewritten = padded_lanes.narrow(closed, BOUNDARY(5))
  assert rewritten is not closed
  text = str(rewritten)
  assert "f32[4,5]" in text and "f32[2,5]" in text   # q, the carry and k windows narrowed
  assert "dot_general" in text and "f32[4,8] = dot_general" not in text


@pytest.mark.parametrize("boundary", [
    padded_lanes.Boundary(),                                          # no seeds at all
    padded_lanes.Boundary(seeds={0: (1, 5), 1: (1, 5), 2: (1, 5)}),   # no sinks: o whole
])
def test_blocks_not_known_to_overhang_are_left_alone(boundary):
  closed = _attention_body(5, 8, "scan")
  assert padded_lanes.narrow(closed, boundary) is closed


def test_a_result_narrowed_along_another_axis_is_not_written_back_as_its_block():
  """A square block transposed: narrow along the rows, its sink along the lanes."""
  lanes = lax.broadcasted_iota(jnp.int32, (8, 8), 1)

  def f(x, o):
    v = _select(lanes < 5, x, 0.0)
    return x, v.T * 2.0, jnp.sum(v, axis=1)
  x, o = random_array((8, 8), seed=1), random_array((8, 8), seed=2)
  closed = jax.make_jaxpr(f)(x, o)
  rewritten = padded_lanes.narrow(
      closed, padded_lanes.Boundary(seeds={0: (1, 5), 1: (1, 5)}, sinks={0: 0, 1: 1}))
  got, want = _run(rewritten, x, o), _run(closed, x, o)
  np.testing.assert_allclose(got[1][:, :5], want[1][:, :5], rtol=1e-6)
  np.testing.assert_allclose(got[2], want[2], rtol=1e-5)


# ------------------------------------------------------------------ the plan
def test_overhang_is_the_last_block_dimension_past_the_array_at_every_step():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  x = random_array((32, 72))
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  call = pl.pallas_call(kernel, grid=(4,), in_specs=[spec], out_specs=spec,
                        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))
  plan = _plan(call, x)
  assert [overhang(op) for op in plan.inputs + plan.outputs] == [(1, 72), (1, 72)]
  rows = pl.BlockSpec((16, 72), lambda i: (i, 0))    # the rows: every block inside
  call = pl.pallas_call(kernel, grid=(2,), in_specs=[rows], out_specs=rows,
                        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))
  plan = _plan(call, x)
  assert [overhang(op) for op in plan.inputs + plan.outputs] == [None, None]
  moving = pl.BlockSpec((8, 48), lambda i: (0, i % 2))   # second block: starts differ
  call = pl.pallas_call(kernel, grid=(2,), in_specs=[moving], out_specs=moving,
                        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))
  plan = _plan(call, x)
  assert [overhang(op) for op in plan.inputs + plan.outputs] == [None, None]


# ------------------------------------------------------------------ kernels
def _mha(q, k, v, *, block_q, block_k, causal, lanes, pl=pl, plgpu=plgpu):
  """A Triton-style attention kernel (one head), its head dimension padded to `lanes`
  by its BlockSpecs and masked, keys in a fori_loop (a scan, or a while loop to the
  causal diagonal)."""
  seq, head_dim = q.shape

  def kernel(q_ref, k_ref, v_ref, o_ref):
    i = pl.program_id(0)
    head = (jnp.arange(lanes) < head_dim)[None, :]
    qv = plgpu.load(q_ref, mask=head, other=0.0)

    def body(j, carry):
      acc, m, l = carry
      window = pl.ds(j * block_k, block_k)
      kv = plgpu.load(k_ref.at[window, :], mask=head, other=0.0)
      s = jnp.dot(qv, kv.T, precision=HIGHEST) / np.sqrt(head_dim)
      if causal:
        rows = i * block_q + jnp.arange(block_q)[:, None]
        cols = j * block_k + jnp.arange(block_k)[None, :]
        s = jnp.where(rows >= cols, s, -1e30)
      m_new = jnp.maximum(m, s.max(axis=1))
      p = jnp.exp(s - m_new[:, None])
      alpha = jnp.exp(m - m_new)
      vv = plgpu.load(v_ref.at[window, :], mask=head)
      acc = acc * alpha[:, None] + jnp.dot(p, vv, precision=HIGHEST)
      return acc, m_new, l * alpha + p.sum(axis=1)

    upper = lax.div(block_q * (i + 1) + block_k - 1, block_k) if causal else seq // block_k
    init = (jnp.zeros((block_q, lanes), f32), jnp.full((block_q,), -jnp.inf, f32),
            jnp.zeros((block_q,), f32))
    acc, _, l = lax.fori_loop(0, upper, body, init)
    plgpu.store(o_ref, (acc / l[:, None]).astype(o_ref.dtype), mask=head)

  q_spec = pl.BlockSpec((block_q, lanes), lambda i: (i, 0))
  kv_spec = pl.BlockSpec((seq, lanes), lambda i: (0, 0))
  return pl.pallas_call(kernel, grid=(seq // block_q,), in_specs=[q_spec, kv_spec, kv_spec],
                        out_specs=q_spec, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
                        **({} if pl is globals()["pl"] else dict(interpret=True)))


def _attention(q, k, v, causal):
  s = jnp.einsum("qd,kd->qk", q, k, precision=HIGHEST) / np.sqrt(q.shape[1])
  if causal:
    s = jnp.where(jnp.tril(jnp.ones(s.shape, bool)), s, -jnp.inf)
  return jnp.einsum("qk,kd->qd", jax.nn.softmax(s, axis=1), v, precision=HIGHEST)


@pytest.mark.parametrize("head_dim,lanes", [(72, 128), (40, 64), (3, 16), (100, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_a_padded_head_dimension(head_dim, lanes, causal):
  q, k, v = (random_array((64, head_dim), seed=s) for s in range(3))
  call = _mha(q, k, v, block_q=16, block_k=16, causal=causal, lanes=lanes)
  plan = _plan(call, q, k, v)
  assert any("padded lanes dropped" in r for r in plan.reasons)
  assert_close(jax.jit(call)(q, k, v), _attention(q, k, v, causal), rtol=1e-4, atol=1e-5)


def test_attention_with_a_padded_head_dimension_matches_jax_pallas_interpreter():
  jpl = pytest.importorskip("jax.experimental.pallas")
  jgpu = pytest.importorskip("jax.experimental.pallas.triton")
  q, k, v = (random_array((32, 24), seed=s) for s in range(3, 6))
  ours = _mha(q, k, v, block_q=8, block_k=8, causal=True, lanes=32)
  theirs = _mha(q, k, v, block_q=8, block_k=8, causal=True, lanes=32, pl=jpl, plgpu=jgpu)
  assert_close(jax.jit(ours)(q, k, v), theirs(q, k, v), rtol=1e-5, atol=1e-6)


def test_an_output_block_revisited_along_a_reduction_keeps_its_real_lanes():
  """A resident output block with padded lanes, accumulated over the reduction axis
  through masked loads and stores (its padding is read back at every step)."""
  x = random_array((4, 16, 24))

  def kernel(x_ref, o_ref):
    head = (jnp.arange(32) < 24)[None, :]

    @pl.when(pl.program_id(1) == 0)
    def _():
      plgpu.store(o_ref, jnp.zeros((16, 32), f32), mask=head)

    xv = plgpu.load(x_ref, mask=head, other=0.0)
    sq = jnp.dot(xv, xv.T, precision=HIGHEST)          # a contraction over the lanes
    old = plgpu.load(o_ref, mask=head, other=0.0)
    plgpu.store(o_ref, old + jnp.dot(jnp.tanh(sq), xv, precision=HIGHEST), mask=head)

  call = pl.pallas_call(
      kernel, grid=(1, 4),
      in_specs=[pl.BlockSpec((None, 16, 32), lambda i, r: (r, i, 0))],
      out_specs=pl.BlockSpec((16, 32), lambda i, r: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((16, 24), f32))
  want = sum(jnp.tanh(x[r] @ x[r].T) @ x[r] for r in range(4))
  assert any("padded lanes dropped" in r for r in _plan(call, x).reasons)
  assert_close(jax.jit(call)(x), want, rtol=1e-4, atol=1e-5)


def test_decode_attention_with_padded_head_rows():
  """The heads of one KV group padded to a block of 8 rows (JAX's GPU decode
  attention does so for its products): the rows past the heads are never computed."""
  heads, seq, dim = 5, 64, 32
  q = random_array((heads, dim), seed=1)
  k, v = random_array((seq, dim), seed=2), random_array((seq, dim), seed=3)

  def kernel(q_ref, k_ref, v_ref, o_ref):
    qv = q_ref[...]

    def body(j, carry):
      acc, m, l = carry
      window = pl.ds(j * 16, 16)
      s = jnp.dot(qv, k_ref[window, :].T, precision=HIGHEST)
      m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))   # per-row statistics, (8, 1)
      p = jnp.exp(s - m_new)
      alpha = jnp.exp(m - m_new)
      acc = acc * alpha + jnp.dot(p, v_ref[window, :], precision=HIGHEST)
      return acc, m_new, l * alpha + p.sum(axis=1, keepdims=True)

    init = (jnp.zeros((8, dim), f32), jnp.full((8, 1), -jnp.inf, f32), jnp.zeros((8, 1), f32))
    acc, _, l = lax.fori_loop(0, seq // 16, body, init)
    o_ref[...] = acc / l

  call = pl.pallas_call(
      kernel, grid=(1,),
      in_specs=[pl.BlockSpec((8, dim), lambda i: (0, 0)),
                pl.BlockSpec((seq, dim), lambda i: (0, 0)),
                pl.BlockSpec((seq, dim), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((8, dim), lambda i: (0, 0)),
      out_shape=jax.ShapeDtypeStruct((heads, dim), f32))
  plan = _plan(call, q, k, v)
  assert [overhang(op) for op in plan.inputs[:1] + plan.outputs] == [(0, heads)] * 2
  assert any("padded lanes dropped" in r for r in plan.reasons)
  want = jax.nn.softmax(q @ k.T, axis=1) @ v
  assert_close(jax.jit(call)(q, k, v), want, rtol=1e-4, atol=1e-5)
