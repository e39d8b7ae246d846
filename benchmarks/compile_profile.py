"""First-call cost of every suite row, split into phases, pallet against jax.numpy.

    python -m benchmarks.compile_profile [--size tiny|small|full] [--only NAME] [--rounds N]

Per row and variant (`jnp`, `pallet`), each compile starts without any cached
program (JAX's lowered and compiled modules, pallet's traced kernels and plans are
cleared; JAX's tracing caches only with --cold), with the rows interleaved round by
round after one untimed round, and is split into:

  * `kernel`: pallet tracing the kernel into a description (inside `jit.trace`);
  * `trace`: the rest of `jax.jit(f).trace(...)` (the caller's program);
  * `plan`: pallet's planning, during lowering (grid and body analyses, the plan);
  * `emit`: tracing the function the plan emits into a jaxpr (during lowering);
  * `lower`: the rest of `.lower()`: jaxpr to StableHLO;
  * `xla`: `.compile()`, XLA compiling the module.

It also counts the lowered module's operations and `while` loops. Reported: the
median of each phase over the rounds, pallet's total over jnp's per row, and the
geomean over rows. On a busy machine only ratios from one run mean anything.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from typing import Any, Callable

import jax

from benchmarks import catalog
from benchmarks.case import SIZES, Benchmark
from benchmarks.runner import fresh_compile_caches
from benchmarks.suite import positive_int
from benchmarks.variants import cpu_variant

PHASES = ("kernel", "trace", "plan", "emit", "lower", "xla")


class _Clock:
  """Seconds spent inside pallet's kernel tracing, planning and emitted function."""

  def __init__(self):
    self.spent = dict.fromkeys(("kernel", "plan", "emit"), 0.0)
    self._depth = 0

  def timed(self, phase: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
      outer = self._depth == 0
      self._depth += 1
      start = time.perf_counter()
      try:
        return fn(*args, **kwargs)
      finally:
        self._depth -= 1
        if outer:
          self.spent[phase] += time.perf_counter() - start
    return wrapper


@contextlib.contextmanager
def _instrumented(clock: _Clock):
  """Wraps pallet's kernel tracing and the XLA backend's planning with `clock`."""
  from pallet import tracing
  from pallet.backends import xla
  trace_kernel, planned = tracing.trace_kernel, xla._planned

  def timed_planned(kernel):
    plan, fn = clock.timed("plan", planned)(kernel)
    return plan, clock.timed("emit", fn)
  tracing.trace_kernel = clock.timed("kernel", trace_kernel)
  xla._planned = timed_planned
  try:
    yield
  finally:
    tracing.trace_kernel, xla._planned = trace_kernel, planned


def profile_once(program: Callable, shapes: Any, cold: bool = False) -> dict[str, float]:
  """One first call of `program` on `shapes`, split into PHASES (seconds)."""
  fresh_compile_caches(cold)
  clock = _Clock()
  fresh = lambda *a: program(*a)
  with _instrumented(clock):
    t0 = time.perf_counter()
    traced = jax.jit(fresh).trace(*shapes)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
  lowered.compile()
  t3 = time.perf_counter()
  text = lowered.as_text()
  spent = clock.spent
  return {"kernel": spent["kernel"], "trace": t1 - t0 - spent["kernel"],
          "plan": spent["plan"], "emit": spent["emit"],
          "lower": t2 - t1 - spent["plan"] - spent["emit"], "xla": t3 - t2,
          "ops": float(text.count(" = ")), "whiles": float(text.count("stablehlo.while"))}


def profile(benches: list[Benchmark], rounds: int,
            cold: bool = False) -> dict[str, dict[str, list[dict]]]:
  """Every row's jnp and pallet first calls, `rounds` times, rows interleaved and the
  variant order alternating between rounds; an untimed round first (unless `cold`)."""
  variants = [cpu_variant("jnp"), cpu_variant("pallet")]
  programs = {b.name: {v.name: v.build(b) for v in variants} for b in benches}
  shapes = {b.name: jax.eval_shape(b.make_inputs, jax.random.key(0)) for b in benches}
  samples: dict[str, dict[str, list[dict]]] = {b.name: {"jnp": [], "pallet": []}
                                              for b in benches}
  for r in range(-1 if not cold else 0, rounds):
    for b in benches:
      order = ("jnp", "pallet") if r % 2 == 0 else ("pallet", "jnp")
      for v in order:
        run = profile_once(programs[b.name][v], shapes[b.name], cold)
        if r >= 0:
          samples[b.name][v].append(run)
    print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
  return samples


def _median(runs: list[dict], key: str) -> float:
  return statistics.median(run[key] for run in runs)


def _total(run: dict) -> float:
  return sum(run[p] for p in PHASES)


def report(samples: dict[str, dict[str, list[dict]]]) -> list[str]:
  ms = lambda s: f"{1e3 * s:7.1f}"
  head = ("row".ljust(28) + " jnp ms  pallet ms  ratio |"
          + "".join(f"{p:>8s}" for p in PHASES) + " | jnp xla  ops p/j  whiles")
  lines, ratios = [head, "-" * len(head)], []
  for name, runs in samples.items():
    jnp_runs, pal_runs = runs["jnp"], runs["pallet"]
    # ratio of medians of totals: each total from one cold compile
    jnp_total = statistics.median(_total(r) for r in jnp_runs)
    pal_total = statistics.median(_total(r) for r in pal_runs)
    ratio = pal_total / jnp_total
    ratios.append(ratio)
    lines.append(f"{name:28s}{ms(jnp_total)} {ms(pal_total):>9s} {ratio:6.2f} |"
                 + "".join(f"{1e3 * _median(pal_runs, p):8.1f}" for p in PHASES)
                 + f" | {ms(_median(jnp_runs, 'xla'))}"
                 + f" {int(_median(pal_runs, 'ops')):5d}/{int(_median(jnp_runs, 'ops')):<5d}"
                 + f" {int(_median(pal_runs, 'whiles'))}")
  geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
  lines.append(f"pallet/jnp first-call time: geomean {geo:.2f} over {len(ratios)} rows, "
               f"max {max(ratios):.2f}")
  return lines


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.compile_profile",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--size", choices=SIZES, default="full")
  p.add_argument("--only", action="append", default=[], metavar="NAME",
                 help="a benchmark or family (repeatable)")
  p.add_argument("--rounds", type=positive_int, default=3)
  p.add_argument("--cold", action="store_true",
                 help="clear every JAX cache before each compile (a fresh process)")
  args = p.parse_args(argv)
  benches = catalog.select(catalog.all_benchmarks(args.size), args.only)
  with jax.default_device(jax.devices("cpu")[0]):
    samples = profile(benches, args.rounds, args.cold)
  print("\n".join(report(samples)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
