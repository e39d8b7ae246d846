"""Errors are part of the interface: each names the kernel, the argument at fault and
what was expected."""
from __future__ import annotations

import inspect
import os
import pickle
import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
import pallet.tpu as pltpu
from helpers import assert_close, current_test_backend, pallas_call, random_array, sds

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
  # A TypeError as well (as calling the index map with the grid indices is in Pallas).
  with _raises(TypeError, "copy_kernel", "in_specs[0]", "x_ref", "index_map takes 2",
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
  # A TypeError as well (as calling the kernel with those refs is in Pallas).
  with _raises(TypeError, "<lambda>", f"takes {n_params} positional parameters",
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


def test_kernel_closing_over_a_traced_array():
  # Traced scalars and refs become operands (test_closed_over.py); an array does not,
  # as in Pallas: only a BlockSpec can say how the kernel sees it.
  @jax.jit
  def f(x, y):
    def closing_kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] + y
    return pallas_call(closing_kernel, out_shape=sds(x))(x)

  with _raises(pl.PalletError, "closing_kernel", "closes over a traced array",
               f"float32{list(X.shape)}".replace(" ", ""), "traced scalars and refs only",
               "pass the array to the call as an input"):
    f(X, X + 1.0)


def test_typed_prng_key_operand():
  # The XLA backend holds refs of typed keys; Triton cannot, and says what to pass.
  def key_kernel(key_ref, o_ref):
    o_ref[...] = jax.random.uniform(key_ref[...], o_ref.shape)

  key = jax.random.key(7)
  if current_test_backend() == "xla":
    assert_close(pallas_call(key_kernel, out_shape=sds(X))(key), jax.random.uniform(key, X.shape))
    return
  with _raises(pl.PalletError, "key_kernel", "input 0", "typed PRNG keys", "key<fry>[]",
               "triton backend", "jax.random.key_data(key)"):
    pallas_call(key_kernel, out_shape=sds(X))(key)


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


# ------------------------------------------------------------------ errors JAX used to raise
def _line(fn, marker: str) -> str:
  """"test_errors.py:N" of the line of `fn`'s source that contains `marker`."""
  lines, start = inspect.getsourcelines(fn)
  [offset] = [i for i, text in enumerate(lines) if marker in text]
  return f"test_errors.py:{start + offset}"


def test_storing_a_value_of_the_wrong_dtype():
  def dtype_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...].astype(jnp.int32)

  with _raises(pl.PalletError, "kernel 'dtype_kernel'", _line(dtype_kernel, "astype"),
               "dtype int32", "output 0 ('o_ref')", "dtype is float32",
               "expected a float32 value"):
    pallas_call(dtype_kernel, out_shape=sds(X))(X)


def test_storing_a_value_of_the_wrong_shape():
  def shape_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[0]

  with _raises(pl.PalletError, "kernel 'shape_kernel'", _line(shape_kernel, "x_ref[0]"),
               "shape (4,)", "output 0 ('o_ref')", "expected a value of shape (8, 4)"):
    pallas_call(shape_kernel, out_shape=sds(X))(X)


def test_storing_a_scalar_into_a_block_says_how_to_broadcast():
  def scalar_kernel(x_ref, o_ref):
    o_ref[...] = jnp.sum(x_ref[...])

  with _raises(pl.PalletError, "kernel 'scalar_kernel'", _line(scalar_kernel, "jnp.sum"),
               "shape ()", "output 0 ('o_ref')", "expected a value of shape (8, 4)",
               "jnp.broadcast_to"):
    pallas_call(scalar_kernel, out_shape=sds(X))(X)


def test_storing_through_a_view_names_the_indexed_shape():
  def view_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
    o_ref.at[2:6][0, :] = x_ref[0, :2]

  with _raises(pl.PalletError, "kernel 'view_kernel'", _line(view_kernel, "o_ref.at"),
               "shape (2,)", "output 0 ('o_ref')", "expected a value of shape (4,)"):
    pallas_call(view_kernel, out_shape=sds(X))(X)


