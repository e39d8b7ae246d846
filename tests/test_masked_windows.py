"""Triton-style masked loads and stores of one rectangular window (`x_ref.at[pl.ds(i, n),
:]` with a mask) discharge to slices of the ref, not to a gather of every element at
computed offsets; windows that overhang the ref read 0 there and drop those writes,
as before. Checked against jax.numpy on random inputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallet as pl
import pallet.triton as plgpu
from helpers import assert_close, random_array, sds
from pallet.backends.xla import body_analysis

f32 = jnp.float32
pytestmark = pytest.mark.cpu_only


def _kernel_of(fn, *args):
  eqns = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "pallas_call"]
  return eqns[0].params["kernel"]


def _binds(jaxpr, name):
  return any(e.primitive.name == name or any(_binds(s, name) for s in
                                             body_analysis._nested_jaxprs(e))
             for e in jaxpr.eqns)


def _shifted_rows(x, shift, width):
  """Program i loads rows [8i + shift, 8i + shift + 8) of x, lanes [2, 10) of which the
  first `width` are unmasked, and stores them doubled into the same window of o."""
  rows, cols = x.shape

  def kernel(s_ref, x_ref, o_ref):
    start = pl.program_id(0) * 8 + s_ref[0]
    lanes = (jnp.arange(8) < width)[None, :]
    window = (pl.ds(start, 8), pl.ds(2, 8))
    v = plgpu.load(x_ref.at[window], mask=lanes, other=-1.0)
    plgpu.store(o_ref.at[window], 2.0 * v, mask=lanes)

  return pl.pallas_call(
      kernel, out_shape=sds(x), grid=(rows // 8,),
      in_specs=[pl.BlockSpec((1,), lambda i: (0,)), pl.BlockSpec((rows, cols), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((rows, cols), lambda i: (0, 0)),
      input_output_aliases={1: 0})(jnp.array([shift], jnp.int32), x)


def _shifted_rows_reference(x, shift, width):
  """Rows inside some window doubled (the windows do not overlap), the rest kept."""
  rows = x.shape[0]
  covered = (jnp.arange(rows) >= shift) & (jnp.arange(rows) < rows // 8 * 8 + shift)
  lanes = (jnp.arange(x.shape[1]) >= 2) & (jnp.arange(x.shape[1]) < 2 + width)
  return jnp.where(covered[:, None] & lanes[None, :], 2.0 * x, x)


@pytest.mark.parametrize("shift", [0, 3, -5])
def test_masked_window_loads_and_stores_match_jnp(shift):
  # shift 3 and -5 make the first or last window overhang the rows
  x = random_array((32, 12))
  fn = lambda x: _shifted_rows(x, shift, 6)
  kernel = _kernel_of(fn, x)
  pure = body_analysis.discharged(kernel).jaxpr
  assert not _binds(pure, "gather") and not _binds(pure, "scatter")
  assert_close(fn(x), _shifted_rows_reference(x, shift, 6))


def test_masked_window_loads_fill_masked_lanes_with_other():
  def kernel(x_ref, o_ref):
    lanes = (jnp.arange(8) < 5)[None, :]
    o_ref[...] = plgpu.load(x_ref.at[pl.ds(pl.program_id(0) * 4, 4), pl.ds(0, 8)],
                            mask=lanes, other=7.0)
  x = random_array((16, 8))
  out = pl.pallas_call(kernel, out_shape=sds(x), grid=(4,),
                       in_specs=[pl.BlockSpec((16, 8), lambda i: (0, 0))],
                       out_specs=pl.BlockSpec((4, 8), lambda i: (i, 0)))(x)
  assert_close(out, jnp.where(jnp.arange(8)[None, :] < 5, x, 7.0))


def test_window_with_a_scalar_index_drops_that_dimension():
  def kernel(x_ref, o_ref):
    row = pl.program_id(0)
    o_ref[...] = plgpu.load(x_ref.at[row, pl.ds(2, 4)], mask=jnp.arange(4) < 3)[None]
  x = random_array((6, 8))
  out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((6, 4), f32), grid=(6,),
                       in_specs=[pl.BlockSpec((6, 8), lambda i: (0, 0))],
                       out_specs=pl.BlockSpec((1, 4), lambda i: (i, 0)))(x)
  assert_close(out, jnp.where(jnp.arange(4) < 3, x[:, 2:6], 0.0))
