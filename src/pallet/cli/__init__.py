"""The `pallet` console command: `pallet demo`, `pallet bench`, `pallet tune`, `pallet info`."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

SIZES = ("full", "small", "tiny")


def _positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="pallet", description=__doc__)
  parser.add_argument("--version", action=_Version, help="print the pallet and jax "
                      "versions and exit")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  demo = sub.add_parser("demo", help="run a gallery of kernels, check them against "
                        "jax.numpy and time them (interleaved)")
  demo.add_argument("--backend", choices=("xla", "triton"), default=None,
                    help="pallet backend to run the kernels on; without a GPU 'triton' "
                         "runs Triton's interpreter, slowly (default: pallet's default "
                         "for this machine)")
  demo.add_argument("--scale", type=int, choices=(0, 1, 2), default=0,
                    help="problem size: 0 small, 1 and 2 larger (default: 0)")
  demo.add_argument("--reps", type=_positive_int, default=7,
                    help="timed rounds, each running pallet and jax.numpy once "
                         "(default: 7)")
  sub.add_parser("bench", add_help=False,
                 help="the benchmark suite (pallet vs jax.numpy vs the Pallas interpreter); "
                      "arguments after 'bench' go to it: see 'pallet bench --help'")
  tune = sub.add_parser("tune", help="autotune the library's kernels (pallet.ops and "
                        "the demo gallery) on this machine and cache the choices")
  tune.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="tune only the case NAME, or every case under NAME/ "
                         "(repeatable; see --list) (default: every case)")
  tune.add_argument("--list", action="store_true",
                    help="list the cases and exit (default: off)")
  tune.add_argument("--size", choices=SIZES, default="full",
                    help="problem sizes to tune for (default: full)")
  tune.add_argument("--reps", type=_positive_int, default=None,
                    help="timed rounds per config (default: each function's own, "
                         "usually 5)")
  tune.add_argument("--force", action="store_true",
                    help="measure again where the cache already has a choice "
                         "(default: off)")
  tune.add_argument("--backend", choices=("xla", "triton"), default=None,
                    help="pallet backend to tune on (default: pallet's default for "
                         "this machine)")
  tune.add_argument("--confirm", type=_positive_int, default=None, metavar="ROUNDS",
                    help="after tuning, time the default and the chosen config again in "
                         "ROUNDS interleaved rounds of their own (default: off)")
  tune.add_argument("--clear-cache", action="store_true",
                    help="delete the autotune cache file first (default: off)")
  sub.add_parser("info", help="versions and available backends")
  return parser


class _Version(argparse.Action):
  """--version, importing jax only when asked."""

  def __init__(self, option_strings, dest, help=None):
    super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

  def __call__(self, parser, namespace, values, option_string=None):
    import jax
    import pallet
    print(f"pallet {pallet.__version__} (jax {jax.__version__})")
    parser.exit()


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args, rest = parser.parse_known_args(argv)
  if args.command != "bench" and rest:
    parser.error(f"unrecognized arguments: {' '.join(rest)}")

  if args.command in ("demo", "tune"):
    _triton_interpreter_without_gpu(args.backend)
  if args.command == "demo":
    from pallet.cli import demo as demo_lib
    return demo_lib.run(scale=args.scale, reps=args.reps, backend=args.backend)
  if args.command == "bench":
    return _bench(rest)
  if args.command == "tune":
    from pallet.cli import tune as tune_lib
    return tune_lib.run(only=args.only, list_only=args.list, size=args.size, reps=args.reps,
                        force=args.force, backend=args.backend, clear=args.clear_cache,
                        confirm=args.confirm or 0)
  if args.command == "info":
    import jax
    import pallet
    from pallet import backends
    print(f"pallet {pallet.__version__}, jax {jax.__version__}, devices {jax.devices()}")
    print(f"backends: {backends.available()}, default: {backends.resolve(None, False)}")
    for name in backends.names():
      if (reason := backends.unavailable_reason(name)) is not None:
        print(f"  {name}: not available: {reason}")
    return 0
  return 2


def _triton_interpreter_without_gpu(backend: str | None) -> None:
  """`--backend triton` without a GPU runs Triton's interpreter, as --help says; Triton
  reads TRITON_INTERPRET once, when first imported, which has not happened yet here."""
  from pallet import backends
  if (backend is not None and backends.canonical(backend) == "triton"
      and not backends.triton_interpreter_on() and not backends.gpu_present()):
    os.environ["TRITON_INTERPRET"] = "1"


def _bench(rest: list[str]) -> int:
  """The benchmark suite, `pallet.bench`: from a source checkout it writes into the
  checkout (docs/, bench_out/), from an installed pallet under ./bench_out
  (pallet/bench/paths.py)."""
  try:
    bench = importlib.import_module("pallet.bench.__main__")
  except ImportError as e:
    print(f"pallet bench: cannot import the benchmark suite ({e}); install pallet's "
          f"[test] extra", file=sys.stderr)
    return 2
  return bench.main(rest)

