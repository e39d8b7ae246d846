"""Running one benchmark: compile every variant, check it, time it interleaved.

Timing method (also in docs/performance.md):
  * Each variant is compiled ahead of time (`jax.jit(...).lower(...).compile()`),
    so compilation is never inside a timed call; those seconds (trace + lower +
    compile: what a first call costs beyond its run) are recorded, and so is the
    compiled program's peak memory from XLA's memory analysis (arguments +
    outputs + temporaries - aliased bytes). A first call is a single sample of a
    few tens of milliseconds, which a busy machine moves by 2x, so every variant
    but the slow peer is compiled `compile_reps` times, each from cold caches, as
    in a fresh process (`fresh_compile_caches(cold=True)`: pallet's traced kernels
    and plans and all of JAX's, traced jaxprs included: an op's jitted wrapper
    must trace its kernel again), and its first-call time is the median.
  * One untimed warm-up call per variant; its output is checked against the
    jax.numpy output, and a mismatch stops that variant from being timed.
  * Then `reps` rounds; each round calls every variant once, in a fixed order,
    timing `fn(*args)` up to `jax.block_until_ready`. A variant's time is the
    median of its samples.
  * The interpret peer follows `PeerPolicy`: if its warm-up call alone took
    at least `single_run_s`, that one call is its measurement (it ran after
    compilation, so it excludes compile time); otherwise it joins only the first
    `reps` rounds. Once the peer has used `budget_s` seconds in total (compile
    + runs), the peer of every later benchmark is reported as n/a.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax

from pallet.bench.case import Benchmark
from pallet.bench.checking import MismatchError, check_matches
from pallet.bench.variants import REFERENCE, Variant

Status = Literal["ok", "error", "mismatch", "known_issue", "skipped"]


@dataclasses.dataclass
class VariantResult:
  status: Status
  samples_s: list[float] = dataclasses.field(default_factory=list)
  compile_s: float | None = None        # median of compile_samples_s
  compile_samples_s: list[float] = dataclasses.field(default_factory=list)
  peak_bytes: int | None = None
  message: str = ""

  @property
  def timed(self) -> bool:
    return self.status in ("ok", "known_issue") and bool(self.samples_s)

  @property
  def median_ms(self) -> float | None:
    return 1e3 * statistics.median(self.samples_s) if self.timed else None


@dataclasses.dataclass
class BenchmarkResult:
  bench: Benchmark
  variants: dict[str, VariantResult]

  def ratio(self, numerator: str, denominator: str) -> float | None:
    """median(numerator) / median(denominator), None unless both were timed."""
    num, den = self.variants.get(numerator), self.variants.get(denominator)
    if num is None or den is None or not (num.timed and den.timed):
      return None
    return num.median_ms / den.median_ms


@dataclasses.dataclass
class PeerPolicy:
  """How much time the (very slow) interpret peer may take; see module docstring."""

  reps: int = 3
  single_run_s: float = 2.0
  budget_s: float = 600.0
  spent_s: float = 0.0

  @property
  def exhausted(self) -> bool:
    return self.spent_s >= self.budget_s


def describe_exception(e: BaseException) -> str:
  text = str(e).strip()
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def peak_memory(compiled: Any) -> int | None:
  """Bytes a compiled program holds at once, per XLA's memory analysis (None where
  the backend gives none)."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - an analysis is optional per backend
    return None
  if m is None:
    return None
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)


def fresh_compile_caches(cold: bool = False) -> None:
  """Forgets pallet's traced kernels and plans and JAX's lowered and compiled
  modules, so that the next compile is a first call; `cold` also JAX's tracing
  caches (jax.numpy's own jitted helpers), as in a fresh process. Otherwise those
  stay warm, as for any but the first row of the suite (for every variant alike)."""
  from pallet.core import trace_cache
  trace_cache.clear()
  if cold:
    jax.clear_caches()
    return
  from jax._src.interpreters import pxla   # the two caches keyed by program
  pxla._cached_lowering_to_hlo.cache_clear()
  pxla._cached_compilation.cache_clear()


