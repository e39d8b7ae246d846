"""The `pallet` console command: `pallet demo`, `pallet bench`, `pallet info`."""
from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="pallet", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  demo = sub.add_parser("demo", help="run a gallery of kernels, check them against "
                        "jax.numpy and time them")
  demo.add_argument("--scale", type=int, default=0, help="problem size: 0 small, 1, 2 larger")
  demo.add_argument("--reps", type=int, default=7)
  sub.add_parser("bench", help="the benchmark suite (run from a source checkout); "
                 "arguments after 'bench' go to it", add_help=False)
  sub.add_parser("info", help="versions and available backends")
  args, rest = parser.parse_known_args(argv)

  if args.command == "demo":
    from pallet import demo as demo_lib
    return demo_lib.run(scale=args.scale, reps=args.reps)
  if args.command == "bench":
    sys.path.insert(0, os.getcwd())
    try:
      from benchmarks.__main__ import main as bench_main
    except ImportError:
      print("pallet bench needs a source checkout: run it from the repository root",
            file=sys.stderr)
      return 2
    return bench_main(rest)
  if args.command == "info":
    import jax
    import pallet
    from pallet import backends
    print(f"pallet {pallet.__version__}, jax {jax.__version__}, devices {jax.devices()}")
    print(f"backends: {backends.available()}, default: {backends.resolve(None, False)}")
    return 0
  return 2


if __name__ == "__main__":
  sys.exit(main())
