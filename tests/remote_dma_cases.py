"""Collective kernels (remote DMAs, remote signals, barrier semaphores) on 4 simulated
CPU devices, each compared with JAX's own collective on fresh random inputs.

Run by tests/test_remote_dma.py in a child process (the device count is fixed when
JAX starts); every case prints "CASE_OK <name>" when it passes, or its traceback.
Outputs start poisoned (`interpret=True` fills them with NaN), so an element a
kernel fails to write shows.
"""
import functools
import pathlib
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import pallet as pl
import pallet.tpu as pltpu

assert len(jax.devices()) == 4, jax.devices()
N = 4
MESH = Mesh(np.array(jax.devices()), ("x",))
MESH2 = Mesh(np.array(jax.devices()).reshape(2, 2), ("y", "x"))
CASES = {}
ANY = pl.BlockSpec(memory_space=pltpu.ANY)
VMEM = pl.BlockSpec(memory_space=pltpu.VMEM)


def case(fn):
  CASES[fn.__name__] = fn
  return fn


def on_mesh(fn, in_specs, out_specs, mesh=MESH, check_vma=False):
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                               check_vma=check_vma))


def random(shape, seed, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


def close(actual, expected, **tol):
  np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                             **({"rtol": 1e-6, "atol": 1e-6} | tol))


def neighbours():
  me = lax.axis_index("x")
  return me, lax.rem(me + 1, N), lax.rem(me + N - 1, N)


def barrier_with(*devices):
  """Signals each device's barrier semaphore, then waits for as many signals here."""
  sem = pltpu.get_barrier_semaphore()
  for d in devices:
    pl.semaphore_signal(sem, 1, device_id=d)
  pl.semaphore_wait(sem, len(devices))


# ------------------------------------------------------------------ ring all-gather
def ring_all_gather_kernel(x_ref, o_ref, copy_sem, send_sem, recv_sem):
  """Each device's block travels right around the ring, one hop per step."""
  me, right, left = neighbours()
  pltpu.make_async_copy(x_ref, o_ref.at[me], copy_sem).start()
  pltpu.make_async_copy(x_ref, o_ref.at[me], copy_sem).wait()
  barrier_with(left, right)

  def step(i, carry):
    slot = lax.rem(me - i + N, N)
    hop = pltpu.make_async_remote_copy(o_ref.at[slot], o_ref.at[slot], send_sem, recv_sem,
                                       device_id=(right,))
    hop.start()
    hop.wait()
    return carry
  lax.fori_loop(0, N - 1, step, 0)


def ring_all_gather(x):
  return pl.pallas_call(ring_all_gather_kernel,
                        out_shape=jax.ShapeDtypeStruct((N, *x.shape), x.dtype),
                        in_specs=[ANY], out_specs=ANY,
                        scratch_shapes=[pltpu.SemaphoreType.DMA] * 3, interpret=True)(x)


@case
def ring_all_gather_f32_and_bf16():
  for dtype, seed in ((jnp.float32, 1), (jnp.bfloat16, 2), (jnp.int32, 3)):
    x = random((N * 8, 128), seed, dtype) if dtype != jnp.int32 else \
        jax.random.randint(jax.random.key(seed), (N * 8, 128), -1000, 1000, jnp.int32)
    for check_vma in (False, True):
      got = on_mesh(ring_all_gather, P("x"), P("x"), check_vma=check_vma)(x)
      want = on_mesh(lambda v: lax.all_gather(v, "x"), P("x"), P("x"))(x)
      close(got, want, rtol=0, atol=0)


@case
def grad_of_all_gather():
  x, w = random((N * 8, 128), 4), random((N * N * 8, 128), 5)
  for check_vma in (False, True):
    ours = on_mesh(ring_all_gather, P("x"), P("x"), check_vma=check_vma)
    ref = on_mesh(lambda v: lax.all_gather(v, "x"), P("x"), P("x"))
    loss = lambda f: (lambda v: jnp.sum(f(v).reshape(w.shape) * w))
    close(jax.grad(loss(ours))(x), jax.grad(loss(ref))(x), rtol=1e-5, atol=1e-5)
    close(jax.jit(jax.grad(loss(ours)))(x), jax.grad(loss(ref))(x), rtol=1e-5, atol=1e-5)
  xs = random((3, N * 8, 128), 14)      # and vmap over a batch of inputs
  close(jax.vmap(on_mesh(ring_all_gather, P("x"), P("x")))(xs),
        jax.vmap(on_mesh(lambda v: lax.all_gather(v, "x"), P("x"), P("x")))(xs), rtol=0, atol=0)


