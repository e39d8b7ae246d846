"""The XLA backend's planner: which grid axes it vectorizes, sums, loops or chunks, and
why, plus results against jax.numpy for every strategy it can choose."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallet as pl
import pallet.tpu as pltpu
from helpers import assert_close, poisoned, random_array, sds
from pallet.backends import xla as xla_backend
from pallet.backends.xla import body_analysis, plan as plan_lib, plan_of

f32 = jnp.float32
pytestmark = pytest.mark.cpu_only


@pytest.fixture
def small_memory_budget(monkeypatch):
  """Shrinks the planner's memory budget; plans cached for kernels traced before
  (the trace cache hands back the same description) are dropped."""
  monkeypatch.setattr(plan_lib, "MEMORY_FLOOR_BYTES", 0)
  xla_backend._planned.cache_clear()
  yield monkeypatch
  xla_backend._planned.cache_clear()


def _description(fn, *args):
  eqns = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "pallas_call"]
  assert len(eqns) == 1
  return eqns[0].params["kernel"]


def _plan(fn, *args):
  return plan_of(_description(fn, *args))


# ------------------------------------------------------------------ kernels
def _add(x, y, block):
  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]
  spec = pl.BlockSpec((block,), lambda i: (i,))
  return pl.pallas_call(kernel, out_shape=sds(x), grid=(x.shape[0] // block,),
                        in_specs=[spec, spec], out_specs=spec)(x, y)


def _matmul(x, y, update, b=8, out=None):
  """Blocked matmul; `update(o, product, k)` is the kernel's step on the o block."""
  def kernel(x_ref, y_ref, *refs):
    o_ref = refs[-1]
    k = pl.program_id(2)
    o_ref[...] = update(o_ref[...], jnp.dot(x_ref[...], y_ref[...],
                                            preferred_element_type=f32), k)
  m, kk = x.shape
  n = y.shape[1]
  in_specs = [pl.BlockSpec((b, b), lambda i, j, k: (i, k)),
              pl.BlockSpec((b, b), lambda i, j, k: (k, j))]
  args = (x, y)
  aliases = None
  if out is not None:
    in_specs.append(pl.BlockSpec((b, b), lambda i, j, k: (i, j)))
    args, aliases = (x, y, out), {2: 0}
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((m, n), f32),
                        grid=(m // b, n // b, kk // b), in_specs=in_specs,
                        out_specs=pl.BlockSpec((b, b), lambda i, j, k: (i, j)),
                        input_output_aliases=aliases)(*args)


def _zero_then_add(o, p, k):
  return jnp.where(k == 0, 0.0, o) + p


def _blocks_k(x, y, b=8):
  """Per-k block products of x @ y, k-major: the terms a matmul kernel accumulates."""
  nk = x.shape[1] // b
  return [x[:, k * b:(k + 1) * b] @ y[k * b:(k + 1) * b] for k in range(nk)]


def _column_sum_squares(x, br=8, bc=8):
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
    v = x_ref[...]
    o_ref[...] += jnp.sum(v * v, axis=0)
  rows, cols = x.shape
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((cols,), f32),
                        grid=(cols // bc, rows // br),
                        in_specs=[pl.BlockSpec((br, bc), lambda j, i: (i, j))],
                        out_specs=pl.BlockSpec((bc,), lambda j, i: (j,)))(x)


def _attention(q, k, v, causal, block=8):
  def kernel(q_ref, k_ref, v_ref, o_ref):
    qi = pl.program_id(1)
    q_blk = q_ref[...]
    n_blocks = qi + 1 if causal else k_ref.shape[0] // block

    def step(j, carry):
      m, l, acc = carry
      kb = k_ref[pl.ds(j * block, block), :]
      vb = v_ref[pl.ds(j * block, block), :]
      s = q_blk @ kb.T
      if causal:
        rows = qi * block + lax.broadcasted_iota(jnp.int32, s.shape, 0)
        cols = j * block + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(cols <= rows, s, -jnp.inf)
      m_new = jnp.maximum(m, s.max(1))
      p = jnp.exp(s - m_new[:, None])
      scale = jnp.exp(m - m_new)
      return m_new, l * scale + p.sum(1), acc * scale[:, None] + p @ vb

    d = q_ref.shape[1]
    init = (jnp.full((block,), -jnp.inf, f32), jnp.zeros((block,), f32),
            jnp.zeros((block, d), f32))
    _, l, acc = lax.fori_loop(0, n_blocks, step, init)
    o_ref[...] = acc / l[:, None]

  bh, seq, d = q.shape
  q_spec = pl.BlockSpec((None, block, d), lambda b, i: (b, i, 0))
  kv_spec = pl.BlockSpec((None, seq, d), lambda b, i: (b, 0, 0))
  return pl.pallas_call(kernel, out_shape=sds(q), grid=(bh, seq // block),
                        in_specs=[q_spec, kv_spec, kv_spec], out_specs=q_spec)(q, k, v)


def _attention_reference(q, k, v, causal):
  s = jnp.einsum("bqd,bkd->bqk", q, k)
  if causal:
    s = jnp.where(jnp.tril(jnp.ones(s.shape[1:], bool)), s, -jnp.inf)
  return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)


# ------------------------------------------------------------------ plan choices
def test_tiled_parallel_axis_is_vectorized_without_loops():
  x, y = random_array((64,)), random_array((64,))
  plan = _plan(functools.partial(_add, block=8), x, y)
  assert (plan.vectorized, plan.outer, plan.inner, plan.summed) == ([0], [], [], [])
  assert "axis 0 vectorized" in plan.describe()
  assert_close(_add(x, y, 8), x + y)


def test_matmul_merges_its_k_axis_into_the_blocks():
  x, y = random_array((16, 32)), random_array((32, 24))
  fn = lambda x, y: _matmul(x, y, _zero_then_add)
  plan = _plan(fn, x, y)
  assert (plan.merged, plan.vectorized, plan.summed) == ([2], [0, 1], [])
  assert (plan.outer, plan.inner, plan.keep_initial) == ([], [], [False])
  assert plan.chunk[2] == 4 and "merged into the blocks" in plan.describe()
  assert_close(fn(x, y), x @ y, matmul=True)


def _zero_then_add_scaled(o, p, k):
  return jnp.where(k == 0, 0.0, o) + 0.5 * p


def test_matmul_accumulator_that_does_not_merge_sums_its_k_axis():
  x, y = random_array((16, 32)), random_array((32, 24))
  fn = lambda x, y: _matmul(x, y, _zero_then_add_scaled)
  plan = _plan(fn, x, y)
  assert (plan.summed, plan.merged, plan.vectorized) == ([2], [], [2, 0, 1])
  assert (plan.outer, plan.inner, plan.keep_initial) == ([], [], [False])
  assert "vectorized and summed" in plan.describe()
  assert_close(fn(x, y), 0.5 * (x @ y), matmul=True)


def test_pl_when_zeroing_is_recognised_like_where():
  def kernel(x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      o_ref[...] = jnp.zeros(o_ref.shape, f32)
    o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=f32)

  def fn(x, y):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), f32),
                          grid=(2, 2, 4),
                          in_specs=[pl.BlockSpec((8, 8), lambda i, j, k: (i, k)),
                                    pl.BlockSpec((8, 8), lambda i, j, k: (k, j))],
                          out_specs=pl.BlockSpec((8, 8), lambda i, j, k: (i, j)))(x, y)
  x, y = random_array((16, 32)), random_array((32, 16))
  assert _plan(fn, x, y).merged == [2]
  assert_close(fn(x, y), x @ y, matmul=True)