def test_static_slice_past_the_end():
  def slice_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
    o_ref[pl.ds(6, 4), :] = x_ref[pl.ds(0, 4), :]

  with _raises(pl.PalletError, "kernel 'slice_kernel'", _line(slice_kernel, "pl.ds(6, 4)"),
               "output 0 ('o_ref')", "start=6, size=4", "dimension of size 8",
               "expected a slice inside the block", "mask"):
    pallas_call(slice_kernel, out_shape=sds(X))(X)


def test_python_slice_past_the_end_is_clipped_and_says_so():
  def clipped_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
    o_ref[6:10, :] = x_ref[0:4, :]

  with _raises(pl.PalletError, "kernel 'clipped_kernel'", _line(clipped_kernel, "6:10"),
               "shape (4, 4)", "output 0 ('o_ref')", "expected a value of shape (2, 4)",
               "clipped"):
    pallas_call(clipped_kernel, out_shape=sds(X))(X)


def test_pl_ds_with_a_traced_size():
  def traced_size_kernel(x_ref, o_ref):
    n = pl.program_id(0) + 1
    o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[0, pl.ds(0, 2)] = x_ref[0, pl.ds(0, n)]

  with _raises(pl.PalletError, "kernel 'traced_size_kernel'",
               _line(traced_size_kernel, "pl.ds(0, n)"), "input 0 ('x_ref')",
               "pl.ds(start, size)", "traced", "expected a static size", "mask"):
    pallas_call(traced_size_kernel, out_shape=sds(X), grid=(2,))(X)


def test_errors_inside_a_loop_body_name_the_ref_and_line():
  def loop_kernel(x_ref, o_ref, acc_ref):
    def body(i, c):
      acc_ref[...] = x_ref[...].astype(jnp.int32)
      return c
    jax.lax.fori_loop(0, 2, body, 0)
    o_ref[...] = acc_ref[...]

  with _raises(pl.PalletError, "kernel 'loop_kernel'", _line(loop_kernel, "astype"),
               "dtype int32", "scratch 0 ('acc_ref')", "expected a float32 value"):
    pallas_call(loop_kernel, out_shape=sds(X), scratch_shapes=[pltpu.VMEM((8, 4), f32)])(X)


def test_pl_when_with_an_array_condition():
  def when_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

    @pl.when(x_ref[...] > 0)
    def _():
      o_ref[...] = x_ref[...] * 2

  with _raises(pl.PalletError, "pl.when", "kernel 'when_kernel'",
               _line(when_kernel, "@pl.when"), "shape (8, 4)", "expected a scalar",
               "jnp.any"):
    pallas_call(when_kernel, out_shape=sds(X))(X)


def test_grad_through_a_while_loop_with_a_traced_trip_count():
  def loop_kernel(n_ref, x_ref, o_ref):
    o_ref[...] = jax.lax.fori_loop(0, n_ref[0], lambda i, a: a * x_ref[...],
                                   jnp.ones_like(x_ref[...]))

  def f(x, n):
    return pallas_call(loop_kernel, out_shape=sds(x))(n, x)

  n = jnp.array([3], jnp.int32)
  x = random_array((8, 4))
  # forward mode works (and is right) ...
  tangent = jax.jvp(lambda x: f(x, n), (x,), (jnp.ones_like(x),))[1]
  assert_close(tangent, 3 * x ** 2, rtol=1e-4, atol=1e-4)
  # ... reverse mode says where and why it cannot
  with _raises(pl.PalletError, "kernel 'loop_kernel'", _line(loop_kernel, "fori_loop"),
               "reverse-mode", "trip count", "expected a static trip count", "jax.jvp"):
    jax.grad(lambda x: f(x, n).sum())(x)


def test_grad_through_a_while_loop_off_the_derivative_path_works():
  def scaled_kernel(x_ref, o_ref):
    scale = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0),
                               (0, 1.0))[1]
    o_ref[...] = x_ref[...] * scale

  x = random_array((8, 4))
  g = jax.grad(lambda x: (pallas_call(scaled_kernel, out_shape=sds(x))(x) * x).sum())(x)
  assert_close(g, 16.0 * x)


