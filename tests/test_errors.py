"""Errors are part of the interface: each names the kernel, the argument at fault and
what was expected."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import pallet as pl
import pallet.tpu as pltpu
from helpers import pallas_call, random_array, sds

f32 = jnp.float32


def copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


def _raises(exc, *fragments):
  """pytest.raises matching every fragment (literal text) in order."""
  return pytest.raises(exc, match=".*".join(re.escape(f) for f in fragments))


X = random_array((8, 4))


def test_block_rank_differs_from_array_rank():
  with _raises(pl.PalletError, "copy_kernel", "in_specs[0]", "x_ref", "(4,)", "rank 1",
               "(8, 4)", "rank 2"):
    pallas_call(copy_kernel, out_shape=sds(X), grid=(2,),
                in_specs=[pl.BlockSpec((4,), lambda i: (i,))])(X)


def test_index_map_arity_differs_from_grid_rank():
  with _raises(pl.PalletError, "copy_kernel", "in_specs[0]", "x_ref", "index_map takes 2",
               "(2,)", "must take 1"):
    pallas_call(copy_kernel, out_shape=sds(X), grid=(2,),
                in_specs=[pl.BlockSpec((4, 4), lambda i, j: (i, 0))])(X)


def test_index_map_arity_error_mentions_scalar_prefetch():
  def prefetch_kernel(s_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...]

  with _raises(pl.PalletError, "prefetch_kernel", "out_specs[0]", "index_map takes 1",
               "scalar-prefetch", "must take 2"):
    pallas_call(prefetch_kernel, out_shape=sds(X),
                grid_spec=pltpu.PrefetchScalarGridSpec(
                    num_scalar_prefetch=1, grid=(2,),
                    in_specs=[pl.BlockSpec((4, 4), lambda i, s: (i, 0))],
                    out_specs=pl.BlockSpec((4, 4), lambda i: (i, 0))))(
                        jnp.zeros((2,), jnp.int32), X)


def test_index_map_returns_wrong_number_of_indices():
  with _raises(pl.PalletError, "copy_kernel", "out_specs[0]", "o_ref", "returned 1 indices",
               "rank 2"):
    pallas_call(copy_kernel, out_shape=sds(X), grid=(2,),
                in_specs=[pl.BlockSpec((4, 4), lambda i: (i, 0))],
                out_specs=pl.BlockSpec((4, 4), lambda i: (i,)))(X)


def test_index_map_returns_non_integer():
  with _raises(pl.PalletError, "copy_kernel", "in_specs[0]", "index_map result 0",
               "integer scalar", "float32"):
    pallas_call(copy_kernel, out_shape=sds(X), grid=(2,),
                in_specs=[pl.BlockSpec((4, 4), lambda i: (i * 1.0, 0))])(X)


@pytest.mark.parametrize("bad", [4.0, "4", (4,)])
def test_non_integer_block_shape(bad):
  with _raises(pl.PalletError, "copy_kernel", "in_specs[0]", "x_ref",
               "block_shape entries must be static ints", repr(bad)):
    pallas_call(copy_kernel, out_shape=sds(X), grid=(2,),
                in_specs=[pl.BlockSpec((bad, 4), lambda i: (i, 0))])(X)


def test_non_positive_block_size():
  with _raises(pl.PalletError, "copy_kernel", "in_specs[0]", "positive", "0"):
    pallas_call(copy_kernel, out_shape=sds(X), grid=(2,),
                in_specs=[pl.BlockSpec((0, 4), lambda i: (i, 0))])(X)


def test_out_shape_and_out_specs_structure_mismatch():
  with _raises(pl.PalletError, "copy_kernel", "out_specs", "structure", "out_shape"):
    pallas_call(copy_kernel, out_shape=sds(X), grid=(2,),
                out_specs=[pl.BlockSpec((4, 4), lambda i: (i, 0))] * 2)(X)


def test_in_specs_and_inputs_structure_mismatch():
  with _raises(pl.PalletError, "copy_kernel", "in_specs", "structure", "inputs"):
    pallas_call(copy_kernel, out_shape=sds(X),
                in_specs=[pl.BlockSpec((8, 4)), pl.BlockSpec((8, 4))])(X)


def test_unknown_memory_space():
  with _raises(pl.PalletError, "copy_kernel", "in_specs[0]", "x_ref",
               "unknown memory space 'vmem'", "VMEM"):
    pallas_call(copy_kernel, out_shape=sds(X),
                in_specs=[pl.BlockSpec(memory_space="vmem")])(X)


@pytest.mark.parametrize("kernel,n_params", [
    (lambda a, b, c: None, 3), (lambda a: None, 1)])
def test_kernel_with_wrong_number_of_parameters(kernel, n_params):
  with _raises(pl.PalletError, "<lambda>", f"takes {n_params} positional parameters",
               "passes 2 refs", "1 inputs", "1 outputs"):
    pallas_call(kernel, out_shape=sds(X))(X)


def test_kernel_parameter_count_includes_scratch():
  def two_param_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  with _raises(pl.PalletError, "two_param_kernel", "passes 3 refs", "1 scratch"):
    pallas_call(two_param_kernel, out_shape=sds(X),
                scratch_shapes=[pltpu.VMEM((8, 4), f32)])(X)


def test_unknown_backend_name():
  with _raises(ValueError, "unknown pallet backend 'tpu'", "xla", "triton"):
    pl.pallas_call(copy_kernel, out_shape=sds(X), backend="tpu")(X)


def test_unknown_backend_error_names_the_kernel():
  with _raises(ValueError, "copy_kernel", "unknown pallet backend 'tpu'"):
    pl.pallas_call(copy_kernel, out_shape=sds(X), backend="tpu")(X)


@pytest.mark.parametrize("fn", [lambda: pl.program_id(0), lambda: pl.num_programs(0)])
def test_program_id_outside_a_kernel(fn):
  with pytest.raises(RuntimeError, match="only be called inside a kernel"):
    fn()


def test_program_id_axis_outside_the_grid():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * pl.program_id(2)

  with _raises(ValueError, "program_id(2)", "(2,)", "1 axes"):
    pallas_call(kernel, out_shape=sds(X), grid=(2,))(X)


def test_kernel_closing_over_a_traced_value():
  @jax.jit
  def f(x, y):
    def closing_kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] + y
    return pallas_call(closing_kernel, out_shape=sds(x))(x)

  with _raises(pl.PalletError, "closing_kernel", "closes over a traced",
               "pass it to pallas_call as an input"):
    f(X, jnp.float32(1.0))


def test_input_output_aliases_shape_mismatch():
  with _raises(pl.PalletError, "copy_kernel", "input_output_aliases 0: 0", "float32[8,4]",
               "float32[4,4]", "must match"):
    pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct((4, 4), f32),
                input_output_aliases={0: 0})(X)


def test_input_output_aliases_dtype_mismatch():
  with _raises(pl.PalletError, "copy_kernel", "input_output_aliases", "int32[8,4]",
               "must match"):
    pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct((8, 4), jnp.int32),
                input_output_aliases={0: 0})(X)


def test_input_output_aliases_out_of_range():
  with _raises(pl.PalletError, "copy_kernel", "input_output_aliases", "3: 0",
               "out of range", "1 inputs"):
    pallas_call(copy_kernel, out_shape=sds(X), input_output_aliases={3: 0})(X)


@pytest.mark.parametrize("grid", [(2.5,), ("a",), (-1,)])
def test_bad_grid(grid):
  with _raises(pl.PalletError, "copy_kernel", "grid"):
    pallas_call(copy_kernel, out_shape=sds(X), grid=grid)


def test_dimension_semantics_wrong_length_or_value():
  for semantics in [("parallel", "parallel"), ("sideways",)]:
    with _raises(pl.PalletError, "copy_kernel", "dimension_semantics", "parallel",
                 "arbitrary", "(2,)"):
      pallas_call(copy_kernel, out_shape=sds(X), grid=(2,),
                  compiler_params=pltpu.CompilerParams(dimension_semantics=semantics))


def test_out_shape_not_a_shape():
  with _raises(pl.PalletError, "copy_kernel", "out_shape[0]", "jax.ShapeDtypeStruct", "int"):
    pallas_call(copy_kernel, out_shape=(8, 4))(X)


def test_input_not_an_array():
  with _raises(pl.PalletError, "copy_kernel", "input 0", "array", "str"):
    pallas_call(copy_kernel, out_shape=sds(X))("abc")


def test_spec_that_is_not_a_blockspec():
  with _raises(pl.PalletError, "copy_kernel", "expected a pl.BlockSpec", "str"):
    pallas_call(copy_kernel, out_shape=sds(X), in_specs=["whole"])(X)


def test_kernel_returning_a_value():
  def returning_kernel(x_ref, o_ref):
    return x_ref[...]

  with _raises(pl.PalletError, "returning_kernel", "returned a value", "return None"):
    pallas_call(returning_kernel, out_shape=sds(X))(X)


def test_run_scoped_with_a_non_shape():
  def kernel(x_ref, o_ref):
    pl.run_scoped(lambda s: None, (4,))

  with _raises(TypeError, "run_scoped", "scratch shapes", "(4,)"):
    pallas_call(kernel, out_shape=sds(X))(X)


def test_dimension_semantics_passed_directly_is_a_type_error():
  with pytest.raises(TypeError, match="dimension_semantics"):
    pl.pallas_call(copy_kernel, out_shape=sds(X), dimension_semantics=("parallel",))
