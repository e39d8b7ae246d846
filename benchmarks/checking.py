"""Comparing a variant's output with the jax.numpy result."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from benchmarks.case import Benchmark


class MismatchError(AssertionError):
  """A variant computed something other than the jax.numpy program."""


def check_matches(bench: Benchmark, variant: str, actual: Any, expected: Any) -> None:
  """Raise MismatchError naming the benchmark, variant and worst element."""
  actual_leaves = jax.tree_util.tree_leaves(actual)
  expected_leaves = jax.tree_util.tree_leaves(expected)
  if len(actual_leaves) != len(expected_leaves):
    raise MismatchError(f"{bench.name}: {variant} returned {len(actual_leaves)} "
                        f"arrays, jax.numpy returned {len(expected_leaves)}")
  for i, (a, e) in enumerate(zip(actual_leaves, expected_leaves)):
    a, e = np.asarray(a), np.asarray(e)
    if a.shape != e.shape or a.dtype != e.dtype:
      raise MismatchError(f"{bench.name}: {variant} output {i} is {a.dtype}{list(a.shape)}, "
                          f"expected {e.dtype}{list(e.shape)}")
    a64, e64 = a.astype(np.float64), e.astype(np.float64)
    bad = ~np.isclose(a64, e64, rtol=bench.rtol, atol=bench.atol, equal_nan=False)
    if bad.any():
      err = np.where(bad, np.abs(a64 - e64), 0.0)
      err = np.where(np.isnan(err), np.inf, err)
      worst = np.unravel_index(int(np.argmax(err)), a.shape)
      raise MismatchError(
          f"{bench.name}: {variant} differs from jax.numpy at {int(bad.sum())} of "
          f"{a.size} elements (rtol={bench.rtol}, atol={bench.atol}); worst at index "
          f"{tuple(int(w) for w in worst)}: got {a[worst]!r}, expected {e[worst]!r}")
