"""DMAs and semaphores (`pltpu.make_async_copy`, `pl.semaphore_*`): what a TPU promises
(a copy is visible after its wait, a semaphore counts) and a clear error where a TPU
would hang."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
from pallet import tpu as pltpu
from helpers import assert_close, current_test_backend, pallas_call, random_array, sds

pytestmark = pytest.mark.skipif(
    current_test_backend() != "xla",
    reason="DMAs and semaphores run on the XLA backend; the Triton backend has no rules for them")

ANY = pl.BlockSpec(memory_space=pltpu.ANY)


def test_copy_is_visible_after_wait():
  x = random_array((4, 16, 8))

  def kernel(x_hbm, o_ref, buf, sem):
    i = pl.program_id(0)
    copy = pltpu.make_async_copy(x_hbm.at[3 - i, pl.ds(4, 8)], buf, sem)
    copy.start()
    copy.wait()
    o_ref[...] = buf[...] * 2.0

  out = pallas_call(
      kernel, jax.ShapeDtypeStruct((4, 8, 8), x.dtype), grid=(4,), in_specs=[ANY],
      out_specs=pl.BlockSpec((None, 8, 8), lambda i: (i, 0, 0)),
      scratch_shapes=[pltpu.VMEM((8, 8), x.dtype), pltpu.SemaphoreType.DMA])(x)
  assert_close(out, x[::-1, 4:12] * 2.0)


@pytest.mark.parametrize("memory_space", [pltpu.VMEM, pltpu.SMEM, pltpu.ANY])
def test_refs_made_with_jax_empty_ref_in_a_memory_space(memory_space):
  """`jax.empty_ref(ty, pltpu.VMEM)` in a kernel: on the CPU every memory space is one."""
  x = random_array((4, 16, 128))

  def kernel(x_ref, o_ref):
    buf = jax.empty_ref(jax.ShapeDtypeStruct((16, 128), x.dtype), memory_space)
    pltpu.sync_copy(x_ref, buf)
    buf[...] += 1.0
    o_ref[...] = buf[...] * 2.0

  out = pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
                    in_specs=[pl.BlockSpec((None, 16, 128), lambda i: (i, 0, 0))],
                    out_specs=pl.BlockSpec((None, 16, 128), lambda i: (i, 0, 0)))(x)
  assert_close(out, (x + 1.0) * 2.0)


@pytest.mark.parametrize("sem_shape", [(2,), 2])   # an int is a 1-D shape, as in Pallas
def test_copies_into_an_any_output_and_add(sem_shape):
  x, y = random_array((16, 8)), random_array((16, 8))

  def kernel(x_hbm, y_hbm, o_hbm, sems):
    first = pltpu.async_copy(x_hbm, o_hbm, sems.at[0])
    first.wait()
    pltpu.async_copy(y_hbm.at[pl.ds(0, 8)], o_hbm.at[pl.ds(8, 8)], sems.at[1], add=True).wait()
    pltpu.sync_copy(y_hbm.at[pl.ds(8, 8)], o_hbm.at[pl.ds(0, 8)])

  out = pallas_call(kernel, sds(x), in_specs=[ANY, ANY], out_specs=ANY,
                    scratch_shapes=[pltpu.SemaphoreType.DMA(sem_shape)])(x, y)
  assert_close(out, jnp.concatenate([y[8:], x[8:] + y[:8]]))


def test_source_semaphore_counts_the_read():
  x = random_array((8, 8))

  def kernel(x_hbm, o_hbm, seen, sems):
    copy = pltpu.make_async_copy(x_hbm, o_hbm, sems.at[0], src_sem=sems.at[1])
    copy.start()
    seen[0] = pl.semaphore_read(sems.at[1])
    copy.wait_send()
    seen[1] = pl.semaphore_read(sems.at[1])
    copy.wait_recv()
    pltpu.make_async_copy(x_hbm, o_hbm).start()   # no semaphore: nothing to wait on

  out, seen = pallas_call(
      kernel, (sds(x), jax.ShapeDtypeStruct((2,), jnp.int32)), in_specs=[ANY],
      out_specs=(ANY, pl.BlockSpec(memory_space=pltpu.SMEM)),
      scratch_shapes=[pltpu.SemaphoreType.DMA((2,))])(x)
  assert_close(out, x)
  np.testing.assert_array_equal(seen, [64, 0])


def test_semaphores_count():
  inc = random_array((3,), jnp.int32, low=1, high=9)

  def kernel(inc_ref, o_ref, sem):
    for i in range(3):
      pl.semaphore_signal(sem, inc_ref[i])
    o_ref[0] = pl.semaphore_read(sem)
    pl.semaphore_wait(sem, inc_ref[0])
    o_ref[1] = pl.semaphore_read(sem)
    pl.semaphore_wait(sem, 1, decrement=False)
    o_ref[2] = pl.semaphore_read(sem)

  out = pallas_call(kernel, jax.ShapeDtypeStruct((3,), jnp.int32),
                    scratch_shapes=[pltpu.SemaphoreType.REGULAR])(inc)
  total = int(inc.sum())
  np.testing.assert_array_equal(out, [total, total - int(inc[0]), total - int(inc[0])])


def test_dma_semaphore_counts_elements_of_every_copy():
  """Several copies signal one semaphore; one wait for the whole buffer takes them all."""
  x = random_array((6, 4, 8))
  pages = jnp.array([5, 0, 3], jnp.int32)

  def kernel(pages_ref, x_hbm, o_ref, buf, sem):
    for i in range(3):
      pltpu.make_async_copy(x_hbm.at[pages_ref[i]], buf.at[i], sem).start()
    pltpu.make_async_copy(buf, buf, sem).wait()
    o_ref[...] = buf[...]

  out = pallas_call(
      kernel, jax.ShapeDtypeStruct((3, 4, 8), x.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(1,), in_specs=[ANY],
          out_specs=pl.BlockSpec((3, 4, 8), lambda i, p: (0, 0, 0)),
          scratch_shapes=[pltpu.VMEM((3, 4, 8), x.dtype), pltpu.SemaphoreType.DMA]))(pages, x)
  assert_close(out, x[pages])


def test_none_scratch_entries_reach_the_kernel_as_none():
  """paged_attention passes None for the scale buffers of unquantized pages."""
  x = random_array((8, 8))

  def kernel(x_hbm, o_ref, buf, scales, sem):
    assert scales is None
    pltpu.sync_copy(x_hbm, buf)
    o_ref[...] = buf[...] - 1.0

  out = pallas_call(kernel, sds(x), in_specs=[ANY],
                    scratch_shapes=[pltpu.VMEM((8, 8), x.dtype), None,
                                    pltpu.SemaphoreType.DMA])(x)
  assert_close(out, x - 1.0)


def test_double_buffering_across_grid_steps():
  """Step i waits for the block step i-1 started (slot i % 2) and prefetches block i+1.
  One TensorCore (pallet's stand-in is a v5e) runs "parallel" axes in order too."""
  n, block = 6, 8
  x = random_array((n * block, 16))

  def kernel(x_hbm, o_ref, bufs, sems):
    i = pl.program_id(0)

    def copy(step, slot):
      return pltpu.make_async_copy(x_hbm.at[pl.ds(step * block, block)], bufs.at[slot],
                                   sems.at[slot])

    @pl.when(i == 0)
    def _():
      copy(0, 0).start()

    @pl.when(i + 1 < n)
    def _():
      copy(i + 1, (i + 1) % 2).start()

    copy(i, i % 2).wait()
    o_ref[...] = jnp.cumsum(bufs[i % 2], axis=0) + i.astype(jnp.float32)

  out = pallas_call(
      kernel, sds(x), grid=(n,), in_specs=[ANY],
      out_specs=pl.BlockSpec((block, 16), lambda i: (i, 0)),
      scratch_shapes=[pltpu.VMEM((2, block, 16), x.dtype), pltpu.SemaphoreType.DMA((2,))],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))(x)
  expected = (jnp.cumsum(x.reshape(n, block, 16), axis=1)
              + jnp.arange(n, dtype=x.dtype)[:, None, None]).reshape(x.shape)
  assert_close(out, expected)