# ------------------------------------------------------------------ barrier, then exchange
def exchange_kernel(x_ref, o_ref, send_sems, recv_sems):
  """After a barrier with both neighbours, send the block left and right: o[0] holds
  the left neighbour's block, o[1] the right neighbour's."""
  me, right, left = neighbours()
  barrier_with(left, right)
  to_right = pltpu.make_async_remote_copy(x_ref, o_ref.at[0], send_sems.at[0],
                                          recv_sems.at[0], device_id=right)
  to_left = pltpu.make_async_remote_copy(x_ref, o_ref.at[1], send_sems.at[1],
                                         recv_sems.at[1], device_id=left)
  to_right.start()
  to_left.start()
  to_right.wait()
  to_left.wait()


@case
def barrier_then_exchange():
  x = random((N * 8, 256), 6)
  f = lambda v: pl.pallas_call(
      exchange_kernel, out_shape=jax.ShapeDtypeStruct((2, *v.shape), v.dtype),
      in_specs=[VMEM], out_specs=VMEM,
      scratch_shapes=[pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,))],
      compiler_params=pltpu.CompilerParams(collective_id=0), interpret=True)(v)[None]
  got = on_mesh(f, P("x"), P("x"))(x)
  from_left = lambda v: lax.ppermute(v, "x", [(i, (i + 1) % N) for i in range(N)])
  from_right = lambda v: lax.ppermute(v, "x", [(i, (i - 1) % N) for i in range(N)])
  want = on_mesh(lambda v: jnp.stack([from_left(v), from_right(v)])[None], P("x"), P("x"))(x)
  close(got, want, rtol=0, atol=0)


# ------------------------------------------------------------------ reduce-scatter
def reduce_scatter_kernel(x_ref, o_ref, acc, buf, send_sem, recv_sems, ready_sem):
  """Ring reduce-scatter over a grid of N - 1 steps. Step s sends the running sum of
  chunk (me - s - 1) right, into the receiver's buffer slot s % 2 (double buffering:
  a receiver first tells its left neighbour that the slot is free), and adds this
  device's own chunk to what arrived. After the last step the sum of chunk `me`."""
  s = pl.program_id(0)
  me, right, left = neighbours()

  @pl.when(s == 0)
  def _():
    barrier_with(left, right)
    acc[...] = x_ref[lax.rem(me + N - 1, N)]

  slot = lax.rem(s, 2)
  pl.semaphore_signal(ready_sem, 1, device_id={"x": left})
  pl.semaphore_wait(ready_sem, 1)
  hop = pltpu.make_async_remote_copy(acc, buf.at[slot], send_sem, recv_sems.at[slot],
                                     device_id={"x": right})
  hop.start()
  hop.wait_send()
  hop.wait_recv()
  acc[...] = buf[slot] + x_ref[lax.rem(me - s - 2 + 2 * N, N)]

  @pl.when(s == N - 2)
  def _():
    o_ref[...] = acc[...]


