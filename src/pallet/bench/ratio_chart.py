"""A bar chart of pallet/jax.numpy time ratios for one family, from a results JSON.

`python -m pallet.bench.ratio_chart docs/perf_cpu.json --family ops --out docs/ops/perf_ops.png`
draws the chart the ops gallery shows, from the same run as docs/performance.md (no new
timing: the JSON holds the medians).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_ratio_chart(rows: list[dict], path: Path, title: str, target: float | None) -> None:
  """One bar per kernel: pallet's median time over jax.numpy's (below 1: pallet faster)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  timed = [r for r in rows if r.get("pallet_over_jnp")]
  fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(timed) + 2), 4.5))
  ax.bar(range(len(timed)), [r["pallet_over_jnp"] for r in timed], color="tab:blue")
  ax.axhline(1.0, color="black", linewidth=1)
  if target is not None:
    ax.axhline(target, color="tab:red", linestyle="--", linewidth=1, label=f"target {target}")
    ax.legend()
  ax.set_xticks(range(len(timed)))
  ax.set_xticklabels([r["name"] for r in timed], rotation=35, ha="right")
  ax.set_ylabel("pallet time / jax.numpy time (median)")
  ax.set_title(title)
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m pallet.bench.ratio_chart", description=__doc__.split("\n")[0])
  p.add_argument("results", type=Path, help="a results JSON written by python -m benchmarks")
  p.add_argument("--family", required=True, help="benchmark family to draw (e.g. ops)")
  p.add_argument("--out", type=Path, required=True, help="the PNG to write")
  p.add_argument("--target", type=float, default=None, help="a ratio to mark (default: none)")
  args = p.parse_args(argv)
  data = json.loads(args.results.read_text())
  rows = [r for r in data["results"] if r["family"] == args.family]
  if not rows:
    p.error(f"no results of family {args.family!r} in {args.results}")
  write_ratio_chart(rows, args.out, f"pallet.{args.family} on the CPU: time relative to jax.numpy",
                    args.target)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