def test_scalar_prefetch_writes_persist_across_grid_steps():
  """Scalar-prefetch operands live in SMEM on a TPU: a kernel may keep state there."""
  x = random_array((4, 8))

  def kernel(state_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] + state_ref[0].astype(jnp.float32)
    state_ref[0] = state_ref[0] * 2

  call = pallas_call(
      kernel, sds(x),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(4,),
          in_specs=[pl.BlockSpec((1, 8), lambda i, s: (i, 0))],
          out_specs=pl.BlockSpec((1, 8), lambda i, s: (i, 0))))
  out = call(jnp.array([3], jnp.int32), x)
  assert_close(out, x + jnp.array([3.0, 6.0, 12.0, 24.0])[:, None])
  # under vmap, every batch element starts from the operand's value again
  xs = jnp.stack([x, -x])
  outs = jax.vmap(lambda x: call(jnp.array([3], jnp.int32), x))(xs)
  assert_close(outs, xs + jnp.array([3.0, 6.0, 12.0, 24.0])[:, None])


def test_semaphores_in_run_scoped():
  x = random_array((8, 8))

  def kernel(x_hbm, o_hbm):
    def body(buf, sems):
      pltpu.make_async_copy(x_hbm, buf, sems.at[1]).start()
      pltpu.make_async_copy(x_hbm, buf, sems.at[1]).wait()
      buf[...] = buf[...] + 1.0
      pltpu.make_async_copy(buf, o_hbm, sems.at[0]).start()
      pltpu.make_async_copy(buf, o_hbm, sems.at[0]).wait()
    pl.run_scoped(body, pltpu.VMEM((8, 8), jnp.float32), pltpu.SemaphoreType.DMA((2,)))

  out = pallas_call(kernel, sds(x), in_specs=[ANY], out_specs=ANY)(x)
  assert_close(out, x + 1.0)


