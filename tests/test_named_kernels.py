"""Named kernels: NamedArray operands, blocks and grid by axis name, NamedRefs in kernels.

Every kernel is compared with jax.numpy on fresh random inputs. Kernels run on the
backend under test (`PALLET_TEST_BACKEND`, see helpers.py).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
import pallet.named as pn
from helpers import assert_close, current_test_backend, random_array, runs_on_gpu

Batch, Head, Seq, Feature = pn.make_axes(batch=2, head=3, seq=32, feature=16)
Key = pn.Axis("key", 32)


def named_call(kernel, out_shape, **kwargs):
  """pn.pallas_call on the backend under test (interpreted where there is no GPU)."""
  backend = current_test_backend()
  kwargs.setdefault("backend", backend)
  if backend != "xla":
    kwargs.setdefault("interpret", not runs_on_gpu())
  return pn.pallas_call(kernel, out_shape, **kwargs)


def rand(axes, dtype=jnp.float32):
  axes = tuple(axes)
  return pn.NamedArray(random_array(tuple(ax.size for ax in axes), dtype), axes)


def poisoned_like(axes, dtype=jnp.float32):
  return pn.full(axes, jnp.nan, dtype)


# ============================================================ basics


def add_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] + y_ref[...]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_blocks_by_name_align_operands_stored_in_different_orders(dtype):
  x = rand((Batch, Seq, Feature), dtype)
  y = rand((Feature, Seq, Batch), dtype)  # same axes, another layout
  seen = []

  def kernel(x_ref, y_ref, o_ref):
    seen.append((x_ref.axes, y_ref.axes, o_ref.axes))
    add_kernel(x_ref, y_ref, o_ref)

  out = named_call(kernel, out_shape=pn.NamedShapeDtype((Seq, Batch, Feature), dtype),
                   grid={"batch": 2, "seq": 4},
                   block={"batch": None, "seq": 8})(x, y)
  assert isinstance(out, pn.NamedArray) and out.axes == (Seq, Batch, Feature)
  small = Seq.resize(8)
  assert seen[0] == ((small, Feature), (Feature, small), (small, Feature))
  assert_close(out.rearrange(("batch", "seq", "feature")).array,
               x.array + jnp.transpose(y.array, (2, 1, 0)))


def test_every_output_element_is_written():
  x = rand((Batch, Seq, Feature))
  out = named_call(lambda x_ref, p_ref, o_ref: o_ref.__setitem__(..., pn.exp(x_ref[...])),
                   out_shape=x, grid=(Seq.resize(4), Batch),
                   block={"seq": 8, "batch": None},
                   input_output_aliases={1: 0})(x, poisoned_like(x.axes))
  assert not bool(jnp.isnan(out.array).any())
  assert_close(out.array, jnp.exp(x.array))


def test_per_operand_specs_and_whole_operands():
  x = rand((Batch, Seq, Feature))
  bias = rand((Feature,))
  out = named_call(
      lambda x_ref, b_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2 + b_ref[...]),
      out_shape=x, grid={"seq": 4},
      in_specs=[{"seq": 8}, None], out_specs=pn.NamedBlockSpec({"seq": 8}))(x, bias)
  assert_close(out.array, x.array * 2 + bias.array)


def test_custom_index_map_by_name():
  x = rand((Seq, Feature))
  y = rand((Seq, Feature))
  reverse = pn.NamedBlockSpec({"seq": 8}, index_map=lambda ids: {"seq": 3 - ids["step"]})
  forward = pn.NamedBlockSpec({"seq": 8}, index_map=lambda ids: {"seq": ids["step"]})
  out = named_call(add_kernel, out_shape=x, grid={"step": 4}, in_specs=[reverse, forward],
                   out_specs=forward)(x, y)
  blocks = x.array.reshape(4, 8, 16)[::-1].reshape(32, 16)
  assert_close(out.array, blocks + y.array)


def test_unnamed_grid_with_positional_index_map():
  x = rand((Seq, Feature))
  spec = pn.NamedBlockSpec({"seq": 16, "feature": 8},
                           index_map=lambda ids: {"seq": ids[1], "feature": ids[0]})
  out = named_call(lambda x_ref, o_ref: o_ref.__setitem__(..., -x_ref[...]), out_shape=x,
                   grid=(2, 2), in_specs=[spec], out_specs=spec)(x)
  assert_close(out.array, -x.array)


def test_program_id_by_name():
  Row, Col = pn.make_axes(row=4, col=8)
  template = pn.NamedShapeDtype((Row, Col), jnp.int32)

  def kernel(o_ref):
    value = pn.program_id("row") * 10 + pn.program_id("col") + pn.num_programs("col") * 100
    o_ref[...] = pn.full(o_ref.axes, 0, jnp.int32) + value

  out = named_call(kernel, out_shape=template, grid={"row": 4, "col": 2},
                   out_specs={"row": None, "col": 4})()
  expected = (np.arange(4)[:, None] * 10 + np.arange(8)[None] // 4 + 200)
  np.testing.assert_array_equal(out.array, expected)


def test_mixed_raw_operands_and_several_outputs():
  x = rand((Seq, Feature))
  scale = random_array((32, 16))

  def kernel(x_ref, s_ref, named_out, raw_out):
    named_out[...] = x_ref[...] * 3
    raw_out[...] = s_ref[...] + pn.sum(x_ref[...], "feature").array[:, None]

  named_o, raw_o = named_call(
      kernel,
      out_shape=(pn.NamedShapeDtype((Seq, Feature), jnp.float32),
                 jax.ShapeDtypeStruct((32, 16), jnp.float32)),
      grid={"seq": 4},
      in_specs=[{"seq": 8}, pl.BlockSpec((8, 16), lambda i: (i, 0))],
      out_specs=[{"seq": 8}, pl.BlockSpec((8, 16), lambda i: (i, 0))])(x, scale)
  assert isinstance(named_o, pn.NamedArray) and not isinstance(raw_o, pn.NamedArray)
  assert_close(named_o.array, x.array * 3)
  assert_close(raw_o, scale + x.array.sum(1, keepdims=True))


def test_vmap_of_a_function_that_launches_a_named_kernel():
  raws = random_array((3, 32, 16))

  def scaled(raw):
    x = pn.named(raw, (Seq, Feature))
    out = named_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 4.0),
                     out_shape=x, grid={"seq": 4}, block={"seq": 8})(x)
    return out.array

  assert_close(jax.vmap(scaled)(raws), raws * 4.0)


def test_named_kernel_under_jit_and_grad():
  x = rand((Seq, Feature))

  def square(x):
    return named_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * x_ref[...]),
                      out_shape=x, grid={"seq": 4}, block={"seq": 8})(x)

  assert_close(jax.jit(square)(x).array, x.array ** 2)
  grad = jax.grad(lambda x: square(x).sum().array)(x)
  assert grad.axes == x.axes
  assert_close(grad.array, 2 * x.array)


def test_named_scratch_accumulates_across_grid_steps():
  x = rand((Seq, Feature))
  Acc = pn.NamedShapeDtype((Feature,), jnp.float32)

  def column_sums(x_ref, o_ref, acc_ref):
    @pl.when(pn.program_id("seq") == 0)
    def _():
      acc_ref[...] = 0.0
    acc_ref[...] += pn.sum(x_ref[...], "seq")
    o_ref[...] = acc_ref[...]

  out = named_call(column_sums, out_shape=Acc, grid={"seq": 4}, in_specs=[{"seq": 8}],
                   out_specs=[None], scratch_shapes=[Acc])(x)
  assert out.axes == (Feature,)
  assert_close(out.array, x.array.sum(0))


def test_partial_kernels_keep_their_name_in_errors():
  x = rand((Seq, Feature))
  with pytest.raises(pl.PalletError, match="kernel 'add_kernel' takes 3 positional"):
    named_call(functools.partial(add_kernel), out_shape=x, grid={"seq": 4},
               block={"seq": 8})(x)


# ============================================================ attention


def flash_attention_kernel(q_ref, k_ref, v_ref, o_ref, *, block_k):
  q = q_ref[...] / np.sqrt(q_ref.shape["feature"])
  rows = q_ref.axes[0]

  def body(j, carry):
    m, total, acc = carry
    window = k_ref.slice({"key": pn.ds(j * block_k, block_k)})  # traced start
    s = pn.dot(q, window.value(), axis="feature")
    new_m = pn.maximum(m, pn.max(s, "key"))
    p = pn.exp(s - new_m)
    rescale = pn.exp(m - new_m)
    v = v_ref[{"key": pn.ds(j * block_k, block_k)}]
    return new_m, total * rescale + pn.sum(p, "key"), acc * rescale + pn.dot(p, v, axis="key")

  init = (pn.full((rows,), -jnp.inf), pn.zeros((rows,)), pn.zeros(q.axes))
  _, total, acc = jax.lax.fori_loop(0, k_ref.shape["key"] // block_k, body, init)
  o_ref[...] = acc / total


@pytest.mark.parametrize("block_q,block_k", [(8, 8), (16, 32)])
def test_attention_over_named_axes(block_q, block_k):
  q = rand((Batch, Head, Seq, Feature))
  k = rand((Head, Key, Batch, Feature))
  v = rand((Batch, Key, Head, Feature))
  out = named_call(functools.partial(flash_attention_kernel, block_k=block_k), out_shape=q,
                   grid={"batch": 2, "head": 3, "seq": 32 // block_q},
                   block={"batch": None, "head": None, "seq": block_q})(q, k, v)
  assert out.axes == q.axes
  ka = k.rearrange(("batch", "head", "key", "feature")).array
  va = v.rearrange(("batch", "head", "key", "feature")).array
  scores = jnp.einsum("bhsd,bhkd->bhsk", q.array, ka) / np.sqrt(16)
  assert_close(out.array, jnp.einsum("bhsk,bhkd->bhsd", jax.nn.softmax(scores, -1), va),
               matmul=True)


# ============================================================ errors


def test_error_block_names_an_unknown_axis():
  x = rand((Seq, Feature))
  with pytest.raises(ValueError, match=r"kernel 'add_kernel', in_specs\[1\]: block names axis "
                                       r"'sequence', but the operand's axes are "
                                       r"\('seq', 'feature'\)"):
    named_call(add_kernel, out_shape=x, grid={"seq": 4},
               in_specs=[{"seq": 8}, {"sequence": 8}], out_specs={"seq": 8})(x, x)
  # pallas_call's shared `block=` may name axes only some operands have
  out = named_call(add_kernel, out_shape=x, grid={"seq": 4},
                   block={"seq": 8, "head": None})(x, x)
  assert_close(out.array, 2 * x.array)


def test_error_cut_axis_without_grid_axis():
  x = rand((Seq, Feature))
  with pytest.raises(ValueError, match="in_specs\\[0\\]: axis 'seq' is cut into blocks of 8 "
                                       "but the grid has no axis 'seq'"):
    named_call(add_kernel, out_shape=x, grid={"step": 4}, block={"seq": 8})(x, x)


def test_error_bad_block_size():
  x = rand((Seq, Feature))
  with pytest.raises(ValueError, match="block size for axis 'seq' must be a positive int or "
                                       "None, got 0"):
    named_call(add_kernel, out_shape=x, grid={"seq": 4}, block={"seq": 0})(x, x)


def test_error_index_map_names_an_unknown_axis():
  x = rand((Seq, Feature))
  spec = pn.NamedBlockSpec({"seq": 8}, index_map=lambda ids: {"rows": ids["seq"]})
  with pytest.raises(ValueError, match="index_map returns a block index for axis 'rows'"):
    named_call(add_kernel, out_shape=x, grid={"seq": 4}, in_specs=[spec, spec],
               out_specs=spec)(x, x)


def test_error_spec_kinds_must_match_operands():
  x = rand((Seq, Feature))
  raw = random_array((32, 16))
  with pytest.raises(TypeError, match=r"in_specs\[1\]: the operand is not a NamedArray"):
    named_call(add_kernel, out_shape=x, grid={"seq": 4}, in_specs=[{"seq": 8}, {"seq": 8}],
               out_specs={"seq": 8})(x, raw)
  with pytest.raises(TypeError, match=r"in_specs\[0\]: a NamedArray operand needs a "
                                      "NamedBlockSpec"):
    named_call(add_kernel, out_shape=x, grid={"seq": 4},
               in_specs=[pl.BlockSpec((8, 16), lambda i: (i, 0)), {"seq": 8}],
               out_specs={"seq": 8})(x, x)
  with pytest.raises(ValueError, match="1 in_specs for 2 operands"):
    named_call(add_kernel, out_shape=x, grid={"seq": 4}, in_specs=[{"seq": 8}],
               out_specs={"seq": 8})(x, x)


def test_error_grid_mixing_axes_and_sizes():
  x = rand((Seq, Feature))
  with pytest.raises(TypeError, match="grid mixes Axis objects and sizes"):
    named_call(add_kernel, out_shape=x, grid=(Seq, 4))


def test_error_program_id_outside_a_named_kernel_or_unknown_name():
  with pytest.raises(RuntimeError, match="may only be called inside a kernel run by "
                                         "pallet.named.pallas_call"):
    pn.program_id("seq")
  x = rand((Seq, Feature))

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + pn.program_id("rows")
  with pytest.raises(ValueError, match=r"program_id\('rows'\): the grid axes are \('seq',\)"):
    named_call(kernel, out_shape=x, grid={"seq": 4}, block={"seq": 8})(x)


def test_error_kernel_arity_names_the_user_kernel():
  x = rand((Seq, Feature))
  with pytest.raises(pl.PalletError, match="kernel 'add_kernel' takes 3 positional"):
    named_call(add_kernel, out_shape=x, grid={"seq": 4}, block={"seq": 8})(x)


def test_error_writing_a_block_with_a_foreign_axis():
  x = rand((Seq, Feature))

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * pn.ones((Head,))
  with pytest.raises(ValueError, match="axis 'head' is not in the target"):
    named_call(kernel, out_shape=x, grid={"seq": 4}, block={"seq": 8})(x)
