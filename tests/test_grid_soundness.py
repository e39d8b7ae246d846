"""The grid runs as if in row-major order on every backend (grid_analysis.py): axes
run in parallel only when their programs are proven independent; a declared
"parallel" axis that carries state warns and runs in order; debug output names the
read that forced the order. Each kernel is checked against a jax.numpy reference."""
from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import pytest

import pallet as pl
from pallet.core import grid_analysis
from pallet import tpu as pltpu
from helpers import assert_close, current_test_backend, pallas_call, poisoned, random_array

f32 = jnp.float32


def _line_of(fn, text: str) -> str:
  """'file:line' of the first line of `fn`'s source containing `text`."""
  lines, first = inspect.getsourcelines(fn)
  offset = next(i for i, line in enumerate(lines) if text in line)
  return f"{inspect.getsourcefile(fn)}:{first + offset}"


def _kernel_of(fn, *args):
  """The traced KernelDescription of the one pallas_call in `fn(*args)`."""
  eqns = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "pallas_call"]
  return eqns[0].params["kernel"]


# ------------------------------------------------------------------ prefix sums
def prefix_sum_kernel(x_ref, o_ref, total_ref):
  @pl.when(pl.program_id(0) == 0)
  def _():
    total_ref[...] = jnp.zeros_like(total_ref)
  total_ref[...] += jnp.cumsum(x_ref[...])
  running = total_ref[...]
  o_ref[...] = running
  total_ref[...] = jnp.full_like(running, running[-1])


def _prefix_sum(n=64, block=8, **kwargs):
  return pallas_call(prefix_sum_kernel, jax.ShapeDtypeStruct((n,), f32), grid=(n // block,),
                     in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
                     out_specs=pl.BlockSpec((block,), lambda i: (i,)),
                     scratch_shapes=[pltpu.VMEM((block,), f32)], **kwargs)


def test_blocked_prefix_sum_through_scratch_without_dimension_semantics():
  x = random_array((64,))
  assert_close(_prefix_sum()(x), jnp.cumsum(x), rtol=1e-5, atol=1e-4)


def test_prefix_sum_rows_in_parallel_columns_in_order():
  # grid (rows, column blocks): the total restarts on every row (j == 0), so rows
  # are independent and run in parallel while columns run in order.
  def kernel(x_ref, o_ref, total_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      total_ref[...] = jnp.zeros_like(total_ref)
    running = total_ref[...] + jnp.cumsum(x_ref[...], axis=1)
    o_ref[...] = running
    total_ref[...] = jnp.broadcast_to(running[:, -1:], total_ref.shape)

  x = random_array((16, 32))
  fn = pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, f32), grid=(4, 4),
                   in_specs=[pl.BlockSpec((4, 8), lambda i, j: (i, j))],
                   out_specs=pl.BlockSpec((4, 8), lambda i, j: (i, j)),
                   scratch_shapes=[pltpu.VMEM((4, 8), f32)])
  assert_close(fn(x), jnp.cumsum(x, axis=1), rtol=1e-5, atol=1e-4)
  facts = grid_analysis.analyse(_kernel_of(fn, x))
  assert facts.parallel == (0,) and facts.axes[0].independent
  (reason,) = [r for r in facts.axes[1].reasons if r.kind == "scratch"]
  assert reason.ref == "scratch 0 ('total_ref')" and reason.index == 0
  assert reason.line == _line_of(kernel, "running = total_ref[...]")


def test_state_carried_across_an_outer_axis_runs_the_whole_grid_in_order():
  # One running total over the whole grid, reset only at the very first step.
  def kernel(x_ref, o_ref, total_ref):
    @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0))
    def _():
      total_ref[0] = 0.0
    total_ref[0] += jnp.sum(x_ref[...])
    o_ref[...] = jnp.full(o_ref.shape, total_ref[0])

  x = random_array((3, 4, 8))
  fn = pallas_call(kernel, jax.ShapeDtypeStruct((3, 4, 8), f32), grid=(3, 4),
                   in_specs=[pl.BlockSpec((None, None, 8), lambda i, j: (i, j, 0))],
                   out_specs=pl.BlockSpec((None, None, 8), lambda i, j: (i, j, 0)),
                   scratch_shapes=[pltpu.SMEM((1,), f32)])
  expected = jnp.cumsum(x.sum(-1).reshape(-1)).reshape(3, 4, 1)
  assert_close(fn(x), jnp.broadcast_to(expected, x.shape), rtol=1e-5, atol=1e-4)
  assert grid_analysis.analyse(_kernel_of(fn, x)).parallel == ()