@pytest.mark.parametrize("dtype", [pltpu.dma_semaphore, pl.semaphore])
def test_semaphore_memory_space_scratch(dtype):
  """`pltpu.SEMAPHORE(shape, dtype)` is another way to ask for semaphores."""
  x = random_array((2, 8))

  def kernel(x_hbm, o_hbm, sems):
    pltpu.make_async_copy(x_hbm.at[0], o_hbm.at[1], sems.at[1]).start()
    pltpu.make_async_copy(x_hbm.at[1], o_hbm.at[0], sems.at[0]).start()
    pltpu.make_async_copy(x_hbm.at[0], o_hbm.at[1], sems.at[1]).wait()
    pltpu.make_async_copy(x_hbm.at[1], o_hbm.at[0], sems.at[0]).wait()

  out = pallas_call(kernel, sds(x), in_specs=[ANY], out_specs=ANY,
                    scratch_shapes=[pltpu.SEMAPHORE((2,), dtype)])(x)
  assert_close(out, x[::-1])


def test_dma_kernel_under_jit_and_vmap():
  x = random_array((3, 16, 8))

  def kernel(x_hbm, o_hbm, sem):
    copy = pltpu.make_async_copy(x_hbm.at[pl.ds(8, 8)], o_hbm.at[pl.ds(0, 8)], sem)
    copy.start()
    copy.wait()
    o_hbm[pl.ds(8, 8), :] = x_hbm[pl.ds(0, 8), :]

  call = pallas_call(kernel, jax.ShapeDtypeStruct((16, 8), x.dtype), in_specs=[ANY],
                     out_specs=ANY, scratch_shapes=[pltpu.SemaphoreType.DMA])
  out = jax.jit(jax.vmap(call))(x)
  assert_close(out, jnp.roll(x, 8, axis=1))


# ------------------------------------------------------------------ errors
def _run_expecting_error(kernel, scratch, fragments):
  x = random_array((8, 8))
  call = pallas_call(kernel, sds(x), in_specs=[ANY], out_specs=ANY, scratch_shapes=scratch)
  with pytest.raises(Exception) as info:
    jax.block_until_ready(call(x))
  for f in fragments:
    assert f in str(info.value), str(info.value)


