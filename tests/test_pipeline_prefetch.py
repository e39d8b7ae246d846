"""`pl.Buffered(prefetched_count=k)` inputs of `pltpu.emit_pipeline`: the first k blocks
the pipeline fetches come from a window the caller filled and bound with
`allocation.with_window_ref(...)`, later ones from the input ref, as on a TPU."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import pallet as pl
from pallet import tpu as pltpu
from helpers import assert_close, pallas_call, poisoned, random_array

ANY = pl.BlockSpec(memory_space=pltpu.ANY)


def _run(window, x, *, index_map, grid, block=128, prefetched_count=1, buffer_count=2,
         bind=True):
  """Copies input blocks (index_map) to output blocks (step i -> block i) through a
  pipeline whose input has `window` prefetched; the output starts poisoned."""
  n_out = grid * block

  def kernel(x_hbm, window_ref, _, o_hbm):
    def body(x_blk, o_blk):
      o_blk[...] = x_blk[...]
    pipeline, make_allocations = pltpu.emit_pipeline_with_allocations(
        body, grid=(grid,),
        in_specs=[pl.BlockSpec((block,), index_map, pipeline_mode=pl.Buffered(
            buffer_count=buffer_count, prefetched_count=prefetched_count))],
        out_specs=[pl.BlockSpec((block,), lambda i: (i,))])

    @functools.partial(pl.run_scoped, allocs=make_allocations(x_hbm, o_hbm))
    def _(allocs):
      x_alloc, o_alloc = allocs
      if bind:
        x_alloc = x_alloc.with_window_ref(window_ref)
      pipeline(x_hbm, o_hbm, allocations=(x_alloc, o_alloc))

  return pallas_call(kernel, jax.ShapeDtypeStruct((n_out,), jnp.float32),
                     in_specs=[ANY, ANY, ANY], out_specs=ANY,
                     input_output_aliases={2: 0})(x, window, poisoned((n_out,)))


@pytest.mark.parametrize("layout", ["leading", "flat"])
def test_first_fetch_comes_from_the_prefetched_window(layout):
  # Blocks 0, 0, 1, 1: the first fetch (steps 0 and 1, the block unchanged) is slot 0 of
  # the window, which differs from the input; the second fetch is copied from the input.
  x, window = random_array((256,)), random_array((2, 128))
  bound = window if layout == "leading" else window.reshape(256)
  out = _run(bound, x, index_map=lambda i: (i // 2,), grid=4)
  expected = jnp.concatenate([window[0], window[0], x[128:], x[128:]])
  assert_close(out, expected, rtol=0, atol=0)


def test_two_prefetched_fetches_fill_two_slots():
  x, window = random_array((512,)), random_array((3, 128))
  out = _run(window, x, index_map=lambda i: (3 - i,), grid=4, prefetched_count=2,
             buffer_count=3)
  expected = jnp.concatenate([window[0], window[1], x[128:256], x[:128]])
  assert_close(out, expected, rtol=0, atol=0)


def test_a_window_holding_the_whole_block_is_that_block():
  x, window = random_array((512,)), random_array((512,))
  out = _run(window, x, index_map=lambda i: (0,), grid=1, block=512, buffer_count=1)
  assert_close(out, window, rtol=0, atol=0)


def test_a_prefetched_input_without_its_window_is_a_clear_error():
  x = random_array((512,))
  with pytest.raises(ValueError, match=r"emit_pipeline in kernel 'kernel' at "
                     r".*test_pipeline_prefetch.py:\d+, input 0: Expected external window "
                     r"buffer to be bound for prefetched input \(prefetched_count=1\)"):
    _run(random_array((2, 128)), x, index_map=lambda i: (i,), grid=4, bind=False)


def test_a_window_without_room_for_its_slots_is_a_clear_error():
  x = random_array((512,))
  with pytest.raises(pl.PalletError, match=r"input 0: the prefetched window has shape "
                     r"\(100,\); for blocks of shape \(128,\) and buffer_count=2"):
    _run(random_array((100,)), x, index_map=lambda i: (i,), grid=4)