def test_accumulator_without_reset_starts_from_the_aliased_input():
  x, y, init = random_array((16, 16)), random_array((16, 16)), random_array((16, 16))
  fn = lambda x, y, init: _matmul(x, y, lambda o, p, k: o + p, out=init)
  plan = _plan(fn, x, y, init)
  assert plan.merged == [2] and plan.keep_initial == [True]
  assert_close(fn(x, y, init), init + x @ y, matmul=True)
  fn = lambda x, y, init: _matmul(x, y, lambda o, p, k: o + 2.0 * p, out=init)
  plan = _plan(fn, x, y, init)
  assert plan.summed == [2] and plan.keep_initial == [True]
  assert_close(fn(x, y, init), init + 2.0 * (x @ y), matmul=True)


@pytest.mark.parametrize("name, update, reference", [
    ("last writer wins", lambda o, p, k: p, lambda terms, n: terms[-1]),
    ("decaying", lambda o, p, k: 0.5 * o + p,
     lambda terms, n: sum(t * 0.5 ** (n - 1 - k) for k, t in enumerate(terms))),
    ("zeroed on the last step", lambda o, p, k: jnp.where(k == 3, 0.0, o) + p,
     lambda terms, n: terms[-1]),
    ("running max", lambda o, p, k: jnp.where(k == 0, p, jnp.maximum(o, p)),
     lambda terms, n: functools.reduce(jnp.maximum, terms)),
    ("reads its block twice", lambda o, p, k: jnp.where(k == 0, 0.0, o) + p * o,
     lambda terms, n: functools.reduce(lambda acc, t: acc + t * acc, terms[1:], 0 * terms[0])),
])
def test_non_accumulators_are_never_summed(name, update, reference):
  x, y = random_array((16, 32)), random_array((32, 16))
  fn = lambda x, y: _matmul(x, y, update)
  plan = _plan(fn, x, y)
  assert plan.summed == [] and plan.merged == [] and plan.inner == [2], name
  assert "looped" in plan.describe()
  terms = _blocks_k(x, y)
  assert_close(fn(x, y), reference(terms, len(terms)), matmul=True)


def test_reset_that_depends_on_data_is_not_an_accumulator():
  def kernel(x_ref, y_ref, o_ref):
    p = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=f32)
    o_ref[...] = jnp.where(x_ref[0, 0] > 0, 0.0, o_ref[...]) + p

  x, y = random_array((8, 32)), random_array((32, 8))
  fn = lambda x, y: pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((8, 8), f32), grid=(4,),
      in_specs=[pl.BlockSpec((8, 8), lambda k: (0, k)), pl.BlockSpec((8, 8), lambda k: (k, 0))],
      out_specs=pl.BlockSpec((8, 8), lambda k: (0, 0)))(x, y)
  plan = _plan(fn, x, y)
  assert plan.summed == [] and "depends on data" in plan.describe()
  expected = jnp.zeros((8, 8))
  for k, t in enumerate(_blocks_k(x, y)):
    expected = jnp.where(x[0, 8 * k] > 0, 0.0, expected) + t
  assert_close(fn(x, y), expected, matmul=True)


def test_block_reduction_accumulator_merges_its_axis_into_the_blocks():
  x = random_array((64, 32))
  plan = _plan(_column_sum_squares, x)
  assert (plan.vectorized, plan.merged, plan.inner, plan.summed) == ([0], [1], [], [])
  assert plan.chunk[1] == 8 and "merged into the blocks" in plan.describe()
  assert_close(_column_sum_squares(x), jnp.sum(x * x, axis=0), rtol=1e-5, atol=1e-4)


def _row_blocks_reduce(x, term, init=None):
  """o[j] accumulates term(x block) over row blocks; with `init`, no zeroing."""
  def kernel(x_ref, *refs):
    o_ref = refs[-1]
    if init is None:
      @pl.when(pl.program_id(1) == 0)
      def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
    o_ref[...] += term(x_ref[...])
  rows, cols = x.shape
  in_specs = [pl.BlockSpec((8, 8), lambda j, i: (i, j))]
  args, aliases = (x,), None
  if init is not None:
    in_specs.append(pl.BlockSpec((8,), lambda j, i: (j,)))
    args, aliases = (x, init), {1: 0}
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((cols,), f32),
                        grid=(cols // 8, rows // 8), in_specs=in_specs,
                        out_specs=pl.BlockSpec((8,), lambda j, i: (j,)),
                        input_output_aliases=aliases)(*args)


def test_merged_axis_without_zeroing_starts_from_the_aliased_input():
  x, init = random_array((64, 32)), random_array((32,))
  fn = lambda x, init: _row_blocks_reduce(x, lambda v: jnp.sum(jnp.abs(v) + 1.0, axis=0), init)
  assert _plan(fn, x, init).merged == [1]
  assert_close(fn(x, init), init + jnp.sum(jnp.abs(x) + 1.0, axis=0), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name, term, reference", [
    ("max, not sum", lambda v: jnp.max(v, axis=0), lambda x: jnp.sum(
        jnp.max(x.reshape(8, 8, 32), axis=1), axis=0)),
    ("squared sum", lambda v: jnp.sum(v, axis=0) ** 2, lambda x: jnp.sum(
        jnp.sum(x.reshape(8, 8, 32), axis=1) ** 2, axis=0)),
    ("sum plus a constant", lambda v: jnp.sum(v, axis=0) + 1.0, lambda x: jnp.sum(x, axis=0) + 8),
    ("mean", lambda v: jnp.mean(v, axis=0), lambda x: jnp.sum(x, axis=0) / 8),
])
def test_block_terms_that_do_not_merge_keep_the_loop(name, term, reference):
  x = random_array((64, 32))
  fn = lambda x: _row_blocks_reduce(x, term)
  plan = _plan(fn, x)
  assert plan.merged == [] and plan.inner == [1], name
  assert "cannot be merged" in plan.describe()
  assert_close(fn(x), reference(x), rtol=1e-5, atol=1e-4)


@pytest.fixture
def large_step_work(monkeypatch):
  """Every loop step counts as large enough to keep its loop (plans re-made)."""
  monkeypatch.setattr(plan_lib, "LOOP_STEP_FLOPS", 0)
  xla_backend._planned.cache_clear()
  yield monkeypatch
  xla_backend._planned.cache_clear()


@pytest.mark.parametrize("causal", [False, True])
def test_axis_feeding_a_loop_trip_count_stays_looped(causal, large_step_work):
  q, k, v = (random_array((2, 32, 8)) for _ in range(3))
  fn = lambda q, k, v: _attention(q, k, v, causal)
  plan = _plan(fn, q, k, v)
  if causal:
    assert (plan.vectorized, plan.outer, plan.bounded_loops) == ([0], [1], False)
    assert "trip count" in plan.describe() and "while loops kept" in plan.describe()
  else:
    assert (plan.vectorized, plan.outer) == ([0, 1], [])
  assert_close(fn(q, k, v), _attention_reference(q, k, v, causal), rtol=1e-4, atol=1e-4)


