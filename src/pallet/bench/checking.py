"""Checking benchmark results: a variant's output against the jax.numpy result, and
(`python -m pallet.bench.checking`) what pallet's checking mode costs."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pallet.bench.case import Benchmark
from pallet.bench.paths import SCRATCH_DIR


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


# ------------------------------------------------------------------ checking-mode cost
# `python -m pallet.bench.checking`: what pallet's checking mode costs (docs/checking.md).
# Every kernel of the suite runs unchecked on pallet, checked on pallet, and under
# Pallas's own checked (TPU) interpreter, interleaved by pallet.bench.runner. (The
# runner imports this module for check_matches: suite modules are imported late.)
CHECKED_PARAMS = dict(detect_races=True, out_of_bounds_reads="raise",
                      uninitialized_memory="nan")
CHECKING_TARGET = 3.0   # checked / unchecked, geomean over the suite (issue 9)


def _pallet_checked(bench: Benchmark):
  import pallet
  return bench.build_pallas(pallet, backend="xla",
                            interpret=pallet.InterpretParams(**CHECKED_PARAMS))


def _pallet_checked_opt_in(bench: Benchmark):
  """The default checks plus the opt-in NaN/Inf and int32-overflow checks."""
  import pallet
  return bench.build_pallas(pallet, backend="xla", interpret=pallet.InterpretParams(
      **CHECKED_PARAMS, detect_nans=True, detect_int_overflow=True))


def _pallas_checked(bench: Benchmark):
  from pallet.bench.peer import peer_pallas
  peer = peer_pallas()
  return bench.build_pallas(peer, interpret=peer.tpu.InterpretParams(**CHECKED_PARAMS))


def checking_variants(opt_in: bool = False, peer: bool = True):
  """jnp (the runner's reference), pallet unchecked, pallet checked, (with `opt_in`)
  pallet checked with the opt-in NaN and overflow checks too, Pallas checked."""
  from pallet.bench.variants import JNP, Variant, cpu_variant
  variants = [JNP, cpu_variant("pallet"), Variant("checked", _pallet_checked)]
  if opt_in:
    variants.append(Variant("checked_opt_in", _pallet_checked_opt_in))
  if peer:
    variants.append(Variant("pallas_checked", _pallas_checked, slow_peer=True))
  return tuple(variants)


def checking_columns():
  from pallet.bench.report import Columns
  return Columns(reference="pallet", subject="checked", peer="pallas_checked")


def checking_summary(results) -> list[str]:
  """The geomean cost of the checks, and how much faster than Pallas's checked
  interpreter pallet's checking mode is."""
  def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None

  def fastest(result, variant):
    v = result.variants.get(variant)
    return min(v.samples_s) if v is not None and v.timed else None

  cost = [x for r in results if (x := r.ratio("checked", "pallet")) is not None]
  speedup = [x for r in results if (x := r.ratio("pallas_checked", "checked")) is not None]
  # Medians suffer on a busy machine; the fastest runs show the cost of the work itself.
  cost_min = [a / b for r in results
              if (a := fastest(r, "checked")) and (b := fastest(r, "pallet"))]
  lines = []
  opt_in = [x for r in results if (x := r.ratio("checked_opt_in", "pallet")) is not None]
  if opt_in:
    lines.append(f"checked_opt_in/pallet (default checks + detect_nans + "
                 f"detect_int_overflow) geomean over {len(opt_in)} kernels: "
                 f"{geomean(opt_in):.2f}, max {max(opt_in):.2f}")
  g = geomean(cost)
  if g is None:
    lines.append("checked/pallet: n/a (checked timed on no kernel)")
  else:
    lines.append(f"checked/pallet geomean over {len(cost)} kernels: {g:.2f}, max "
                 f"{max(cost):.2f} (target geomean <= {CHECKING_TARGET:g}: "
                 f"{'met' if g <= CHECKING_TARGET else 'MISSED'}); fastest runs: geomean "
                 f"{geomean(cost_min):.2f}, max {max(cost_min):.2f}")
  if speedup:
    lines.append(f"pallas_checked/checked over {len(speedup)} kernels: geomean "
                 f"{geomean(speedup):.0f}x, min {min(speedup):.1f}x")
  return lines


def suite_benchmarks(size: str) -> list[Benchmark]:
  """The suite's own Pallas kernels. JAX's kernel library and pallet.ops choose their
  own pallas_call options (no per-call `interpret=`); the sharded rows need devices."""
  from pallet.bench import catalog
  from pallet.bench.report import LIBRARY_FAMILY_PREFIX
  return [b for b in catalog.all_benchmarks(size)
          if not b.family.startswith(LIBRARY_FAMILY_PREFIX)
          and b.family not in ("ops", "sharded")]


def markdown_table(results) -> str:
  """The cost table as docs/checking.md shows it."""
  from pallet.bench.report import time_cell

  def ratio(value, suffix=""):
    return "-" if value is None else f"{value:.2f}{suffix}" if value < 10 else f"{value:.0f}{suffix}"

  opt_in = any("checked_opt_in" in r.variants for r in results)
  rows = ["| kernel | grid steps | unchecked ms | checked ms | checked / unchecked "
          + ("| + opt-in / unchecked " if opt_in else "")
          + "| Pallas checked ms | Pallas checked / checked |",
          "|---|--:|--:|--:|--:|" + ("--:|" if opt_in else "") + "--:|--:|"]
  for r in results:
    v = r.variants
    cells = [r.bench.name, str(r.bench.grid_steps), time_cell(v.get("pallet")),
             time_cell(v.get("checked")), ratio(r.ratio("checked", "pallet"))]
    if opt_in:
      cells.append(ratio(r.ratio("checked_opt_in", "pallet")))
    cells += [time_cell(v.get("pallas_checked")),
              ratio(r.ratio("pallas_checked", "checked"), "x")]
    rows.append("| " + " | ".join(cells) + " |")
  return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
  """Time the suite unchecked, checked, and under Pallas's checked interpreter."""
  from pallet.bench import catalog, report
  from pallet.bench.case import SIZES
  from pallet.bench.runner import PeerPolicy
  from pallet.bench.suite import exit_code, positive_int, run_suite

  p = argparse.ArgumentParser(prog="python -m pallet.bench.checking",
                              description="Cost of pallet's checking mode (docs/checking.md).")
  p.add_argument("--size", choices=SIZES, default="small")
  p.add_argument("--only", action="append", default=[], metavar="NAME")
  p.add_argument("--reps", type=positive_int, default=11)
  p.add_argument("--peer-reps", type=positive_int, default=3)
  p.add_argument("--peer-budget-s", type=float, default=600.0)
  p.add_argument("--out", type=Path, default=SCRATCH_DIR)
  p.add_argument("--opt-in", action="store_true",
                 help="also time the default checks plus detect_nans and detect_int_overflow")
  p.add_argument("--no-peer", action="store_true",
                 help="skip Pallas's checked interpreter (slow)")
  args = p.parse_args(argv)
  try:
    selected = catalog.select(suite_benchmarks(args.size), args.only)
  except ValueError as e:
    p.error(str(e))
  peer = PeerPolicy(reps=args.peer_reps, budget_s=args.peer_budget_s)
  variants = checking_variants(opt_in=args.opt_in, peer=not args.no_peer)
  results = run_suite(selected, variants, reps=args.reps, peer=peer, seed=0,
                      device=jax.devices("cpu")[0])
  cols = checking_columns()
  print()
  print(report.format_table(results, cols))
  for note in report.footnotes(results):
    print(note)
  print()
  for line in checking_summary(results):
    print(line)
  print()
  print(markdown_table(results))
  args.out.mkdir(parents=True, exist_ok=True)
  path = args.out / f"checking_{args.size}.json"
  report.write_json(path, results, {"size": args.size, "reps": args.reps,
                                    "jax": jax.__version__}, cols)
  print(f"\nwrote {path}")
  return exit_code(results)


if __name__ == "__main__":
  sys.exit(main())