def test_wait_without_a_started_copy_is_an_error_not_a_hang():
  def never_started(x_hbm, o_hbm, buf, sem):
    pltpu.make_async_copy(x_hbm, buf, sem).wait()   # the unsatisfiable wait

  _run_expecting_error(never_started, [pltpu.VMEM((8, 8), jnp.float32), pltpu.SemaphoreType.DMA],
                       ["DMA wait", "never_started", "test_dma.py", "never finish"])


def test_second_wait_for_one_copy_is_an_error():
  def waits_twice(x_hbm, o_hbm, buf, sem):
    copy = pltpu.make_async_copy(x_hbm.at[pl.ds(0, 4)], buf.at[pl.ds(0, 4)], sem)
    copy.start()
    copy.wait()
    pltpu.make_async_copy(x_hbm, buf, sem).wait()   # 64 elements, none left

  _run_expecting_error(waits_twice, [pltpu.VMEM((8, 8), jnp.float32), pltpu.SemaphoreType.DMA],
                       ["waits_twice", "64 copied elements", "never finish"])


def test_unsatisfiable_semaphore_wait_is_an_error():
  def over_waits(x_hbm, o_hbm, sem):
    pl.semaphore_signal(sem, 2)
    pl.semaphore_wait(sem, 3)

  _run_expecting_error(over_waits, [pltpu.SemaphoreType.REGULAR],
                       ["semaphore_wait", "over_waits", "never finish"])


def test_waiting_on_a_copy_without_semaphore_is_a_clear_error():
  def no_sem(x_hbm, o_hbm):
    pltpu.make_async_copy(x_hbm, o_hbm).wait()

  with pytest.raises(pl.PalletError, match=r"wait_recv\(\) in kernel 'no_sem'.*no semaphore"):
    pallas_call(no_sem, jax.ShapeDtypeStruct((8, 8), jnp.float32), in_specs=[ANY],
                out_specs=ANY)(random_array((8, 8)))


def test_copy_shape_mismatch_is_a_clear_error():
  def mismatched(x_hbm, o_hbm, buf, sem):
    pltpu.make_async_copy(x_hbm.at[pl.ds(0, 4)], buf, sem).start()

  with pytest.raises(pl.PalletError, match=r"mismatched.*same shape"):
    pallas_call(mismatched, jax.ShapeDtypeStruct((8, 8), jnp.float32), in_specs=[ANY],
                out_specs=ANY,
                scratch_shapes=[pltpu.VMEM((8, 8), jnp.float32), pltpu.SemaphoreType.DMA])(
                    random_array((8, 8)))


def test_copy_from_a_ref_selected_at_run_time():
  """JAX's documented use of pl.select_ref: the source of a DMA chosen per grid step."""
  a, b = random_array((4, 8, 16)), random_array((4, 8, 16))
  choice = jnp.array([1, 0, 0, 1], jnp.int32)

  def kernel(choice_ref, a_hbm, b_hbm, o_ref, buf, sem):
    i = pl.program_id(0)
    src = pl.select_ref(choice_ref[i], a_hbm.at[i], b_hbm.at[i])
    pltpu.async_copy(src, buf, sem).wait()
    o_ref[...] = buf[...] * 2

  any_spec = pl.BlockSpec(memory_space=pltpu.ANY)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(4,), in_specs=[any_spec, any_spec],
      out_specs=pl.BlockSpec((None, 8, 16), lambda i, c: (i, 0, 0)),
      scratch_shapes=[pltpu.VMEM((8, 16), jnp.float32), pltpu.SemaphoreType.DMA])
  out = pallas_call(kernel, sds(a), grid_spec=grid_spec)(choice, a, b)
  assert_close(out, 2 * jnp.where(choice[:, None, None] == 0, a, b))