def test_small_loop_with_a_static_trip_count_bound_is_masked_and_vectorized():
  # causal: query block i runs i + 1 key blocks, at most 4; each looped step of the
  # query axis would be far below LOOP_STEP_FLOPS, so every axis is vectorized
  q, k, v = (random_array((2, 32, 8)) for _ in range(3))
  fn = lambda q, k, v: _attention(q, k, v, True)
  plan = _plan(fn, q, k, v)
  assert (plan.vectorized, plan.outer, plan.bounded_loops) == ([0, 1], [], True)
  assert "masked fixed-length loops" in plan.describe() and "at most 4 steps" in plan.describe()
  assert_close(fn(q, k, v), _attention_reference(q, k, v, True), rtol=1e-4, atol=1e-4)


def test_outputs_that_do_not_tile_keep_their_axis_looped():
  # Programs 2b and 2b+1 both write output block b: the later one must win.
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + pl.program_id(0).astype(f32)
  x = random_array((32,))
  fn = lambda x: pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((16,), f32), grid=(8,),
      in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
      out_specs=pl.BlockSpec((4,), lambda i: (i // 2,)))(x)
  plan = _plan(fn, x)
  # grid_analysis: programs along axis 0 share output blocks, so the axis runs in order
  assert plan.vectorized == [] and plan.inner == [0]
  assert "visited by steps (0,) and (1,)" in plan.describe()
  odd = x.reshape(8, 4)[1::2] + jnp.arange(1, 8, 2, dtype=f32)[:, None]
  assert_close(fn(x), odd.reshape(-1))


def test_inputs_that_do_not_tile_are_gathered_per_program():
  # Reversed blocks and overlapping windows (an Element dim 8 long, 4 apart).
  def kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + w_ref[:4] * w_ref[4:]
  x, w = random_array((32,)), random_array((36,))
  fn = lambda x, w: pl.pallas_call(
      kernel, out_shape=sds(x), grid=(8,),
      in_specs=[pl.BlockSpec((4,), lambda i: (7 - i,)),
                pl.BlockSpec((pl.Element(8),), lambda i: (4 * i,))],
      out_specs=pl.BlockSpec((4,), lambda i: (i,)))(x, w)
  plan = _plan(fn, x, w)
  assert plan.vectorized == [0] and plan.outer == []
  assert [op.gathered for op in plan.inputs] == [True, True]
  assert "gathered per program" in plan.describe()
  expected = x.reshape(8, 4)[::-1].reshape(-1) * 2.0 + w[:32] * w[4:36]
  assert_close(fn(x, w), expected)


@pytest.mark.parametrize("chunked", [False, True])
def test_gathered_blocks_on_a_2d_grid_with_chunks(chunked, request):
  if chunked:
    request.getfixturevalue("small_memory_budget").setattr(plan_lib, "MEMORY_MULTIPLE", 0.5)
  # Output block (i, j) reads input block ((3 i) mod 4, 2 - j): permuted and reversed.
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.sin(x_ref[...]) + pl.program_id(0).astype(f32)
  x = random_array((16, 12))
  fn = lambda x: pl.pallas_call(
      kernel, out_shape=sds(x), grid=(4, 3),
      in_specs=[pl.BlockSpec((4, 4), lambda i, j: ((3 * i) % 4, 2 - j))],
      out_specs=pl.BlockSpec((4, 4), lambda i, j: (i, j)))(x)
  plan = _plan(fn, x)
  assert plan.inputs[0].gathered and plan.vectorized
  if chunked:
    assert plan.outer and "chunked" in plan.describe()
  blocks = x.reshape(4, 4, 3, 4).transpose(0, 2, 1, 3)
  picked = blocks[jnp.array([0, 3, 2, 1])][:, ::-1]
  expected = jnp.sin(picked) + jnp.arange(4, dtype=f32)[:, None, None, None]
  assert_close(fn(x), expected.transpose(0, 2, 1, 3).reshape(16, 12))


def test_scalar_prefetch_loops_every_axis():
  def kernel(order_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0
  x, order = random_array((32, 8)), jnp.array([3, 1, 0, 2], jnp.int32)
  spec = pl.BlockSpec((8, 8), lambda i, order: (order[i], 0))
  fn = lambda order, x: pl.pallas_call(
      kernel, out_shape=sds(x),
      grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(4,),
                                             in_specs=[spec], out_specs=spec))(order, x)
  plan = _plan(fn, order, x)
  assert plan.vectorized == [] and plan.inner == [0] and "scalar-prefetch" in plan.describe()
  assert_close(fn(order, x), x * 2.0)


def test_debug_prints_the_reasons(capsys, large_step_work):
  q, k, v = (random_array((2, 16, 8)) for _ in range(3))
  def kernel(q_ref, k_ref, v_ref, o_ref):
    n = pl.program_id(1) + 1
    o_ref[...] = lax.fori_loop(0, n, lambda j, acc: acc + k_ref[pl.ds(j * 8, 8), :],
                               q_ref[...]) + v_ref[:8, :]
  q_spec = pl.BlockSpec((None, 8, 8), lambda b, i: (b, i, 0))
  kv_spec = pl.BlockSpec((None, 16, 8), lambda b, i: (b, 0, 0))
  out = pl.pallas_call(kernel, out_shape=sds(q), grid=(2, 2), in_specs=[q_spec, kv_spec, kv_spec],
                       out_specs=q_spec, debug=True)(q, k, v)
  printed = capsys.readouterr().out
  assert "axis 0 vectorized" in printed and "axis 1 looped" in printed
  assert "trip count" in printed
  expected = q + jnp.stack([jnp.concatenate([k[b, :8], k[b, :8] + k[b, 8:]]) for b in range(2)])
  assert_close(out, expected + jnp.tile(v[:, :8], (1, 2, 1)))


# ------------------------------------------------------------------ chunking
def test_huge_vectorization_is_chunked(small_memory_budget):
  small_memory_budget.setattr(plan_lib, "MEMORY_MULTIPLE", 16)

  def kernel(x_ref, t_ref, o_ref):
    # each program builds a (table x block) outer product: 256x its block
    o_ref[...] = jnp.sum(t_ref[...][:, None] * x_ref[...][None, :], axis=0)
  x, t = random_array((64 * 8,)), random_array((256,))
  fn = lambda x, t: pl.pallas_call(
      kernel, out_shape=sds(x), grid=(64,),
      in_specs=[pl.BlockSpec((8,), lambda i: (i,)), pl.BlockSpec((256,), lambda i: (0,))],
      out_specs=pl.BlockSpec((8,), lambda i: (i,)))(x, t)
  plan = _plan(fn, x, t)
  assert plan.vectorized == [0] and plan.outer == [0]
  assert 1 < plan.chunk[0] < 64 and 64 % plan.chunk[0] == 0
  assert "chunked" in plan.describe()
  # Memory: vectorized programs create at most the budget, 16x the operands' bytes.
  facts = body_analysis.analyse_body(_description(fn, x, t))
  assert facts.intermediate_bytes * plan.chunk[0] <= 16 * (x.nbytes * 2 + t.nbytes)
  assert_close(fn(x, t), jnp.sum(t) * x, rtol=1e-4, atol=1e-4)


def test_summed_axis_is_chunked_into_the_inner_loop(small_memory_budget):
  small_memory_budget.setattr(plan_lib, "MEMORY_MULTIPLE", 0.25)
  x, y = random_array((16, 256)), random_array((256, 16))
  fn = lambda x, y: _matmul(x, y, _zero_then_add_scaled)
  plan = _plan(fn, x, y)
  assert plan.summed == [2] and plan.inner == [2] and 1 < plan.chunk[2] < 32
  assert_close(fn(x, y), 0.5 * (x @ y), matmul=True)


# ------------------------------------------------------------------ other strategies
def test_resident_outputs_loaded_every_step_when_they_move_along_an_arbitrary_axis():
  # the sum carried in scratch keeps the "arbitrary" axis in order
  def kernel(x_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += jnp.sin(x_ref[...])
    o_ref[...] = acc_ref[...]
  x = random_array((4, 32))
  spec = pl.BlockSpec((4, 8), lambda i: (0, i))
  fn = lambda x: pl.pallas_call(kernel, out_shape=sds(x), grid=(4,), in_specs=[spec],
                                out_specs=spec, scratch_shapes=[pltpu.VMEM((4, 8), jnp.float32)],
                                compiler_params=pl.CompilerParams(
                                    dimension_semantics=("arbitrary",)))(x)
  plan = _plan(fn, x)
  assert plan.inner == [0] and not plan.resident_outputs
  assert_close(fn(x), jnp.cumsum(jnp.sin(x).reshape(4, 4, 8), axis=1).reshape(4, 32))


def test_partly_written_vectorized_outputs_keep_poison_elsewhere():
  # Programs write only the first half of their block; the rest must stay as given.
  def kernel(x_ref, o_in_ref, o_ref):
    del o_in_ref
    o_ref[:4] = x_ref[:4] + 1.0
  x, init = random_array((32,)), poisoned((32,))
  spec = pl.BlockSpec((8,), lambda i: (i,))
  fn = lambda x, init: pl.pallas_call(kernel, out_shape=sds(x), grid=(4,),
                                      in_specs=[spec, spec], out_specs=spec,
                                      input_output_aliases={1: 0})(x, init)
  assert _plan(fn, x, init).vectorized == [0]
  out = fn(x, init).reshape(4, 8)
  assert_close(out[:, :4], (x + 1.0).reshape(4, 8)[:, :4])
  assert bool(jnp.all(jnp.isnan(out[:, 4:])))


def test_overhanging_blocks_under_vectorization():
  x, y = random_array((60,)), random_array((60,))
  assert_close(_add(jnp.pad(x, (0, 4)), jnp.pad(y, (0, 4)), 8)[:60], x + y)
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 3.0
  spec = pl.BlockSpec((8,), lambda i: (i,))
  out = pl.pallas_call(kernel, out_shape=sds(x), grid=(8,), in_specs=[spec],
                       out_specs=spec)(x)
  assert_close(out, x * 3.0)


# ------------------------------------------------------------------ helpers of the plan
def test_accumulator_analysis_reports_why_not():
  x, y = random_array((16, 16)), random_array((16, 16))
  facts = body_analysis.analyse_body(
      _description(lambda x, y: _matmul(x, y, lambda o, p, k: o * p), x, y))
  assert 0 in facts.not_accumulators and not facts.accumulators
  facts = body_analysis.analyse_body(
      _description(lambda x, y: _matmul(x, y, _zero_then_add), x, y))
  assert list(facts.accumulators) == [0] and facts.has_matrix_product


def test_element_blocks_that_tile_are_sliced_not_gathered():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] - 1.0
  x = random_array((64, 8))
  fn = lambda x: pl.pallas_call(
      kernel, out_shape=sds(x), grid=(8,),
      in_specs=[pl.BlockSpec((pl.Element(8), 8), lambda i: (8 * i, 0))],
      out_specs=pl.BlockSpec((8, 8), lambda i: (i, 0)))(x)
  plan = _plan(fn, x)
  assert plan.vectorized == [0] and not plan.inputs[0].gathered
  assert_close(fn(x), x - 1.0)


# ------------------------------------------------------------------ element padding
@pytest.mark.parametrize("prefetch", [False, True])
def test_element_padding_offsets_count_in_the_padded_array(prefetch):
  # Windows of 6 around each 4-element output block, offsets counted in x padded by
  # (2, 0): offset 4*i of the padded array is element 4*i - 2 of x. The padding is
  # unspecified, so the kernel masks positions outside x.
  n = 32
  def kernel(*refs):
    x_ref, o_ref = refs[-2:]
    pos = pl.program_id(0) * 4 - 2 + jnp.arange(6)
    w = jnp.where(pos >= 0, x_ref[...], 0.0)
    o_ref[...] = w[:4] + w[2:]
  x = random_array((n,))
  dims = (pl.Element(6, padding=(2, 0)),)
  out_spec = pl.BlockSpec((4,), lambda i, *_: (i,))
  if prefetch:
    fn = lambda x: pl.pallas_call(
        kernel, out_shape=sds(x),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(n // 4,), out_specs=out_spec,
            in_specs=[pl.BlockSpec(dims, lambda i, s: (s[0] * i,))]))(
                                  jnp.array([4], jnp.int32), x)
  else:
    fn = lambda x: pl.pallas_call(kernel, out_shape=sds(x), grid=(n // 4,), out_specs=out_spec,
                                  in_specs=[pl.BlockSpec(dims, lambda i: (4 * i,))])(x)
  xp = jnp.pad(x, (2, 0))
  assert_close(fn(x), xp[:n] + xp[2:n + 2])


# ------------------------------------------------------------------ bodies vmap cannot batch
def test_threefry_kernel_loops_instead_of_failing_under_vmap():
  from jax._src.random import threefry2x32 as threefry  # the primitive the TPU kernels bind
  def kernel(key_ref, o_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    counts = ((i * 8 + lax.broadcasted_iota(jnp.uint32, (8, 128), 0)) * 256
              + j * 128 + lax.broadcasted_iota(jnp.uint32, (8, 128), 1)).astype(jnp.uint32)
    k1 = jnp.reshape(key_ref[0, 0], (1, 1))
    k2 = jnp.reshape(key_ref[0, 1], (1, 1))
    a, b = threefry.threefry2x32_p.bind(k1, k2, jnp.zeros_like(counts), counts)
    o_ref[...] = a ^ b
  key = jnp.array([[5, 11]], jnp.uint32)
  fn = lambda key: pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((16, 256), jnp.uint32), grid=(2, 2),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, j)))(key)
  plan = _plan(fn, key)
  assert plan.vectorized == [] and plan.outer == [0, 1]
  assert "threefry2x32" in plan.describe() and "vmap" in plan.describe()
  counts = jnp.arange(16 * 256, dtype=jnp.uint32).reshape(16, 256)
  a, b = threefry.threefry2x32_p.bind(jnp.full(counts.shape, 5, jnp.uint32),
                                      jnp.full(counts.shape, 11, jnp.uint32),
                                      jnp.zeros_like(counts), counts)
  np.testing.assert_array_equal(np.asarray(fn(key)), np.asarray(a ^ b))


def _unbatchable_primitive():
  """A primitive with an implementation and a lowering but no batching rule."""
  from jax.extend.core import Primitive
  from jax.interpreters import mlir
  p = Primitive("pallet_test_no_batching")
  p.def_impl(lambda x: x * 3.0)
  p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
  mlir.register_lowering(p, mlir.lower_fun(lambda x: x * 3.0, multiple_results=False))
  return p


def test_primitive_without_batching_rule_makes_the_plan_loop(capsys):
  p = _unbatchable_primitive()
  def kernel(x_ref, o_ref):
    o_ref[...] = p.bind(x_ref[...]) + 1.0
  x = random_array((32, 16))
  spec = pl.BlockSpec((8, 16), lambda i: (i, 0))
  fn = lambda x: pl.pallas_call(kernel, out_shape=sds(x), grid=(4,), in_specs=[spec],
                                out_specs=spec, debug=True)(x)
  plan = _plan(fn, x)
  assert plan.vectorized == [] and plan.outer == [0]
  assert "has no batching rule" in capsys.readouterr().out
  assert_close(fn(x), x * 3.0 + 1.0)


# ------------------------------------------------------------------ DMAs and semaphores
def test_kernels_with_dmas_run_in_grid_order():
  from pallet import tpu as pltpu
  def kernel(x_hbm, o_ref, buf, sem):
    i = pl.program_id(0)
    copy = pltpu.make_async_copy(x_hbm.at[pl.ds(i * 8, 8)], buf, sem)
    copy.start()
    copy.wait()
    o_ref[...] = buf[...] * 2.0
  x = random_array((32, 16))
  fn = lambda x: pl.pallas_call(
      kernel, out_shape=sds(x), grid=(4,),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((8, 16), lambda i: (i, 0)),
      scratch_shapes=[pltpu.VMEM((8, 16), f32), pltpu.SemaphoreType.DMA],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))(x)
  plan = _plan(fn, x)
  assert plan.vectorized == [] and "DMA" in plan.describe()
  assert_close(fn(x), x * 2.0)


