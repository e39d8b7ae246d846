"""Running a list of benchmarks on one device: what the CPU and GPU commands share."""
from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax

from pallet.bench import report
from pallet.bench.case import Benchmark
from pallet.bench.runner import BenchmarkResult, PeerPolicy, run_benchmark
from pallet.bench.variants import Variant


def run_suite(benches: Sequence[Benchmark], variants: Sequence[Variant], *, reps: int,
              peer: PeerPolicy, seed: int, device: jax.Device,
              compile_reps: int = 3) -> list[BenchmarkResult]:
  """Run `benches` one after another with `device` as JAX's default device."""
  results = []
  with jax.default_device(device):
    for bench in benches:
      print(f"[{len(results) + 1}/{len(benches)}] {bench.name}: {bench.shapes}, "
            f"grid {bench.grid}", flush=True)
      result = run_benchmark(bench, variants, reps=reps, peer=peer, seed=seed,
                             compile_reps=compile_reps)
      results.append(result)
      print("    " + "  ".join(f"{v}={report.time_cell(r)}"
                               for v, r in result.variants.items()), flush=True)
  return results


# The peers (Pallas interpret, Pallas on Triton) are JAX's own code with their own limits
# (no advanced indexing, no int16 atomics, ...): their errors are reported, not failures.
OWN_VARIANTS = ("jnp", "pallet")


def exit_code(results: Sequence[BenchmarkResult]) -> int:
  """1 if jax.numpy or pallet failed or disagreed with jax.numpy, else 0."""
  failed = any(v.status in ("error", "mismatch")
               for r in results for name, v in r.variants.items() if name in OWN_VARIANTS)
  return 1 if failed else 0


def positive_int(text: str) -> int:
  """argparse type for counts such as --reps."""
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value