def test_copies_signal_and_wait_on_a_semaphore_selected_at_run_time():
  """pl.select_ref over semaphores: each copy signals the chosen one of two DMA
  semaphores and waits on it; the other one is left untouched."""
  xs = [random_array((8, 16)) for _ in range(4)]

  def kernel(x0, x1, x2, x3, o_hbm, counts_ref, sems):
    for i, x in enumerate((x0, x1, x2, x3)):
      chosen = pl.select_ref(jnp.int32(i) % 2, sems.at[0], sems.at[1])
      copy = pltpu.make_async_copy(x, o_hbm.at[pl.ds(8 * i, 8)], chosen)
      copy.start()
      counts_ref[i] = pl.semaphore_read(sems.at[i % 2])   # the chosen one counts the copy
      counts_ref[4 + i] = pl.semaphore_read(sems.at[1 - i % 2])
      copy.wait()

  out, counts = pallas_call(
      kernel, (jax.ShapeDtypeStruct((32, 16), jnp.float32),
               jax.ShapeDtypeStruct((8,), jnp.int32)),
      in_specs=[ANY] * 4, out_specs=(ANY, pl.BlockSpec(memory_space=pltpu.SMEM)),
      scratch_shapes=[pltpu.SemaphoreType.DMA((2,))])(*xs)
  assert_close(out, jnp.concatenate(xs))
  np.testing.assert_array_equal(counts, [128] * 4 + [0] * 4)


def test_semaphore_signal_wait_and_read_through_select_ref():
  inc = random_array((2,), jnp.int32, low=1, high=9)

  def kernel(idx_ref, inc_ref, o_ref, s0, s1):
    chosen = pl.select_ref(idx_ref[0], s0, s1)
    pl.semaphore_signal(chosen, inc_ref[0])
    pl.semaphore_signal(s1, inc_ref[1])
    o_ref[0] = pl.semaphore_read(s0)
    o_ref[1] = pl.semaphore_read(s1)
    o_ref[2] = pl.semaphore_read(chosen)
    pl.semaphore_wait(chosen, inc_ref[0])
    o_ref[3] = pl.semaphore_read(chosen)
    pl.semaphore_wait(s1, pl.semaphore_read(s1))

  smem = pl.BlockSpec(memory_space=pltpu.SMEM)
  call = pallas_call(kernel, jax.ShapeDtypeStruct((4,), jnp.int32), in_specs=[smem, smem],
                     out_specs=smem, scratch_shapes=[pltpu.SemaphoreType.REGULAR] * 2)
  a, b = int(inc[0]), int(inc[1])
  np.testing.assert_array_equal(call(jnp.array([0], jnp.int32), inc), [a, b, a, 0])
  np.testing.assert_array_equal(call(jnp.array([1], jnp.int32), inc), [0, a + b, a + b, b])


def test_select_ref_reshaped_and_bitcast_selects_the_same_view_of_each_candidate():
  a, b = random_array((2, 4, 128)), random_array((2, 4, 128))
  choice = jnp.array([1, 0], jnp.int32)

  def kernel(choice_ref, a_hbm, b_hbm, o_hbm, bits_ref, sem):
    for i in range(2):
      sel = pl.select_ref(choice_ref[i], a_hbm, b_hbm)
      pltpu.async_copy(sel.reshape(8, 128), o_hbm.at[i], sem).wait()
    bits_ref[...] = pl.select_ref(choice_ref[0], a_hbm, b_hbm).bitcast(jnp.int32)[0]

  smem = pl.BlockSpec(memory_space=pltpu.SMEM)
  out, bits = pallas_call(
      kernel, (jax.ShapeDtypeStruct((2, 8, 128), jnp.float32),
               jax.ShapeDtypeStruct((4, 128), jnp.int32)),
      in_specs=[smem, ANY, ANY], out_specs=(ANY, pl.BlockSpec(memory_space=pltpu.VMEM)),
      scratch_shapes=[pltpu.SemaphoreType.DMA])(choice, a, b)
  assert_close(out, jnp.stack([b.reshape(8, 128), a.reshape(8, 128)]))
  np.testing.assert_array_equal(bits, jax.lax.bitcast_convert_type(b[0], jnp.int32))
