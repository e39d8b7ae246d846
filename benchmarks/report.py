"""Presenting results: terminal table, summary lines against the targets, JSON, chart."""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.runner import BenchmarkResult, VariantResult

# Targets for the backend (issue 3); the suite reports them, it does not enforce them.
GEOMEAN_TARGET = 1.2
MAX_RATIO_TARGET = 2.0
PEER_SPEEDUP_TARGET = 100.0
PEER_SPEEDUP_MIN_STEPS = 256

SINGLE_RUN_MARK = "*"
KNOWN_ISSUE_MARK = "!"
HEADER = ("kernel", "grid steps", "jnp ms", "pallet ms", "pallet/jnp",
          "interpret ms", "interpret/pallet")


@dataclasses.dataclass(frozen=True)
class Summary:
  geomean: float | None
  count: int
  max_ratio: tuple[str, float] | None
  min_peer_speedup: tuple[str, float] | None
  peer_count: int
  untimed_pallet: tuple[str, ...]

  def lines(self) -> list[str]:
    def verdict(ok: bool) -> str:
      return "met" if ok else "MISSED"

    out = []
    if self.geomean is None:
      out.append("pallet/jnp geomean: n/a (pallet timed on no kernel)")
    else:
      out.append(f"pallet/jnp geomean over {self.count} kernels: {self.geomean:.2f} "
                 f"(target <= {GEOMEAN_TARGET}: {verdict(self.geomean <= GEOMEAN_TARGET)})")
    if self.max_ratio is not None:
      name, value = self.max_ratio
      out.append(f"pallet/jnp max: {value:.2f} ({name}) "
                 f"(target <= {MAX_RATIO_TARGET}: {verdict(value <= MAX_RATIO_TARGET)})")
    if self.min_peer_speedup is None:
      out.append(f"interpret/pallet min over kernels with >= {PEER_SPEEDUP_MIN_STEPS} "
                 "grid steps: n/a (none timed)")
    else:
      name, value = self.min_peer_speedup
      out.append(f"interpret/pallet min over {self.peer_count} kernels with >= "
                 f"{PEER_SPEEDUP_MIN_STEPS} grid steps: {value:.0f}x ({name}) (target >= "
                 f"{PEER_SPEEDUP_TARGET:.0f}x: {verdict(value >= PEER_SPEEDUP_TARGET)})")
    if self.untimed_pallet:
      out.append(f"pallet NOT timed (error/mismatch) on: {', '.join(self.untimed_pallet)}")
    return out


def summarize(results: Sequence[BenchmarkResult]) -> Summary:
  ratios = [(r.bench.name, r.ratio("pallet", "jnp")) for r in results]
  timed = [(n, x) for n, x in ratios if x is not None]
  speedups = [(r.bench.name, r.ratio("interpret", "pallet")) for r in results
              if r.bench.grid_steps >= PEER_SPEEDUP_MIN_STEPS]
  speedups = [(n, x) for n, x in speedups if x is not None]
  return Summary(
      geomean=(math.exp(sum(math.log(x) for _, x in timed) / len(timed))
               if timed else None),
      count=len(timed),
      max_ratio=max(timed, key=lambda t: t[1]) if timed else None,
      min_peer_speedup=min(speedups, key=lambda t: t[1]) if speedups else None,
      peer_count=len(speedups),
      untimed_pallet=tuple(r.bench.name for r in results if "pallet" in r.variants
                           and r.ratio("pallet", "jnp") is None),
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


def table_rows(results: Sequence[BenchmarkResult]) -> list[tuple[str, ...]]:
  rows = []
  for r in results:
    v = r.variants
    rows.append((r.bench.name, str(r.bench.grid_steps), time_cell(v.get("jnp")),
                 time_cell(v.get("pallet")), _ratio_cell(r.ratio("pallet", "jnp")),
                 time_cell(v.get("interpret")),
                 _ratio_cell(r.ratio("interpret", "pallet"), "x")))
  return rows


def format_table(results: Sequence[BenchmarkResult]) -> str:
  rows = [HEADER, *table_rows(results)]
  widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
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


def to_json(results: Sequence[BenchmarkResult], meta: dict[str, Any]) -> dict[str, Any]:
  summary = summarize(results)
  return {
      "meta": meta,
      "summary": {
          "pallet_over_jnp_geomean": summary.geomean,
          "pallet_over_jnp_max": summary.max_ratio,
          "interpret_over_pallet_min_ge_256_steps": summary.min_peer_speedup,
          "pallet_untimed": list(summary.untimed_pallet),
      },
      "results": [{
          "name": r.bench.name,
          "family": r.bench.family,
          "shapes": r.bench.shapes,
          "grid": list(r.bench.grid),
          "grid_steps": r.bench.grid_steps,
          "pallet_over_jnp": r.ratio("pallet", "jnp"),
          "interpret_over_pallet": r.ratio("interpret", "pallet"),
          "variants": {name: {
              "status": v.status,
              "median_ms": v.median_ms,
              "samples_ms": [1e3 * s for s in v.samples_s],
              "compile_s": v.compile_s,
              "message": v.message,
          } for name, v in r.variants.items()},
      } for r in results],
  }


def write_json(path: Path, results: Sequence[BenchmarkResult], meta: dict[str, Any]) -> None:
  path.write_text(json.dumps(to_json(results, meta), indent=2) + "\n")


def write_chart(path: Path, results: Sequence[BenchmarkResult], title: str) -> None:
  """Grouped bars per kernel, one per variant, on a log time axis."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  variants = [v for v in ("jnp", "pallet", "interpret")
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
  ax.set_xticklabels([r.bench.name for r in results], rotation=30, ha="right")
  ax.set_title(title)
  ax.legend()
  ax.grid(axis="y", which="major", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
