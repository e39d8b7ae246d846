"""Presenting results: terminal table, summary lines against the targets, JSON, chart."""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pallet.bench.runner import BenchmarkResult, VariantResult

# Targets for the backend (issue 3); the suite reports them, it does not enforce them.
GEOMEAN_TARGET = 1.1        # issue 10: over the whole suite, JAX's kernel library included
MAX_RATIO_TARGET = 1.5
COMPILE_RATIO_TARGET = 2.0  # first call (trace + compile) against jax.numpy's
PEER_SPEEDUP_TARGET = 100.0
PEER_SPEEDUP_MIN_STEPS = 256

SINGLE_RUN_MARK = "*"
KNOWN_ISSUE_MARK = "!"


@dataclasses.dataclass(frozen=True)
class Columns:
  """Which variants the table compares: subject vs reference, and peer vs subject."""

  reference: str = "jnp"
  subject: str = "pallet"
  peer: str = "interpret"

  @property
  def header(self) -> tuple[str, ...]:
    r, s, p = self.reference, self.subject, self.peer
    return ("kernel", "grid steps", f"{r} ms", f"{s} ms", f"{s}/{r}", f"{p} ms", f"{p}/{s}",
            f"{r} compile s", f"{s} compile s", f"{s}/{r} compile", f"{p} compile s",
            f"{r} MiB", f"{s} MiB")


CPU_COLUMNS = Columns()


@dataclasses.dataclass(frozen=True)
class Summary:
  geomean: float | None
  count: int
  max_ratio: tuple[str, float] | None
  min_peer_speedup: tuple[str, float] | None
  peer_count: int
  untimed_subject: tuple[str, ...]
  # Kernels (>= PEER_SPEEDUP_MIN_STEPS steps) where the peer is already within
  # PEER_SPEEDUP_TARGET of the reference, so even reference speed misses that target.
  peer_bound: tuple[tuple[str, float], ...] = ()
  cols: Columns = CPU_COLUMNS
  compile_geomean: float | None = None
  compile_max: tuple[str, float] | None = None

  def lines(self, targets: bool = True) -> list[str]:
    """Summary lines; with `targets`, each says whether the CPU target is met."""

    def verdict(ok: bool) -> str:
      return ("met" if ok else "MISSED") if targets else "not a target here"

    sub_ref = f"{self.cols.subject}/{self.cols.reference}"
    peer_sub = f"{self.cols.peer}/{self.cols.subject}"
    out = []
    if self.geomean is None:
      out.append(f"{sub_ref} geomean: n/a ({self.cols.subject} timed on no kernel)")
    else:
      out.append(f"{sub_ref} geomean over {self.count} kernels: {self.geomean:.2f} "
                 f"(target <= {GEOMEAN_TARGET}: {verdict(self.geomean <= GEOMEAN_TARGET)})")
    if self.max_ratio is not None:
      name, value = self.max_ratio
      out.append(f"{sub_ref} max: {value:.2f} ({name}) "
                 f"(target <= {MAX_RATIO_TARGET}: {verdict(value <= MAX_RATIO_TARGET)})")
    if self.compile_max is not None:
      name, value = self.compile_max
      out.append(f"{sub_ref} compile time (first call: trace + compile) geomean "
                 f"{self.compile_geomean:.2f}, max {value:.2f} ({name}) (target <= "
                 f"{COMPILE_RATIO_TARGET}: {verdict(value <= COMPILE_RATIO_TARGET)})")
    if self.min_peer_speedup is None:
      out.append(f"{peer_sub} min over kernels with >= {PEER_SPEEDUP_MIN_STEPS} "
                 "grid steps: n/a (none timed)")
    else:
      name, value = self.min_peer_speedup
      out.append(f"{peer_sub} min over {self.peer_count} kernels with >= "
                 f"{PEER_SPEEDUP_MIN_STEPS} grid steps: {_format_number(value)}x ({name}) (target >= "
                 f"{PEER_SPEEDUP_TARGET:.0f}x: {verdict(value >= PEER_SPEEDUP_TARGET)})")
    if self.peer_bound:
      bound = ", ".join(f"{n} ({_format_number(x)}x)" for n, x in self.peer_bound)
      out.append(f"  {self.cols.peer}/{self.cols.reference} is below "
                 f"{PEER_SPEEDUP_TARGET:.0f}x on: {bound}; matching {self.cols.reference} "
                 f"there cannot reach that target")
    if self.untimed_subject:
      out.append(f"{self.cols.subject} NOT timed (error/mismatch) on: "
                 f"{', '.join(self.untimed_subject)}")
    return out


