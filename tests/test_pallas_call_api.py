"""pallas_call's arguments: pytrees of operands and specs, GridSpec, the kinds of block
dimension, missing specs, program_id / num_programs."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
from helpers import assert_close, pallas_call, poisoned, random_array, sds

f32 = jnp.float32


def test_pytree_inputs_outputs_and_specs():
  # A list out_shape hands the kernel one parameter per output and the results
  # come back as a tuple (both like Pallas); a dict input arrives as a dict of refs.
  def kernel(xs, y_ref, sum_ref, prod_ref):
    a_ref, b_ref = xs["a"], xs["b"]
    sum_ref[...] = a_ref[...] + y_ref[...]
    prod_ref[...] = b_ref[...] * y_ref[...]

  a, b, y = random_array((16, 8)), random_array((16, 8)), random_array((16, 8))
  spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
  out = pallas_call(kernel, out_shape=[sds(a), sds(b)], grid=(4,),
                    in_specs=[{"a": spec, "b": spec}, spec],
                    out_specs=[spec, spec])({"a": a, "b": b}, y)
  assert isinstance(out, tuple)
  assert_close(out, (a + y, b * y))


def test_dict_out_shape_and_tuple_specs_interchangeable_with_lists():
  def kernel(x_ref, outs):
    outs["double"][...] = x_ref[...] * 2
    outs["neg"][...] = -x_ref[...]

  x = random_array((12,))
  spec = pl.BlockSpec((4,), lambda i: (i,))
  out = pallas_call(kernel, out_shape={"double": sds(x), "neg": sds(x)}, grid=(3,),
                    in_specs=(spec,), out_specs={"double": spec, "neg": spec})(x)
  assert_close(out, {"double": x * 2, "neg": -x})


def test_single_blockspec_for_single_operand_and_single_output():
  x = random_array((32,))
  spec = pl.BlockSpec((8,), lambda i: (i,))
  out = pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] - 1),
                    out_shape=sds(x), grid=(4,), in_specs=spec, out_specs=spec)(x)
  assert_close(out, x - 1)


def test_grid_spec_object():
  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] @ y_ref[...]

  x, y = random_array((32, 16)), random_array((16, 24))
  gs = pl.GridSpec(grid=(4, 3),
                   in_specs=[pl.BlockSpec((8, 16), lambda i, j: (i, 0)),
                             pl.BlockSpec((16, 8), lambda i, j: (0, j))],
                   out_specs=pl.BlockSpec((8, 8), lambda i, j: (i, j)))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((32, 24), f32), grid_spec=gs)(x, y)
  assert_close(out, x @ y, matmul=True)


@pytest.mark.parametrize("through", ["pallas_call", "grid_spec"])
def test_scratch_shapes_dict_reaches_the_kernel_by_keyword(through):
  # As in Pallas: a dict of scratch shapes is passed by keyword, whatever the order
  # of the kernel's parameters and of the dict's keys.
  import pallet.tpu as pltpu
  x = random_array((16, 128))

  def kernel(x_ref, o_ref, total, doubled):
    @pl.when(pl.program_id(0) == 0)
    def _():
      total[...] = jnp.zeros_like(total)
    doubled[...] = x_ref[...] * 2
    total[...] += doubled[...]
    o_ref[...] = total[...]

  scratch = {"total": pltpu.VMEM((8, 128), f32), "doubled": pltpu.VMEM((8, 128), f32)}
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  if through == "pallas_call":
    call = pallas_call(kernel, sds(x), grid=(2,), in_specs=[spec], out_specs=spec,
                       scratch_shapes=scratch)
  else:
    call = pallas_call(kernel, sds(x), grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0, grid=(2,), in_specs=[spec], out_specs=spec,
        scratch_shapes=scratch))
  running = jnp.cumsum(2 * x.reshape(2, 8, 128), axis=0).reshape(16, 128)
  assert_close(call(x), running)


def test_scratch_shapes_dict_key_the_kernel_lacks_is_a_clear_error():
  import pallet.tpu as pltpu
  x = random_array((8, 128))

  def kernel(x_ref, o_ref, acc):
    o_ref[...] = x_ref[...]
  call = pl.pallas_call(kernel, sds(x), scratch_shapes={"acum": pltpu.VMEM((8, 128), f32)})
  with pytest.raises(TypeError, match=r"kernel 'kernel' takes parameters \(x_ref, o_ref, "
                     r"acc\).*by keyword \(acum\)"):
    call(x)


def test_no_block_spec_passes_whole_arrays():
  def kernel(x_ref, w_ref, o_ref):
    assert x_ref.shape == (4, 6) and w_ref.shape == (6,)
    o_ref[...] = x_ref[...] * w_ref[...]

  x, w = random_array((4, 6)), random_array((6,))
  out = pallas_call(kernel, out_shape=sds(x), in_specs=[pl.no_block_spec, pl.no_block_spec],
                    out_specs=pl.no_block_spec)(x, w)
  assert_close(out, x * w)


def test_missing_spec_means_whole_array_alongside_blocked_ones():
  # in_specs entry None: the kernel sees the whole `w` at every grid step.
  def kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] + jnp.sum(w_ref[...])

  x, w = random_array((16, 4)), random_array((5, 3))
  spec = pl.BlockSpec((4, 4), lambda i: (i, 0))
  out = pallas_call(kernel, out_shape=sds(x), grid=(4,), in_specs=[spec, None],
                    out_specs=spec)(x, w)
  assert_close(out, x + jnp.sum(w), rtol=1e-5, atol=1e-4)


def test_blockspec_with_no_index_map_is_block_zero():
  x = random_array((16,))
  out = pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 5),
                    out_shape=jax.ShapeDtypeStruct((4,), f32),
                    in_specs=[pl.BlockSpec((4,))], out_specs=pl.BlockSpec((4,)))(x)
  assert_close(out, x[:4] * 5)


def test_blockspec_old_argument_order_is_accepted():
  spec = pl.BlockSpec(lambda i: (i,), (4,))
  assert spec.block_shape == (4,) and spec.index_map(2) == (2,)


@pytest.mark.parametrize("squeeze", [None, pl.Squeezed(), pl.squeezed])
def test_squeezed_dims_are_hidden_from_the_kernel(squeeze):
  def kernel(x_ref, o_ref):
    assert x_ref.shape == (8,), x_ref.shape
    o_ref[...] = jnp.cumsum(x_ref[...])

  x = random_array((3, 8))
  spec = pl.BlockSpec((squeeze, 8), lambda i: (i, 0))
  out = pallas_call(kernel, out_shape=sds(x), grid=(3,), in_specs=[spec], out_specs=spec)(x)
  assert_close(out, jnp.cumsum(x, axis=1), rtol=1e-5, atol=1e-5)


def test_squeezed_middle_dim_of_3d_array():
  def kernel(x_ref, o_ref):
    assert x_ref.shape == (2, 5)
    o_ref[...] = x_ref[...].T

  x = random_array((2, 4, 5))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4, 5, 2), f32), grid=(4,),
                    in_specs=[pl.BlockSpec((2, None, 5), lambda j: (0, j, 0))],
                    out_specs=pl.BlockSpec((None, 5, 2), lambda j: (j, 0, 0)))(x)
  assert_close(out, jnp.transpose(x, (1, 2, 0)))


def test_blocked_dim_class_equals_plain_int():
  x = random_array((12, 6))
  spec = pl.BlockSpec((pl.Blocked(4), 6), lambda i: (i, 0))
  out = pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] ** 2),
                    out_shape=sds(x), grid=(3,), in_specs=[spec], out_specs=spec)(x)
  assert_close(out, x ** 2)


def test_element_dims_overlapping_windows():
  # Sliding windows of 4 elements with stride 2: Element offsets may overlap.
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.sum(x_ref[...], keepdims=True)

  x = random_array((18,))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), f32), grid=(8,),
                    in_specs=[pl.BlockSpec((pl.Element(4),), lambda i: (2 * i,))],
                    out_specs=pl.BlockSpec((1,), lambda i: (i,)))(x)
  expected = jnp.stack([x[2 * i:2 * i + 4].sum() for i in range(8)])
  assert_close(out, expected)


def test_element_dims_with_padding_read_outside_the_array():
  # A 3-tap stencil: each window starts one element before its output position;
  # padding (1, 1) lets the first and last windows hang off the edges. As in Pallas,
  # Element offsets count in the padded array (offset i*4 is element i*4 - 1). The
  # values read in the padding are unspecified, so the kernel masks them.
  n = 16

  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    w = x_ref[...]
    pos = i * 4 - 1 + jnp.arange(6)
    w = jnp.where((pos >= 0) & (pos < n), w, 0.0)
    o_ref[...] = w[:-2] + w[1:-1] + w[2:]

  x = random_array((n,))
  out = pallas_call(
      kernel, out_shape=sds(x), grid=(n // 4,),
      in_specs=[pl.BlockSpec((pl.Element(6, padding=(1, 1)),), lambda i: (i * 4,))],
      out_specs=pl.BlockSpec((4,), lambda i: (i,)))(x)
  xp = jnp.pad(x, 1)
  assert_close(out, xp[:-2] + xp[1:-1] + xp[2:], rtol=1e-5, atol=1e-5)


def test_element_output_dims():
  x = random_array((4, 6))
  out = pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1),
                    out_shape=sds(x), grid=(2,),
                    in_specs=[pl.BlockSpec((pl.Element(2), 6), lambda i: (2 * i, 0))],
                    out_specs=pl.BlockSpec((pl.Element(2), 6), lambda i: (2 * i, 0)))(x)
  assert_close(out, x + 1)


@pytest.mark.parametrize("grid", [(3,), (2, 3), (2, 3, 4)])
def test_program_id_and_num_programs(grid):
  def kernel(ids_ref, sizes_ref):
    for a in range(len(grid)):
      ids_ref[a] = pl.program_id(a)
      sizes_ref[a] = pl.num_programs(a)
    # negative axes count from the end
    ids_ref[len(grid)] = pl.program_id(-1)

  nd = len(grid)
  block = (None,) * nd
  ids, sizes = pallas_call(
      kernel, grid=grid,
      out_shape=(jax.ShapeDtypeStruct((*grid, nd + 1), jnp.int32),
                 jax.ShapeDtypeStruct((*grid, nd), jnp.int32)),
      out_specs=(pl.BlockSpec((*block, nd + 1), lambda *g: (*g, 0)),
                 pl.BlockSpec((*block, nd), lambda *g: (*g, 0))))()
  coords = np.stack(np.indices(grid), -1)
  np.testing.assert_array_equal(ids[..., :nd], coords)
  np.testing.assert_array_equal(ids[..., nd], coords[..., -1])
  np.testing.assert_array_equal(sizes, np.broadcast_to(np.array(grid), (*grid, nd)))


def test_num_programs_of_a_static_grid_is_a_python_int_in_kernels_and_index_maps():
  # As in Pallas: a static grid size is a Python int (it can size Python loops and
  # shapes), and pl.num_programs / pl.program_id answer inside index maps too.
  seen = []

  def reversed_rows(i):
    seen.append(pl.num_programs(0))
    return pl.num_programs(0) - 1 - i, 0

  def kernel(x_ref, o_ref):
    n = pl.num_programs(0)
    seen.append(n)
    o_ref[...] = x_ref[...] * sum(range(n))    # a Python loop over the grid size

  x = random_array((4, 8))
  out = pallas_call(kernel, out_shape=sds(x), grid=(4,),
                    in_specs=[pl.BlockSpec((1, 8), reversed_rows)],
                    out_specs=pl.BlockSpec((1, 8), lambda i: (i, 0)))(x)
  assert_close(out, x[::-1] * 6)
  assert seen and all(type(n) is int and n == 4 for n in seen)


@pytest.mark.cpu_only
def test_num_programs_of_a_traced_axis_in_an_index_map_is_a_clear_error():
  @jax.jit
  def run(n, x):
    return pl.pallas_call(lambda x_ref, o_ref: None, out_shape=sds(x), grid=(n,),
                          in_specs=[pl.BlockSpec((1, 8), lambda i: (pl.num_programs(0) - i, 0))],
                          out_specs=pl.BlockSpec((1, 8), lambda i: (i, 0)))(x)
  with pytest.raises(pl.PalletError, match=r"pl.num_programs\(0\) in an index map of "
                     r"kernel '<lambda>' at .*test_pallas_call_api.py:\d+: .*computed at run "
                     r"time.*scalar-prefetch"):
    run(4, random_array((4, 8)))


def test_grid_as_int_and_cdiv():
  assert pl.cdiv(10, 4) == 3 and pl.cdiv(8, 4) == 2
  assert int(pl.cdiv(jnp.int32(10), jnp.int32(4))) == 3
  x = random_array((10,))
  spec = pl.BlockSpec((4,), lambda i: (i,))
  out = pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 3),
                    out_shape=sds(x), grid=pl.cdiv(10, 4), in_specs=[spec],
                    out_specs=spec)(x)
  assert_close(out, x * 3)


def test_zero_size_grid_runs_no_program():
  # The output aliases `before`; with no program run it keeps those values.
  x, before = random_array((8,)), random_array((8,))
  spec = pl.BlockSpec((4,), lambda i, j: (i,))
  out = pallas_call(lambda x_ref, b_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                    out_shape=sds(x), grid=(2, 0), in_specs=[spec, spec], out_specs=spec,
                    input_output_aliases={1: 0})(x, before)
  assert_close(out, before)


def test_no_inputs_kernel():
  def kernel(o_ref):
    o_ref[...] = jnp.full(o_ref.shape, 7, jnp.int32) + pl.program_id(0)

  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((3, 5), jnp.int32), grid=(3,),
                    out_specs=pl.BlockSpec((None, 5), lambda i: (i, 0)))()
  np.testing.assert_array_equal(out, 7 + np.arange(3)[:, None] + np.zeros((3, 5), int))


def test_scalar_output_and_0d_operands():
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.sum(x_ref[...]) * 2

  x = random_array((7,))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((), f32))(x)
  assert_close(out, jnp.sum(x) * 2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32,
                                   jnp.int8, jnp.uint8, jnp.bool_])
def test_dtypes_round_trip(dtype):
  x = random_array((16, 8), dtype)
  spec = pl.BlockSpec((8, 8), lambda i: (i, 0))
  out = pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                    out_shape=sds(x), grid=(2,), in_specs=[spec], out_specs=spec)(x)
  assert_close(out, x)


def test_kernel_parameters_via_functools_partial():
  def kernel(x_ref, o_ref, *, scale, shift):
    o_ref[...] = x_ref[...] * scale + shift

  x = random_array((6,))
  out = pallas_call(functools.partial(kernel, scale=3.0, shift=-2.0), out_shape=sds(x))(x)
  assert_close(out, x * 3 - 2)


def test_kernel_closure_over_python_and_numpy_constants():
  table = np.arange(6, dtype=np.float32) * 0.5
  factor = 1.5

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * factor + table

  x = random_array((6,))
  assert_close(pallas_call(kernel, out_shape=sds(x))(x), x * factor + table)


def test_interpret_true_runs_on_the_cpu():
  x = random_array((8,))
  out = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 2),
                       out_shape=sds(x), interpret=True)(x)
  assert_close(out, x + 2)


@pytest.mark.cpu_only
@pytest.mark.parametrize("name", ["xla", "cpu", "interpret", "XLA"])
def test_backend_selected_by_name(name):
  x = random_array((8,))
  out = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 4),
                       out_shape=sds(x), backend=name)(x)
  assert_close(out, x * 4)


def test_poisoned_alias_shows_every_element_written():
  # An aliased NaN buffer: any element a kernel skips stays NaN.
  def kernel(x_ref, buf_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

  x = random_array((12, 8))
  spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
  out = pallas_call(kernel, out_shape=sds(x), grid=(3,), in_specs=[spec, spec],
                    out_specs=spec, input_output_aliases={1: 0})(x, poisoned(x.shape))
  assert not np.isnan(np.asarray(out)).any()
  assert_close(out, x + 1)
