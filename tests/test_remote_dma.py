"""Remote DMAs, remote signals and barrier semaphores (pallet/distributed/remote.py, lockstep.py).

The collective kernels run on 4 simulated CPU devices in one child process
(tests/remote_dma_cases.py: ring all-gather, barrier-then-exchange, a double-buffered
ring reduce-scatter, pl.kernel and core_map meshes, every device-id form, control flow
that differs between devices, JAX's own all-gather op, grads, deadlock errors), each
compared with JAX's collective on random inputs. The errors that need no mesh run here.
"""
from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import pytest

import pallet as pl
import pallet.tpu as pltpu
from helpers import random_array, run_on_simulated_devices

CASES = ["ring_all_gather_f32_and_bf16", "grad_of_all_gather", "barrier_then_exchange",
         "ring_reduce_scatter_double_buffered", "kernel_and_core_map_on_a_core_mesh",
         "device_ids_mesh_logical_and_dict", "control_flow_that_differs_between_devices",
         "devices_that_wait_for_a_later_branch", "waits_whose_size_differs_per_device",
         "copies_whose_size_differs_per_device",
         "jax_all_gather_op", "deadlock_and_ordering_errors", "checking_mode_on_every_device"]
ANY = pl.BlockSpec(memory_space=pltpu.ANY)


@pytest.fixture(scope="module")
def child_output() -> str:
  return run_on_simulated_devices(path=str(pathlib.Path(__file__).parent / "remote_dma_cases.py"))


@pytest.mark.parametrize("case", CASES)
def test_collective_kernel_on_four_devices(child_output, case):
  assert f"CASE_OK {case}\n" in child_output, child_output


def _call(kernel, scratch):
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                        in_specs=[ANY], out_specs=ANY, scratch_shapes=scratch)


def test_a_remote_copy_outside_shard_map_is_a_clear_error():
  def send(x_ref, o_ref, send_sem, recv_sem):
    pltpu.make_async_remote_copy(x_ref, o_ref, send_sem, recv_sem, device_id=1).start()

  with pytest.raises(pl.PalletError, match=r"make_async_remote_copy in kernel 'send' at "
                                           r".*test_remote_dma.py:\d+: .*outside shard_map"):
    _call(send, [pltpu.SemaphoreType.DMA] * 2)(random_array((8, 128)))


def test_device_id_errors_name_the_kernel_and_what_was_expected():
  def logical_tuple(x_ref, o_ref, sem):
    pl.semaphore_signal(sem, 1, device_id=(0, 1), device_id_type=pl.DeviceIdType.LOGICAL)

  def float_id(x_ref, o_ref, sem):
    pl.semaphore_signal(sem, 1, device_id={"core": 0.5})

  def unknown_axis(x_ref, o_ref, sem):
    pl.semaphore_signal(sem, 1, device_id={"nowhere": 0})

  sem = [pltpu.SemaphoreType.REGULAR]
  with pytest.raises(pl.PalletError, match=r"kernel 'logical_tuple'.*LOGICAL device_id is "
                                           r"one scalar"):
    _call(logical_tuple, sem)(random_array((8, 128)))
  with pytest.raises(pl.PalletError, match=r"kernel 'unknown_axis'.*axis 'nowhere', which is "
                                           r"neither an axis of the enclosing mesh"):
    _call(unknown_axis, sem)(random_array((8, 128)))
  mesh = pltpu.create_tensorcore_mesh("core")
  with pytest.raises(pl.PalletError, match=r"kernel 'float_id'.*must be an integer scalar"):
    pl.kernel(float_id, out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32), mesh=mesh,
              scratch_types=sem)(random_array((8, 128)))


def test_the_running_core_may_be_named_other_cores_may_not():
  """On one device, a device_id naming only the kernel's own core (a pl.kernel mesh
  axis) is this device: the kernel runs; naming another core fails at run time."""
  mesh = pltpu.create_tensorcore_mesh("core")
  x = random_array((8, 128))

  def signal_core(core):
    def kernel(x_ref, o_ref, sem):
      pl.semaphore_signal(sem, 2, device_id={"core": core()})
      pl.semaphore_signal(sem, 1, core_index=core())
      pl.semaphore_wait(sem, 3)
      o_ref[...] = x_ref[...] * 2
    return pl.kernel(kernel, out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32), mesh=mesh,
                     scratch_types=[pltpu.SemaphoreType.REGULAR])

  assert jnp.array_equal(signal_core(lambda: jax.lax.axis_index("core"))(x), x * 2)
  with pytest.raises(Exception, match=r"names another core along 'core'"):
    jax.block_until_ready(signal_core(lambda: jax.lax.axis_index("core") + 1)(x))


def test_barrier_semaphore_outside_a_kernel_is_a_clear_error():
  with pytest.raises(pl.PalletError, match=r"get_barrier_semaphore\(\) at .*"
                                           r"test_remote_dma.py:\d+: called outside a kernel"):
    pltpu.get_barrier_semaphore()