@case
def ring_reduce_scatter_double_buffered():
  x = random((N * N, 8, 128), 7)       # each device: (N, 8, 128), one chunk per device
  f = lambda v: pl.pallas_call(
      reduce_scatter_kernel, out_shape=jax.ShapeDtypeStruct(v.shape[1:], v.dtype),
      grid=(N - 1,), in_specs=[VMEM], out_specs=VMEM,
      scratch_shapes=[pltpu.VMEM(v.shape[1:], v.dtype), pltpu.VMEM((2, *v.shape[1:]), v.dtype),
                      pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA((2,)),
                      pltpu.SemaphoreType.REGULAR],
      compiler_params=pltpu.CompilerParams(collective_id=1), interpret=True)(v)
  got = on_mesh(f, P("x"), P("x"))(x)
  want = on_mesh(lambda v: lax.psum_scatter(v, "x"), P("x"), P("x"))(x)
  close(got, want, rtol=1e-5, atol=1e-5)
  # ... and its gradient (a reduce-scatter is linear: the cotangent is all-gathered)
  w = random(want.shape, 8)
  loss = lambda g: (lambda v: jnp.sum(on_mesh(g, P("x"), P("x"))(v) * w))
  close(jax.grad(loss(f))(x), jax.grad(loss(lambda v: lax.psum_scatter(v, "x")))(x),
        rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ pl.kernel and core_map
@case
def kernel_and_core_map_on_a_core_mesh():
  cores = pltpu.create_tensorcore_mesh("core")
  x = random((N * 8, 128), 9)
  want = on_mesh(lambda v: lax.ppermute(v, "x", [(i, (i + 1) % N) for i in range(N)]),
                 P("x"), P("x"))(x)

  def permute_right(x_ref, o_ref, send_sem, recv_sem):
    _, right, left = neighbours()
    barrier_with({"x": left}, {"x": right})
    pltpu.async_remote_copy(x_ref, o_ref, send_sem, recv_sem,
                            device_id={"x": right, "core": lax.axis_index("core")}).wait()

  f = pl.kernel(permute_right, out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                mesh=cores, scratch_types=[pltpu.SemaphoreType.DMA] * 2, interpret=True)
  close(on_mesh(f, P("x"), P("x"))(x), want, rtol=0, atol=0)

  def with_core_map(v):
    def stateful(refs):
      x_ref, o_ref = refs

      @pl.core_map(cores)
      def _():
        pl.run_scoped(lambda s, r: permute_right(x_ref, o_ref, s, r),
                      pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA)
    return pl.run_state(stateful)((v, jnp.full_like(v, jnp.nan)))[1]
  close(on_mesh(with_core_map, P("x"), P("x"))(x), want, rtol=0, atol=0)


# ------------------------------------------------------------------ device id forms
def send_to(target_of):
  """A kernel sending its block to the device `target_of()` names (and receiving one)."""
  def kernel(x_ref, o_ref, send_sem, recv_sem):
    pltpu.async_remote_copy(x_ref, o_ref, send_sem, recv_sem, **target_of()).wait()
  return lambda v: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
                                  in_specs=[ANY], out_specs=ANY,
                                  scratch_shapes=[pltpu.SemaphoreType.DMA] * 2,
                                  interpret=True)(v)


@case
def device_ids_mesh_logical_and_dict():
  x = random((2 * 8, 2 * 128), 10)     # a 2 x 2 mesh ("y", "x"), blocks of (8, 128)
  spec = P("y", "x")
  y, xi = lax.axis_index, lax.axis_index
  flat = lambda: y("y") * 2 + xi("x")
  forms = {
      # MESH coordinates (y, x): move along x
      "mesh_tuple": (lambda: dict(device_id=(y("y"), 1 - xi("x"))), "x", [(0, 1), (1, 0)]),
      # a dict names the axes that move; the others stay this device's
      "mesh_dict": (lambda: dict(device_id={"y": 1 - y("y")}), "y", [(0, 1), (1, 0)]),
      # LOGICAL: the flat index over the mesh, row-major
      "logical": (lambda: dict(device_id=lax.rem(flat() + 1, 4),
                               device_id_type=pl.DeviceIdType.LOGICAL),
                  ("y", "x"), [(i, (i + 1) % 4) for i in range(4)]),
      # a tuple of axis names as a key: one index over both axes jointly
      "joint_dict": (lambda: dict(device_id={("y", "x"): lax.rem(flat() + 3, 4)}),
                     ("y", "x"), [(i, (i + 3) % 4) for i in range(4)]),
      # the deprecated DeviceIdType.MESH spelled out, one scalar per axis
      "mesh_explicit": (lambda: dict(device_id=(1 - y("y"), 1 - xi("x")),
                                     device_id_type=pl.DeviceIdType.MESH),
                        ("y", "x"), [(i, 3 - i) for i in range(4)]),
  }
  for name, (target_of, axes, perm) in forms.items():
    got = on_mesh(send_to(target_of), spec, spec, MESH2)(x)
    want = on_mesh(lambda v: lax.ppermute(v, axes, perm), spec, spec, MESH2)(x)
    try:
      close(got, want, rtol=0, atol=0)
    except AssertionError as e:
      raise AssertionError(name) from e