@pytest.mark.parametrize("grid_size", ["static", "traced"])
def test_poison_buffers_fill_unwritten_output_blocks(grid_size):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  x = random_array((32, 8))
  spec = pl.BlockSpec((8, 8), lambda i: (i, 0))
  fn = lambda x, n: pl.pallas_call(kernel, out_shape=sds(x), grid=(n,), in_specs=[spec],
                                   out_specs=spec)(x)
  with pl.enable_poison_buffers(True):
    out = jax.jit(fn)(x, jnp.int32(2)) if grid_size == "traced" else fn(x, 2)
  assert_close(out[:16], x[:16] + 1.0)
  assert bool(jnp.all(jnp.isnan(out[16:])))
  assert_close(fn(x, 2)[16:], jnp.zeros((16, 8), f32))   # poisoning off: zeros


def test_batching_rule_that_fails_makes_the_plan_loop_when_traced(capsys):
  from jax.extend.core import Primitive
  from jax.interpreters import batching, mlir
  p = Primitive("pallet_test_failing_batching")
  p.def_impl(lambda x: x - 2.0)
  p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
  mlir.register_lowering(p, mlir.lower_fun(lambda x: x - 2.0, multiple_results=False))
  def refuse(args, dims):
    raise NotImplementedError("this rule refuses every batch")
  batching.primitive_batchers[p] = refuse
  def kernel(x_ref, o_ref):
    o_ref[...] = p.bind(x_ref[...]) * 2.0
  x = random_array((32, 16))
  spec = pl.BlockSpec((8, 16), lambda i: (i, 0))
  fn = lambda x: pl.pallas_call(kernel, out_shape=sds(x), grid=(4,), in_specs=[spec],
                                out_specs=spec, debug=True)(x)
  assert_close(fn(x), (x - 2.0) * 2.0)
  plan = _plan(fn, x)
  assert plan.vectorized == [] and plan.outer == [0]
  assert "refuses every batch" in plan.describe()
  assert "does not run under vmap" in capsys.readouterr().out


