"""The checking mode's no-false-alarm run: correct kernels under `PALLET_CHECKS=1`.

    PYTHONPATH=src python tools/false_alarm_run.py [--cases 20] [--skip-fuzz] [--skip-tests]

A development tool, not part of the test suite (it takes tens of minutes on two cores).
It sets `PALLET_CHECKS=1` (the default check set) and runs, in this process:

- the test files of JAX's kernel library (`tests/test_jax_ops.py`, the pallas ops of
  the installed jax), `pallet.ops` (`tests/test_ops_*.py`), the examples
  (`tests/test_examples.py`) and the docs' kernels (`tests/test_docs.py`), default
  markers (slow tests left out);
- the fuzz families, `python -m tests.fuzz --family all --cases N`.

Every kernel there is correct, so any `KernelCheckError` is a false alarm: a test that
fails, or a fuzz case that disagrees. Calls that pass their own
`interpret=InterpretParams(...)` keep their own checks (the docs' worked bugs). It
counts the `pallas_call` launches that ran checked (each trace of a checked call, by
kernel name) and prints the counts recorded in docs/checking.md.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_FILES = ["tests/test_jax_ops.py", "tests/test_ops_*.py", "tests/test_examples.py",
              "tests/test_docs.py"]


class _Counter:
  """Counts the calls whose checks `pallet.checking.options` turned on, and alarms."""

  def __init__(self) -> None:
    self.calls = 0
    self.kernels: collections.Counter = collections.Counter()
    self.alarms: list[str] = []

  def install(self) -> None:
    import pallet.checking
    from pallet.errors import KernelCheckError
    resolve = pallet.checking.options

    def counting(interpret):
      options = resolve(interpret)
      if options is not None:
        self.calls += 1
      return options

    pallet.checking.options = counting   # what every launch asks (`checking.options(...)`)
    original_init = KernelCheckError.__init__
    counter = self

    def noting_init(self, *args, **kwargs):
      original_init(self, *args, **kwargs)
      counter.alarms.append(str(self).splitlines()[0][:200])

    KernelCheckError.__init__ = noting_init


def _run_tests(files: list[str]) -> int:
  import glob

  import pytest
  paths = sorted({p for pattern in files for p in glob.glob(os.path.join(ROOT, pattern))})
  return pytest.main(["-q", "-p", "no:cacheprovider", "-rf", *paths])


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--cases", type=int, default=20, help="fuzz cases per family")
  parser.add_argument("--skip-fuzz", action="store_true")
  parser.add_argument("--skip-tests", action="store_true")
  args = parser.parse_args(argv)
  os.environ["PALLET_CHECKS"] = "1"
  sys.path[:0] = [os.path.join(ROOT, "src"), ROOT, os.path.join(ROOT, "tests")]
  os.chdir(ROOT)
  counter = _Counter()
  counter.install()
  status = 0
  if not args.skip_tests:
    rc = _run_tests(TEST_FILES)
    print(f"tests: pytest exit {int(rc)}; checked launches so far {counter.calls}; "
          f"KernelCheckErrors raised {len(counter.alarms)}", flush=True)
    status |= int(rc) not in (0, 5)
  if not args.skip_fuzz:
    before = counter.calls
    from tests.fuzz.__main__ import main as fuzz_main
    rc = fuzz_main(["--family", "all", "--cases", str(args.cases)])
    print(f"fuzz: exit {rc}; checked launches {counter.calls - before}", flush=True)
    status |= rc != 0
  print(f"checked launches: {counter.calls}; KernelCheckErrors raised: {len(counter.alarms)}")
  for alarm in counter.alarms:
    print(f"  {alarm}")
  return status


if __name__ == "__main__":
  sys.exit(main())
