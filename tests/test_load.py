"""Load: many un-jitted calls of the same kernel, and many distinct shapes, keep
pallet's memory bounded (issue 9 §3). Slow: each test compiles or runs hundreds of
kernels. The bounds are generous; the behaviour before the content-keyed, bounded
caches (a re-trace and re-compile per call, ~+100 MB over 600 calls; every
description of every shape kept) fails them."""
from __future__ import annotations

import gc
import os
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
from pallet.core import trace_cache
from pallet.core.tracing import KernelDescription
from helpers import assert_close, pallas_call, random_array, sds

pytestmark = pytest.mark.slow


def _rss_mb() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _scaled(x):
  """A call as user code writes it: the kernel defined afresh around a fresh array."""
  scale = jnp.float32(2.0)
  traces = _scaled.traces

  def scale_kernel(x_ref, o_ref):
    traces.append(1)
    o_ref[...] = x_ref[...] * scale
  return pallas_call(scale_kernel, out_shape=sds(x))(x)


_scaled.traces = []


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_repeated_unjitted_calls_trace_once_and_keep_memory_flat():
  x = random_array((1024,))
  for _ in range(20):
    _scaled(x).block_until_ready()
  _scaled.traces.clear()
  gc.collect()
  tracemalloc.start()
  rss, heap = _rss_mb(), tracemalloc.get_traced_memory()[0]
  for _ in range(600):
    out = _scaled(x)
  out.block_until_ready()
  gc.collect()
  heap_growth = (tracemalloc.get_traced_memory()[0] - heap) / 2**20
  tracemalloc.stop()
  rss_growth = _rss_mb() - rss
  assert_close(out, x * 2)
  assert not _scaled.traces, f"traced {len(_scaled.traces)} times in 600 identical calls"
  assert heap_growth < 5, f"Python heap grew {heap_growth:.1f} MB over 600 calls"
  assert rss_growth < 40, f"RSS grew {rss_growth:.1f} MB over 600 calls"


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_many_shapes_keep_pallet_caches_bounded(monkeypatch):
  monkeypatch.setattr(trace_cache, "MAX_KERNELS", 16)
  trace_cache.clear()

  def add_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]

  spec = pl.BlockSpec((128,), lambda i: (i,))
  gc.collect()
  before = {id(o) for o in gc.get_objects() if isinstance(o, KernelDescription)}
  for n in range(1, 101):
    if n == 31:       # the caches are full: from here on memory must stay flat
      gc.collect()
      rss = _rss_mb()
    # (device_put: jnp.asarray of a NumPy array would compile per shape itself)
    x = jax.device_put(np.full((128 * n,), n, np.float32))
    out = pallas_call(add_kernel, out_shape=sds(x), grid=(n,), in_specs=[spec, spec],
                      out_specs=spec)(x, x)
    if n % 20 == 0:
      assert_close(out, x + x)
  gc.collect()
  rss_growth = _rss_mb() - rss
  assert rss_growth < 30, f"RSS grew {rss_growth:.1f} MB over 70 new shapes (caches full)"
  # Only this test's kernels: earlier tests' may be held by caches outside pallet (JAX's).
  live = sum(isinstance(o, KernelDescription) and id(o) not in before for o in gc.get_objects())
  assert live <= 2 * 16, f"{live} kernel descriptions alive after 100 shapes (bound 16)"
  assert all(len(c) <= 16 for c in trace_cache._all_caches)
  trace_cache.clear()


def test_closed_over_arrays_are_keyed_by_content():
  def call(table):
    def table_kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] + table
    return pallas_call(table_kernel, out_shape=sds(x))(x)

  x = random_array((8,))
  trace_cache.clear()
  a, b = random_array((8,)), random_array((8,))
  for table in (a, jnp.array(a), np.asarray(a), b):
    assert_close(call(table), x + table)
  assert trace_cache.stats["miss"] == 3       # a (jax), a (numpy: another type), b
  assert trace_cache.stats["hit"] == 1
