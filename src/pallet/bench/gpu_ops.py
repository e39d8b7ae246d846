"""Times the op programs of `pallet.bench.gpu_op_cases` against what a user would call
instead, on the GPU JAX runs on (or, at size "tiny", on the CPU: a smoke run).

Per program and size: every variant's result is first checked against the jax.numpy
reference (a variant that differs is reported, never timed); then the variants are
timed in interleaved rounds (each round calls every variant, in a rotating order;
each sample is enough back-to-back calls to take ~20 ms, so launch overhead is not
what is measured), median per variant. Reported: pallet's TFLOP/s or GB/s, the
baseline's, their time ratio and each one's share of the device's peak (PEAKS).
"""
from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from pallet.bench.gpu_op_cases import Baseline, OpCase

SAMPLE_S = 0.02

# Dense bf16 tensor-core TFLOP/s and HBM TB/s of one device, from the vendors' data
# sheets (NVIDIA H100, H200, A100, B200; AMD Instinct MI300X, MI250X): the figures
# "with sparsity" halved. Matched against JAX's device_kind, first match wins.
PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H100 PCIe", 756.0, 2.0), ("H100 NVL", 835.0, 3.9), ("GH200", 989.0, 4.0),
    ("H200", 989.0, 4.8), ("H100", 989.0, 3.35), ("B200", 2250.0, 8.0),
    ("A100-SXM4-40GB", 312.0, 1.555), ("A100-PCIE-40GB", 312.0, 1.555),
    ("A100 80GB PCIe", 312.0, 1.935), ("A100", 312.0, 2.039), ("MI300X", 1307.4, 5.3),
    ("MI250X", 383.0, 3.2), ("L40S", 362.0, 0.864),
)


def peak_of(device_kind: str) -> tuple[float, float] | None:
  """(bf16 dense TFLOP/s, HBM TB/s) of a device, or None if PEAKS does not list it."""
  for name, tflops, tbps in PEAKS:
    if name in device_kind:
      return tflops, tbps
  return None


@dataclasses.dataclass
class Timed:
  """One variant of one program: "ok" (timed), "mismatch", "error" or "n/a"."""
  name: str
  status: str
  seconds: float | None = None
  message: str = ""


@dataclasses.dataclass
class Result:
  case: OpCase
  size: str
  variants: list[Timed]

  def rate(self, timed: Timed) -> float | None:
    """TFLOP/s or GB/s of a timed variant."""
    if timed.seconds is None:
      return None
    work = self.case.flops / 1e12 if self.case.unit == "TFLOP/s" else self.case.bytes / 1e9
    return work / timed.seconds


def max_relative_error(actual: Any, expected: Any) -> float:
  """The largest |actual - expected| over the leaves, relative to each leaf's largest
  |expected|."""
  worst = 0.0
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    a64, e64 = np.asarray(a, np.float64), np.asarray(e, np.float64)
    if a64.shape != e64.shape:
      return math.inf
    scale = max(float(np.max(np.abs(e64))) if e64.size else 0.0, 1e-30)
    worst = max(worst, float(np.max(np.abs(a64 - e64))) / scale if e64.size else 0.0)
  return worst


def _variants(case: OpCase, on_gpu: bool) -> list[Baseline]:
  """pallet's program first, then the baselines (run None: not available here)."""
  out = [Baseline("pallet", case.pallet)]
  for b in case.baselines:
    out.append(dataclasses.replace(b, run=None) if b.gpu_only and not on_gpu else b)
  return out