@pytest.mark.skipif(current_test_backend() != "xla", reason="generates Triton source itself")
def test_unsupported_primitive_on_triton_names_its_line_and_the_xla_backend():
  import pallet.triton as pltriton
  from pallet.backends.triton import TritonLoweringError

  def sorting_kernel(x_ref, o_ref):
    y = x_ref[...] * 2
    o_ref[...] = jnp.sort(y)

  x = random_array((16,))
  f = pl.pallas_call(sorting_kernel, out_shape=sds(x), backend="triton", interpret=True)
  with _raises(TritonLoweringError, "kernel 'sorting_kernel'",
               _line(sorting_kernel, "jnp.sort"), "primitive 'sort'",
               "not supported by the Triton backend", "backend=\"xla\""):
    pltriton.source(f, x)


def test_triton_backend_without_triton_says_how_to_install(monkeypatch):
  from pallet import backends
  monkeypatch.setattr(backends, "triton_installed", lambda: False)

  def install_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  with _raises(pl.PalletError, "kernel 'install_kernel'", "backend='triton'",
               'pip install "pallet[triton]"', "backend='xla'"):
    pl.pallas_call(install_kernel, out_shape=sds(X), backend="triton", interpret=True)(X)
  assert "triton" not in backends.available()
  assert 'pip install "pallet[triton]"' in backends.unavailable_reason("triton")


def test_pallet_info_lists_only_backends_that_run(monkeypatch, capsys):
  from pallet import backends, cli
  monkeypatch.setattr(backends, "triton_installed", lambda: False)
  assert cli.main(["info"]) == 0
  out = capsys.readouterr().out
  assert "backends: ['xla']" in out
  assert 'triton: not available' in out and 'pip install "pallet[triton]"' in out


# ------------------------------------------------ where errors and warnings point
_PALLET_SRC = os.path.dirname(os.path.abspath(pl.__file__))
_JAX_SRC = os.path.dirname(os.path.abspath(jax.__file__))


def _call_line(fn, marker: str) -> int:
  """The line of `fn`'s source holding `marker`."""
  lines, first = inspect.getsourcelines(fn)
  return first + next(i for i, line in enumerate(lines) if marker in line)


@pytest.mark.parametrize("cls, printed", [
    (pl.PalletError, "pallet.PalletError"),
    (pl.GridOrderWarning, "pallet.GridOrderWarning"),
    (pl.KernelCheckError, "pallet.KernelCheckError"),
    (pltpu.LoweringException, "pallet.tpu.LoweringException"),
])
def test_errors_print_under_the_name_users_reach_them_by(cls, printed):
  assert traceback.format_exception_only(cls, cls("message"))[0] == f"{printed}: message\n"
  assert pickle.loads(pickle.dumps(cls("message"))).args == ("message",)


def _bad_spec_call():
  f = pl.pallas_call(copy_kernel, out_shape=sds(X), grid=(2,),
                     in_specs=[pl.BlockSpec((4,), lambda i: (i,))])
  return f(X)   # BAD SPEC


def _bad_body_call():
  def short_store_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[:2]
  spec = pl.BlockSpec((4, 4), lambda i: (i, 0))
  f = pl.pallas_call(short_store_kernel, out_shape=sds(X), grid=(2,), in_specs=[spec],
                     out_specs=spec)
  return jax.jit(f)(X)   # BAD BODY


def _failing_check_call():
  def sum_rows_kernel(x_ref, o_ref):
    o_ref[...] += jnp.sum(x_ref[...], axis=0)   # o_ref is never zeroed
  f = pl.pallas_call(sum_rows_kernel, out_shape=jax.ShapeDtypeStruct((4,), f32), grid=(2,),
                     in_specs=[pl.BlockSpec((4, 4), lambda i: (i, 0))],
                     out_specs=pl.BlockSpec((4,), lambda i: (0,)),
                     interpret=pl.InterpretParams(uninitialized_memory="nan"))
  return f(X)   # FAILING CHECK


@pytest.mark.parametrize("call, marker, error", [
    (_bad_spec_call, "# BAD SPEC", pl.PalletError),
    (_bad_body_call, "# BAD BODY", pl.PalletError),
    (_failing_check_call, "# FAILING CHECK", pl.KernelCheckError)])
def test_a_traceback_ends_at_the_users_line(call, marker, error):
  """pallet's frames are hidden as JAX hides its own (JAX_TRACEBACK_FILTERING, on by
  default): what is left is the user's code, ending at the call."""
  with pytest.raises(error) as info:
    call()
  frames = traceback.extract_tb(info.value.__traceback__)
  hidden = (_PALLET_SRC, _JAX_SRC, os.path.dirname(os.path.abspath(os.__file__)))
  assert not [f for f in frames if f.filename.startswith(hidden)], frames
  assert (frames[-1].filename, frames[-1].lineno) == (__file__, _call_line(call, marker))