# ------------------------------------------------------------------ static index vectors
def _masked_row_op(x, block, offset=0, init=None):
  """Triton-style row softmax: one grid-less instance per row under vmap, the row read
  and written through an index vector `col_idx` with a mask (as jax's gpu/softmax);
  with `init`, the output starts as that (aliased) array."""
  from pallet import triton as plgpu
  n = x.shape[-1]

  def kernel(x_ref, *refs):
    o_ref = refs[-1]
    col_idx = offset + jnp.arange(block)
    mask = (col_idx >= 0) & (col_idx < n)
    row = plgpu.load(x_ref.at[col_idx], mask=mask, other=-jnp.inf)
    e = jnp.exp(row - jnp.max(row))
    plgpu.store(o_ref.at[col_idx], (e / jnp.sum(e)).astype(o_ref.dtype), mask=mask)
  f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), x.dtype),
                     input_output_aliases={} if init is None else {1: 0})
  return jax.vmap(f)(x) if init is None else jax.vmap(f)(x, init)


def _masked_row_reference(x, block, offset=0):
  n = x.shape[-1]
  cols = offset + np.arange(block)
  keep = cols[(cols >= 0) & (cols < n)]
  rows = x[:, keep].astype(f32)
  e = jnp.exp(rows - jnp.max(rows, axis=-1, keepdims=True))
  return e / jnp.sum(e, axis=-1, keepdims=True), keep


@pytest.mark.parametrize("n,block,offset,sliced", [
    (128, 128, 0, True), (100, 128, 0, True), (128, 64, 32, True),
    # negative indices wrap before the mask applies: no contiguous run, a gather stays
    (100, 128, -20, False)])
def test_static_index_vectors_become_slices(n, block, offset, sliced):
  x = random_array((6, n))
  got = jax.jit(functools.partial(_masked_row_op, block=block, offset=offset))(x)
  expected, keep = _masked_row_reference(x, block, offset)
  assert_close(got[:, keep], expected)
  hlo = jax.jit(functools.partial(_masked_row_op, block=block, offset=offset)).lower(x).as_text()
  assert ("gather" not in hlo and "scatter" not in hlo) == sliced


def test_static_index_vectors_keep_unwritten_columns_poisoned():
  x = random_array((3, 100))
  got = jax.jit(functools.partial(_masked_row_op, block=64, offset=8))(x, init=poisoned(x.shape))
  expected, keep = _masked_row_reference(x, 64, 8)
  assert_close(got[:, keep], expected)
  rest = np.setdiff1d(np.arange(100), keep)
  assert np.all(np.isnan(np.asarray(got[:, rest])))


def test_static_index_vectors_in_bf16():
  x = random_array((4, 96), jnp.bfloat16)
  got = jax.jit(functools.partial(_masked_row_op, block=128))(x)
  expected, _ = _masked_row_reference(x, 128)
  assert got.dtype == jnp.bfloat16
  assert_close(got, expected.astype(jnp.bfloat16))