LIBRARY_FAMILY_PREFIX = "jax_ops"   # rows running JAX's own kernel library (jax_op_cases.py)


def split_library(results: Sequence[BenchmarkResult]
                  ) -> tuple[list[BenchmarkResult], list[BenchmarkResult]]:
  """(kernels written here, rows of JAX's kernel library)."""
  library = [r for r in results if r.bench.family.startswith(LIBRARY_FAMILY_PREFIX)]
  return [r for r in results if r not in library], library


def compile_ratio(r: BenchmarkResult, numerator: str, denominator: str) -> float | None:
  """compile seconds of numerator / denominator, None unless both compiled."""
  num, den = r.variants.get(numerator), r.variants.get(denominator)
  if num is None or den is None or num.status in ("error", "skipped") or \
      den.status in ("error", "skipped") or not num.compile_s or not den.compile_s:
    return None
  return num.compile_s / den.compile_s


def _geomean(values: Sequence[float]) -> float | None:
  return math.exp(sum(math.log(x) for x in values) / len(values)) if values else None


def summarize(results: Sequence[BenchmarkResult], cols: Columns = CPU_COLUMNS) -> Summary:
  ratios = [(r.bench.name, r.ratio(cols.subject, cols.reference)) for r in results]
  timed = [(n, x) for n, x in ratios if x is not None]
  compiles = [(r.bench.name, x) for r in results
              if (x := compile_ratio(r, cols.subject, cols.reference)) is not None]
  speedups = [(r.bench.name, r.ratio(cols.peer, cols.subject)) for r in results
              if r.bench.grid_steps >= PEER_SPEEDUP_MIN_STEPS]
  speedups = [(n, x) for n, x in speedups if x is not None]
  return Summary(
      geomean=_geomean([x for _, x in timed]),
      count=len(timed),
      compile_geomean=_geomean([x for _, x in compiles]),
      compile_max=max(compiles, key=lambda t: t[1]) if compiles else None,
      max_ratio=max(timed, key=lambda t: t[1]) if timed else None,
      min_peer_speedup=min(speedups, key=lambda t: t[1]) if speedups else None,
      peer_count=len(speedups),
      peer_bound=tuple((r.bench.name, x) for r in results
                       if r.bench.grid_steps >= PEER_SPEEDUP_MIN_STEPS
                       and (x := r.ratio(cols.peer, cols.reference)) is not None
                       and x < PEER_SPEEDUP_TARGET),
      cols=cols,
      untimed_subject=tuple(r.bench.name for r in results if cols.subject in r.variants
                            and r.ratio(cols.subject, cols.reference) is None),
  )


def _format_number(value: float) -> str:
  if value >= 100:
    return f"{value:.0f}"
  if value >= 10:
    return f"{value:.1f}"
  return f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def time_cell(result: VariantResult | None) -> str:
  if result is None:
    return "-"
  if result.timed:
    marks = (SINGLE_RUN_MARK if len(result.samples_s) == 1 else "") + (
        KNOWN_ISSUE_MARK if result.status == "known_issue" else "")
    return _format_number(result.median_ms) + marks
  if result.status == "skipped":
    return result.message
  return result.status.upper()


def _ratio_cell(value: float | None, suffix: str = "") -> str:
  return "-" if value is None else _format_number(value) + suffix


def _compile_cell(result: VariantResult | None) -> str:
  if result is None or result.compile_s is None or result.status in ("error", "skipped"):
    return "-"
  return _format_number(result.compile_s)


def _memory_cell(result: VariantResult | None) -> str:
  if result is None or result.peak_bytes is None:
    return "-"
  return _format_number(result.peak_bytes / 2 ** 20)


def table_rows(results: Sequence[BenchmarkResult],
               cols: Columns = CPU_COLUMNS) -> list[tuple[str, ...]]:
  rows = []
  for r in results:
    v = r.variants
    rows.append((r.bench.name, str(r.bench.grid_steps), time_cell(v.get(cols.reference)),
                 time_cell(v.get(cols.subject)),
                 _ratio_cell(r.ratio(cols.subject, cols.reference)),
                 time_cell(v.get(cols.peer)),
                 _ratio_cell(r.ratio(cols.peer, cols.subject), "x"),
                 _compile_cell(v.get(cols.reference)), _compile_cell(v.get(cols.subject)),
                 _ratio_cell(compile_ratio(r, cols.subject, cols.reference)),
                 _compile_cell(v.get(cols.peer)),
                 _memory_cell(v.get(cols.reference)), _memory_cell(v.get(cols.subject))))
  return rows