def test_traceback_filtering_off_keeps_pallets_frames():
  previous = jax.config.jax_traceback_filtering
  jax.config.update("jax_traceback_filtering", "off")
  try:
    with pytest.raises(pl.PalletError) as info:
      _bad_spec_call()
  finally:
    jax.config.update("jax_traceback_filtering", previous)
  frames = traceback.extract_tb(info.value.__traceback__)
  assert any(f.filename.startswith(_PALLET_SRC) for f in frames)


def test_grid_order_warning_points_at_the_users_call():
  def accumulate_kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += x_ref[...]

  x = random_array((8, 4))
  f = pl.pallas_call(
      accumulate_kernel, out_shape=jax.ShapeDtypeStruct((4, 4), f32), grid=(2,),
      in_specs=[pl.BlockSpec((4, 4), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((4, 4), lambda i: (0, 0)),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))
  with pytest.warns(pl.GridOrderWarning, match="accumulate_kernel") as record:
    out = f(x)
  assert_close(out, x[:4] + x[4:])
  warning = [w for w in record if issubclass(w.category, pl.GridOrderWarning)][0]
  assert (warning.filename, warning.lineno) == (
      __file__, _call_line(test_grid_order_warning_points_at_the_users_call, "out = f(x)"))


def test_index_map_message_shows_traced_values_readably():
  with pytest.raises(pl.PalletError) as info:
    _bad_index_map_call()
  message = str(info.value)
  assert "Tracer" not in message
  assert "index_map returned 1 indices (<traced int32[]>,) but the array has rank 2" in message
  assert f"index_map defined at {__file__}:{_call_line(_bad_index_map_call, '# MAP')}" in message


def _bad_index_map_call():
  spec = pl.BlockSpec((4, 4),
                      lambda i: i)   # MAP
  return pl.pallas_call(copy_kernel, out_shape=sds(X), grid=(2,), in_specs=[spec])(X)


@pytest.mark.parametrize("x64", [False, True])
def test_float64_inputs_follow_jax_x64_setting(x64):
  """With x64 off, JAX computes float64 inputs in float32; so does a kernel (not an MLIR
  verifier error naming no kernel). With x64 on, the kernel computes in float64."""
  def add_one_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

  x = np.random.default_rng(0).standard_normal((8, 4))   # NumPy float64
  spec = pl.BlockSpec((4, 4), lambda i: (i, 0))
  with jax.enable_x64(x64):
    out = pallas_call(add_one_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                      grid=(2,), in_specs=[spec], out_specs=spec)(x)
    want = jnp.asarray(x) + 1
  assert out.dtype == want.dtype == (jnp.float64 if x64 else jnp.float32)
  assert_close(out, want)


@pytest.mark.parametrize("which", ["tpu.sync_copy", "program_id"])
def test_calling_jax_pallas_inside_a_pallet_kernel_names_the_line(which):
  """A leftover import of JAX's own Pallas in a kernel pallet runs: its primitives would
  fail deep inside pallet's analyses; the error names the call instead."""
  from jax.experimental import pallas as jpl
  from jax.experimental.pallas import tpu as jpltpu

  def kernel(x_ref, o_ref):
    if which == "program_id":
      o_ref[...] = x_ref[...] + jpl.program_id(0).astype(jnp.float32)
    else:
      jpltpu.sync_copy(x_ref, o_ref)   # the line the error names

  x = random_array((8, 128))
  line = inspect.getsourcelines(kernel)[1] + (2 if which == "program_id" else 4)
  with pytest.raises(pl.PalletError, match=rf"kernel 'kernel' .* at .*test_errors\.py:{line} "
                                           r"calls JAX's own Pallas .*import it from pallet"):
    pallas_call(kernel, out_shape=sds(x), grid=(1,))(x)
  # pallet's own API in the same process is unaffected
  assert_close(pallas_call(lambda x_ref, o_ref: pltpu.sync_copy(x_ref, o_ref),
                           out_shape=sds(x))(x), x)
