"""The XLA backend's plans for kernels with scalar prefetch: inputs whose blocks sit at
positions read from data are gathered per program on vectorized axes (the index maps
run on the data at run time); kernels whose prefetch places output blocks, or that
write a prefetch ref, loop their whole grid. Results against NumPy
models (randomly drawn tables and shapes) and JAX's Pallas interpreter."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pallet as pl
import pallet.tpu as pltpu
from helpers import assert_close, random_array
from pallet.backends.xla import plan_of

pytestmark = pytest.mark.cpu_only
f32 = jnp.float32


def _plan(fn, *args):
  eqns = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "pallas_call"]
  assert len(eqns) == 1
  return plan_of(eqns[0].params["kernel"])


# ------------------------------------------------------------------ block-sparse attention
def _sparse_kernel(m, ids_ref, mask_ref, q_ref, k_ref, o_ref, acc_ref):
  """acc(h, i) = sum over kv steps j with mask[h, i, j] of q @ k_j^T @ k_j, where k_j
  is the key block at ids[h, i, j] (splash attention's pattern: positions and skips
  read from tables, a scratch accumulator over the last axis)."""
  h, i, j = m.program_id(0), m.program_id(1), m.program_id(2)

  @m.when(j == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @m.when(mask_ref[h, i, j] != 0)
  def _():
    k = k_ref[...]
    s = jnp.dot(q_ref[...], k.T, preferred_element_type=f32)
    acc_ref[...] += jnp.dot(s, k, preferred_element_type=f32)

  @m.when(j == m.num_programs(2) - 1)
  def _():
    o_ref[...] = acc_ref[...]


def _sparse_call(m, mtpu, grid, bq, bk, semantics, **options):
  h, nq, nk = grid

  def call(ids, mask, q, k):
    d = q.shape[-1]
    spec = mtpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=grid,
        in_specs=[m.BlockSpec((None, bq, d), lambda h, i, j, ids, mask: (h, i, 0)),
                  m.BlockSpec((None, bk, d), lambda h, i, j, ids, mask: (h, ids[h, i, j], 0))],
        out_specs=m.BlockSpec((None, bq, d), lambda h, i, j, ids, mask: (h, i, 0)),
        scratch_shapes=[mtpu.VMEM((bq, d), f32)])
    params = None if semantics is None else mtpu.CompilerParams(dimension_semantics=semantics)
    return m.pallas_call(lambda *refs: _sparse_kernel(m, *refs), grid_spec=spec,
                         out_shape=jax.ShapeDtypeStruct(q.shape, f32), compiler_params=params,
                         **options)(ids, mask, q, k)
  return call


def _sparse_model(ids, mask, q, k, bq, bk):
  """The row-major loop in NumPy (float64)."""
  ids, mask, q, k = (np.asarray(a, np.float64) if a.dtype.kind == "f" else np.asarray(a)
                     for a in (ids, mask, q, k))
  out = np.zeros(q.shape)
  for h, i, j in np.ndindex(*ids.shape):
    if mask[h, i, j]:
      qb = q[h, i * bq:(i + 1) * bq]
      kb = k[h, ids[h, i, j] * bk:(ids[h, i, j] + 1) * bk]
      out[h, i * bq:(i + 1) * bq] += (qb @ kb.T) @ kb
  return out


def _sparse_inputs(grid, bq, bk, nblocks, d, seed):
  rng = np.random.default_rng(seed)
  h, nq, nk = grid
  ids = jnp.asarray(rng.integers(0, nblocks, grid), jnp.int32)
  mask = jnp.asarray(rng.integers(0, 2, grid), jnp.int32)
  q = random_array((h, nq * bq, d), seed=seed)
  k = random_array((h, nblocks * bk, d), seed=seed + 1)
  return ids, mask, q, k


def test_blocks_at_data_positions_are_gathered_on_vectorized_axes():
  grid, bq, bk = (2, 4, 3), 8, 8
  args = _sparse_inputs(grid, bq, bk, 5, 16, seed=3)
  call = _sparse_call(pl, pltpu, grid, bq, bk, ("parallel", "arbitrary", "arbitrary"))
  plan = _plan(call, *args)
  # heads declared parallel, query blocks proven independent; the kv axis carries acc
  assert plan.vectorized == [0, 1] and plan.inner == [2]
  assert plan.inputs[1].gathered and plan.inputs[1].table is None
  assert not plan.inputs[0].gathered and plan.inputs[0].table is not None
  assert plan.resident_outputs
  out = jax.jit(call)(*args)
  assert_close(out, _sparse_model(*args, bq, bk), matmul=True)


def test_gathered_blocks_agree_with_jax_interpreter():
  jpl = pytest.importorskip("jax.experimental.pallas")
  jpltpu = pytest.importorskip("jax.experimental.pallas.tpu")
  grid, bq, bk = (2, 3, 4), 8, 4
  args = _sparse_inputs(grid, bq, bk, 6, 8, seed=11)
  semantics = ("parallel", "parallel", "arbitrary")
  ours = jax.jit(_sparse_call(pl, pltpu, grid, bq, bk, semantics))(*args)
  theirs = _sparse_call(jpl, jpltpu, grid, bq, bk, semantics, interpret=True)(*args)
  assert_close(ours, theirs, matmul=True)


@settings(max_examples=25, deadline=None)
@given(grid=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
       bq=st.sampled_from([1, 2, 8]), bk=st.sampled_from([1, 4, 8]),
       nblocks=st.integers(1, 4), d=st.sampled_from([1, 8]),
       semantics=st.sampled_from([None, ("parallel", "parallel", "arbitrary"),
                                  ("arbitrary",) * 3, ("parallel", "arbitrary", "arbitrary")]),
       seed=st.integers(0, 2**16))
def test_data_positions_and_skips_match_the_row_major_loop(grid, bq, bk, nblocks, d,
                                                          semantics, seed):
  args = _sparse_inputs(grid, bq, bk, nblocks, d, seed)
  out = jax.jit(_sparse_call(pl, pltpu, grid, bq, bk, semantics))(*args)
  assert_close(out, _sparse_model(*args, bq, bk), matmul=True)


# ------------------------------------------------------------------ plans that loop all
def _permuted_copy(out_from_data: bool):
  """o block i = 2 * x block perm[i] (or o block perm[i] = 2 * x block i)."""
  def kernel(perm_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  def call(perm, x):
    at_data = pl.BlockSpec((4, 8), lambda i, perm: (perm[i], 0))
    in_order = pl.BlockSpec((4, 8), lambda i, perm: (i, 0))
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(perm.shape[0],),
        in_specs=[in_order if out_from_data else at_data],
        out_specs=at_data if out_from_data else in_order)
    return pl.pallas_call(kernel, grid_spec=spec,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(perm, x)
  return call


def test_output_blocks_at_data_positions_loop_the_grid():
  perm = jnp.asarray(np.random.default_rng(0).permutation(4), jnp.int32)
  x = random_array((16, 8))
  call = _permuted_copy(out_from_data=True)
  plan = _plan(call, perm, x)
  assert plan.vectorized == [] and "the block positions of output 0" in plan.describe()
  expected = jnp.zeros_like(x).reshape(4, 4, 8).at[perm].set(2 * x.reshape(4, 4, 8))
  assert_close(jax.jit(call)(perm, x), expected.reshape(16, 8))


def test_input_blocks_at_data_positions_vectorize():
  perm = jnp.asarray(np.random.default_rng(1).permutation(4), jnp.int32)
  x = random_array((16, 8))
  call = _permuted_copy(out_from_data=False)
  plan = _plan(call, perm, x)
  assert plan.vectorized == [0] and plan.inputs[0].gathered
  assert_close(jax.jit(call)(perm, x), 2 * x.reshape(4, 4, 8)[perm].reshape(16, 8))


def test_aliased_input_at_data_positions_sees_earlier_writes():
  # o aliases x and program i reads x block perm[i], which another program writes: the
  # two share one buffer (docs/semantics.md, section 5), so with block positions known
  # only at run time the grid runs in order and matches JAX's TPU interpreter.
  def kernel(perm_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

  def call(perm, x, pl=pl, pltpu=pltpu, **interpret):
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(4,),
        in_specs=[pl.BlockSpec((4, 8), lambda i, perm: (perm[i], 0))],
        out_specs=pl.BlockSpec((4, 8), lambda i, perm: (i, 0)))
    return pl.pallas_call(kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct(x.shape, f32),
                          input_output_aliases={1: 0}, **interpret)(perm, x)

  from jax.experimental import pallas as jpl
  from jax.experimental.pallas import tpu as jpltpu
  perm = jnp.asarray([3, 0, 0, 2], jnp.int32)
  x = random_array((16, 8))
  plan = _plan(call, perm, x)
  assert plan.vectorized == [] and plan.shared_reads == ((0, 0),)
  theirs = call(perm, x, pl=jpl, pltpu=jpltpu, interpret=jpltpu.InterpretParams())
  assert_close(jax.jit(call)(perm, x), theirs)
  # the hardware's answer, by hand: step 1 fetches block 0 after step 0 wrote it, step 2
  # keeps that block (same position), step 3 fetches block 2 after step 2 wrote it
  x3 = x.reshape(4, 4, 8)[3]
  assert_close(theirs, jnp.concatenate([x3 + 1, x3 + 2, x3 + 2, x3 + 3]))


def test_kernel_writing_its_prefetch_loops_the_grid():
  # a counter in the prefetch ref (SMEM on a TPU) carries from step to step
  def kernel(count_ref, x_ref, o_ref):
    count_ref[0] += 1
    o_ref[...] = x_ref[...] * count_ref[0].astype(f32)

  def call(count, x):
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(4,),
        in_specs=[pl.BlockSpec((4, 8), lambda i, c: (i, 0))],
        out_specs=pl.BlockSpec((4, 8), lambda i, c: (i, 0)))
    return pl.pallas_call(kernel, grid_spec=spec,
                          out_shape=jax.ShapeDtypeStruct(x.shape, f32))(count, x)

  count, x = jnp.zeros((1,), jnp.int32), random_array((16, 8))
  plan = _plan(call, count, x)
  assert plan.vectorized == [] and "writes a scalar-prefetch ref" in plan.describe()
  steps = jnp.repeat(jnp.arange(1, 5, dtype=f32), 4)[:, None]
  assert_close(jax.jit(call)(count, x), x * steps)