def test_static_index_pass_compiles_nothing_for_float_constants():
  """A float computed from literals alone (the `-inf` an online softmax starts from)
  can never be an index: the pass must trace it, not run it as an eager program."""
  from pallet import triton as plgpu

  def kernel(x_ref, o_ref):
    cols = jnp.arange(128)
    start = jnp.zeros((128,), f32) - jnp.inf
    row = plgpu.load(x_ref.at[cols], mask=cols < 100, other=-jnp.inf)
    plgpu.store(o_ref.at[cols], jnp.maximum(start, row) * 2.0, mask=cols < 100)
  f = jax.vmap(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((100,), f32)))
  x = random_array((4, 100))
  compiles = []

  def count(event, *_, **__):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)
  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    hlo = jax.jit(f).lower(x).as_text()
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
  assert compiles == []
  assert "gather" not in hlo and "scatter" not in hlo
  assert_close(jax.jit(f)(x), x * 2.0)


def test_index_vectors_that_are_not_contiguous_stay_gathers():
  from pallet import triton as plgpu

  def kernel(x_ref, o_ref):
    idx = jnp.arange(64)[::-1] * 2
    o_ref[...] = plgpu.load(x_ref.at[idx])
  x = random_array((4, 128))
  f = jax.vmap(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64,), f32)))
  assert_close(jax.jit(f)(x), x[:, np.arange(64)[::-1] * 2])
  assert "gather" in jax.jit(f).lower(x).as_text()


# ------------------------------------------------------------------ scratch accumulators
def _scratch_matmul(x, y, *, b=16, copy_when="last", reset_when=0, out_dtype=f32):
  """TPU-style matmul: f32 scratch zeroed at k == reset_when, += every step, copied
  (cast) to the output on the last step ("last"), every step ("always") or at
  k == 0 ("first", wrong on purpose)."""
  from pallet import tpu as pltpu
  nk = x.shape[1] // b

  def kernel(x_ref, y_ref, o_ref, acc_ref):
    k = pl.program_id(2)

    @pl.when(k == reset_when)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=f32)

    def copy():
      o_ref[...] = acc_ref[...].astype(o_ref.dtype)
    if copy_when == "always":
      copy()
    else:
      pl.when(k == (nk - 1 if copy_when == "last" else 0))(copy)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), out_dtype),
      grid=(x.shape[0] // b, y.shape[1] // b, nk),
      in_specs=[pl.BlockSpec((b, b), lambda i, j, k: (i, k)),
                pl.BlockSpec((b, b), lambda i, j, k: (k, j))],
      out_specs=pl.BlockSpec((b, b), lambda i, j, k: (i, j)),
      scratch_shapes=[pltpu.VMEM((b, b), f32)])(x, y)


@pytest.mark.parametrize("copy_when", ["last", "always"])
@pytest.mark.parametrize("dtype", [f32, jnp.bfloat16])
def test_scratch_accumulator_runs_as_a_merged_contraction(copy_when, dtype):
  x, y = random_array((48, 64), dtype), random_array((64, 32), dtype)
  fn = functools.partial(_scratch_matmul, copy_when=copy_when, out_dtype=dtype)
  plan = _plan(fn, x, y)
  assert plan.merged == [2] and plan.inner == [] and plan.outer == []
  assert "scratch buffers accumulate" in plan.describe()
  expected = jnp.dot(x.astype(f32), y.astype(f32), precision=lax.Precision.HIGHEST)
  got = jax.jit(fn)(x, y)
  assert got.dtype == dtype
  assert_close(got, expected.astype(dtype))


@pytest.mark.parametrize("kwargs,why", [
    (dict(copy_when="first"), "not written exactly on the last step"),
    (dict(reset_when=1), "not zeroed exactly on the first step"),
])
def test_scratch_patterns_not_proven_keep_the_loop(kwargs, why):
  x, y = random_array((32, 64)), random_array((64, 32))
  fn = functools.partial(_scratch_matmul, **kwargs)
  plan = _plan(fn, x, y)
  assert plan.merged == [] and 2 in plan.inner
  assert why in plan.describe()
  if kwargs.get("copy_when") == "first":   # the looped plan computes what the kernel says
    b = 16
    assert_close(jax.jit(fn)(x, y), jnp.dot(x[:, :b], y[:b], precision=lax.Precision.HIGHEST))


def test_scratch_row_reduction_merges_into_one_sum():
  from pallet import tpu as pltpu

  def kernel(x_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += jnp.sum(x_ref[...] * x_ref[...], axis=0)

    @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
    def _():
      o_ref[...] = acc_ref[...] * 0.5
  x = random_array((64, 48))
  fn = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((48,), f32), grid=(3, 8),
                      in_specs=[pl.BlockSpec((8, 16), lambda j, i: (i, j))],
                      out_specs=pl.BlockSpec((16,), lambda j, i: (j,)),
                      scratch_shapes=[pltpu.VMEM((16,), f32)])
  plan = _plan(fn, x)
  assert plan.merged == [1]
  assert_close(jax.jit(fn)(x), 0.5 * jnp.sum(x * x, axis=0))


# ------------------------------------------------------------------ widened edge axes
def _row_kernel_call(body, x, *vectors, block=8, n_out=1):
  """Row blocks of `x` (last one overhanging), whole vectors; `body(x, *vectors)`
  returns the output blocks."""
  rows, cols = x.shape

  def kernel(*refs):
    outs = body(*(r[...] for r in refs[:1 + len(vectors)]))
    for r, v in zip(refs[1 + len(vectors):], outs):
      r[...] = v.astype(r.dtype)
  spec = pl.BlockSpec((block, cols), lambda i: (i, 0))
  vec = pl.BlockSpec((cols,), lambda i: (0,))
  return pl.pallas_call(kernel, out_shape=[sds(x)] * n_out, grid=(pl.cdiv(rows, block),),
                        in_specs=[spec] + [vec] * len(vectors), out_specs=[spec] * n_out)


def _softmax_rows(x):
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  return e / jnp.sum(e, axis=-1, keepdims=True)


@pytest.mark.parametrize("dtype", [f32, jnp.bfloat16])
def test_overhanging_row_blocks_run_widened_without_padding(dtype):
  x = random_array((37, 128), dtype)
  fn = _row_kernel_call(lambda x: [_softmax_rows(x.astype(f32))], x)
  plan = _plan(fn, x)
  assert plan.merged == [0] and plan.vectorized == [] and plan.outer == []
  assert "axis 0 widened" in plan.describe()
  (got,) = jax.jit(fn)(x)
  assert got.dtype == dtype
  assert_close(got, _softmax_rows(x.astype(f32)).astype(dtype))
  assert "stablehlo.pad" not in jax.jit(fn).lower(x).as_text()


def test_widened_rows_broadcast_vectors_and_row_constant_outputs():
  x, g, b = random_array((21, 64)), random_array((64,)), random_array((64,))

  def body(x, g, b):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return [(x - mean) * lax.rsqrt(var + 1e-5) * g + b, jnp.zeros_like(x) + g]
  fn = _row_kernel_call(body, x, g, b, n_out=2)
  assert _plan(fn, x, g, b).merged == [0]
  got = jax.jit(fn)(x, g, b)
  mean = jnp.mean(x, axis=-1, keepdims=True)
  expected = (x - mean) * lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + 1e-5) * g + b
  assert_close(got[0], expected)
  assert_close(got[1], jnp.broadcast_to(g, x.shape))