def test_scratch_used_within_each_step_keeps_axes_parallel():
  def kernel(x_ref, o_ref, tmp_ref):
    tmp_ref[...] = x_ref[...] * 2
    o_ref[...] = tmp_ref[...] + 1

  x = random_array((8, 16))
  fn = pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, f32), grid=(2, 4),
                   in_specs=[pl.BlockSpec((4, 4), lambda i, j: (i, j))],
                   out_specs=pl.BlockSpec((4, 4), lambda i, j: (i, j)),
                   scratch_shapes=[pltpu.VMEM((4, 4), f32)])
  assert_close(fn(x), x * 2 + 1)
  facts = grid_analysis.analyse(_kernel_of(fn, x))
  assert facts.parallel == (0, 1) and all(a.independent for a in facts.axes)


def test_programs_sharing_an_output_block_run_in_order_last_write_wins():
  # Programs 2b and 2b+1 both write output block b: row-major order says 2b+1 wins.
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + pl.program_id(0).astype(f32)

  x = random_array((32,))
  fn = pallas_call(kernel, jax.ShapeDtypeStruct((16,), f32), grid=(8,),
                   in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
                   out_specs=pl.BlockSpec((4,), lambda i: (i // 2,)))
  odd = x.reshape(8, 4)[1::2] + jnp.arange(1, 8, 2, dtype=f32)[:, None]
  assert_close(fn(x), odd.reshape(-1))
  (reason,) = grid_analysis.analyse(_kernel_of(fn, x)).axes[0].reasons
  assert reason.kind == "output" and reason.ref == "output 0 ('o_ref')"
  assert "steps (0,) and (1,)" in reason.detail


def test_programs_whose_element_windows_overlap_run_in_order_last_write_wins():
  # pl.Element output windows at offsets 2j + 2, three wide: neighbours along axis 1
  # share an element, so axis 1 may not run in parallel (found by tests/fuzz, blocks).
  def kernel(x_ref, buffer_ref, o_ref):
    o_ref[...] = x_ref[...] + (10 * pl.program_id(0) + pl.program_id(1)).astype(f32)

  x = random_array((4, 4, 3))
  spec = pl.BlockSpec((None, pl.Element(3)), lambda i, j: ((i + j) % 3, 2 * j + 2))
  fn = pallas_call(kernel, jax.ShapeDtypeStruct((3, 11), f32), grid=(4, 4),
                   in_specs=[pl.BlockSpec((None, None, 3), lambda i, j: (i, j, 0)), spec],
                   out_specs=spec, input_output_aliases={1: 0})
  expected = poisoned((3, 11))
  for i in range(4):
    for j in range(4):     # the row-major loop: the last write of an element wins
      expected = expected.at[(i + j) % 3, 2 * j + 2:2 * j + 5].set(x[i, j] + 10 * i + j)
  assert_close(fn(x, poisoned((3, 11))), expected)
  axis = grid_analysis.analyse(_kernel_of(fn, x, poisoned((3, 11)))).axes[1]
  assert not axis.parallel
  assert "overlap" in axis.reasons[0].detail


# ------------------------------------------------------------------ declared "parallel"
def test_declared_parallel_axis_that_carries_scratch_warns_and_runs_in_order():
  fn = _prefix_sum(compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))
  x = random_array((64,))
  with pytest.warns(grid_analysis.GridOrderWarning) as record:
    out = fn(x)
  assert_close(out, jnp.cumsum(x), rtol=1e-5, atol=1e-4)
  (w,) = record
  message = str(w.message)
  for part in ("kernel 'prefix_sum_kernel'", "grid axis 0", "scratch 0 ('total_ref')",
               _line_of(prefix_sum_kernel, "total_ref[...] += ")):
    assert part in message, (part, message)
  assert pl.GridOrderWarning is grid_analysis.GridOrderWarning


def test_the_warning_comes_once_per_kernel():
  fn = _prefix_sum(n=32, compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel",)))
  x = random_array((32,))
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    fn(x)
    fn(x + 1)
    jax.jit(fn)(x)
  assert len([w for w in record if w.category is grid_analysis.GridOrderWarning]) == 1


def test_declared_parallel_reduction_axis_sharing_an_output_block_warns():
  # The user says every axis is parallel, but programs along k accumulate into the
  # same output block: pallet warns and runs k in order.
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += x_ref[...]

  x = random_array((8, 32))
  fn = pallas_call(kernel, jax.ShapeDtypeStruct((8, 8), f32), grid=(2, 4),
                   in_specs=[pl.BlockSpec((4, 8), lambda i, k: (i, k))],
                   out_specs=pl.BlockSpec((4, 8), lambda i, k: (i, 0)),
                   compiler_params=pltpu.CompilerParams(
                       dimension_semantics=("parallel", "parallel")))
  with pytest.warns(grid_analysis.GridOrderWarning, match="grid axis 1") as record:
    out = fn(x)
  assert_close(out, x.reshape(8, 4, 8).sum(1), rtol=1e-5, atol=1e-5)
  message = str(record[0].message)
  assert "output 0 ('o_ref')" in message and "differ along axis 1" in message
  assert _line_of(kernel, "o_ref[...] = jnp.zeros_like") in message


def test_well_declared_scratch_reduction_does_not_warn():
  # The usual TPU pattern: parallel rows, "arbitrary" reduction axis, scratch zeroed
  # at k == 0 and stored at the last k.
  def kernel(x_ref, o_ref, acc_ref):
    k = pl.program_id(1)

    @pl.when(k == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += x_ref[...]

    @pl.when(k == pl.num_programs(1) - 1)
    def _():
      o_ref[...] = acc_ref[...]

  x = random_array((8, 32))
  for semantics in (("parallel", "arbitrary"), None):
    params = semantics and pltpu.CompilerParams(dimension_semantics=semantics)
    fn = pallas_call(kernel, jax.ShapeDtypeStruct((8, 8), f32), grid=(2, 4),
                     in_specs=[pl.BlockSpec((4, 8), lambda i, k: (i, k))],
                     out_specs=pl.BlockSpec((4, 8), lambda i, k: (i, 0)),
                     scratch_shapes=[pltpu.VMEM((4, 8), f32)], compiler_params=params)
    with warnings.catch_warnings():
      warnings.simplefilter("error", grid_analysis.GridOrderWarning)
      out = fn(x)
    assert_close(out, x.reshape(8, 4, 8).sum(1), rtol=1e-5, atol=1e-5)
    facts = grid_analysis.analyse(_kernel_of(fn, x))
    assert facts.parallel == (0,) and facts.axes[0].independent


def test_atomics_into_a_shared_block_of_a_declared_parallel_axis_do_not_warn():
  # Atomics are how parallel programs combine results without an order.
  def kernel(x_ref, zeros_ref, o_ref):
    pl.atomic_add(o_ref, pl.ds(0, 4), x_ref[...])

  x = random_array((32,), jnp.int32)
  fn = pallas_call(kernel, jax.ShapeDtypeStruct((4,), jnp.int32), grid=(8,),
                   in_specs=[pl.BlockSpec((4,), lambda i: (i,)), pl.BlockSpec((4,), lambda i: (0,))],
                   out_specs=pl.BlockSpec((4,), lambda i: (0,)),
                   input_output_aliases={1: 0},
                   compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))
  fn = lambda x, fn=fn: fn(x, jnp.zeros((4,), jnp.int32))
  with warnings.catch_warnings():
    warnings.simplefilter("error", grid_analysis.GridOrderWarning)
    out = fn(x)
  assert_close(out, x.reshape(8, 4).sum(0))
  (reason,) = grid_analysis.analyse(_kernel_of(fn, x)).axes[0].reasons
  assert reason.kind == "output" and not reason.certain and "atomics" in reason.detail


def test_a_carry_that_only_data_decides_keeps_a_declaration():
  # Whether the scratch is reset depends on data: no proof either way, so a
  # "parallel" declaration stands (no warning); inferred, the axis runs in order.
  def kernel(flag_ref, x_ref, o_ref, acc_ref):
    @pl.when(flag_ref[0] > 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += x_ref[...]
    o_ref[...] = acc_ref[...]

  def call(semantics):
    return pallas_call(kernel, jax.ShapeDtypeStruct((16,), f32), grid=(4,),
                       in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                                 pl.BlockSpec((4,), lambda i: (i,))],
                       out_specs=pl.BlockSpec((4,), lambda i: (i,)),
                       scratch_shapes=[pltpu.VMEM((4,), f32)],
                       compiler_params=pltpu.CompilerParams(dimension_semantics=semantics))

  flag, x = jnp.ones((1,), jnp.int32), random_array((16,))
  with warnings.catch_warnings():
    warnings.simplefilter("error", grid_analysis.GridOrderWarning)
    assert_close(call(("parallel",))(flag, x), x)
  facts = grid_analysis.analyse(_kernel_of(call(None), flag, x))
  assert facts.parallel == () and not facts.axes[0].reasons[0].certain
  assert_close(call(None)(flag, x), x)


# ------------------------------------------------------------------ debug output
@pytest.mark.cpu_only
def test_debug_names_the_read_that_forced_in_order_execution(capsys):
  x = random_array((64,))
  assert_close(_prefix_sum(debug=True)(x), jnp.cumsum(x), rtol=1e-5, atol=1e-4)
  out = capsys.readouterr().out
  plan = out[out.index("--- pallet xla plan"):]
  assert "axis 0 runs in order: scratch 0 ('total_ref') is read at step (1,)" in plan
  assert _line_of(prefix_sum_kernel, "total_ref[...] += ") in plan


def test_triton_source_loops_over_an_axis_that_carries_state():
  pytest.importorskip("triton")
  from pallet.backends.triton import source
  x = random_array((64,))
  fn = pl.pallas_call(prefix_sum_kernel, jax.ShapeDtypeStruct((64,), f32), grid=(8,),
                      in_specs=[pl.BlockSpec((8,), lambda i: (i,))],
                      out_specs=pl.BlockSpec((8,), lambda i: (i,)),
                      scratch_shapes=[pltpu.VMEM((8,), f32)], backend="triton")
  src = source(fn, x)
  assert "for i0 in range(8):  # grid axis 0 (sequential)" in src
  assert "scratch 0 ('total_ref') is read at step (1,)" in src


def test_poisoned_output_of_an_in_order_axis_is_fully_written():
  # The in-order run must still write every block: alias the output to NaNs.
  def kernel(x_ref, buf_ref, o_ref, total_ref):
    prefix_sum_kernel(x_ref, o_ref, total_ref)

  x = random_array((40,))
  out = pallas_call(kernel, jax.ShapeDtypeStruct((40,), f32), grid=(5,),
                    in_specs=[pl.BlockSpec((8,), lambda i: (i,))] * 2,
                    out_specs=pl.BlockSpec((8,), lambda i: (i,)),
                    scratch_shapes=[pltpu.VMEM((8,), f32)],
                    input_output_aliases={1: 0})(x, poisoned((40,)))
  assert_close(out, jnp.cumsum(x), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_output_block_ids_are_those_of_sorting_whole_rows(seed):
  # the shared-output check labels each step's block by its rank among the distinct
  # blocks; one integer key per row must give NumPy's labels exactly
  import numpy as np
  rng = np.random.default_rng(seed)
  n, k = int(rng.integers(1, 400)), int(rng.integers(1, 4))
  scale = 10 ** int(rng.integers(1, 18))
  rows = rng.integers(-scale, scale, (n, k)) if seed % 2 else rng.integers(0, 4, (n, k))
  want = np.unique(rows, axis=0, return_inverse=True)[1].reshape(-1)
  np.testing.assert_array_equal(grid_analysis._row_ids(rows), want)
  wide = np.array([[2 ** 62, 0], [-2 ** 62, 1], [2 ** 62, 0]], np.int64)   # keys too wide
  np.testing.assert_array_equal(grid_analysis._row_ids(wide),
                                np.unique(wide, axis=0, return_inverse=True)[1].reshape(-1))
