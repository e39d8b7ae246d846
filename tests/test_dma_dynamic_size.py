"""DMAs whose length is known only at run time: `make_async_copy(src.at[pl.ds(start, n)],
dst.at[pl.ds(0, n)], sem)` with a traced `n`, as paged and ragged attention and causal
convolutions use them. The copy moves exactly `n` rows, its semaphore counts them, a
wait on a descriptor of the same views waits for them; JAX's TPU interpreter is the
oracle where it runs the same kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pallet as pl
from pallet import tpu as pltpu
from helpers import assert_close, current_test_backend, pallas_call, random_array

pytestmark = pytest.mark.skipif(
    current_test_backend() != "xla",
    reason="DMAs and semaphores run on the XLA backend; the Triton backend has no rules for them")

f32 = jnp.float32
ROWS, COLS, BUF = 64, 128, 16
FILL = -7.0   # what the kernel leaves in the buffer where no row was copied


def _window_kernel(pl, pltpu, read_count=True):
  """Copies rows [start, start + n) of x into rows [offset, offset + n) of a buffer
  first filled with FILL; also reports the semaphore count after the start (JAX's TPU
  interpreter has no semaphore_read)."""
  def kernel(s_ref, x_hbm, o_ref, count_ref, buf, sem):
    start, n, offset = s_ref[0], s_ref[1], s_ref[2]
    buf[...] = jnp.full(buf.shape, FILL, buf.dtype)
    copy = pltpu.make_async_copy(x_hbm.at[pl.ds(start, n)], buf.at[pl.ds(offset, n)], sem)
    copy.start()
    count_ref[0] = pl.semaphore_read(sem) if read_count else 0
    copy.wait()
    o_ref[...] = buf[...]
  return kernel


def _window_call(pl, pltpu, interpret):
  return pl.pallas_call(
      _window_kernel(pl, pltpu, read_count=interpret is False),
      out_shape=(jax.ShapeDtypeStruct((BUF, COLS), f32), jax.ShapeDtypeStruct((1,), jnp.int32)),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(1,),
          in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=(pl.BlockSpec((BUF, COLS), lambda i, s: (0, 0)),
                     pl.BlockSpec(memory_space=pltpu.SMEM)),
          scratch_shapes=[pltpu.VMEM((BUF, COLS), f32), pltpu.SemaphoreType.DMA]),
      interpret=interpret)


def _window_reference(x, start, n, offset):
  out = np.full((BUF, COLS), FILL, np.float32)
  out[offset:offset + n] = np.asarray(x)[start:start + n]
  return out


# (start, n, offset): inside, empty, the whole buffer, at the ends of both refs
CASES = [(3, 5, 0), (10, 0, 4), (0, BUF, 0), (ROWS - 7, 7, BUF - 7), (41, 1, 15), (20, 9, 7)]


@pytest.mark.parametrize("start,n,offset", CASES)
def test_copy_of_a_run_time_length(start, n, offset):
  x = random_array((ROWS, COLS))
  out, count = _window_call(pl, pltpu, False)(jnp.array([start, n, offset], jnp.int32), x)
  assert_close(out, _window_reference(x, start, n, offset))
  assert int(count[0]) == n * COLS   # a DMA semaphore counts the copied elements


def test_matches_jax_tpu_interpreter():
  from jax.experimental import pallas as jpl
  from jax.experimental.pallas import tpu as jpltpu
  x = random_array((ROWS, COLS))
  for start, n, offset in CASES[:4]:
    s = jnp.array([start, n, offset], jnp.int32)
    theirs, _ = _window_call(jpl, jpltpu, jpltpu.InterpretParams())(s, x)
    ours, _ = _window_call(pl, pltpu, False)(s, x)
    assert_close(ours, theirs)


def test_lengths_vary_over_the_grid_under_jit():
  """The length comes from the grid index and the data, and the kernel is jitted."""
  x = random_array((4, ROWS, COLS))
  lengths = jnp.array([0, 5, 16, 9], jnp.int32)

  def kernel(len_ref, x_hbm, o_ref, buf, sem):
    b = pl.program_id(0)
    n = len_ref[b]
    buf[...] = jnp.full(buf.shape, FILL, buf.dtype)
    pltpu.async_copy(x_hbm.at[b, pl.ds(ROWS - n, n)], buf.at[pl.ds(0, n)], sem).wait()
    o_ref[...] = buf[...]

  call = jax.jit(pallas_call(
      kernel, jax.ShapeDtypeStruct((4, BUF, COLS), f32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(4,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=pl.BlockSpec((None, BUF, COLS), lambda b, lens: (b, 0, 0)),
          scratch_shapes=[pltpu.VMEM((BUF, COLS), f32), pltpu.SemaphoreType.DMA])))
  out = call(lengths, x)
  expected = np.full((4, BUF, COLS), FILL, np.float32)
  for b, n in enumerate(np.asarray(lengths)):
    expected[b, :n] = np.asarray(x)[b, ROWS - n:]
  assert_close(out, expected)


def test_add_copy_of_a_run_time_length():
  x, y = random_array((ROWS, COLS)), random_array((BUF, COLS))

  def kernel(s_ref, x_hbm, y_hbm, o_hbm, sem):
    pltpu.sync_copy(y_hbm, o_hbm)
    n = s_ref[0]
    pltpu.async_copy(x_hbm.at[pl.ds(s_ref[1], n)], o_hbm.at[pl.ds(2, n)], sem, add=True).wait()

  out = pallas_call(
      kernel, jax.ShapeDtypeStruct((BUF, COLS), f32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
          out_specs=pl.BlockSpec(memory_space=pl.ANY),
          scratch_shapes=[pltpu.SemaphoreType.DMA]))(jnp.array([6, 30], jnp.int32), x, y)
  assert_close(out, y.at[2:8].add(x[30:36]))


# ------------------------------------------------------------------ paged KV-cache update
NUM_PAGES, PAGE, HEAD = 12, 8, 128


def _kv_update_kernel(pl, pltpu):
  """Writes the `lens[b]` new tokens of sequence b at position `pos[b]` of its pages:
  the part that fits the current page, then the rest into the next page (at most two
  pages per step). Copies of run-time lengths into pages of an aliased HBM cache."""
  def kernel(lens_ref, pos_ref, pages_ref, new_hbm, cache_in, cache_hbm, sems):
    del cache_in   # aliased with cache_hbm
    b = pl.program_id(0)
    n, pos = lens_ref[b], pos_ref[b]
    page_index, offset = pos // PAGE, pos % PAGE
    first = jnp.minimum(n, PAGE - offset)
    rest = n - first
    copy = pltpu.make_async_copy(
        new_hbm.at[b, pl.ds(0, first)],
        cache_hbm.at[pages_ref[b, page_index], pl.ds(offset, first)], sems.at[0])
    copy.start()
    spill = pltpu.make_async_copy(
        new_hbm.at[b, pl.ds(first, rest)],
        cache_hbm.at[pages_ref[b, page_index + 1], pl.ds(0, rest)], sems.at[1])
    spill.start()
    copy.wait()
    spill.wait()
  return kernel


def _kv_update_call(pl, pltpu, batch, interpret):
  return pl.pallas_call(
      _kv_update_kernel(pl, pltpu),
      out_shape=jax.ShapeDtypeStruct((NUM_PAGES, PAGE, HEAD), f32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(batch,),
          in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
          out_specs=pl.BlockSpec(memory_space=pl.ANY),
          scratch_shapes=[pltpu.SemaphoreType.DMA((2,))]),
      input_output_aliases={4: 0}, interpret=interpret)


def _kv_update_reference(cache, new, lens, pos, pages):
  cache = np.array(cache)
  for b in range(len(lens)):
    for t in range(int(lens[b])):
      p = int(pos[b]) + t
      cache[pages[b, p // PAGE], p % PAGE] = np.asarray(new)[b, t]
  return cache


def _kv_inputs(seed):
  rng = np.random.default_rng(seed)
  batch, max_new = 4, PAGE
  pages = rng.permutation(NUM_PAGES)[:batch * 3].reshape(batch, 3).astype(np.int32)
  lens = np.array([0, 1, PAGE, 5], np.int32)         # empty, one token, a whole page, ragged
  pos = np.array([3, PAGE - 1, 4, 2 * PAGE - 2], np.int32)   # spills into the next page
  cache = random_array((NUM_PAGES, PAGE, HEAD), seed=seed)
  new = random_array((batch, max_new, HEAD), seed=seed + 1)
  return cache, new, jnp.asarray(lens), jnp.asarray(pos), jnp.asarray(pages)


def test_paged_kv_cache_update():
  cache, new, lens, pos, pages = _kv_inputs(11)
  out = jax.jit(_kv_update_call(pl, pltpu, 4, False))(lens, pos, pages, new, cache)
  assert_close(out, _kv_update_reference(cache, new, lens, pos, pages))


def test_paged_kv_cache_update_matches_jax_tpu_interpreter():
  from jax.experimental import pallas as jpl
  from jax.experimental.pallas import tpu as jpltpu
  cache, new, lens, pos, pages = _kv_inputs(12)
  theirs = _kv_update_call(jpl, jpltpu, 4, jpltpu.InterpretParams())(lens, pos, pages, new,
                                                                      cache)
  ours = _kv_update_call(pl, pltpu, 4, False)(lens, pos, pages, new, cache)
  assert_close(ours, theirs)


# ------------------------------------------------------------------ views through a reshape
LAYERS = 3


def _merged_pages_kernel(pl, pltpu):
  """Serving kernels' paged-cache copies: the cache of one layer seen with its page and
  token dimensions merged (`cache.at[layer].reshape(pages * page, head)`), `n` tokens
  copied from any position, across page boundaries, into a buffer; then the buffer
  written back `n` tokens further on, through the same kind of view."""
  def kernel(s_ref, cache_in, cache_hbm, o_ref, buf, sems):
    del cache_in   # aliased with cache_hbm
    layer, start, n, dest = s_ref[0], s_ref[1], s_ref[2], s_ref[3]
    tokens = cache_hbm.at[layer].reshape(NUM_PAGES * PAGE, HEAD)
    buf[...] = jnp.full(buf.shape, FILL, buf.dtype)
    fetch = pltpu.make_async_copy(tokens.at[pl.ds(start, n)], buf.at[pl.ds(0, n)], sems.at[0])
    fetch.start()
    fetch.wait()
    o_ref[...] = buf[...]
    store = pltpu.make_async_copy(buf.at[pl.ds(0, n)], tokens.at[pl.ds(dest, n)], sems.at[1])
    store.start()
    store.wait()
  return kernel


def _merged_pages_call(pl, pltpu, interpret):
  return pl.pallas_call(
      _merged_pages_kernel(pl, pltpu),
      out_shape=(jax.ShapeDtypeStruct((LAYERS, NUM_PAGES, PAGE, HEAD), f32),
                 jax.ShapeDtypeStruct((2 * PAGE, HEAD), f32)),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(1,),
          in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=(pl.BlockSpec(memory_space=pl.ANY),
                     pl.BlockSpec((2 * PAGE, HEAD), lambda i, s: (0, 0))),
          scratch_shapes=[pltpu.VMEM((2 * PAGE, HEAD), f32), pltpu.SemaphoreType.DMA((2,))]),
      input_output_aliases={1: 0}, interpret=interpret)


def _merged_pages_reference(cache, layer, start, n, dest):
  tokens = np.array(cache)[layer].reshape(NUM_PAGES * PAGE, HEAD)
  fetched = np.full((2 * PAGE, HEAD), FILL, np.float32)
  fetched[:n] = tokens[start:start + n]
  new_cache = np.array(cache)
  view = new_cache[layer].reshape(NUM_PAGES * PAGE, HEAD)   # a view: writes land in new_cache
  view[dest:dest + n] = fetched[:n]
  return new_cache, fetched


# (layer, start, n, dest): within a page, across one and two page boundaries, empty,
# at the cache's last token, a whole buffer
MERGED_CASES = [(0, 3, 4, 40), (1, PAGE - 2, 5, 17), (2, 5, 2 * PAGE, 60), (1, 30, 0, 0),
                (2, NUM_PAGES * PAGE - 3, 3, 0), (0, 16, 2 * PAGE, NUM_PAGES * PAGE - 2 * PAGE)]


@pytest.mark.parametrize("layer,start,n,dest", MERGED_CASES)
def test_copies_through_a_reshaped_cache(layer, start, n, dest):
  cache = random_array((LAYERS, NUM_PAGES, PAGE, HEAD), seed=layer + start)
  scalars = jnp.array([layer, start, n, dest], jnp.int32)
  new_cache, fetched = jax.jit(_merged_pages_call(pl, pltpu, False))(scalars, cache)
  want_cache, want_fetched = _merged_pages_reference(cache, layer, start, n, dest)
  assert_close(fetched, want_fetched)
  assert_close(new_cache, want_cache)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_copies_through_a_reshaped_cache_at_any_position(data):
  """Random positions and lengths against the NumPy model (JAX's TPU interpreter, the
  other oracle of this file, has no reshaped DMA views)."""
  total = NUM_PAGES * PAGE
  layer = data.draw(st.integers(0, LAYERS - 1))
  start = data.draw(st.integers(0, total - 1))
  n = data.draw(st.integers(0, min(2 * PAGE, total - start)))
  dest = data.draw(st.integers(0, total - n))
  cache = random_array((LAYERS, NUM_PAGES, PAGE, HEAD), seed=start)
  new_cache, fetched = _merged_pages_jitted(jnp.array([layer, start, n, dest], jnp.int32), cache)
  want_cache, want_fetched = _merged_pages_reference(cache, layer, start, n, dest)
  assert_close(fetched, want_fetched)
  assert_close(new_cache, want_cache)


_merged_pages_jitted = jax.jit(_merged_pages_call(pl, pltpu, False))


def test_run_time_length_through_a_reshape_of_part_of_a_ref_is_refused():
  """A reshape of rows 0..31 only is not the array reshaped: pallet says so."""
  x = random_array((ROWS, COLS))

  def partial(s_ref, x_hbm, o_ref, buf, sem):
    rows = x_hbm.at[pl.ds(0, 32)].reshape(64, COLS // 2)
    pltpu.make_async_copy(rows.at[pl.ds(0, s_ref[0])], buf.at[pl.ds(0, s_ref[0]), pl.ds(0, 64)],
                          sem).start()

  with pytest.raises(pl.PalletError, match=r"kernel 'partial'.*size known only at run time.*"
                     r"reshape of part of the array"):
    _one_copy(partial, [3], x)


# ------------------------------------------------------------------ causal conv, carried state
K, T, C = 4, 16, 128   # kernel width, tokens per block, channels


def _causal_conv_kernel(len_ref, x_hbm, w_ref, state_hbm, y_ref, new_state_hbm, buf, sems):
  """One ragged sequence per grid step: y[t] = sum_k w[k] * ext[t + k] over
  ext = concat(state, x[:L]); the new state is the last K - 1 rows of ext."""
  b = pl.program_id(0)
  length = len_ref[b]
  pltpu.sync_copy(state_hbm.at[b], buf.at[pl.ds(0, K - 1)])
  pltpu.async_copy(x_hbm.at[b, pl.ds(0, length)], buf.at[pl.ds(K - 1, length)], sems.at[0]).wait()
  ext = buf[...]
  acc = jnp.zeros((T, C), f32)
  for k in range(K):
    acc += w_ref[k] * ext[k:k + T]
  rows = jax.lax.broadcasted_iota(jnp.int32, (T, C), 0)
  y_ref[...] = jnp.where(rows < length, acc, 0.0)
  # the carried state: the last K - 1 rows of ext, the old state's tail first
  kept = K - 1 - jnp.minimum(length, K - 1)
  pltpu.async_copy(state_hbm.at[b, pl.ds(K - 1 - kept, kept)],
                   new_state_hbm.at[b, pl.ds(0, kept)], sems.at[1]).wait()
  fresh = K - 1 - kept
  pltpu.async_copy(x_hbm.at[b, pl.ds(length - fresh, fresh)],
                   new_state_hbm.at[b, pl.ds(kept, fresh)], sems.at[1]).wait()


def test_causal_conv_with_carried_state():
  batch = 5
  lengths = jnp.array([T, 0, 1, 2, 11], jnp.int32)
  x, w = random_array((batch, T, C)), random_array((K, C))
  state = random_array((batch, K - 1, C))
  y, new_state = pallas_call(
      _causal_conv_kernel,
      (jax.ShapeDtypeStruct((batch, T, C), f32), jax.ShapeDtypeStruct((batch, K - 1, C), f32)),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(batch,),
          in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec((K, C), lambda b, n: (0, 0)),
                    pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=(pl.BlockSpec((None, T, C), lambda b, n: (b, 0, 0)),
                     pl.BlockSpec(memory_space=pl.ANY)),
          scratch_shapes=[pltpu.VMEM((T + K - 1, C), f32), pltpu.SemaphoreType.DMA((2,))]),
  )(lengths, x, w, state)
  for b, length in enumerate(np.asarray(lengths)):
    ext = jnp.concatenate([state[b], x[b, :length]])
    ref = sum(w[k] * ext[k:k + length] for k in range(K))
    assert_close(y[b, :length], ref, rtol=1e-5, atol=1e-4)
    assert_close(y[b, length:], jnp.zeros((T - length, C)))
    assert_close(new_state[b], ext[-(K - 1):])


# ------------------------------------------------------------------ errors
def _one_copy(kernel, scalars, x, checked=False, out_rows=BUF):
  interpret = pltpu.InterpretParams() if checked else False
  return pallas_call(
      kernel, jax.ShapeDtypeStruct((out_rows, COLS), f32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=pl.BlockSpec((out_rows, COLS), lambda i, s: (0, 0)),
          scratch_shapes=[pltpu.VMEM((BUF, COLS), f32), pltpu.SemaphoreType.DMA]),
      interpret=interpret)(jnp.asarray(scalars, jnp.int32), x)


def _run_time_error(fn, *fragments):
  with pytest.raises(Exception) as info:
    jax.block_until_ready(fn())
  for f in fragments:
    assert f in str(info.value), str(info.value)


@pytest.mark.parametrize("start,n,where", [(60, 8, "x_hbm"), (0, BUF + 1, "buf"),
                                           (5, -1, "x_hbm")])
def test_checking_mode_reports_a_window_past_the_end(start, n, where):
  x = random_array((ROWS, COLS))

  def copy(s_ref, x_hbm, o_ref, buf, sem):
    c = pltpu.make_async_copy(x_hbm.at[pl.ds(s_ref[0], s_ref[1])],
                              buf.at[pl.ds(0, s_ref[1])], sem)
    c.start()
    c.wait()
    o_ref[...] = buf[...]

  _run_time_error(lambda: _one_copy(copy, [start, n], x, checked=True),
                  "out_of_bounds", "kernel 'copy'", f"'{where}'",
                  "test_dma_dynamic_size.py", "size known at run time")


def test_checking_mode_accepts_copies_in_bounds():
  x = random_array((ROWS, COLS))

  def copy(s_ref, x_hbm, o_ref, buf, sem):
    buf[...] = jnp.full(buf.shape, FILL, buf.dtype)
    c = pltpu.make_async_copy(x_hbm.at[pl.ds(s_ref[0], s_ref[1])],
                              buf.at[pl.ds(BUF - s_ref[1], s_ref[1])], sem)
    c.start()
    c.wait()
    o_ref[...] = buf[...]

  for start, n in [(ROWS - BUF, BUF), (0, 0), (9, 3)]:
    out = _one_copy(copy, [start, n], x, checked=True)
    assert_close(out, _window_reference(x, start, n, BUF - n))


def test_reading_the_buffer_before_the_wait_is_reported_in_checking_mode():
  x = random_array((ROWS, COLS))

  def early(s_ref, x_hbm, o_ref, buf, sem):
    c = pltpu.make_async_copy(x_hbm.at[pl.ds(0, s_ref[1])], buf.at[pl.ds(0, s_ref[1])], sem)
    c.start()
    o_ref[...] = buf[...]
    c.wait()

  _run_time_error(lambda: _one_copy(early, [0, 4], x, checked=True),
                  "uninitialized", "kernel 'early'", "'buf'")


def test_different_run_time_lengths_at_the_two_ends_fail_the_kernel():
  x = random_array((ROWS, COLS))

  def uneven(s_ref, x_hbm, o_ref, buf, sem):
    buf[...] = jnp.zeros_like(buf)
    c = pltpu.make_async_copy(x_hbm.at[pl.ds(0, s_ref[0])], buf.at[pl.ds(0, s_ref[1])], sem)
    c.start()
    c.wait()
    o_ref[...] = buf[...]

  assert_close(_one_copy(uneven, [3, 3], x), jnp.zeros((BUF, COLS)).at[:3].set(x[:3]))
  _run_time_error(lambda: _one_copy(uneven, [3, 4], x), "make_async_copy", "kernel 'uneven'",
                  "test_dma_dynamic_size.py", "differ in size along dimension 0")


def test_wait_for_more_than_was_copied_is_an_error_not_a_hang():
  x = random_array((ROWS, COLS))

  def overwaits(s_ref, x_hbm, o_ref, buf, sem):
    pltpu.make_async_copy(x_hbm.at[pl.ds(0, s_ref[0])], buf.at[pl.ds(0, s_ref[0])], sem).start()
    pltpu.make_async_copy(x_hbm.at[pl.ds(0, s_ref[1])], buf.at[pl.ds(0, s_ref[1])], sem).wait()
    o_ref[...] = buf[...]

  _one_copy(overwaits, [5, 5], x)   # the same length: the wait is satisfied
  _run_time_error(lambda: _one_copy(overwaits, [5, 6], x), "DMA wait", "kernel 'overwaits'",
                  "known at run time", "never finish")


def test_static_shape_or_dtype_mismatch_is_a_trace_time_error():
  x = random_array((ROWS, COLS))

  def wrong_rank(s_ref, x_hbm, o_ref, buf, sem):
    pltpu.make_async_copy(x_hbm.at[pl.ds(0, s_ref[0])], buf.at[0, pl.ds(0, s_ref[0])],
                          sem).start()

  with pytest.raises(pl.PalletError, match=r"make_async_copy in kernel 'wrong_rank'.*"
                     r"source float32\[<= 64 \(known at run time\), 128\].*same shape"):
    _one_copy(wrong_rank, [3], x)

  def wrong_width(s_ref, x_hbm, o_ref, buf, sem):
    pltpu.make_async_copy(x_hbm.at[pl.ds(0, s_ref[0]), pl.ds(0, 64)],
                          buf.at[pl.ds(0, s_ref[0])], sem).start()

  with pytest.raises(pl.PalletError, match=r"kernel 'wrong_width'.*same shape"):
    _one_copy(wrong_width, [3], x)


def test_run_time_length_with_a_strided_view_is_refused():
  x = random_array((ROWS, COLS))

  def strided(s_ref, x_hbm, o_ref, buf, sem):
    pltpu.make_async_copy(x_hbm.at[pl.ds(0, s_ref[0], 2)], buf.at[pl.ds(0, s_ref[0])],
                          sem).start()

  with pytest.raises(pl.PalletError, match=r"kernel 'strided'.*size known only at run time.*"
                     r"unit-stride slices"):
    _one_copy(strided, [3], x)


def test_plain_load_of_a_run_time_length_is_refused_as_in_jax():
  """JAX refuses `x_ref[pl.ds(0, n)]` with a traced n outside DMAs; so does pallet, clearly."""
  x = random_array((BUF, COLS))

  def load(s_ref, x_ref, o_ref):
    o_ref[pl.ds(0, 2)] = x_ref[pl.ds(0, s_ref[0])][:2]

  with pytest.raises(pl.PalletError, match=r"kernel 'load'.*traced.*expected a static size"):
    pallas_call(load, jax.ShapeDtypeStruct((BUF, COLS), f32),
                grid_spec=pltpu.PrefetchScalarGridSpec(
                    num_scalar_prefetch=1, grid=(1,),
                    in_specs=[pl.BlockSpec((BUF, COLS), lambda i, s: (0, 0))],
                    out_specs=pl.BlockSpec((BUF, COLS), lambda i, s: (0, 0))))(
        jnp.array([3], jnp.int32), x)