def format_table(results: Sequence[BenchmarkResult], cols: Columns = CPU_COLUMNS) -> str:
  rows = [cols.header, *table_rows(results, cols)]
  widths = [max(len(row[i]) for row in rows) for i in range(len(cols.header))]
  lines = []
  for k, row in enumerate(rows):
    cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
    lines.append("  ".join(cells))
    if k == 0:
      lines.append("  ".join("-" * w for w in widths))
  return "\n".join(lines)


def footnotes(results: Sequence[BenchmarkResult], limit: int = 600) -> list[str]:
  notes, marks = [], set()
  for r in results:
    for name, v in r.variants.items():
      if v.status in ("error", "mismatch"):
        text = v.message if len(v.message) <= limit else v.message[:limit] + " ..."
        notes.append(f"{r.bench.name} [{name}] {v.status.upper()}: {text}")
      if v.timed and len(v.samples_s) == 1:
        marks.add(SINGLE_RUN_MARK)
      if v.status == "known_issue":
        notes.append(f"{r.bench.name} [{name}] {KNOWN_ISSUE_MARK} result differs "
                     f"from jax.numpy (known): {v.message}")
  if SINGLE_RUN_MARK in marks:
    notes.insert(0, f"{SINGLE_RUN_MARK} measured once (a single run took longer "
                 "than the peer's single-run threshold)")
  return notes


def to_json(results: Sequence[BenchmarkResult], meta: dict[str, Any],
            cols: Columns = CPU_COLUMNS) -> dict[str, Any]:
  summary = summarize(results, cols)
  sub_ref, peer_sub = (f"{cols.subject}_over_{cols.reference}",
                       f"{cols.peer}_over_{cols.subject}")
  return {
      "meta": meta,
      "summary": {
          f"{sub_ref}_geomean": summary.geomean,
          f"{sub_ref}_max": summary.max_ratio,
          f"{sub_ref}_compile_geomean": summary.compile_geomean,
          f"{sub_ref}_compile_max": summary.compile_max,
          f"{peer_sub}_min_ge_{PEER_SPEEDUP_MIN_STEPS}_steps": summary.min_peer_speedup,
          f"{cols.subject}_untimed": list(summary.untimed_subject),
      },
      "results": [{
          "name": r.bench.name,
          "family": r.bench.family,
          "shapes": r.bench.shapes,
          "grid": list(r.bench.grid),
          "grid_steps": r.bench.grid_steps,
          sub_ref: r.ratio(cols.subject, cols.reference),
          f"{sub_ref}_compile": compile_ratio(r, cols.subject, cols.reference),
          peer_sub: r.ratio(cols.peer, cols.subject),
          "variants": {name: {
              "status": v.status,
              "median_ms": v.median_ms,
              "samples_ms": [1e3 * s for s in v.samples_s],
              "compile_s": v.compile_s,
              "compile_samples_s": v.compile_samples_s,
              "peak_bytes": v.peak_bytes,
              "message": v.message,
          } for name, v in r.variants.items()},
      } for r in results],
  }


def write_json(path: Path, results: Sequence[BenchmarkResult], meta: dict[str, Any],
               cols: Columns = CPU_COLUMNS) -> None:
  path.write_text(json.dumps(to_json(results, meta, cols), indent=2) + "\n")


def write_chart(path: Path, results: Sequence[BenchmarkResult], title: str,
                cols: Columns = CPU_COLUMNS) -> None:
  """Grouped bars per kernel, one per variant, on a log time axis."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  variants = [v for v in (cols.reference, cols.subject, cols.peer)
              if any(v in r.variants for r in results)]
  width = 0.8 / len(variants)
  all_ms = [v.median_ms for r in results for v in r.variants.values() if v.timed]
  fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(results) + 2), 5))
  for k, name in enumerate(variants):
    xs, heights = [], []
    for i, r in enumerate(results):
      ms = r.variants[name].median_ms if name in r.variants else None
      if ms is not None:
        xs.append(i + (k - (len(variants) - 1) / 2) * width)
        heights.append(ms)
    ax.bar(xs, heights, width, label=name)
  ax.set_yscale("log")
  if all_ms:  # bars grow from a decade below the fastest time, not from 0
    ax.set_ylim(bottom=10 ** math.floor(math.log10(min(all_ms)) - 1))
  ax.set_ylabel("median time per call (ms, log scale)")
  ax.set_xticks(range(len(results)))
  ax.set_xticklabels([f"{r.bench.name}\n{r.bench.grid_steps} steps" for r in results],
                     rotation=30, ha="right")
  ax.set_title(title)
  ax.legend()
  ax.grid(axis="y", which="major", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
