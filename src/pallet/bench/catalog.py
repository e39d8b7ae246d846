"""The suite: every benchmark family, in the order the report lists them."""
from __future__ import annotations

from collections.abc import Sequence

from pallet.bench import (attention, elementwise, fused, indexing, jax_op_cases, matmul, ops,
                        reduction, rowwise, scratch_kernels, sharded, stencil,
                        user_kernels)
from pallet.bench.case import Benchmark, Size

# `sharded` is empty unless 4 devices are present (a multi-device run of the suite).
FAMILIES = (elementwise, matmul, rowwise, attention, stencil, reduction, indexing,
            jax_op_cases, ops, fused, user_kernels, scratch_kernels, sharded)


def all_benchmarks(size: Size) -> list[Benchmark]:
  return [b for family in FAMILIES for b in family.benchmarks(size)]


def select(benchmarks: Sequence[Benchmark], names: Sequence[str]) -> list[Benchmark]:
  """Benchmarks whose name or family is in `names` (all of them if `names` is empty).

    Raises ValueError naming every unknown entry and the valid choices.
    """
  if not names:
    return list(benchmarks)
  known = {b.name for b in benchmarks} | {b.family for b in benchmarks}
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ValueError(
        f"--only: unknown benchmark {', '.join(map(repr, unknown))}; "
        f"choose from names {sorted(b.name for b in benchmarks)} "
        f"or families {sorted({b.family for b in benchmarks})}")
  return [b for b in benchmarks if b.name in names or b.family in names]