def run_case(case: OpCase, size: str, *, reps: int, on_gpu: bool, key: jax.Array) -> Result:
  """Checks every variant of `case` against its reference, then times the ones that match."""
  inputs = case.inputs(key)
  expected = jax.jit(case.reference)(*inputs)
  timed: list[Timed] = []
  runnable: list[tuple[int, Any, tuple]] = []
  for variant in _variants(case, on_gpu):
    name = variant.name
    if variant.run is None:
      timed.append(Timed(name, "n/a", message="needs a GPU"))
      continue
    try:
      args = jax.block_until_ready(jax.jit(variant.prepare)(*inputs))
      compiled = jax.jit(variant.run).lower(*args).compile()
      out = jax.block_until_ready(compiled(*args))
      out = jax.jit(variant.finish)(out) if variant.checked else expected
    except Exception as e:  # noqa: BLE001 - one failing variant must not stop the run
      timed.append(Timed(name, "error", message=f"{type(e).__name__}: {_first_line(e)}"))
      continue
    error = max_relative_error(out, expected)
    if not error <= case.tolerance:
      timed.append(Timed(name, "mismatch", message=f"max error {error:.3g} of the largest "
                                                   f"reference value (allowed "
                                                   f"{case.tolerance})"))
      continue
    del out
    timed.append(Timed(name, "ok"))
    runnable.append((len(timed) - 1, compiled, args))
  del expected
  samples: dict[int, list[float]] = {i: [] for i, _, _ in runnable}
  inner = {i: _calls_per_sample(compiled, args) for i, compiled, args in runnable}
  for r in range(reps):
    shift = r % max(1, len(runnable))
    for i, compiled, args in runnable[shift:] + runnable[:shift]:
      start = time.perf_counter()
      for _ in range(inner[i]):
        out = compiled(*args)
      jax.block_until_ready(out)
      samples[i].append((time.perf_counter() - start) / inner[i])
  for i, s in samples.items():
    timed[i].seconds = statistics.median(s)
  return Result(case, size, timed)


def _calls_per_sample(compiled: Any, args: tuple) -> int:
  start = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  once = time.perf_counter() - start
  return max(1, min(1000, int(SAMPLE_S / max(once, 1e-6))))


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return text[0][:200] if text else ""


# ------------------------------------------------------------------ the report
def _rate(value: float | None, unit: str) -> str:
  if value is None:
    return "-"
  return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _share(value: float | None, unit: str, peak: tuple[float, float] | None) -> str:
  if value is None or peak is None:
    return "-"
  full = peak[0] if unit == "TFLOP/s" else peak[1] * 1e3
  return f"{100 * value / full:.0f}%"


def table(results: Sequence[Result], device_kind: str) -> str:
  """One row per (program, size, baseline): pallet's rate, the baseline's, the time
  ratio pallet/baseline (> 1: pallet is slower) and both shares of the peak."""
  peak = peak_of(device_kind)
  head = ("program", "shape", "unit", "pallet", "% peak", "instead", "rate", "% peak",
          "pallet/instead (time)")
  rows = []
  for res in results:
    unit = res.case.unit
    pallet = res.variants[0]
    p_rate = res.rate(pallet)
    p_text = _rate(p_rate, unit) if pallet.status == "ok" else pallet.status
    others = res.variants[1:] or [Timed("-", "n/a")]
    for other in others:
      o_rate = res.rate(other)
      ratio = (f"{pallet.seconds / other.seconds:.2f}x"
               if pallet.seconds and other.seconds else "-")
      rows.append((res.case.name, res.case.shape, unit, p_text, _share(p_rate, unit, peak),
                   other.name, _rate(o_rate, unit) if other.status == "ok" else other.status,
                   _share(o_rate, unit, peak), ratio))
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  return "\n".join(lines)


def problems(results: Sequence[Result]) -> list[str]:
  """Every variant that errored or computed a different result (n/a is not a problem)."""
  return [f"{r.case.name} [{r.size}] {v.name}: {v.status}: {v.message}"
          for r in results for v in r.variants if v.status in ("error", "mismatch")]


def run(cases_by_size: Sequence[tuple[str, Sequence[OpCase]]], *, reps: int,
        on_gpu: bool, log: Any = sys.stderr) -> list[Result]:
  results = []
  start = time.perf_counter()
  for size, cases in cases_by_size:
    for n, case in enumerate(cases):
      print(f"[{time.perf_counter() - start:6.0f}s] {size}: {case.name} ({case.shape})",
            file=log, flush=True)
      results.append(run_case(case, size, reps=reps, on_gpu=on_gpu,
                              key=jax.random.key(n)))
      gc.collect()
  return results


def numbers(results: Sequence[Result]) -> list[dict[str, Any]]:
  """The results as JSON-ready rows."""
  return [{"program": r.case.name, "size": r.size, "shape": r.case.shape, "unit": r.case.unit,
           "flops": r.case.flops, "bytes": r.case.bytes,
           "variants": {v.name: {"status": v.status, "ms": None if v.seconds is None
                                 else v.seconds * 1e3, "rate": r.rate(v),
                                 "message": v.message} for v in r.variants}}
          for r in results]