# ------------------------------------------------------------------ control flow per device
def swap_pairs_and_count_kernel(x_ref, o_ref, n_ref, send_sem, recv_sem, count_sem):
  """Even devices send right, odd ones left (a `pl.when` each device decides for
  itself); then device d signals its right neighbour d + 1 times in a while loop
  whose trip count is its own, and reports how many signals it received."""
  me, right, left = neighbours()
  even = lax.rem(me, 2) == 0

  @pl.when(even)
  def _():
    pltpu.make_async_remote_copy(x_ref, o_ref, send_sem, recv_sem, device_id=me + 1).start()

  @pl.when(jnp.logical_not(even))
  def _():
    @functools.partial(lax.fori_loop, 0, 2, init_val=None)
    def _(half, carry):       # two half copies, from a loop inside the branch
      rows = pl.ds(half * 4, 4)
      pltpu.make_async_remote_copy(x_ref.at[rows], o_ref.at[rows], send_sem, recv_sem,
                                   device_id=me - 1).start()
      return carry

  pltpu.make_async_remote_copy(x_ref, o_ref, send_sem, recv_sem, device_id=me).wait()

  def signal_once(i):
    pl.semaphore_signal(count_sem, 1, device_id=right)
    return i + 1
  lax.while_loop(lambda i: i <= me, signal_once, 0)
  received = left + 1
  pl.semaphore_wait(count_sem, received)
  n_ref[0] = received + pl.semaphore_read(count_sem)


@case
def control_flow_that_differs_between_devices():
  x = random((N * 8, 128), 13)
  f = lambda v: pl.pallas_call(
      swap_pairs_and_count_kernel,
      out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((1,), jnp.int32)),
      in_specs=[ANY], out_specs=(ANY, pl.BlockSpec(memory_space=pltpu.SMEM)),
      scratch_shapes=[pltpu.SemaphoreType.DMA] * 2 + [pltpu.SemaphoreType.REGULAR],
      interpret=True)(v)
  got, counts = on_mesh(f, P("x"), (P("x"), P("x")))(x)
  swap = [(i, i ^ 1) for i in range(N)]
  close(got, on_mesh(lambda v: lax.ppermute(v, "x", swap), P("x"), P("x"))(x), rtol=0, atol=0)
  np.testing.assert_array_equal(counts, [(d - 1) % N + 1 for d in range(N)])


def handshake_kernel(x_ref, o_ref, sem, send_sem, recv_sem):
  """Device 0 waits for device 1's signal, which device 1 sends in a later `pl.when`,
  then sends its block to device 1; device 1 waits for it and answers with its own:
  each device's program reads top to bottom, the devices run concurrently (even
  devices likewise ask their right neighbour, who waits for the question)."""
  me = lax.axis_index("x")
  partner = jnp.where(lax.rem(me, 2) == 0, me + 1, me - 1)

  @pl.when(lax.rem(me, 2) == 0)
  def _():
    pl.semaphore_wait(sem, 1)                                    # the partner is ready
    pltpu.make_async_remote_copy(x_ref, o_ref, send_sem, recv_sem, device_id=partner).start()
    pltpu.make_async_remote_copy(x_ref, o_ref, send_sem, recv_sem,
                                 device_id=partner).wait()       # its answer arrived

  @pl.when(lax.rem(me, 2) == 1)
  def _():
    pl.semaphore_signal(sem, 1, device_id=partner)
    copy = pltpu.make_async_remote_copy(x_ref, o_ref, send_sem, recv_sem, device_id=partner)
    copy.wait_recv()                                             # the question arrived
    copy.start()
    copy.wait_send()


@case
def devices_that_wait_for_a_later_branch():
  x = random((N * 8, 128), 16)
  f = lambda v: pl.pallas_call(
      handshake_kernel, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
      in_specs=[ANY], out_specs=ANY,
      scratch_shapes=[pltpu.SemaphoreType.REGULAR] + [pltpu.SemaphoreType.DMA] * 2,
      interpret=True)(v)
  swap = [(i, i ^ 1) for i in range(N)]
  want = on_mesh(lambda v: lax.ppermute(v, "x", swap), P("x"), P("x"))(x)
  close(on_mesh(f, P("x"), P("x"))(x), want, rtol=0, atol=0)
  close(jax.grad(lambda v: jnp.sum(on_mesh(f, P("x"), P("x"))(v) * want))(x),
        jax.grad(lambda v: jnp.sum(on_mesh(lambda u: lax.ppermute(u, "x", swap), P("x"),
                                           P("x"))(v) * want))(x), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ JAX's example kernel
@case
def jax_all_gather_op():
  sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))
  from pallet.bench import jax_ops
  module = jax_ops.load("tpu/all_gather")
  for memory_space in (pltpu.VMEM, pltpu.ANY):
    x = random((N * 16, 128), 11)
    got = module.all_gather(jax.device_put(x, jax.NamedSharding(MESH, P("x"))), mesh=MESH,
                            axis_name="x", memory_space=memory_space)
    close(got, x, rtol=0, atol=0)


