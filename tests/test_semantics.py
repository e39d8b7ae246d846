"""The execution semantics written down in docs/semantics.md, one test (or more) each."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
import pallet.tpu as pltpu
from helpers import (assert_close, current_test_backend, pallas_call, poisoned, random_array,
                     sds)

f32 = jnp.float32
i32 = jnp.int32


def _kernel_description(fn, *args):
  """The KernelDescription bound by the (single) pallas_call in fn."""
  eqns = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "pallas_call"]
  assert len(eqns) == 1
  return eqns[0].params["kernel"]


def _plan(fn, *args):
  from pallet.backends.xla import plan_of
  return plan_of(_kernel_description(fn, *args))


# ------------------------------------------------------------ grid order
def test_sequential_grid_runs_in_row_major_order():
  # The output never moves, so both axes are sequential; a scratch counter numbers
  # the programs in the order they run.
  grid = (3, 4)

  def kernel(o_ref, counter_ref):
    @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0))
    def _():
      counter_ref[0] = 0
    o_ref[pl.program_id(0), pl.program_id(1)] = counter_ref[0]
    counter_ref[0] += 1

  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(grid, i32), grid=grid,
                    scratch_shapes=[pltpu.SMEM((1,), i32)])()
  np.testing.assert_array_equal(out, np.arange(12).reshape(grid))


def test_arbitrary_dimension_semantics_force_row_major_order_of_moving_blocks():
  # Output blocks move along both axes (parallel by default); declaring them
  # "arbitrary" makes the scratch counter see the row-major order.
  grid = (2, 3)

  def kernel(o_ref, counter_ref):
    @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0))
    def _():
      counter_ref[0] = 0
    o_ref[...] = jnp.full(o_ref.shape, counter_ref[0], i32)
    counter_ref[0] += 1

  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4, 6), i32), grid=grid,
                    out_specs=pl.BlockSpec((2, 2), lambda i, j: (i, j)),
                    scratch_shapes=[pltpu.SMEM((1,), i32)],
                    compiler_params=pltpu.CompilerParams(
                        dimension_semantics=("arbitrary", "arbitrary")))()
  expected = np.kron(np.arange(6).reshape(grid), np.ones((2, 2), int))
  np.testing.assert_array_equal(out, expected)


# ------------------------------------------------------------ index maps
@pytest.mark.parametrize("index_map,source", [
    (lambda i: (3 - i,), lambda x: x.reshape(4, 4)[::-1].reshape(-1)),
    (lambda i: (2,), lambda x: jnp.tile(x[8:12], 4)),
])
def test_index_map_returns_block_indices(index_map, source):
  x = random_array((16,))
  out = pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                    out_shape=sds(x), grid=(4,),
                    in_specs=[pl.BlockSpec((4,), index_map)],
                    out_specs=pl.BlockSpec((4,), lambda i: (i,)))(x)
  assert_close(out, source(x))


def test_element_dims_take_element_offsets():
  x = random_array((20,))
  out = pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                    out_shape=jax.ShapeDtypeStruct((12,), f32), grid=(4,),
                    in_specs=[pl.BlockSpec((pl.Element(3),), lambda i: (5 * i,))],
                    out_specs=pl.BlockSpec((3,), lambda i: (i,)))(x)
  assert_close(out, jnp.concatenate([x[5 * i:5 * i + 3] for i in range(4)]))


def test_transposed_2d_grid_index_map():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...].T

  x = random_array((12, 8))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 12), f32), grid=(3, 2),
                    in_specs=[pl.BlockSpec((4, 4), lambda i, j: (i, j))],
                    out_specs=pl.BlockSpec((4, 4), lambda i, j: (j, i)))(x)
  assert_close(out, x.T)


# ------------------------------------------------------------ overhanging blocks
@pytest.mark.parametrize("shape,block", [((10, 10), (4, 4)), ((7,), (3,)), ((5, 9), (8, 2)),
                                         ((13, 6), (5, 6))])
def test_blocks_overhanging_the_edge_compute_every_in_range_element(shape, block):
  grid = tuple(pl.cdiv(n, b) for n, b in zip(shape, block))
  index_map = lambda *ids: ids
  x = random_array(shape)
  spec = pl.BlockSpec(block, index_map)
  out = pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., jnp.sin(x_ref[...]) * 2),
                    out_shape=sds(x), grid=grid, in_specs=[spec], out_specs=spec)(x)
  assert_close(out, jnp.sin(x) * 2)


def test_overhanging_writes_are_dropped_not_wrapped():
  # Aliased poisoned buffer of 10 rows; blocks of 4 rows over grid 3 cover rows
  # 0..11. Rows 10, 11 do not exist; writes there must not land anywhere else.
  x = random_array((10, 3))

  def kernel(x_ref, buf_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

  spec = pl.BlockSpec((4, 3), lambda i: (i, 0))
  out = pallas_call(kernel, out_shape=sds(x), grid=(3,), in_specs=[spec, spec],
                    out_specs=spec, input_output_aliases={1: 0})(x, poisoned(x.shape))
  assert_close(out, x + 1)


@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype, pad", [(jnp.float32, np.nan), (jnp.int32, np.iinfo(np.int32).min)])
@pytest.mark.parametrize("how", ["interpret", "poison_switch", "jax_flag"])
def test_reads_past_the_edge_are_poisoned_in_interpret_mode(dtype, pad, how):
  # As in Pallas's interpreter: a block read past its array's edge holds NaN (the
  # integer minimum), so a kernel that lets it into a result shows it.
  x = random_array((5,), dtype)

  def copy(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  call = dict(out_shape=jax.ShapeDtypeStruct((8,), dtype), grid=(1,),
              in_specs=[pl.BlockSpec((8,), lambda i: (0,))])
  if how == "interpret":
    out = pl.pallas_call(copy, interpret=True, **call)(x)
  elif how == "poison_switch":
    with pl.enable_poison_buffers(True):
      out = pl.pallas_call(copy, **call)(x)
  else:   # JAX's own flag, as Pallas code sets it, turns pallet's poisoning on too
    jax.config.update("jax_pallas_poison_buffers", True)
    try:
      out = pl.pallas_call(copy, **call)(x)
    finally:
      jax.config.update("jax_pallas_poison_buffers", False)
  expected = jnp.concatenate([x, jnp.full((3,), pad, dtype)])
  np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


@pytest.mark.cpu_only
def test_unmasked_reduction_over_the_edge_shows_in_interpret_mode():
  # A matmul whose K blocks overhang K and are not masked reads padding into every
  # result: NaN under interpret=True (as in Pallas); masked, the result is right.
  x, y = random_array((16, 20)), random_array((20, 16))

  def matmul(masked):
    def kernel(x_ref, y_ref, o_ref):
      k = pl.program_id(0)
      @pl.when(k == 0)
      def _():
        o_ref[...] = jnp.zeros_like(o_ref)
      a, b = x_ref[...], y_ref[...]
      if masked:
        valid = k * 8 + jnp.arange(8) < 20
        a, b = jnp.where(valid[None, :], a, 0.0), jnp.where(valid[:, None], b, 0.0)
      o_ref[...] += jnp.dot(a, b, preferred_element_type=f32)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), f32), grid=(3,),
                          in_specs=[pl.BlockSpec((16, 8), lambda k: (0, k)),
                                    pl.BlockSpec((8, 16), lambda k: (k, 0))],
                          out_specs=pl.BlockSpec((16, 16), lambda k: (0, 0)), interpret=True)
  assert np.isnan(np.asarray(matmul(False)(x, y))).all()
  assert_close(matmul(True)(x, y), x @ y, matmul=True)


@pytest.mark.cpu_only
def test_unwritten_outputs_are_poisoned_in_interpret_mode():
  x = random_array((4, 8))

  def kernel(x_ref, o_ref):
    o_ref[:2] = x_ref[:2] * 2.0
  out = pl.pallas_call(kernel, out_shape=sds(x), interpret=True)(x)
  assert_close(out[:2], x[:2] * 2.0)
  assert np.isnan(np.asarray(out[2:])).all()


def test_overhanging_reduction_masks_out_of_range_reads():
  # Reads past the edge are unspecified: a correct kernel masks them.
  n, block = 11, 4

  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.zeros(o_ref.shape, f32)
    pos = pl.program_id(0) * block + jnp.arange(block)
    o_ref[...] += jnp.sum(jnp.where(pos < n, x_ref[...], 0.0), keepdims=True)

  x = random_array((n,))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1,), f32),
                    grid=(pl.cdiv(n, block),),
                    in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
                    out_specs=pl.BlockSpec((1,), lambda i: (0,)))(x)
  assert_close(out, x.sum(keepdims=True), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ resident outputs
def _matmul_with_k_at(position: int, x, y, bm=8, bn=8, bk=4):
  """Blocked matmul whose reduction axis k sits at grid position `position`."""
  m, kdim = x.shape
  n = y.shape[1]
  sizes = {"i": m // bm, "j": n // bn, "k": kdim // bk}
  order = ["i", "j"]
  order.insert(position, "k")
  grid = tuple(sizes[a] for a in order)

  def ids(*g):
    return dict(zip(order, g))

  def kernel(x_ref, y_ref, o_ref):
    k = pl.program_id(order.index("k"))

    @pl.when(k == 0)
    def _():
      o_ref[...] = jnp.zeros(o_ref.shape, f32)
    o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=f32)

  return pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((m, n), f32), grid=grid,
      in_specs=[pl.BlockSpec((bm, bk), lambda *g: (ids(*g)["i"], ids(*g)["k"])),
                pl.BlockSpec((bk, bn), lambda *g: (ids(*g)["k"], ids(*g)["j"]))],
      out_specs=pl.BlockSpec((bm, bn), lambda *g: (ids(*g)["i"], ids(*g)["j"])))(x, y)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_resident_output_accumulates_over_reduction_axis_anywhere_in_grid(position):
  x, y = random_array((16, 12)), random_array((12, 24))
  assert_close(_matmul_with_k_at(position, x, y), x @ y, matmul=True)


def test_resident_output_with_k_not_starting_from_zero_block():
  # The reduction visits blocks in reverse (index map n-1-k); init at k == 0 still works.
  x = random_array((4, 20))

  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      o_ref[...] = jnp.zeros(o_ref.shape, f32)
    o_ref[...] += jnp.sum(x_ref[...], axis=1, keepdims=True)

  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4, 1), f32), grid=(2, 5),
                    in_specs=[pl.BlockSpec((2, 4), lambda i, k: (i, 4 - k))],
                    out_specs=pl.BlockSpec((2, 1), lambda i, k: (i, 0)))(x)
  assert_close(out, x.sum(1, keepdims=True), rtol=1e-5, atol=1e-5)


@pytest.mark.cpu_only
def test_axis_classification_parallel_and_sequential():
  x, y = random_array((16, 12)), random_array((12, 24))
  plan = _plan(lambda x, y: _matmul_with_k_at(1, x, y), x, y)
  # k (axis 1) is a reduction: looped inside, merged into widened blocks, or vectorized and summed where the
  # backend proves the body an accumulator; i and j (axes 0, 2) are parallel.
  reduced = set(plan.inner) | set(getattr(plan, "summed", ())) | set(getattr(plan, "merged", ()))
  assert reduced == {1}
  assert {0, 2} <= set(plan.vectorized) | set(plan.outer)


@pytest.mark.cpu_only
def test_dimension_semantics_are_honoured():
  x = random_array((16, 8))
  spec = pl.BlockSpec((4, 8), lambda i: (i, 0))

  def call(semantics):
    params = None if semantics is None else pltpu.CompilerParams(
        dimension_semantics=semantics)
    return lambda x: pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1),
                                 out_shape=sds(x), grid=(4,), in_specs=[spec],
                                 out_specs=spec, compiler_params=params)(x)

  # "arbitrary" promises nothing: proven independent programs run at once, as undeclared
  assert _plan(call(None), x).vectorized == [0]
  assert _plan(call(("parallel",)), x).vectorized == [0]
  assert _plan(call(("arbitrary",)), x).vectorized == [0]
  for semantics in [("arbitrary",), ("parallel",)]:
    assert_close(call(semantics)(x), x + 1)


# ------------------------------------------------------------ aliasing
def test_input_output_aliases_keep_unwritten_regions():
  # Only the even blocks are written; the odd ones keep the aliased input's values.
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 10

  x = random_array((24, 3))
  out = pallas_call(kernel, out_shape=sds(x), grid=(3,),
                    in_specs=[pl.BlockSpec((4, 3), lambda i: (2 * i, 0))],
                    out_specs=pl.BlockSpec((4, 3), lambda i: (2 * i, 0)),
                    input_output_aliases={0: 0})(x)
  even = (jnp.arange(24) // 4 % 2 == 0)[:, None]
  assert_close(out, jnp.where(even, x * 10, x))


def test_aliased_in_place_update_with_other_inputs():
  def kernel(delta_ref, acc_ref, o_ref):
    o_ref[...] = acc_ref[...] + delta_ref[...]

  acc, delta = random_array((8,)), random_array((8,))
  out = jax.jit(lambda d, a: pallas_call(kernel, out_shape=sds(a),
                                         input_output_aliases={1: 0})(d, a))(delta, acc)
  assert_close(out, acc + delta)


def test_aliased_output_reads_the_input_values_before_writing():
  # o_ref starts as the aliased input, so `+=` updates it in place, block by block.
  def kernel(d_ref, acc_ref, o_ref):
    o_ref[...] += d_ref[...]

  acc, d = random_array((16, 4)), random_array((16, 4))
  spec = pl.BlockSpec((4, 4), lambda i: (i, 0))
  out = pallas_call(kernel, out_shape=sds(acc), grid=(4,),
                    in_specs=[spec, pl.BlockSpec(memory_space=pl.ANY)], out_specs=spec,
                    input_output_aliases={1: 0})(d, acc)
  assert_close(out, acc + d)


def test_aliased_resident_output_accumulates_onto_the_input():
  def kernel(x_ref, acc_ref, o_ref):
    o_ref[...] += jnp.sum(x_ref[...], axis=1, keepdims=True)

  x, acc = random_array((8, 12)), random_array((8, 1))
  out = pallas_call(kernel, out_shape=sds(acc), grid=(2, 3),
                    in_specs=[pl.BlockSpec((4, 4), lambda i, k: (i, k)),
                              pl.BlockSpec((4, 1), lambda i, k: (i, 0))],
                    out_specs=pl.BlockSpec((4, 1), lambda i, k: (i, 0)),
                    input_output_aliases={1: 0})(x, acc)
  assert_close(out, acc + x.sum(1, keepdims=True), rtol=1e-5, atol=1e-5)


def test_a_dma_into_an_aliased_whole_input_lands_in_the_output():
  # pl.ANY input and output aliased: one HBM buffer on a TPU, so a copy into the
  # input's ref is in the result (JAX's test_dynamic_dma_on_2nd_minor does this).
  def kernel(array_ref, data_ref, start_ref, size_ref, out_ref, sem):
    del out_ref
    pltpu.async_copy(data_ref.at[pl.ds(0, size_ref[0])],
                     array_ref.at[pl.ds(start_ref[0], size_ref[0])], sem).wait()

  array, data = random_array((64, 128)), random_array((8, 128))
  start, size = jnp.array([13], jnp.int32), jnp.array([5], jnp.int32)
  call = lambda *args: pl.pallas_call(
      kernel, out_shape=sds(array),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pltpu.VMEM),
                pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.SMEM)],
      out_specs=pl.BlockSpec(memory_space=pl.ANY), scratch_shapes=[pltpu.SemaphoreType.DMA],
      input_output_aliases={0: 0})(*args)
  expected = array.at[13:18].set(data[:5])
  assert_close(call(array, data, start, size), expected)
  assert_close(jax.jit(call)(array, data, start, size), expected)


def test_an_aliased_whole_input_and_output_are_one_ref():
  # writes through either ref are seen through the other and reach the result
  def kernel(x_ref, o_ref):
    o_ref[0:4] = x_ref[4:8] * 2.0     # the output's write ...
    x_ref[8:12] = o_ref[0:4] + 1.0    # ... read back through the input, written through it

  x = random_array((16, 8))
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  out = pallas_call(kernel, out_shape=sds(x), in_specs=[any_spec], out_specs=any_spec,
                    input_output_aliases={0: 0})(x)
  expected = x.at[0:4].set(x[4:8] * 2.0)
  assert_close(out, expected.at[8:12].set(x[4:8] * 2.0 + 1.0))


def test_aliased_blocked_operands_stay_apart():
  # a blocked input is a copy of its block (as on a TPU): writing it leaves the output
  def kernel(x_ref, o_ref):
    x_ref[...] = x_ref[...] * 100.0
    o_ref[...] = x_ref[...] + 1.0

  x = random_array((16, 8))
  spec = pl.BlockSpec((8, 8), lambda i: (i, 0))
  out = pallas_call(kernel, out_shape=sds(x), grid=(2,), in_specs=[spec], out_specs=spec,
                    input_output_aliases={0: 0})(x)
  assert_close(out, x * 100.0 + 1.0)


# ------------------------------------------------------------ scratch
def test_scratch_persists_across_grid_steps():
  # Accumulate a row-block sum in VMEM scratch over k; write it on the last step.
  def kernel(x_ref, o_ref, acc_ref):
    k = pl.program_id(1)

    @pl.when(k == 0)
    def _():
      acc_ref[...] = jnp.zeros(acc_ref.shape, f32)
    acc_ref[...] += x_ref[...]

    @pl.when(k == pl.num_programs(1) - 1)
    def _():
      o_ref[...] = acc_ref[...]

  x = random_array((8, 24))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 4), f32), grid=(2, 6),
                    in_specs=[pl.BlockSpec((4, 4), lambda i, k: (i, k))],
                    out_specs=pl.BlockSpec((4, 4), lambda i, k: (i, 0)),
                    scratch_shapes=[pltpu.VMEM((4, 4), f32)])(x)
  assert_close(out, x.reshape(8, 6, 4).sum(1), rtol=1e-5, atol=1e-5)


def test_scratch_with_reduction_axis_first():
  # grid (k, i): the sequential axis precedes the parallel one, so the run is in
  # exact row-major order and the scratch holds one partial sum per i.
  def kernel(x_ref, o_ref, acc_ref):
    k, i = pl.program_id(0), pl.program_id(1)

    @pl.when(k == 0)
    def _():
      acc_ref[i] = jnp.zeros((4,), f32)
    acc_ref[i] = acc_ref[i] + x_ref[...]
    o_ref[...] = acc_ref[i]

  x = random_array((5, 12))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((12,), f32), grid=(5, 3),
                    in_specs=[pl.BlockSpec((None, 4), lambda k, i: (k, i))],
                    out_specs=pl.BlockSpec((4,), lambda k, i: (i,)),
                    scratch_shapes=[pltpu.VMEM((3, 4), f32)])(x)
  assert_close(out, x.sum(0), rtol=1e-5, atol=1e-5)


_CARRY_SEMANTICS = [None, ("arbitrary", "arbitrary"), ("arbitrary", "parallel"),
                    ("parallel", "arbitrary"), ("parallel", "parallel")]


@pytest.mark.parametrize("semantics", _CARRY_SEMANTICS)
def test_scratch_carry_across_moving_output_blocks_under_any_semantics(semantics):
  # A running sum in scratch, zeroed only at the very first step, written to an output
  # block that moves with the grid: every axis carries the sum on, whatever is declared
  # (a carry along a "parallel" axis breaks the promise: pallet warns, runs it in order).
  def kernel(x_ref, o_ref, acc_ref):
    @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0))
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += x_ref[...]
    o_ref[...] = acc_ref[...]

  x = random_array((2, 3, 8, 128))
  spec = pl.BlockSpec((None, None, 8, 128), lambda i, j: (i, j, 0, 0))
  params = None if semantics is None else pltpu.CompilerParams(dimension_semantics=semantics)
  call = pallas_call(kernel, out_shape=sds(x), grid=(2, 3), in_specs=[spec], out_specs=spec,
                     scratch_shapes=[pltpu.VMEM((8, 128), f32)], compiler_params=params)
  if semantics is not None and "parallel" in semantics:
    with pytest.warns(pl.GridOrderWarning, match="declared \"parallel\""):
      out = call(x)
  else:
    out = call(x)
  expected = jnp.cumsum(x.reshape(6, 8, 128), axis=0).reshape(x.shape)
  assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("semantics", [None, ("arbitrary",), ("parallel",)])
def test_scratch_carry_of_the_issue_under_dimension_semantics(semantics):
  # The repro of issue 28: block 1 came out as if the carry were zero under "arbitrary".
  def kernel(x_ref, o_ref, acc):
    @pl.when(pl.program_id(0) == 0)
    def _():
      acc[...] = jnp.zeros_like(acc)
    acc[...] += x_ref[...]
    o_ref[...] = acc[...]

  x = random_array((16, 128))
  params = None if semantics is None else pltpu.CompilerParams(dimension_semantics=semantics)
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  call = pallas_call(kernel, out_shape=sds(x), grid=(2,), in_specs=[spec], out_specs=spec,
                     scratch_shapes=[pltpu.VMEM((8, 128), f32)], compiler_params=params)
  if semantics == ("parallel",):
    with pytest.warns(pl.GridOrderWarning):
      out = call(x)
  else:
    out = call(x)
    # the carry is found, so the axis runs in order whatever the declaration says
    assert _plan(call, x).inner == [0]
  assert_close(out, jnp.concatenate([x[:8], x[:8] + x[8:]]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("semantics", [None, ("arbitrary", "arbitrary"),
                                       ("parallel", "arbitrary")])
def test_scratch_accumulator_over_a_trailing_reduction_axis_under_semantics(semantics):
  # The TPU matmul form (zero at k == 0, copy out at the last k): right whichever of
  # its axes are declared in order.
  def kernel(x_ref, y_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=f32)

    @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
    def _():
      o_ref[...] = acc_ref[...] * 2

  x, y = random_array((32, 48)), random_array((48, 16))
  params = None if semantics is None else pltpu.CompilerParams(dimension_semantics=semantics)
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((32, 16), f32), grid=(4, 3),
                    in_specs=[pl.BlockSpec((8, 16), lambda i, k: (i, k)),
                              pl.BlockSpec((16, 16), lambda i, k: (k, 0))],
                    out_specs=pl.BlockSpec((8, 16), lambda i, k: (i, 0)),
                    scratch_shapes=[pltpu.VMEM((8, 16), f32)], compiler_params=params)(x, y)
  assert_close(out, 2 * (x @ y), matmul=True)


def test_scratch_shapes_accept_shape_dtype_structs():
  def kernel(x_ref, o_ref, tmp_ref):
    tmp_ref[...] = x_ref[...] * 2
    o_ref[...] = tmp_ref[...] + 1

  x = random_array((6,))
  out = pallas_call(kernel, out_shape=sds(x),
                    scratch_shapes=[jax.ShapeDtypeStruct((6,), f32)])(x)
  assert_close(out, x * 2 + 1)


def test_run_scoped_scratch():
  def kernel(x_ref, o_ref):
    def body(a_ref, b_ref):
      a_ref[...] = x_ref[...] * 2
      b_ref[...] = a_ref[...].astype(i32)
      o_ref[...] = b_ref[...] + 1
    pl.run_scoped(body, pltpu.VMEM((8,), f32), pltpu.SMEM((8,), i32))

  x = random_array((8,)) * 10
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), i32))(x)
  np.testing.assert_array_equal(out, (x * 2).astype(i32) + 1)


def test_run_scoped_returns_body_result_and_takes_keyword_scratch():
  def kernel(x_ref, o_ref):
    def body(*, tmp):
      tmp[...] = x_ref[...] + 3
      return jnp.sum(tmp[...])
    o_ref[0] = pl.run_scoped(body, tmp=pltpu.VMEM((4,), f32))

  x = random_array((4,))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1,), f32))(x)
  assert_close(out, jnp.sum(x + 3, keepdims=True), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ multiple outputs
def test_multiple_outputs_with_different_blockings():
  def kernel(x_ref, rows_ref, total_ref):
    rows_ref[...] = jnp.sum(x_ref[...], axis=1)

    @pl.when(pl.program_id(0) == 0)
    def _():
      total_ref[...] = jnp.zeros(total_ref.shape, f32)
    total_ref[...] += jnp.sum(x_ref[...])

  x = random_array((12, 5))
  rows, total = pallas_call(
      kernel, grid=(3,),
      out_shape=(jax.ShapeDtypeStruct((12,), f32), jax.ShapeDtypeStruct((), f32)),
      in_specs=[pl.BlockSpec((4, 5), lambda i: (i, 0))],
      out_specs=[pl.BlockSpec((4,), lambda i: (i,)), pl.BlockSpec((), lambda i: ())])(x)
  assert_close(rows, x.sum(1), rtol=1e-5, atol=1e-5)
  assert_close(total, x.sum(), rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------ debug, name, backend
@pytest.mark.cpu_only
def test_debug_prints_the_traced_kernel_and_the_plan(capsys):
  def my_debug_kernel(x_ref, o_ref):
    o_ref[...] = jnp.cos(x_ref[...])

  x = random_array((8, 4))
  spec = pl.BlockSpec((2, 4), lambda i: (i, 0))
  out = pl.pallas_call(my_debug_kernel, out_shape=sds(x), grid=(4,), in_specs=[spec],
                       out_specs=spec, debug=True)(x)
  assert_close(out, jnp.cos(x))
  printed = capsys.readouterr().out
  assert "my_debug_kernel" in printed
  assert "cos" in printed                        # the traced kernel jaxpr
  assert "vectorized axes" in printed            # the execution plan


def test_name_appears_in_the_jaxpr():
  x = random_array((8,))
  f = pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]), out_shape=sds(x),
                  name="my_special_kernel")
  assert "my_special_kernel" in str(jax.make_jaxpr(f)(x))


def test_default_name_is_the_kernel_function_name():
  def add_three_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 3

  x = random_array((8,))
  assert "add_three_kernel" in str(jax.make_jaxpr(pallas_call(add_three_kernel,
                                                              out_shape=sds(x)))(x))


def test_debug_print_output(capfd):
  def kernel(x_ref, o_ref):
    pl.debug_print("value is {}", x_ref[0])
    o_ref[...] = x_ref[...]

  x = jnp.array([4242, 7], i32)
  out = pallas_call(kernel, out_shape=sds(x))(x)
  jax.effects_barrier()
  np.testing.assert_array_equal(out, x)
  printed = capfd.readouterr().out
  # Triton's device_print has its own layout ("(pid) value is: [4242]"): check the text
  # and the value, not the exact punctuation, on that backend.
  expected = ("value is 4242",) if current_test_backend() == "xla" else ("value is", "4242")
  assert all(e in printed for e in expected), printed


def test_debug_print_from_every_program(capfd):
  def kernel(x_ref, o_ref):
    pl.debug_print("program {} holds {}", pl.program_id(0), x_ref[0])
    o_ref[...] = x_ref[...]

  x = jnp.array([111, 0, 222, 0, 333, 0], i32)
  spec = pl.BlockSpec((2,), lambda i: (i,))
  pallas_call(kernel, out_shape=sds(x), grid=(3,), in_specs=[spec], out_specs=spec)(x)
  jax.effects_barrier()
  printed = capfd.readouterr().out
  for v in ("111", "222", "333"):
    assert v in printed


def test_cost_estimate_and_compiler_params_are_accepted():
  x = random_array((16,))
  spec = pl.BlockSpec((8,), lambda i: (i,))
  for params in [pl.CompilerParams(num_warps=4, num_stages=2),
                 pltpu.CompilerParams(dimension_semantics=("parallel",),
                                      vmem_limit_bytes=1 << 20),
                 pltpu.TPUCompilerParams(dimension_semantics=("arbitrary",))]:
    out = pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2),
                      out_shape=sds(x), grid=(2,), in_specs=[spec], out_specs=spec,
                      compiler_params=params,
                      cost_estimate=pl.CostEstimate(flops=16, transcendentals=0,
                                                    bytes_accessed=128))(x)
    assert_close(out, x * 2)


@pytest.mark.parametrize("space", [pl.ANY, pl.MemorySpace.ANY, pltpu.VMEM, pltpu.SMEM,
                                   pltpu.HBM, pltpu.ANY, pltpu.TPUMemorySpace.VMEM,
                                   pl.MemorySpace.GMEM])
def test_memory_spaces_are_accepted_on_specs(space):
  x = random_array((8, 4))
  out = pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] - 5),
                    out_shape=sds(x), in_specs=[pl.BlockSpec(memory_space=space)],
                    out_specs=pl.BlockSpec(memory_space=space))(x)
  assert_close(out, x - 5)


# ------------------------------------------------------------ reductions that are not plain sums
_K = 4


def _reduce_rows(update, x, k_first: bool):
  """out[i] = fold of `update(o, x_block, k)` over the column blocks k of x[i]."""
  rows = x.shape[0] // 2

  def kernel(x_ref, o_ref):
    k = pl.program_id(0 if k_first else 1)
    update(o_ref, x_ref, k)

  grid = (_K, 2) if k_first else (2, _K)
  ik = (lambda k, i: (i, k)) if k_first else (lambda i, k: (i, k))
  io = (lambda k, i: (i, 0)) if k_first else (lambda i, k: (i, 0))
  return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], 3), f32), grid=grid,
                     in_specs=[pl.BlockSpec((rows, 3), ik)],
                     out_specs=pl.BlockSpec((rows, 3), io))(x)


def _running_max(o_ref, x_ref, k):
  @pl.when(k == 0)
  def _():
    o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, f32)
  o_ref[...] = jnp.maximum(o_ref[...], x_ref[...])


def _decaying_sum(o_ref, x_ref, k):
  @pl.when(k == 0)
  def _():
    o_ref[...] = jnp.zeros(o_ref.shape, f32)
  o_ref[...] = o_ref[...] * 0.5 + x_ref[...]


def _init_from_first_block(o_ref, x_ref, k):
  @pl.when(k == 0)
  def _():
    o_ref[...] = x_ref[...] * 2

  @pl.when(k > 0)
  def _():
    o_ref[...] += x_ref[...] * 2


def _sum_then_mean(o_ref, x_ref, k):
  @pl.when(k == 0)
  def _():
    o_ref[...] = jnp.zeros(o_ref.shape, f32)
  o_ref[...] += x_ref[...]
  o_ref[...] += 1.0

  @pl.when(k == _K - 1)
  def _():
    o_ref[...] = o_ref[...] / _K


def _sum_of_squares_minus_last(o_ref, x_ref, k):
  @pl.when(k == 0)
  def _():
    o_ref[...] = jnp.zeros(o_ref.shape, f32)
  o_ref[...] = o_ref[...] + x_ref[...] ** 2
  o_ref[...] = jnp.where(k == _K - 1, o_ref[...] - x_ref[...] ** 2, o_ref[...])


def _blocks(x):
  return [x[:, 3 * k:3 * k + 3] for k in range(_K)]


_REDUCTIONS = {
    "running_max": (_running_max, lambda x: jnp.max(jnp.stack(_blocks(x)), 0)),
    "decaying_sum": (_decaying_sum, lambda x: sum(b * 0.5 ** (_K - 1 - k)
                                                  for k, b in enumerate(_blocks(x)))),
    "init_from_first_block": (_init_from_first_block, lambda x: 2 * sum(_blocks(x))),
    "sum_then_mean": (_sum_then_mean, lambda x: (sum(_blocks(x)) + _K) / _K),
    "sum_of_squares_minus_last": (_sum_of_squares_minus_last,
                                  lambda x: sum(b ** 2 for b in _blocks(x)[:-1])),
}


@pytest.mark.parametrize("k_first", [False, True])
@pytest.mark.parametrize("name", sorted(_REDUCTIONS))
def test_order_sensitive_and_non_sum_reductions_over_resident_outputs(name, k_first):
  update, reference = _REDUCTIONS[name]
  x = random_array((8, 3 * _K))
  assert_close(_reduce_rows(update, x, k_first), reference(x), rtol=1e-5, atol=1e-5)
