"""Command line: `pallet bench [--small] [--size CLASSES] [--only NAME] ...` (from a
checkout also `python -m benchmarks ...`, a shim that forwards here).

Size classes (src/pallet/bench/case.py): `full` (the suite's sizes) and `test` (the shapes of
JAX's own tests for its Pallas ops) are what the results report, side by side; `small`
and `tiny` shrink the full suite for smoke runs. The default runs `full,test`; `--small`
runs `small,test`, the CI smoke run.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax

from pallet.bench import catalog, report
from pallet.bench.case import MEASURED_CLASSES, SIZES, Size
from pallet.bench.runner import PeerPolicy
from pallet.bench.suite import exit_code, positive_int, run_suite
from pallet.bench.paths import DOCS_DIR, SCRATCH_DIR
from pallet.bench.variants import CPU_VARIANTS

DEFAULT_REPS = 21


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="pallet bench",
      description="Time pallet's CPU backend against jax.numpy and the "
                  "jax.experimental.pallas interpreter on the benchmark suite.")
  size = p.add_mutually_exclusive_group()
  size.add_argument("--small", dest="size", action="store_const", const="small,test",
                    help="the full suite shrunk, then the JAX-test size class: a smoke run "
                         "of everything, for CI (same as --size small,test)")
  size.add_argument("--size", type=_size_classes, metavar="CLASSES",
                    help=f"comma-separated size classes, each run and reported on its own: "
                         f"{', '.join(SIZES)} (default: full,test)")
  p.set_defaults(size="full,test")
  p.add_argument("--only", action="append", default=[], metavar="NAME",
                 help="run only this benchmark or family (repeatable; see --list)")
  p.add_argument("--list", action="store_true", help="list benchmarks and exit")
  p.add_argument("--no-peer", action="store_true",
                 help="skip the jax.experimental.pallas interpret peer")
  p.add_argument("--out", type=Path, default=None, metavar="DIR",
                 help="where to write the JSON and PNG (default: docs/ for a complete "
                      "full-size run, bench_out/ otherwise, both in the repository)")
  p.add_argument("--reps", type=positive_int, default=DEFAULT_REPS, metavar="N",
                 help=f"timed rounds per benchmark (default {DEFAULT_REPS})")
  p.add_argument("--compile-reps", type=positive_int, default=3, metavar="N",
                 help="first calls (trace + compile, each from cold caches) per "
                      "variant, median reported (default 3; the peer compiles once)")
  p.add_argument("--peer-reps", type=positive_int, default=3, metavar="N",
                 help="timed rounds for the interpret peer (default 3)")
  p.add_argument("--peer-single-s", type=float, default=2.0, metavar="S",
                 help="an interpret run this slow is measured only once (default 2)")
  p.add_argument("--peer-budget-s", type=float, default=600.0, metavar="S",
                 help="total seconds the interpret peer may use (default 600)")
  p.add_argument("--seed", type=int, default=0, help="PRNG seed for the inputs")
  return p


def _size_classes(text: str) -> str:
  """argparse type for --size: a comma-separated list of known size classes."""
  names = [n.strip() for n in text.split(",") if n.strip()]
  unknown = [n for n in names if n not in SIZES]
  if not names or unknown:
    raise argparse.ArgumentTypeError(f"unknown size class {', '.join(map(repr, unknown))}; "
                                     f"choose from {', '.join(SIZES)}")
  return ",".join(dict.fromkeys(names))


def _git_commit() -> str | None:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True, timeout=10).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    return None


def _load_average() -> list[float] | None:
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


def _meta(args: argparse.Namespace, size: Size,
          load_at_start: list[float] | None) -> dict[str, Any]:
  return {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "size": size,
      "reps": args.reps,
      "compile_reps": args.compile_reps,
      "peer": None if args.no_peer else {"reps": args.peer_reps,
                                         "single_run_s": args.peer_single_s,
                                         "budget_s": args.peer_budget_s},
      "jax": jax.__version__,
      "python": platform.python_version(),
      "machine": platform.machine(),
      "processor": platform.processor() or None,
      "cpu_count": os.cpu_count(),
      "load_average_at_start": load_at_start,
      "load_average_at_end": _load_average(),
      "devices": [str(d) for d in jax.devices()],
      "git_commit": _git_commit(),
  }


def main(argv: list[str] | None = None) -> int:
  """Run the suite once per size class; 0 if every variant ran and matched
  jax.numpy, 1 otherwise."""
  parser = build_parser()
  args = parser.parse_args(argv)
  classes: list[Size] = args.size.split(",")
  if args.list:
    for size in classes:
      print(f"== size class {size}")
      for b in catalog.all_benchmarks(size):
        print(f"{b.name:24s} {b.family:10s} grid {b.grid} ({b.grid_steps} steps): {b.shapes}")
    return 0
  try:
    selections = {size: catalog.select(catalog.all_benchmarks(size), args.only)
                  for size in classes}
  except ValueError as e:
    parser.error(str(e))

  code = 0
  for size in classes:
    if len(classes) > 1:
      print(f"\n===== size class {size} =====", flush=True)
    code = max(code, _run_class(args, size, selections[size]))
  return code


def _run_class(args: argparse.Namespace, size: Size, selected: list) -> int:
  """One size class: run, print the table and summaries, write JSON and chart."""
  load_at_start = _load_average()
  if load_at_start and load_at_start[0] > 0.5 * (os.cpu_count() or 1):
    print(f"note: machine busy (1-min load average {load_at_start[0]} on "
          f"{os.cpu_count()} cores); timings will be noisy", flush=True)
  variants = [v for v in CPU_VARIANTS if not (args.no_peer and v.slow_peer)]
  peer = PeerPolicy(reps=args.peer_reps, single_run_s=args.peer_single_s,
                    budget_s=args.peer_budget_s)
  results = run_suite(selected, variants, reps=args.reps, peer=peer, seed=args.seed,
                      device=jax.devices("cpu")[0], compile_reps=args.compile_reps)

  print()
  print(f"size class {size}")
  print(report.format_table(results))
  for note in report.footnotes(results):
    print(note)
  # The targets (issue 10's) hold over the whole suite, JAX's kernel library included;
  # each part is summarised beside them.
  own, library = report.split_library(results)
  print()
  for line in report.summarize(results).lines():
    print(line)
  if own and library:
    for title, part in (("kernels written here", own), ("JAX's kernel library", library)):
      print(f"{title}:")
      for line in report.summarize(part).lines(targets=False):
        print("  " + line)

  complete = size in MEASURED_CLASSES and not args.only
  out_dir = args.out or (DOCS_DIR if complete else SCRATCH_DIR)
  out_dir.mkdir(parents=True, exist_ok=True)
  stem = "perf_cpu" if size == "full" else f"perf_cpu_{size}"
  json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
  report.write_json(json_path, results, _meta(args, size, load_at_start))
  try:
    report.write_chart(png_path, results, title=f"pallet CPU backend, {size} sizes "
                       f"(median ms, log scale)")
    print(f"\nwrote {json_path} and {png_path}")
  except ImportError:
    print(f"\nwrote {json_path} (matplotlib not installed: no chart)")

  return exit_code(results)


if __name__ == "__main__":
  sys.exit(main())