def chain_with_per_device_wait_kernel(x_ref, o_ref, n_ref, send_sem, recv_sem):
  """Devices 0..2 each send to the next; every device then waits on a view whose size
  (`pl.ds(0, 8 * received)`) is its own number known at run time (device 0 receives
  nothing and waits on no elements), and reports lax.clamp of a scalar all devices share
  between bounds that differ per device, and what its semaphore holds after the wait."""
  me = lax.axis_index("x")

  @pl.when(me < N - 1)
  def _():
    copy = pltpu.make_async_remote_copy(x_ref, o_ref, send_sem, recv_sem, device_id=me + 1)
    copy.start()
    copy.wait_send()

  received = jnp.where(me > 0, 1, 0)
  rows = pl.ds(0, 8 * received)
  pltpu.make_async_remote_copy(x_ref.at[rows], o_ref.at[rows], send_sem, recv_sem,
                               device_id=me).wait_recv()
  n_ref[0] = lax.clamp(jnp.int32(0), jnp.int32(2), me)
  n_ref[1] = pl.semaphore_read(recv_sem)


@case
def waits_whose_size_differs_per_device():
  x = random((N * 8, 128), 16)
  f = lambda v: pl.pallas_call(
      chain_with_per_device_wait_kernel,
      out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((2,), jnp.int32)),
      in_specs=[ANY], out_specs=(ANY, pl.BlockSpec(memory_space=pltpu.SMEM)),
      scratch_shapes=[pltpu.SemaphoreType.DMA] * 2, interpret=True)(v)
  got, n = on_mesh(f, P("x"), (P("x"), P("x")))(x)
  close(got[8:], x[:-8], rtol=0, atol=0)
  assert np.isnan(np.asarray(got[:8])).all(), "device 0 received nothing: its output stays poisoned"
  np.testing.assert_array_equal(np.asarray(n).reshape(N, 2), [[0, 0], [1, 0], [2, 0], [2, 0]])


def ragged_send_kernel(x_ref, o_ref, copy_sem, send_sem, recv_sem):
  """Each device sends a number of rows known only at run time (its index + 1, as an
  MoE kernel sends its tokens) from row `me` of its block to row `2 * me + 1` of its
  right neighbour's, after copying its own block into place; the receiver waits for
  exactly the rows its left neighbour sends."""
  me, right, left = neighbours()
  pltpu.sync_copy(x_ref, o_ref)
  barrier_with(left, right)
  n, n_left = me + 1, left + 1
  send = pltpu.make_async_remote_copy(x_ref.at[pl.ds(me, n)], o_ref.at[pl.ds(2 * me + 1, n)],
                                      send_sem, recv_sem, device_id=(right,))
  send.start()
  send.wait_send()
  pltpu.make_async_remote_copy(x_ref.at[pl.ds(left, n_left)],
                               o_ref.at[pl.ds(2 * left + 1, n_left)], send_sem, recv_sem,
                               device_id=(left,)).wait_recv()


@case
def copies_whose_size_differs_per_device():
  x = random((N * 16, 128), 17)
  f = lambda v: pl.pallas_call(
      ragged_send_kernel, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
      in_specs=[ANY], out_specs=ANY, scratch_shapes=[pltpu.SemaphoreType.DMA] * 3,
      compiler_params=pltpu.CompilerParams(collective_id=0), interpret=True)(v)
  got = np.asarray(on_mesh(f, P("x"), P("x"))(x)).reshape(N, 16, 128)
  blocks = np.asarray(x).reshape(N, 16, 128)
  expected = blocks.copy()
  for s in range(N):
    r, n = (s + 1) % N, s + 1
    expected[r, 2 * s + 1:2 * s + 1 + n] = blocks[s, s:s + n]
  close(got, expected, rtol=0, atol=0)