@pytest.mark.parametrize("name,body,reference,why", [
    ("row iota", lambda x: [x * lax.broadcasted_iota(f32, x.shape, 0)],
     lambda x: x * (jnp.arange(x.shape[0]) % 8)[:, None].astype(f32), "varies along them"),
    ("row sum", lambda x: [x - jnp.sum(x, axis=0)], lambda x: (lambda p: (
        p - jnp.repeat(p.reshape(-1, 8, p.shape[1]).sum(1), 8, axis=0))[:x.shape[0]])(
            jnp.pad(x, ((0, -x.shape[0] % 8), (0, 0)))), "reduces over the rows"),
])
def test_row_mixing_bodies_keep_vmap_on_overhanging_blocks(name, body, reference, why):
  x = random_array((37, 32))
  fn = _row_kernel_call(body, x)
  plan = _plan(fn, x)
  assert plan.vectorized == [0] and plan.merged == []
  assert why in plan.describe()
  full = x.shape[0] // 8 * 8   # rows of the overhanging block would read undefined rows
  assert_close(jax.jit(fn)(x)[0][:full], reference(x)[:full])


def test_program_id_keeps_vmap_on_overhanging_blocks():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + pl.program_id(0).astype(f32)
  x = random_array((20, 16))
  spec = pl.BlockSpec((8, 16), lambda i: (i, 0))
  fn = pl.pallas_call(kernel, out_shape=sds(x), grid=(3,), in_specs=[spec], out_specs=spec)
  plan = _plan(fn, x)
  assert plan.vectorized == [0] and "program_id" in plan.describe()
  assert_close(jax.jit(fn)(x), x + (jnp.arange(20) // 8)[:, None].astype(f32))


@pytest.mark.parametrize("dtype", [f32, jnp.bfloat16])
def test_row_blocks_run_widened_when_they_divide(dtype):
  x = random_array((32, 128), dtype)
  fn = _row_kernel_call(lambda x: [_softmax_rows(x.astype(f32))], x)
  plan = _plan(fn, x)
  assert plan.merged == [0] and plan.vectorized == []
  assert "stablehlo.reshape" not in jax.jit(fn).lower(x).as_text()
  assert_close(jax.jit(fn)(x)[0], _softmax_rows(x.astype(f32)).astype(dtype))


# ------------------------------------------------------------------ skipped matrix products
def _blockwise_causal(x, y, skip_when, b=8):
  """o[i] = sum over k of x[i, k] @ y[k] where pl.when(keep(i, k)); zero elsewhere."""
  def kernel(x_ref, y_ref, o_ref):
    i, k = pl.program_id(0), pl.program_id(1)

    @pl.when(k == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(skip_when(i, k))
    def _():
      o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=f32)
  n = x.shape[0] // b
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), f32),
                        grid=(n, n), in_specs=[pl.BlockSpec((b, b), lambda i, k: (i, k)),
                                               pl.BlockSpec((b, y.shape[1]), lambda i, k: (k, 0))],
                        out_specs=pl.BlockSpec((b, y.shape[1]), lambda i, k: (i, 0)))(x, y)


@pytest.mark.parametrize("name,keep,looped", [
    ("causal", lambda i, k: k <= i, True),         # 10 of 16 steps compute: 37% skipped
    ("almost all", lambda i, k: i >= 0, False),    # nothing skipped: stays vectorized
])
def test_parallel_axis_deciding_a_skipped_matrix_product_is_looped(name, keep, looped):
  x, y = random_array((32, 32)), random_array((32, 16))
  fn = functools.partial(_blockwise_causal, skip_when=keep)
  plan = _plan(fn, x, y)
  assert (0 in plan.outer) == looped and (0 in plan.vectorized) != looped
  if looped:
    assert "pl.when around a matrix product" in plan.describe()
  blocks = np.arange(32) // 8
  mask = np.asarray([[keep(i, k) for k in blocks] for i in blocks]).astype(np.float32)
  assert_close(jax.jit(fn)(x, y), jnp.dot(x * mask, y, precision=lax.Precision.HIGHEST))


# ------------------------------------------------------------------ data-dependent loops
def test_read_only_operands_of_data_dependent_loops_are_not_copied_per_program():
  """Per row: sum of the first n[i] rows of a shared table, under a cond on n[i]
  (paged attention's shape): vmap must not copy the table once per program."""
  def kernel(n_ref, table_ref, o_ref):
    n = n_ref[0]

    def total():
      return lax.fori_loop(0, n, lambda k, acc: acc + table_ref[k], jnp.zeros((64,), f32))
    o_ref[0, :] = lax.cond(n > 0, total, lambda: jnp.full((64,), -1.0, f32))
  n = jnp.asarray([0, 3, 7, 1, 5, 2, 0, 6], jnp.int32)
  table = random_array((256, 64))
  fn = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 64), f32), grid=(8,),
                      in_specs=[pl.BlockSpec((1,), lambda i: (i,)),
                                pl.BlockSpec((256, 64), lambda i: (0, 0))],
                      out_specs=pl.BlockSpec((1, 64), lambda i: (i, 0)))
  assert _plan(fn, n, table).vectorized == [0]
  sums = jnp.cumsum(table, axis=0)
  expected = jnp.where((n > 0)[:, None], sums[jnp.maximum(n - 1, 0)], -1.0)
  assert_close(jax.jit(fn)(n, table), expected)
  text = jax.jit(fn).lower(n, table).as_text()
  loops = [line for line in text.splitlines() if "stablehlo.while" in line]
  assert loops and not any("8x256x64" in line for line in loops)   # the table: no carry


# ------------------------------------------------------------------ folded index arithmetic
def test_static_ref_indices_fold_before_the_program_is_emitted():
  # Each `ref[k]` discharges to a bounds normalisation on literals (`k < 0 ? k + n : k`).
  def kernel(x_ref, o_ref):
    o_ref[0] = x_ref[1] * x_ref[2]
    o_ref[1] = x_ref[0] - x_ref[3]
  x = random_array((2, 4, 8, 16))
  spec = pl.BlockSpec((None, 4, 8, 16), lambda i: (i, 0, 0, 0))
  out_spec = pl.BlockSpec((None, 2, 8, 16), lambda i: (i, 0, 0, 0))
  fn = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((2, 2, 8, 16), f32), grid=(2,),
                      in_specs=[spec], out_specs=out_spec)
  text = jax.jit(fn).lower(x).as_text()
  assert "stablehlo.compare" not in text and "stablehlo.select" not in text
  assert_close(jax.jit(fn)(x), jnp.stack([x[:, 1] * x[:, 2], x[:, 0] - x[:, 3]], axis=1))


def test_when_on_a_constant_grid_index_runs_only_its_branch():
  # The merged k axis runs once with k == 0: `pl.when(k == 0)` needs no switch.
  def kernel(x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=f32)
  x, y = random_array((16, 32)), random_array((32, 24))
  fn = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 24), f32), grid=(2, 3, 4),
                      in_specs=[pl.BlockSpec((8, 8), lambda i, j, k: (i, k)),
                                pl.BlockSpec((8, 8), lambda i, j, k: (k, j))],
                      out_specs=pl.BlockSpec((8, 8), lambda i, j, k: (i, j)))
  assert _plan(fn, x, y).merged == [2]
  text = jax.jit(fn).lower(x, y).as_text()
  assert "stablehlo.case" not in text and "stablehlo.compare" not in text
  assert_close(jax.jit(fn)(x, y), x @ y, matmul=True)


