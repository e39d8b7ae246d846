"""Compiles every kernel recorded by a test run for the three reference GPU targets.

Usage (two processes: the interpreter and the compiler cannot share one):

    PALLET_TEST_BACKEND=triton TRITON_INTERPRET=1 PALLET_TRITON_DUMP_DIR=/tmp/kernels \\
        python -m pytest tests --ignore=tests/triton
    python tests/triton/compile_suite.py /tmp/kernels [--jobs 2]

Prints one line per failure and a summary per target; exits 1 if any kernel
fails to compile. Uses Triton's own compiler (ptxas for CUDA, LLVM for AMD); no
GPU is needed.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import multiprocessing
import os
import sys
import time

TARGETS = (("cuda", 80, 32), ("cuda", 90, 32), ("hip", "gfx942", 64))


def compile_one(path: str) -> list[tuple[str, str, str]]:
  """[(target, kernel, error)] for the targets where the recorded kernel fails."""
  from triton.backends.compiler import GPUTarget
  from pallet.backends.triton.compiler import compile_recorded
  from pallet.errors import TritonLoweringError
  with open(path) as f:
    record = json.load(f)
  failures = []
  requirement = record.get("cuda_requirement")
  for t in TARGETS:
    try:
      compile_recorded(record, GPUTarget(*t))
    except Exception as e:  # report every failure, keep compiling the rest
      # pallet's own refusal of a CUDA GPU too old for the kernel is the expected result
      if (isinstance(e, TritonLoweringError) and requirement and t[0] == "cuda"
          and t[1] < requirement[0]):
        continue
      first = str(e).strip().splitlines()[:3]
      failures.append((str(t), f"{record['kernel']} ({record['where']}, {path})",
                       " | ".join(first)))
  return failures


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("directory")
  parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
  args = parser.parse_args(argv)
  paths = sorted(glob.glob(os.path.join(args.directory, "*.json")))
  if not paths:
    print(f"no recorded kernels in {args.directory}")
    return 1
  start = time.perf_counter()
  spawn = multiprocessing.get_context("spawn")   # no fork of a process running JAX
  with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=spawn) as pool:
    failures = [f for fs in pool.map(compile_one, paths) for f in fs]
  for target, kernel, error in failures:
    print(f"FAILED {target}: {kernel}: {error}")
  for t in TARGETS:
    bad = sum(1 for f in failures if f[0] == str(t))
    print(f"{t}: {len(paths) - bad}/{len(paths)} kernels compile")
  print(f"{time.perf_counter() - start:.0f}s")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
