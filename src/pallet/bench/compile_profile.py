"""First-call cost of every suite row, split into phases, pallet against jax.numpy.

    python -m pallet.bench.compile_profile [--size tiny|small|full] [--only NAME] [--rounds N]

Per row and variant (`jnp`, `pallet`), each compile starts without any cached
program (JAX's lowered and compiled modules, pallet's traced kernels and plans are
cleared; JAX's tracing caches only with --cold), with the rows interleaved round by
round after one untimed round, and is split into:

  * `kernel`: pallet tracing the kernel into a description (inside `jit.trace`);
  * `trace`: the rest of `jax.jit(f).trace(...)` (the caller's program);
  * `plan`: pallet's planning (grid and body analyses, the plan), during lowering, or
    while tracing where the caller differentiates the kernel (its JVP rule plans);
  * `emit`: tracing the function the plan emits into a jaxpr (ditto);
  * `lower`: the rest of `.lower()`: jaxpr to StableHLO;
  * `xla`: `.compile()`, XLA compiling the module.

It also counts the lowered module's operations and `while` loops. Reported: the
median of each phase over the rounds, pallet's total over jnp's per row, and the
geomean over rows. On a busy machine only ratios from one run mean anything;
`--cpu-time` counts the process's CPU seconds instead of wall time, which other jobs
on the machine disturb far less.

`--targets` also times the Pallas interpret peer's first call and, for kernels with
a loop listed in `src/pallet/bench/loop_twins.py`, their algorithm written as a jax.numpy
loop, and reports the first-call targets: loop-free kernels <= 2x jax.numpy's first
call, kernels with loops <= 1.3x their jax.numpy loop, every row faster than the
interpret peer.
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
import jax.extend.core

from pallet.bench import catalog
from pallet.bench.case import SIZES, Benchmark
from pallet.bench.loop_twins import LOOP_TWINS
from pallet.bench.runner import fresh_compile_caches
from pallet.bench.suite import positive_int
from pallet.bench.variants import cpu_variant

PHASES = ("kernel", "trace", "plan", "emit", "lower", "xla")
# Wall-clock seconds by default; `--cpu-time` switches to the process's CPU seconds (all
# its threads), which a machine shared with other jobs inflates far less: a process
# waiting for a core accrues none.
_clock = time.perf_counter


class _Clock:
  """Seconds spent inside pallet's kernel tracing, planning and emitted function, and
  how much of planning and emitting happened while tracing (derivatives: the JVP rule
  plans and emits the kernel while the caller is traced) rather than lowering."""

  def __init__(self):
    self.spent = dict.fromkeys(("kernel", "plan", "emit"), 0.0)
    self.while_tracing = dict.fromkeys(("kernel", "plan", "emit"), 0.0)
    self.tracing = False
    self._depth = 0

  def timed(self, phase: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
      outer = self._depth == 0
      self._depth += 1
      start = _clock()
      try:
        return fn(*args, **kwargs)
      finally:
        self._depth -= 1
        if outer:
          self.spent[phase] += _clock() - start
          if self.tracing:
            self.while_tracing[phase] += _clock() - start
    return wrapper


@contextlib.contextmanager
def _instrumented(clock: _Clock):
  """Wraps pallet's kernel tracing and the XLA backend's planning with `clock`."""
  from pallet.core import tracing
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
    clock.tracing = True
    t0 = _clock()
    traced = jax.jit(fresh).trace(*shapes)
    t1 = _clock()
    clock.tracing = False
    lowered = traced.lower()
    t2 = _clock()
  lowered.compile()
  t3 = _clock()
  text = lowered.as_text()
  spent, early = clock.spent, clock.while_tracing
  return {"kernel": spent["kernel"], "trace": t1 - t0 - sum(early.values()),
          "plan": spent["plan"], "emit": spent["emit"],
          "lower": t2 - t1 - (spent["plan"] - early["plan"]) - (spent["emit"] - early["emit"]),
          "xla": t3 - t2,
          "ops": float(text.count(" = ")), "whiles": float(text.count("stablehlo.while"))}


def profile(benches: list[Benchmark], rounds: int, cold: bool = False,
            targets: bool = False, size: str = "full") -> dict[str, dict[str, list[dict]]]:
  """Every row's jnp and pallet first calls, `rounds` times, rows interleaved and the
  variant order alternating between rounds; an untimed round first (unless `cold`).
  With `targets`, also the Pallas interpret peer's first call and, for rows listed in
  `loop_twins`, the kernel's algorithm written as a jax.numpy loop (`jnp_loop`); a
  variant that fails to compile is left out of its row."""
  programs = {b.name: {v: cpu_variant(v).build(b) for v in ("jnp", "pallet")} for b in benches}
  if targets:
    for b in benches:
      programs[b.name]["interpret"] = cpu_variant("interpret").build(b)
      if b.name in LOOP_TWINS:
        programs[b.name]["jnp_loop"] = LOOP_TWINS[b.name](size)
  shapes = {b.name: jax.eval_shape(b.make_inputs, jax.random.key(0)) for b in benches}
  samples: dict[str, dict[str, list[dict]]] = {b.name: {v: [] for v in programs[b.name]}
                                              for b in benches}
  for r in range(-1 if not cold else 0, rounds):
    for b in benches:
      order = list(programs[b.name]) if r % 2 == 0 else list(programs[b.name])[::-1]
      for v in order:
        try:
          run = profile_once(programs[b.name][v], shapes[b.name], cold)
        except Exception as e:  # noqa: BLE001 - the peer's own limits: reported, not fatal
          if v in ("jnp", "pallet"):
            raise
          print(f"{b.name} [{v}]: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
          continue
        if r >= 0:
          samples[b.name][v].append(run)
    print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
  if targets:
    for b in benches:
      samples[b.name]["kernel_loops"] = [{"loops": float(_kernel_loops(
          programs[b.name]["pallet"], shapes[b.name]))}]
  return samples


def _kernel_loops(program: Callable, shapes: Any) -> bool:
  """Whether a kernel the program launches has a loop (while, scan) in its body."""
  from pallet.backends.xla.plan import _uses_primitive
  jaxpr = jax.make_jaxpr(program)(*shapes)
  found = []

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name == "pallas_call":
        found.append(_uses_primitive(eqn.params["kernel"].jaxpr.jaxpr, ("while", "scan")))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jaxpr.jaxpr)
  return any(found)


def targets_report(samples: dict[str, dict[str, list[dict]]]) -> list[str]:
  """First calls against the restated targets: loop-free kernels <= 2x jax.numpy's,
  kernels with loops (in the kernel, or in pallet's program: a grid of traced size,
  DMAs) <= 1.3x their algorithm as a jax.numpy loop where `loop_twins` has it, and
  every row faster than the Pallas interpret peer's first call."""
  ms = lambda s: f"{1e3 * s:8.1f}" if s is not None else "       -"
  head = (f"{'row':34s} kind    jnp ms  jnp-loop  interpret   pallet  "
          f"target              met  faster than interpret")
  lines, met = [head, "-" * len(head)], {"loop-free": [], "loop": [], "interpret": []}
  for name, runs in samples.items():
    total = {v: statistics.median(_total(r) for r in runs[v]) if runs.get(v) else None
             for v in ("jnp", "pallet", "interpret", "jnp_loop")}
    # a loop in the kernel, or in pallet's program (a grid of traced size, DMAs, ...)
    loops = bool(runs["kernel_loops"][0]["loops"]) or _median(runs["pallet"], "whiles") > 0
    if not loops:
      ratio, target, ok = total["pallet"] / total["jnp"], "<= 2x jnp", None
      ok = ratio <= 2.0
      met["loop-free"].append(ok)
    elif total["jnp_loop"] is not None:
      ratio, target = total["pallet"] / total["jnp_loop"], "<= 1.3x jnp loop"
      ok = ratio <= 1.3
      met["loop"].append(ok)
    else:
      ratio, target, ok = total["pallet"] / total["jnp"], "(no jnp loop twin)", None
    peer = None if total["interpret"] is None else total["pallet"] < total["interpret"]
    if peer is not None:
      met["interpret"].append(peer)
    lines.append(f"{name:34s} {'loop' if loops else 'free':4s} {ms(total['jnp'])}  "
                 f"{ms(total['jnp_loop'])}   {ms(total['interpret'])} {ms(total['pallet'])}  "
                 f"{ratio:5.2f} {target:17s} {'-' if ok is None else 'yes' if ok else 'NO':3s}  "
                 f"{'-' if peer is None else 'yes' if peer else 'NO'}")
  for kind, oks in met.items():
    lines.append(f"{kind}: {sum(oks)} of {len(oks)} rows meet their target")
  return lines


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
    jnp_runs, pal_runs = runs["jnp"], runs["pallet"]   # (other variants: targets_report)
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
  p = argparse.ArgumentParser(prog="python -m pallet.bench.compile_profile",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--size", choices=SIZES, default="full")
  p.add_argument("--only", action="append", default=[], metavar="NAME",
                 help="a benchmark or family (repeatable)")
  p.add_argument("--rounds", type=positive_int, default=3)
  p.add_argument("--cold", action="store_true",
                 help="clear every JAX cache before each compile (a fresh process)")
  p.add_argument("--targets", action="store_true",
                 help="also time the Pallas interpret peer and the jax.numpy loop twins "
                      "(src/pallet/bench/loop_twins.py) and report the first-call targets")
  p.add_argument("--cpu-time", action="store_true",
                 help="measure CPU seconds of this process (all threads) instead of wall "
                      "time: far less noisy on a shared machine")
  args = p.parse_args(argv)
  global _clock
  _clock = time.process_time if args.cpu_time else time.perf_counter
  benches = catalog.select(catalog.all_benchmarks(args.size), args.only)
  try:
    with jax.default_device(jax.devices("cpu")[0]):
      samples = profile(benches, args.rounds, args.cold, args.targets, args.size)
  finally:
    _clock = time.perf_counter
  print("\n".join(report(samples)))
  if args.targets:
    print("\n".join(targets_report(samples)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
