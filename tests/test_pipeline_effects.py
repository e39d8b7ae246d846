"""`pltpu.emit_pipeline` called on refs outside a kernel (`jax.make_jaxpr`, `jax.jit`):
its jaxpr declares Pallas's effects, its inputs read and its outputs written, and none
for the buffers it allocates; it runs the same as inside a kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallet as pl
from pallet import tpu as pltpu
from helpers import assert_close, poisoned, random_array


def _ref(*shape: int) -> jax.ref.AbstractRef:
  return jax.ref.AbstractRef(jax.core.ShapedArray(shape, jnp.float32))


def _effects(closed: jax.extend.core.ClosedJaxpr) -> set[tuple[str, int]]:
  """(effect class, input position) of every effect of a jaxpr traced over refs."""
  position = {v: i for i, v in enumerate(closed.jaxpr.invars)}
  return {(type(e).__name__, position.get(getattr(e, "input", None), -1))
          for e in closed.effects}


def _add(x, y, o):
  o[...] = x[...] + y[...]


def _add_pipeline(grid=(2,)):
  spec = pl.BlockSpec((256,), lambda i: (i,))
  return pltpu.emit_pipeline(_add, grid=grid, in_specs=[spec, spec], out_specs=[spec])


def test_effects_are_inputs_read_and_outputs_written():
  closed = jax.make_jaxpr(lambda x, y, o: _add_pipeline()(x, y, o))(
      _ref(512), _ref(512), _ref(512))
  assert _effects(closed) == {("ReadEffect", 0), ("ReadEffect", 1), ("WriteEffect", 2)}


def test_effects_with_a_traced_grid_and_a_closed_over_constant():
  scale = jnp.float32(1.5)
  spec = pl.BlockSpec((256,), lambda i: (i,))

  def kernel(n, x_ref, o_ref):
    pltpu.emit_pipeline(lambda x, o: o.__setitem__(..., x[...] * scale), grid=(n,),
                        in_specs=[spec], out_specs=[spec])(x_ref, o_ref)

  closed = jax.make_jaxpr(kernel)(jax.ShapeDtypeStruct((), jnp.int32), _ref(512), _ref(512))
  assert _effects(closed) == {("ReadEffect", 1), ("WriteEffect", 2)}


def test_effects_of_a_view_input_name_its_ref():
  spec = pl.BlockSpec((256,), lambda i: (i,))

  def kernel(x_ref, o_ref):
    pltpu.emit_pipeline(lambda x, o: o.__setitem__(..., x[...]), grid=(2,),
                        in_specs=[spec], out_specs=[spec])(x_ref.at[1, ...], o_ref)

  closed = jax.make_jaxpr(kernel)(_ref(2, 512), _ref(512))
  assert _effects(closed) == {("ReadEffect", 0), ("WriteEffect", 1)}


def test_pipeline_on_refs_under_jit_and_eagerly():
  x, y = random_array((512,)), random_array((512,))

  def run(x, y, o):
    refs = [jax.new_ref(v) for v in (x, y, o)]
    _add_pipeline()(*refs)
    return refs[2][...]

  assert_close(jax.jit(run)(x, y, poisoned((512,))), x + y)
  assert_close(run(x, y, poisoned((512,))), x + y)


def test_an_output_block_is_kept_across_the_steps_that_write_it():
  # the output block stays (0,) for all 4 steps: the body accumulates into it
  x = random_array((4, 128))

  def body(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += x_ref[...]

  def kernel(x_hbm, o_hbm):
    pltpu.emit_pipeline(body, grid=(4,), in_specs=[pl.BlockSpec((1, 128), lambda i: (i, 0))],
                        out_specs=[pl.BlockSpec((1, 128), lambda i: (0, 0))])(x_hbm, o_hbm)

  any_spec = pl.BlockSpec(memory_space=pltpu.ANY)
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((1, 128), jnp.float32),
                       in_specs=[any_spec], out_specs=any_spec)(x)
  assert_close(out, np.sum(np.asarray(x), axis=0, keepdims=True))
