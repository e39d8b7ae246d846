"""`jax.vmap` of `pltpu.emit_pipeline` inside a kernel: every batch element runs the whole
pipeline over its slice of the batched refs (refs vmap does not batch are shared), and
the body and index maps see only the pipeline's own grid, as in Pallas."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import pallet as pl
from pallet import tpu as pltpu
from helpers import assert_close, pallas_call, poisoned, random_array, sds

ANY = pl.BlockSpec(memory_space=pltpu.ANY)


def _call(kernel, x_shape, *inputs):
  """Runs `kernel(*input_refs, out_ref)` with the output aliased to a poisoned buffer."""
  n = len(inputs)
  return pallas_call(kernel, jax.ShapeDtypeStruct(x_shape, jnp.float32),
                     in_specs=[ANY] * (n + 1), out_specs=ANY,
                     input_output_aliases={n: 0})(*inputs, poisoned(x_shape))


@pytest.mark.parametrize("dynamic_grid", [False, True])
def test_vmapped_pipeline_runs_every_batch_element_over_its_own_grid(dynamic_grid):
  x = random_array((3, 16, 384))

  def kernel(x_hbm, _, o_hbm):
    def body(x_blk, o_blk):
      o_blk[...] = 2.0 * x_blk[...] + 100.0 * pl.program_id(0) + 1000.0 * pl.num_programs(0)
    grid = (jnp.int32(3),) if dynamic_grid else (3,)
    jax.vmap(pltpu.emit_pipeline(
        body, grid=grid,
        in_specs=[pl.BlockSpec((16, 128), lambda i: (0, pl.num_programs(0) - 1 - i))],
        out_specs=[pl.BlockSpec((16, 128), lambda i: (0, i))]))(x_hbm, o_hbm)

  blocks = x.reshape(3, 16, 3, 128)[:, :, ::-1].reshape(x.shape)
  expected = 2.0 * blocks + 100.0 * jnp.repeat(jnp.arange(3.0), 128) + 3000.0
  assert_close(_call(kernel, x.shape, x), expected)


def test_in_axes_batch_any_dimension_and_unbatched_refs_are_shared():
  x, y = random_array((16, 3, 256)), random_array((16, 256))

  def kernel(x_hbm, y_hbm, _, o_hbm):
    def body(x_blk, y_blk, o_blk):
      o_blk[...] = x_blk[...] * y_blk[...]
    spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
    jax.vmap(pltpu.emit_pipeline(body, grid=(2, 2), in_specs=[spec, spec], out_specs=[spec]),
             in_axes=(1, None, 1))(x_hbm, y_hbm, o_hbm)

  assert_close(_call(kernel, x.shape, x, y), x * y[:, None, :])


def test_nested_named_vmaps_answer_axis_index():
  # the outer vmap batches dimension 1, the inner one dimension 0 of what is left
  x = random_array((3, 2, 256))

  def kernel(x_hbm, _, o_hbm):
    def body(x_blk, o_blk):
      o_blk[...] = x_blk[...] + 10.0 * lax.axis_index("a") + lax.axis_index("b")
    spec = pl.BlockSpec((128,), lambda i: (i,))
    pipeline = pltpu.emit_pipeline(body, grid=(2,), in_specs=[spec], out_specs=[spec])
    jax.vmap(jax.vmap(pipeline, axis_name="b"), axis_name="a", in_axes=1)(x_hbm, o_hbm)

  expected = x + 10.0 * jnp.arange(2.0)[None, :, None] + jnp.arange(3.0)[:, None, None]
  assert_close(_call(kernel, x.shape, x), expected)


def test_unwindowed_operands_and_explicit_indices_see_their_batch_element():
  x = random_array((3, 16, 256))

  def kernel(x_hbm, _, o_hbm):
    def body(step, x_any, o_blk):
      # x_any is this batch element's whole (16, 256) ref; step.index the inner grid's
      o_blk[...] = x_any[:, pl.ds(step.index[0] * 128, 128)] + 7.0 * step.index[0]
    jax.vmap(pltpu.emit_pipeline(
        body, grid=(2,), in_specs=[ANY],
        out_specs=[pl.BlockSpec((16, 128), lambda i: (0, i))], _explicit_indices=True)
    )(x_hbm, o_hbm)

  assert_close(_call(kernel, x.shape, x), x + 7.0 * jnp.repeat(jnp.arange(2.0), 128))


def _vmapped_copy(x_hbm, o_hbm, **kwargs):
  def body(x_blk, o_blk):
    o_blk[...] = x_blk[...]
  spec = pl.BlockSpec((16, 128), lambda i: (0, i))
  pltpu.emit_pipeline(body, grid=(2,), in_specs=[spec], out_specs=[spec])(x_hbm, o_hbm,
                                                                          **kwargs)


def test_a_body_closing_over_a_batched_value_is_a_clear_error():
  x = random_array((3, 16, 256))

  def kernel(x_hbm, _, o_hbm):
    def per_element(x_ref, o_ref):
      offset = x_ref[0, 0]   # batched by the vmap: one value per batch element

      def body(x_blk, o_blk):
        o_blk[...] = x_blk[...] + offset
      spec = pl.BlockSpec((16, 128), lambda i: (0, i))
      pltpu.emit_pipeline(body, grid=(2,), in_specs=[spec], out_specs=[spec])(x_ref, o_ref)
    jax.vmap(per_element)(x_hbm, o_hbm)

  with pytest.raises(pl.PalletError, match=r"emit_pipeline in kernel 'kernel' at "
                     r".*test_pipeline_vmap.py:\d+: the pipeline's body or an index map uses "
                     r"a value batched by the jax.vmap"):
    _call(kernel, x.shape, x)


@pytest.mark.parametrize("case, message", [
    ("scratch", "scratch refs batched by jax.vmap are not supported"),
    ("view", r"operand leaf 0 is a view \(ref.at\[...\]\) of a ref batched by jax.vmap"),
    ("loop", "batched by a jax.vmap that does not call the pipeline directly"),
])
def test_what_a_vmapped_pipeline_cannot_batch_is_a_clear_error(case, message):
  x = random_array((3, 16, 256))

  def kernel(x_hbm, s_hbm, o_hbm):
    if case == "scratch":
      jax.vmap(lambda x, o, s: _vmapped_copy(x, o, scratches=[s]))(x_hbm, o_hbm, s_hbm)
    elif case == "view":
      jax.vmap(lambda x, o: _vmapped_copy(x.at[:, :], o))(x_hbm, o_hbm)
    else:
      def per_element(x, o):
        lax.fori_loop(0, 2, lambda i, c: (_vmapped_copy(x, o), c)[1], 0)
      jax.vmap(per_element)(x_hbm, o_hbm)

  with pytest.raises(pl.PalletError, match=r"emit_pipeline in kernel 'kernel' at "
                     r".*test_pipeline_vmap.py:\d+: .*" + message):
    _call(kernel, x.shape, x)
