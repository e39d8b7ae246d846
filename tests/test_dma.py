"""DMAs and semaphores (`pltpu.make_async_copy`, `pl.semaphore_*`): what a TPU promises
(a copy is visible after its wait, a semaphore counts) and a clear error where a TPU
would hang, on the backend under test. The Triton backend counts semaphores while it
generates the kernel (pallet/backends/triton/dmas.py): the forms it cannot count are
XLA-only here, and clear errors there (the tests at the end)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
from pallet import tpu as pltpu
import pallet.triton as plt
from helpers import assert_close, current_test_backend, pallas_call, random_array, sds
from pallet.backends.triton import TritonLoweringError

ANY = pl.BlockSpec(memory_space=pltpu.ANY)
TRITON = current_test_backend() == "triton"


def xla_only(reason):
  return pytest.mark.skipif(TRITON, reason=f"the Triton backend refuses {reason} (see the "
                                           f"Triton tests at the end)")


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


@xla_only("semaphores signalled by amounts known only at run time")
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


@xla_only("copies waited on in a later grid step")
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
def _run_expecting_error(kernel, scratch, fragments, triton_fragments):
  """The XLA backend finds the unsatisfiable wait when it runs; the Triton backend when
  it counts the semaphore, generating the kernel."""
  x = random_array((8, 8))
  call = pallas_call(kernel, sds(x), in_specs=[ANY], out_specs=ANY, scratch_shapes=scratch)
  with pytest.raises(TritonLoweringError if TRITON else Exception) as info:
    jax.block_until_ready(call(x))
  for f in triton_fragments if TRITON else fragments:
    assert f in str(info.value), str(info.value)


def test_wait_without_a_started_copy_is_an_error_not_a_hang():
  def never_started(x_hbm, o_hbm, buf, sem):
    pltpu.make_async_copy(x_hbm, buf, sem).wait()   # the unsatisfiable wait

  _run_expecting_error(never_started, [pltpu.VMEM((8, 8), jnp.float32), pltpu.SemaphoreType.DMA],
                       ["DMA wait", "never_started", "test_dma.py", "never finish"],
                       ["kernel 'never_started'", "test_dma.py", "a DMA wait for 64 copied "
                        "elements on scratch 1 ('sem'), which holds 0"])


def test_second_wait_for_one_copy_is_an_error():
  def waits_twice(x_hbm, o_hbm, buf, sem):
    copy = pltpu.make_async_copy(x_hbm.at[pl.ds(0, 4)], buf.at[pl.ds(0, 4)], sem)
    copy.start()
    copy.wait()
    pltpu.make_async_copy(x_hbm, buf, sem).wait()   # 64 elements, none left

  _run_expecting_error(waits_twice, [pltpu.VMEM((8, 8), jnp.float32), pltpu.SemaphoreType.DMA],
                       ["waits_twice", "64 copied elements", "never finish"],
                       ["kernel 'waits_twice'", "64 copied elements", "holds 0"])


def test_unsatisfiable_semaphore_wait_is_an_error():
  def over_waits(x_hbm, o_hbm, sem):
    pl.semaphore_signal(sem, 2)
    pl.semaphore_wait(sem, 3)

  _run_expecting_error(over_waits, [pltpu.SemaphoreType.REGULAR],
                       ["semaphore_wait", "over_waits", "never finish"],
                       ["kernel 'over_waits'", "semaphore wait for 3 on scratch 0 ('sem'), "
                        "which holds 2"])


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


@xla_only("copies started under a condition and waited on after it")
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


@xla_only("semaphores signalled by amounts known only at run time")
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


@xla_only("reshaped and bitcast ref views")
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


# ------------------------------------------------------------------ forms the Triton backend lowers
def test_copies_started_and_waited_in_each_loop_iteration():
  """Windows at traced offsets, one semaphore reused by every iteration, add=True."""
  x, y = random_array((64, 16)), random_array((64, 16))

  def kernel(x_hbm, y_hbm, o_hbm, buf, sem):
    def step(k, carry):
      rows = pl.ds(pl.multiple_of(k * 8, 8), 8)
      pltpu.sync_copy(x_hbm.at[rows], buf)
      buf[...] = buf[...] * 2.0
      copy = pltpu.make_async_copy(buf, o_hbm.at[rows], sem)
      copy.start()
      copy.wait()
      pltpu.async_copy(y_hbm.at[rows], o_hbm.at[rows], sem, add=True).wait()
      return carry
    jax.lax.fori_loop(0, 8, step, 0)

  out = pallas_call(kernel, sds(x), in_specs=[ANY, ANY], out_specs=ANY,
                    scratch_shapes=[pltpu.VMEM((8, 16), jnp.float32),
                                    pltpu.SemaphoreType.DMA])(x, y)
  assert_close(out, 2.0 * x + y)


def test_dma_kernel_with_a_parallel_grid_axis():
  """Each grid step copies its own block in and out: on the Triton backend the steps
  run as separate GPU programs, each with its own scratch and semaphores."""
  x = random_array((4, 8, 128))
  poison = jnp.full((32, 128), jnp.nan, jnp.float32)

  def kernel(x_hbm, p_hbm, o_hbm, buf, sems):
    del p_hbm     # the poisoned buffer aliased to the output
    i = pl.program_id(0)
    pltpu.async_copy(x_hbm.at[3 - i], buf, sems.at[0]).wait()
    buf[...] = jnp.exp(buf[...]) + i.astype(jnp.float32)
    copy = pltpu.make_async_copy(buf, o_hbm.at[pl.ds(i * 8, 8)], sems.at[1])
    copy.start()
    copy.wait()

  out = pallas_call(kernel, sds(poison), grid=(4,), in_specs=[ANY, ANY], out_specs=ANY,
                    input_output_aliases={1: 0},
                    scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32),
                                    pltpu.SemaphoreType.DMA((2,))],
                    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))(
                        x, poison)
  expected = jnp.exp(x[::-1]) + jnp.arange(4, dtype=jnp.float32)[:, None, None]
  assert_close(out, expected.reshape(32, 128))


def test_copies_in_a_branch_with_semaphores_read_along_the_way():
  x = random_array((2, 8, 16))

  def kernel(x_hbm, o_ref, seen_ref, buf, sems):
    i = pl.program_id(0)

    @pl.when(i % 2 == 0)
    def _():
      pltpu.sync_copy(x_hbm.at[i], buf)

    @pl.when(i % 2 == 1)
    def _():
      copy = pltpu.make_async_copy(x_hbm.at[i], buf, sems.at[0], src_sem=sems.at[1])
      copy.start()
      copy.wait_send()
      copy.wait_recv()
      buf[...] = -buf[...]

    copy = pltpu.make_async_copy(buf, o_ref, sems.at[0], src_sem=sems.at[1])
    copy.start()
    seen_ref[0] = pl.semaphore_read(sems.at[0])
    seen_ref[1] = pl.semaphore_read(sems.at[1])
    copy.wait()
    seen_ref[2] = pl.semaphore_read(sems.at[0])

  out, seen = pallas_call(
      kernel, (jax.ShapeDtypeStruct((2, 8, 16), jnp.float32),
               jax.ShapeDtypeStruct((2, 3), jnp.int32)), grid=(2,), in_specs=[ANY],
      out_specs=(pl.BlockSpec((None, 8, 16), lambda i: (i, 0, 0)),
                 pl.BlockSpec((None, 3), lambda i: (i, 0), memory_space=pltpu.SMEM)),
      scratch_shapes=[pltpu.VMEM((8, 16), jnp.float32), pltpu.SemaphoreType.DMA((2,))])(x)
  assert_close(out, jnp.stack([x[0], -x[1]]))
  np.testing.assert_array_equal(seen, [[128, 128, 0]] * 2)


# ------------------------------------------------------------------ forms it refuses
def _triton_source(kernel, *, grid=(), scratch=(), params=None, x=None):
  x = random_array((4, 8, 16)) if x is None else x
  call = pl.pallas_call(kernel, sds(x), grid=grid, in_specs=[ANY], out_specs=ANY,
                        scratch_shapes=list(scratch), compiler_params=params,
                        backend="triton")
  return plt.source(call, x)


def _refused(kernel, message, **kw):
  with pytest.raises(TritonLoweringError, match=rf"kernel '{kernel.__name__}' \(.*"
                                                rf"test_dma\.py:\d+\).*test_dma\.py:\d+.*"
                                                + message):
    _triton_source(kernel, **kw)


_BUF = pltpu.VMEM((8, 16), jnp.float32)


def test_triton_refuses_copies_waited_on_in_a_later_grid_step():
  def double_buffered(x_hbm, o_hbm, bufs, sems):
    i = pl.program_id(0)

    def copy(step):
      return pltpu.make_async_copy(x_hbm.at[step], bufs.at[step % 2], sems.at[step % 2])

    @pl.when(i == 0)
    def _():
      copy(0).start()

    @pl.when(i + 1 < 4)
    def _():
      copy(i + 1).start()

    copy(i).wait()
    o_hbm[i] = bufs[i % 2]

  _refused(double_buffered, r"primitive 'cond': semaphore counts that differ between the "
                            r"branches of a condition \(branch 0: scratch 1 \('sems'\)\[0\] "
                            r"holds 128; branch 1: every semaphore at 0\)",
           grid=(4,), scratch=[pltpu.VMEM((2, 8, 16), jnp.float32),
                               pltpu.SemaphoreType.DMA((2,))])


def test_triton_refuses_a_count_left_for_the_next_grid_step():
  def left_over(x_hbm, o_hbm, buf, sem):
    pltpu.make_async_copy(x_hbm.at[pl.program_id(0)], buf, sem).start()
    o_hbm[pl.program_id(0)] = buf[...]

  with pytest.raises(TritonLoweringError,
                     match=r"kernel 'left_over' \(.*test_dma\.py:\d+\): scratch 1 \('sem'\) "
                           r"holds 128 at the end of a grid step \(last signalled at "
                           r".*test_dma\.py:\d+\).*double buffering across grid steps"):
    _triton_source(left_over, grid=(4,), scratch=[_BUF, pltpu.SemaphoreType.DMA])


def test_triton_refuses_a_copy_waited_on_in_the_next_loop_iteration():
  def prefetching(x_hbm, o_hbm, bufs, sems):
    def copy(k):
      return pltpu.make_async_copy(x_hbm.at[k], bufs.at[k % 2], sems.at[k % 2])
    copy(0).start()

    def step(k, carry):
      @pl.when(k + 1 < 4)
      def _():
        copy(k + 1).start()
      copy(k).wait()
      return carry
    jax.lax.fori_loop(0, 4, step, 0)

  _refused(prefetching, r"semaphore counts that differ",
           scratch=[pltpu.VMEM((2, 8, 16), jnp.float32), pltpu.SemaphoreType.DMA((2,))])


def test_triton_refuses_semaphores_counted_at_run_time():
  def run_time_amount(x_hbm, o_hbm, sem):
    pl.semaphore_signal(sem, x_hbm.shape[0] + pl.program_id(0))
    pl.semaphore_wait(sem, 4)

  _refused(run_time_amount, r"primitive 'semaphore_signal': a semaphore signal by an amount "
                            r"known only at run time",
           grid=(2,), scratch=[pltpu.SemaphoreType.REGULAR])


def test_triton_refuses_a_semaphore_selected_at_run_time():
  def selected_semaphore(x_hbm, o_hbm, sems):
    chosen = pl.select_ref(pl.program_id(0) % 2, sems.at[0], sems.at[1])
    pltpu.async_copy(x_hbm, o_hbm, chosen).wait()

  _refused(selected_semaphore, r"semaphore counts that differ between the branches",
           grid=(2,), scratch=[pltpu.SemaphoreType.DMA((2,))])


def test_triton_refuses_reading_a_semaphore_a_run_time_index_may_alias():
  def aliased_read(x_hbm, o_hbm, seen_ref, sems):
    i = pl.program_id(0)
    copy = pltpu.make_async_copy(x_hbm, o_hbm, sems.at[i % 2])
    copy.start()
    seen_ref[0] = pl.semaphore_read(sems.at[0])    # the same semaphore where i is even
    copy.wait()

  x = random_array((4, 8, 16))
  call = pl.pallas_call(aliased_read, (sds(x), jax.ShapeDtypeStruct((1,), jnp.int32)),
                        grid=(2,), in_specs=[ANY], out_specs=(ANY, ANY),
                        scratch_shapes=[pltpu.SemaphoreType.DMA((2,))], backend="triton")
  with pytest.raises(TritonLoweringError,
                     match=r"kernel 'aliased_read'.*test_dma\.py:\d+.*primitive "
                           r"'semaphore_read': reading scratch 0 \('sems'\)\[0\] while "
                           r"scratch 0 \('sems'\)\[\w+\] holds 512"):
    plt.source(call, x)


@pytest.mark.parametrize("interpret", [False, True])
def test_copy_started_in_one_call_and_waited_in_another(interpret):
  # The DMA semaphore is an output of the first call and an input of the second; with
  # interpret=True (which poisons unwritten outputs) it must still start at zero, or
  # the wait sees a poisoned count (it reported a never-finishing wait).
  x = random_array((8, 128))
  sem_spec = pl.BlockSpec(memory_space=pltpu.SEMAPHORE)

  def start(x_ref, aliased_x, o_ref, sem):
    del aliased_x
    pltpu.make_async_copy(x_ref, o_ref, sem).start()

  def done(x_ref, o_ref, sem, aliased_o):
    del aliased_o
    pltpu.make_async_copy(x_ref, o_ref, sem).wait()

  x2, out, sem = pl.pallas_call(
      start, out_shape=(sds(x), sds(x), pltpu.SemaphoreType.DMA(())), in_specs=[ANY],
      out_specs=(ANY, ANY, sem_spec), input_output_aliases={0: 0}, interpret=interpret)(x)
  out = pl.pallas_call(done, out_shape=sds(x), in_specs=[ANY, ANY, sem_spec], out_specs=ANY,
                       input_output_aliases={1: 0}, interpret=interpret)(x2, out, sem)
  assert_close(out, x)


@xla_only("operands in host memory")
def test_a_copy_into_an_operand_in_host_memory():
  """A DMA from device memory into an operand placed in host memory (`pl.HOST`, a
  `pinned_host` array aliased to the output), as KV-cache offloading kernels do."""
  def kernel(src_ref, host_in, host_out):
    del host_in

    def body(sem):
      pltpu.async_copy(src_ref, host_out, sem).wait()
    pl.run_scoped(body, pltpu.SemaphoreType.DMA)

  device = jax.devices()[0]
  x = random_array((8, 128))
  on_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  dest = jax.device_put(jnp.zeros_like(x), on_host)

  def copy(src, dst):
    return pl.pallas_call(kernel, in_specs=[pl.BlockSpec(memory_space=pl.ANY),
                                            pl.BlockSpec(memory_space=pl.HOST)],
                          out_specs=pl.BlockSpec(memory_space=pl.HOST),
                          input_output_aliases={1: 0},
                          out_shape=jax.ShapeDtypeStruct(dst.shape, dst.dtype))(src, dst)

  y = jax.jit(copy, out_shardings=on_host)(x, dest)
  assert y.sharding.memory_kind == "pinned_host"
  assert_close(y, x)
