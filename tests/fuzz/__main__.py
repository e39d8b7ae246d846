"""python -m tests.fuzz: run generated cases outside pytest and count the outcomes.

  python -m tests.fuzz --family all --cases 2000 --backend xla
  python -m tests.fuzz --family blocks --seed 17 --verbose      # reproduce one case
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--family", default="all", help="a family name, a comma list, or all")
  parser.add_argument("--cases", type=int, default=100, help="cases per family")
  parser.add_argument("--start", type=int, default=0, help="first seed")
  parser.add_argument("--seed", type=int, default=None, help="run this one seed")
  parser.add_argument("--backend", default="xla", choices=["xla", "triton"])
  parser.add_argument("--verbose", "-v", action="store_true",
                      help="print every case's description and outcome")
  parser.add_argument("--stop-on-disagreement", action="store_true")
  parser.add_argument("--progress", type=int, default=0, metavar="N",
                      help="print the counts so far every N cases (long campaigns)")
  args = parser.parse_args(argv)
  if args.backend == "triton":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

  from .families import NAMES, generate
  from .runner import run_case

  families = list(NAMES) if args.family == "all" else args.family.split(",")
  seeds = [args.seed] if args.seed is not None else range(args.start, args.start + args.cases)
  failed = 0
  for family in families:
    counts: collections.Counter = collections.Counter()
    reasons: collections.Counter = collections.Counter()
    started = time.time()
    for seed in seeds:
      outcome = run_case(generate(family, seed), args.backend)
      counts[outcome.status] += 1
      if outcome.status == "skipped":
        reasons[outcome.reason] += 1
      elif outcome.status == "passed":
        against = " and ".join(outcome.checked)
        note = f"; {outcome.reason.splitlines()[0][:160]}" if outcome.reason else ""
        if outcome.case.jax_oracle:
          note += f"; JAX not used: {outcome.case.jax_oracle}"
        reasons[f"passed against {against}{note}"] += 1
      if outcome.status == "disagreed" or args.verbose:
        print(f"--- {family}-{seed} {outcome.report()}", flush=True)
      if outcome.status == "disagreed":
        failed += 1
        if args.stop_on_disagreement:
          break
      done = sum(counts.values())
      if args.progress and done % args.progress == 0:
        print(f"  ... {family}: {done} cases, {counts['passed']} passed, "
              f"{counts['disagreed']} disagreed, {counts['skipped']} skipped "
              f"({time.time() - started:.0f} s)", flush=True)
    print(f"{family}: {sum(counts.values())} cases, {counts['passed']} passed, "
          f"{counts['disagreed']} disagreed, {counts['skipped']} skipped "
          f"({time.time() - started:.0f} s, backend {args.backend}, seeds {seeds[0]}..{seeds[-1]})",
          flush=True)
    for reason, n in reasons.most_common():
      print(f"  {n:5d}  {reason}", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