def test_fold_literals_keeps_what_is_not_constant():
  from pallet.backends.xla.literal_folding import fold_literals

  def f(x, i):
    k = lax.select(3 < 0, 3 + 8, 3)          # folds to 3
    j = lax.select(i < 0, i + 8, i)          # depends on i: kept
    return lax.dynamic_slice_in_dim(x, k, 2) + lax.dynamic_slice_in_dim(x, j, 2)
  closed = jax.make_jaxpr(f)(jnp.arange(8.0), 1)
  folded = fold_literals(closed)
  assert len(folded.jaxpr.eqns) < len(closed.jaxpr.eqns)
  assert any(e.primitive.name == "select_n" for e in folded.jaxpr.eqns)
  x = random_array((8,))
  for i in (1, -3):
    assert_close(jax.core.eval_jaxpr(folded.jaxpr, folded.consts, x, i)[0], f(x, i))


# ------------------------------------------------------------------ unrolled grid loops
def _running_max(x, k_blocks):
  """Column maxima over row blocks: a scratch running max along a sequential axis,
  reset by pl.when on its first step, written out by pl.when on its last."""
  from pallet import tpu as pltpu

  def kernel(x_ref, o_ref, m_ref):
    k = pl.program_id(1)

    @pl.when(k == 0)
    def _():
      m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
    m_ref[...] = jnp.maximum(m_ref[...], jnp.max(x_ref[...], axis=0))

    @pl.when(k == pl.num_programs(1) - 1)
    def _():
      o_ref[...] = m_ref[...] * 2.0
  rows, cols = x.shape
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((cols,), f32), grid=(cols // 8, k_blocks),
      in_specs=[pl.BlockSpec((rows // k_blocks, 8), lambda j, k: (k, j))],
      out_specs=pl.BlockSpec((8,), lambda j, k: (j,)),
      scratch_shapes=[pltpu.VMEM((8,), f32)])(x)


@pytest.mark.parametrize("k_blocks, unrolled", [(4, True), (8, False)])
def test_grid_loops_of_few_steps_are_unrolled(k_blocks, unrolled):
  x = random_array((64, 32))
  fn = lambda x: _running_max(x, k_blocks)
  plan = _plan(fn, x)
  assert plan.inner == [1] and plan.unrolled == unrolled
  assert ("grid loops unrolled: 4 steps" in plan.describe()) == unrolled
  assert_close(fn(x), 2.0 * jnp.max(x, axis=0))


def test_unrolled_steps_resolve_grid_conditions_at_trace_time():
  x = random_array((64, 32))
  kernel = _description(lambda x: _running_max(x, 4), x)
  fn = xla_backend.kernel_as_function(kernel)
  text = str(jax.make_jaxpr(fn)(x))
  assert "cond[" not in text and "while[" not in text   # pl.when(k == ...) folded away
  assert_close(fn(x)[0], 2.0 * jnp.max(x, axis=0))


def _lower_block_product(x, y, blocks, with_free_product=False):
  """Block-lower-triangular x @ y, the causal-attention shape: the product of block
  (i, j) runs under pl.when(j <= i) on program ids alone, into a scratch written out
  on the last step; `with_free_product` adds a product outside any pl.when."""
  def kernel(x_ref, y_ref, o_ref, acc_ref):
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(j == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(j <= i)
    def _():
      acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], precision="highest")
    if with_free_product:
      acc_ref[...] += 0.0 * jnp.dot(x_ref[...], y_ref[...], precision="highest")

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
      o_ref[...] = acc_ref[...] * 2.0
  b = x.shape[0] // blocks
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), f32),
      grid=(blocks, blocks),
      in_specs=[pl.BlockSpec((b, b), lambda i, j: (i, j)),
                pl.BlockSpec((b, y.shape[1]), lambda i, j: (j, 0))],
      out_specs=pl.BlockSpec((b, y.shape[1]), lambda i, j: (i, 0)),
      scratch_shapes=[pltpu.VMEM((b, y.shape[1]), f32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")))(x, y)


def _block_lower_reference(x, y, blocks):
  b = x.shape[0] // blocks
  keep = jnp.kron(jnp.tri(blocks, dtype=f32), jnp.ones((b, b), f32))
  return 2.0 * jnp.dot(x * keep, y, precision="highest")


@pytest.mark.parametrize("blocks, unrolled", [(4, True), (6, False)])
def test_loops_whose_grid_conditions_skip_products_unroll_by_the_steps_computing(blocks,
                                                                                  unrolled):
  # 4 x 4 steps, 10 of them computing a product: unrolled, the 6 skipped steps trace to
  # nothing; 6 x 6 steps, 21 computing: more than GRID_UNROLL_PRODUCT_STEPS, looped
  x, y = random_array((8 * blocks, 8 * blocks)), random_array((8 * blocks, 16))
  fn = lambda x, y: _lower_block_product(x, y, blocks)
  plan = _plan(fn, x, y)
  assert plan.outer + plan.inner == [0, 1] and plan.unrolled == unrolled
  assert ("of which 10 compute the body's matrix products" in plan.describe()) == unrolled
  emitted = str(jax.make_jaxpr(xla_backend.kernel_as_function(_description(fn, x, y)))(x, y))
  assert ("cond[" not in emitted and "while[" not in emitted) == unrolled
  assert_close(fn(x, y), _block_lower_reference(x, y, blocks), matmul=True)


def test_a_product_outside_grid_conditions_keeps_the_loop():
  x, y = random_array((32, 32)), random_array((32, 16))
  fn = lambda x, y: _lower_block_product(x, y, 4, with_free_product=True)
  assert not _plan(fn, x, y).unrolled    # every one of the 16 steps computes a product
  assert_close(fn(x, y), _block_lower_reference(x, y, 4), matmul=True)


def test_indices_from_a_grid_axis_of_size_one_fold_into_slices():
  # the GPU decode kernels' head-block mask: arange(block) < heads - block * program_id(0)
  # over a single head block; with program_id(0) known to be 0 the masked accesses at
  # integer-array indices are slices, not per-element gathers and scatters
  from pallet import triton as plgpu

  def kernel(x_ref, init_ref, o_ref):
    del init_ref
    rows = jnp.arange(8)
    mask = (rows < 5 - 8 * pl.program_id(0))[:, None]
    v = plgpu.load(x_ref.at[rows], mask=mask, other=0.0)
    plgpu.store(o_ref.at[rows], v * 3.0, mask=mask)
  x = random_array((4, 8, 16))
  spec = pl.BlockSpec((None, 8, 16), lambda h, b: (b, 0, 0))
  fn = lambda x, init: pl.pallas_call(
      kernel, out_shape=sds(x), grid=(1, 4), in_specs=[spec, spec], out_specs=spec,
      input_output_aliases={1: 0})(x, init)
  init = poisoned(x.shape)
  emitted = str(jax.make_jaxpr(xla_backend.kernel_as_function(_description(fn, x, init)))(
      x, init))
  assert "gather[" not in emitted and "scatter[" not in emitted
  out = fn(x, init)
  assert_close(out[:, :5], 3.0 * x[:, :5])
  assert bool(jnp.all(jnp.isnan(out[:, 5:])))   # masked-off rows never written