# ------------------------------------------------------------------ errors
def run_expecting(f, x, *needles):
  try:
    jax.block_until_ready(f(x))
  except Exception as e:   # JAX wraps the run-time check's error
    text = str(e)
    missing = [n for n in needles if n not in text]
    assert not missing, f"{missing} not in: {text}"
    return
  raise AssertionError("no error")


def line_of(marker):
  lines = pathlib.Path(__file__).read_text().splitlines()
  return next(i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(marker))


def never_signalled(x_ref, o_ref, sem):
  o_ref[...] = x_ref[...]
  pl.semaphore_wait(sem, 1)  # WAITS FOREVER


def waits_in_a_loop_for_a_later_signal(x_ref, o_ref):
  """Device 0 waits, inside a loop, for device 1, which signals only after the loop: a
  TPU runs this (device 1 skips the wait and runs ahead), lockstep cannot order it
  (a loop runs whole, for every device at once)."""
  me = lax.axis_index("x")
  sem = pltpu.get_barrier_semaphore()

  def body(i, carry):
    @pl.when(me == 0)
    def _():
      pl.semaphore_wait(sem, 1)  # WAITS FOR A LATER SIGNAL
    return carry
  lax.fori_loop(0, 1, body, 0)

  @pl.when(me == 1)
  def _():
    pl.semaphore_signal(sem, 1, device_id=0)
  o_ref[...] = x_ref[...]


def off_the_mesh(x_ref, o_ref, send_sem, recv_sem):
  me = lax.axis_index("x")
  pltpu.async_remote_copy(x_ref, o_ref, send_sem, recv_sem, device_id=me + 2).wait()


@case
def deadlock_and_ordering_errors():
  x = random((N * 8, 128), 12)
  call = lambda k, scratch: (lambda v: pl.pallas_call(
      k, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype), in_specs=[VMEM], out_specs=VMEM,
      scratch_shapes=scratch)(v))
  # the kernel only talks to other devices through its wait's neighbours: give it a
  # remote signal that never reaches the waiting semaphore
  def lonely(x_ref, o_ref, sem, other):
    pl.semaphore_signal(other, 1, device_id=lax.rem(lax.axis_index("x") + 1, N))
    never_signalled(x_ref, o_ref, sem)
  run_expecting(on_mesh(call(lonely, [pltpu.SemaphoreType.REGULAR] * 2), P("x"), P("x")), x,
                "semaphore_wait in kernel 'lonely'",
                f"remote_dma_cases.py:{line_of('# WAITS FOREVER')}", "would hang")
  run_expecting(on_mesh(call(waits_in_a_loop_for_a_later_signal, []), P("x"), P("x")), x,
                "semaphore_wait in kernel 'waits_in_a_loop_for_a_later_signal'",
                f"remote_dma_cases.py:{line_of('# WAITS FOR A LATER SIGNAL')}", "lockstep")
  run_expecting(on_mesh(call(off_the_mesh, [pltpu.SemaphoreType.DMA] * 2), P("x"), P("x")), x,
                "kernel 'off_the_mesh'", "outside the axis (size 4)")


def reads_past_the_end_on_device_2(x_ref, o_ref, sem):
  me, right, left = neighbours()

  @pl.when(me == 2)
  def _():
    o_ref[0, 0] = x_ref[me * 50, 0]  # OUT OF BOUNDS ON ONE DEVICE
  barrier_with(left, right)


@case
def checking_mode_on_every_device():
  """Checking mode's bounds checks run on each device (the others read in bounds)."""
  x = random((N * 8, 128), 15)
  checked = lambda v: pl.pallas_call(
      reads_past_the_end_on_device_2, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
      in_specs=[VMEM], out_specs=VMEM, scratch_shapes=[pltpu.SemaphoreType.REGULAR],
      interpret=pl.InterpretParams(out_of_bounds_reads="raise",
                                   uninitialized_memory="zero"))(v)
  run_expecting(on_mesh(checked, P("x"), P("x")), x,
                "out_of_bounds in kernel 'reads_past_the_end_on_device_2'",
                f"remote_dma_cases.py:{line_of('# OUT OF BOUNDS ON ONE DEVICE')}")


if __name__ == "__main__":
  for name, fn in CASES.items():
    if len(sys.argv) > 1 and name not in sys.argv[1:]:
      continue
    try:
      fn()
      print("CASE_OK", name, flush=True)
    except Exception:
      print("CASE_FAILED", name, flush=True)
      traceback.print_exc()