def _compile(program: Callable[..., Any], args: Sequence[jax.Array]) -> tuple[Any, float]:
  """A first call's compile of `program` from cold caches, and its seconds."""
  fresh = lambda *a: program(*a)
  fresh_compile_caches(cold=True)
  start = time.perf_counter()
  compiled = jax.jit(fresh).lower(*args).compile()
  return compiled, time.perf_counter() - start


def _time_once(fn: Callable[..., Any], args: Sequence[jax.Array]) -> tuple[float, Any]:
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return time.perf_counter() - start, out


def run_benchmark(bench: Benchmark, variants: Sequence[Variant], *, reps: int,
                  peer: PeerPolicy, seed: int = 0, compile_reps: int = 3) -> BenchmarkResult:
  """Compile, check and time `variants` of `bench`; the first must be the jnp reference.

  Raises RuntimeError if the jax.numpy reference itself cannot run, since then
  nothing can be checked.
  """
  if reps < 1:
    raise ValueError(f"reps must be >= 1, got {reps}")
  if not variants or variants[0].name != REFERENCE:
    raise ValueError(f"the first variant must be {REFERENCE!r}, got "
                     f"{[v.name for v in variants]}")
  slow = {v.name for v in variants if v.slow_peer}
  args = jax.block_until_ready(bench.make_inputs(jax.random.key(seed)))
  results: dict[str, VariantResult] = {}
  compiled: dict[str, Callable[..., Any]] = {}

  for variant in variants:
    v, is_peer = variant.name, variant.slow_peer
    if is_peer and peer.exhausted:
      results[v] = VariantResult("skipped",
                                 message=f"n/a (peer budget {peer.budget_s:g}s used up)")
      continue
    samples: list[float] = []
    start = time.perf_counter()
    try:
      program = variant.build(bench)   # imports and op-module loading: not a first call
      for _ in range(1 if is_peer else compile_reps):
        start = time.perf_counter()
        compiled[v], seconds = _compile(program, args)
        samples.append(seconds)
      results[v] = VariantResult("ok", peak_bytes=peak_memory(compiled[v]))
    except Exception as e:  # noqa: BLE001 - any failure is reported per variant
      compiled.pop(v, None)
      results[v] = VariantResult("error", message=f"compile: {describe_exception(e)}")
      samples.append(time.perf_counter() - start)
    results[v].compile_s = statistics.median(samples)
    results[v].compile_samples_s = samples
    if is_peer:
      peer.spent_s += sum(samples)

  if REFERENCE not in compiled:
    raise RuntimeError(f"{bench.name}: the jax.numpy reference failed to compile: "
                       f"{results[REFERENCE].message}")
  _, expected = _time_once(compiled[REFERENCE], args)

  rounds: dict[str, int] = {}
  for v, fn in list(compiled.items()):
    if v == REFERENCE:
      rounds[v] = reps
      continue
    try:
      first_s, out = _time_once(fn, args)
    except Exception as e:  # noqa: BLE001
      results[v].status, results[v].message = "error", f"run: {describe_exception(e)}"
      del compiled[v]
      continue
    is_peer = v in slow
    if is_peer:
      peer.spent_s += first_s
    try:
      check_matches(bench, v, out, expected)
    except MismatchError as e:
      if not (is_peer and bench.peer_known_issue):
        results[v].status, results[v].message = "mismatch", str(e)
        del compiled[v]
        continue
      results[v].status, results[v].message = "known_issue", bench.peer_known_issue
    if is_peer and (first_s >= peer.single_run_s or peer.exhausted):
      results[v].samples_s.append(first_s)
      rounds[v] = 0
    else:
      rounds[v] = peer.reps if is_peer else reps

  for r in range(reps):
    for v, fn in compiled.items():
      if r >= rounds[v] or (v in slow and peer.exhausted):
        continue
      elapsed, _ = _time_once(fn, args)
      results[v].samples_s.append(elapsed)
      if v in slow:
        peer.spent_s += elapsed
  return BenchmarkResult(bench, results)
