"""pallet.bench.fusion_profile: per-kernel times of a compiled program, from JAX's profiler."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallet.bench import catalog, fusion_profile


def _times(fn, *args):
  try:
    return fusion_profile.kernel_times(jax.jit(fn), args, calls=3)
  except RuntimeError as e:   # a JAX version whose profiler writes no JSON trace
    pytest.skip(str(e))


def test_kernel_times_lists_the_programs_kernels_not_the_runtimes():
  x = jnp.ones((256, 256))
  times = _times(lambda x: jnp.exp(x) @ x, x)
  assert times and all(ms >= 0 and runs > 0 for ms, runs in times.values())
  assert not any(name.startswith(fusion_profile._RUNTIME) for name in times)


def test_report_profiles_pallet_and_the_plain_twin():
  _times(jnp.exp, jnp.ones(4))   # skips where the profiler writes no JSON trace
  bench = catalog.select(catalog.all_benchmarks("tiny"), ["vadd_b1024"])[0]
  lines = fusion_profile.report(bench, "tiny", top=3, calls=2)
  assert lines[0].startswith("vadd_b1024")
  assert any(l.startswith("  pallet:") for l in lines)
  assert any(l.startswith("  plain:") for l in lines)


def test_self_times_count_a_loops_body_once():
  events = [{"ph": "X", "pid": 1, "tid": 1, "name": "while", "ts": 0, "dur": 10},
            {"ph": "X", "pid": 1, "tid": 1, "name": "a", "ts": 1, "dur": 3},
            {"ph": "X", "pid": 1, "tid": 1, "name": "b", "ts": 5, "dur": 4},
            {"ph": "X", "pid": 1, "tid": 2, "name": "c", "ts": 2, "dur": 6}]
  assert sorted(fusion_profile._self_times(events)) == [("a", 3), ("b", 4), ("c", 6),
                                                       ("while", 3)]
