"""Where a row's run time goes inside XLA's compiled program: milliseconds per kernel.

A row's ratio says how much slower pallet's program is than jax.numpy's, not which of
its pieces costs. XLA:CPU runs a compiled program as a sequence of kernels (a fusion,
a matrix product handed to its library, a copy, a loop), and JAX's profiler records
each one's start and duration. This runs pallet's program, the plain jax.numpy twin
and, where the row has one, its algorithm twin (`algorithm_twins.py`) under
`jax.profiler.trace` and prints, per program, the kernels that took the most time per
call (a loop's or conditional's own time, its body's kernels listed apart), their share
of the program, how often each ran per call, and the total:

    python -m pallet.bench.fusion_profile --only op_tpu_splash_attention --size test

Kernel names are XLA's (`ynn_fusion` is a fusion handed to the YNNPACK library, a
matrix product or a reduction; `kLoop` fusions are named after their first
instructions); read them next to the program's optimized HLO
(`jax.jit(f).lower(*args).compile().as_text()`). The profiler adds its own overhead,
and the programs run one after another, not interleaved: on a noisy machine compare
shares within a program more than times across programs.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import jax

from pallet.bench import algorithm_twins, catalog
from pallet.bench.case import SIZES, Benchmark

# Events that are the runtime's own bookkeeping, not a kernel of the program.
_RUNTIME = ("ThunkExecutor", "SlinkyThreadPool", "ThreadpoolListener", "PjitFunction",
            "CommonPjRt", "Allocate", "Handle input", "ParseArguments", "PythonRefManager",
            "Wait for", "end: ", "$")


def kernel_times(fn: Callable[..., Any], args: tuple, calls: int = 20) -> dict[str, tuple[float, float]]:
  """{kernel name: (milliseconds per call, runs per call)} of `fn`'s compiled program."""
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as directory:
    with jax.profiler.trace(directory):
      for _ in range(calls):
        jax.block_until_ready(fn(*args))
    traces = glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True)
    if not traces:
      raise RuntimeError("jax.profiler.trace wrote no trace.json.gz on this JAX version")
    with gzip.open(traces[0]) as f:
      events = json.load(f)["traceEvents"]
  total: collections.Counter = collections.Counter()
  runs: collections.Counter = collections.Counter()
  for name, self_us in _self_times(events):
    if not name.startswith(_RUNTIME):
      total[name] += self_us
      runs[name] += 1
  return {name: (us / calls / 1e3, runs[name] / calls) for name, us in total.items()}


def _self_times(events: list[dict]) -> list[tuple[str, float]]:
  """(name, duration less the events nested in it) of every complete event: a loop's
  or a conditional's own time, without the kernels of its body, counted once."""
  threads: dict = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X":
      threads[e.get("pid"), e.get("tid")].append(e)
  out = []
  for spans in threads.values():
    spans.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack: list[list] = []   # [event, time of its children]
    for e in spans:
      while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
        done, children = stack.pop()
        out.append((done["name"], done["dur"] - children))
      if stack:
        stack[-1][1] += e["dur"]
      stack.append([e, 0.0])
    out += [(e["name"], e["dur"] - children) for e, children in stack]
  return out


def programs(bench: Benchmark, size: str) -> dict[str, Callable[..., Any]]:
  import pallet   # the subject; imported here so the module loads without it
  found = {"pallet": jax.jit(bench.build_pallas(pallet)), "plain": jax.jit(bench.reference)}
  if bench.name in algorithm_twins.ALGORITHM_TWINS:
    found["algorithm"] = jax.jit(algorithm_twins.ALGORITHM_TWINS[bench.name](size))
  return found


def report(bench: Benchmark, size: str, top: int = 12, calls: int = 20) -> list[str]:
  args = bench.make_inputs(jax.random.key(0))
  lines = [f"{bench.name} ({size}: {bench.shapes})"]
  for name, fn in programs(bench, size).items():
    times = kernel_times(fn, args, calls)
    ranked = sorted(times.items(), key=lambda kv: -kv[1][0])
    whole = sum(ms for ms, _ in times.values())
    lines.append(f"  {name}: {whole:.3f} ms per call in {len(times)} kernels")
    lines += [f"    {ms:8.3f} ms {100 * ms / whole:5.1f}%  {n:5.1f}x  {kernel}"
              for kernel, (ms, n) in ranked[:top]]
  return lines


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m pallet.bench.fusion_profile",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--only", action="append", required=True, help="a row (repeatable)")
  parser.add_argument("--size", choices=SIZES, default="test")
  parser.add_argument("--top", type=int, default=12, help="kernels listed per program")
  parser.add_argument("--calls", type=int, default=20, help="profiled calls per program")
  args = parser.parse_args(argv)
  for bench in catalog.select(catalog.all_benchmarks(args.size), args.only):
    print("\n".join(report(bench, args.size, args.top, args.calls)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
