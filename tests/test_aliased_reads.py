"""Blocked inputs aliased to outputs share their buffer (backends/xla/aliased_reads.py):
a step reads what earlier steps wrote back, as on a TPU. JAX's TPU interpreter is the
oracle, on random grids and index maps, including the cases where the result depends on
residency (a block still resident, an input block not fetched again)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings, strategies as st

import pallet as pl
import pallet.tpu as pltpu
from helpers import assert_close, current_test_backend, random_array

pytestmark = pytest.mark.skipif(current_test_backend() != "xla",
                                reason="the XLA backend's plans for aliased operands")

R, B, D = 6, 8, 128   # blocks of the aliased array, rows per block, lanes

# index maps over a (2, 3) grid to one of R blocks
MAPS = [lambda i, j: (i * 3 + j) % R, lambda i, j: j, lambda i, j: (i + 2 * j) % R,
        lambda i, j: R - 1 - j, lambda i, j: 0, lambda i, j: (j + 1) % 3 + 3 * i,
        lambda i, j: (4 * i + j) % R]


def _call(pl, pltpu, in_map, out_map, interpret):
  def kernel(acc_ref, x_ref, o_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    o_ref[...] = acc_ref[...] * 0.5 + x_ref[...] + (i * 3 + j).astype(jnp.float32)

  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((R * B, D), jnp.float32), grid=(2, 3),
      in_specs=[pl.BlockSpec((B, D), lambda i, j: (in_map(i, j), 0)),
                pl.BlockSpec((None, None, B, D), lambda i, j: (i, j, 0, 0))],
      out_specs=pl.BlockSpec((B, D), lambda i, j: (out_map(i, j), 0)),
      input_output_aliases={0: 0}, interpret=interpret,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")))


@settings(max_examples=20, deadline=None)
@given(st.integers(0, len(MAPS) - 1), st.integers(0, len(MAPS) - 1), st.integers(0, 2**16))
def test_aliased_reads_match_jax_tpu_interpreter(in_map, out_map, seed):
  from jax.experimental import pallas as jpl
  from jax.experimental.pallas import tpu as jpltpu
  acc, x = random_array((R * B, D), seed=seed), random_array((2, 3, B, D), seed=seed + 1)
  theirs = _call(jpl, jpltpu, MAPS[in_map], MAPS[out_map], jpltpu.InterpretParams())(acc, x)
  ours = jax.jit(_call(pl, pltpu, MAPS[in_map], MAPS[out_map], False))(acc, x)
  assert_close(ours, theirs)


def test_heads_accumulating_through_the_alias():
  """Splash attention's pattern: each head adds to the blocks the head before wrote."""
  acc, x = random_array((R * B, D)), random_array((2, 3, B, D))
  out = _call(pl, pltpu, MAPS[1], MAPS[1], False)(acc, x)
  ids = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
  first = acc[:3 * B].reshape(3, B, D) * 0.5 + x[0] + ids[0][:, None, None]
  second = first * 0.5 + x[1] + ids[1][:, None, None]
  assert_close(out[:3 * B], second.reshape(3 * B, D))
  assert_close(out[3 * B:], acc[3 * B:])


def test_plan_says_why_it_loops():
  acc, x = random_array((R * B, D)), random_array((2, 3, B, D))
  kernel = jax.make_jaxpr(_call(pl, pltpu, MAPS[1], MAPS[1], False))(acc, x)
  description = kernel.jaxpr.eqns[0].params["kernel"]
  from pallet.backends.xla.plan import make_plan
  plan = make_plan(description)
  assert plan.shared_reads == ((0, 0),) and plan.vectorized == []
  assert "share one buffer" in plan.describe()
  # an in-place update that never reads an earlier step's block keeps its plan
  same = jax.make_jaxpr(_call(pl, pltpu, MAPS[0], MAPS[0], False))(acc, x)
  assert make_plan(same.jaxpr.eqns[0].params["kernel"]).shared_reads == ()


def test_blocks_of_different_shapes_match_jax_tpu_interpreter():
  """Input blocks of 16 rows over output blocks of 8: overlaps compared pairwise."""
  from jax.experimental import pallas as jpl
  from jax.experimental.pallas import tpu as jpltpu

  def call(pl, pltpu, **interpret):
    def kernel(acc_ref, o_ref):
      o_ref[...] = acc_ref[pl.ds(0, 8), :] * 0.5 + pl.program_id(0).astype(jnp.float32)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((64, 128), jnp.float32), grid=(6,),
        in_specs=[pl.BlockSpec((16, 128), lambda i: ((i + 1) % 4, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), input_output_aliases={0: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)), **interpret)

  x = random_array((64, 128))
  from pallet.backends.xla.plan import make_plan
  kernel = jax.make_jaxpr(call(pl, pltpu))(x).jaxpr.eqns[0].params["kernel"]
  assert make_plan(kernel).shared_reads == ((0, 0),)
  assert_close(call(pl, pltpu)(x), call(jpl, jpltpu, interpret=jpltpu.InterpretParams())(x))
