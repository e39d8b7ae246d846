"""pallet.bench.gpu_compile_stats without compiling: the occupancy arithmetic, the page
splicing, the launch-table listing in docs/ops/gpu_defaults.md being current, and the
rule that a default spilling or fitting one CTA per SM on sm_90 needs a note."""
from __future__ import annotations

import pytest

from pallet.bench import gpu_compile_stats as stats

SM90, SM80, GFX942 = (stats.DEVICES[d] for d in ("sm_90", "sm_80", "gfx942"))


@pytest.mark.parametrize("device,registers,warps,shared,expected", [
    (SM90, 128, 4, 0, (4, "registers")),           # 128 regs x 128 threads = 16K of 64K
    (SM90, 255, 8, 0, (1, "registers")),           # 256 per thread (rounded per warp)
    (SM90, 24, 4, 0, (16, "warps")),               # 64 warps per SM
    (SM90, 64, 4, 112 * 1024, (2, "shared memory")),   # 228 KB / (112 + 1 reserved)
    (SM80, 64, 4, 112 * 1024, (1, "shared memory")),   # 164 KB
    (GFX942, 122, 4, 0, (4, "registers")),         # 512 // 128 = 4 waves per SIMD, 4 SIMDs
    (GFX942, 256, 8, 0, (1, "registers")),
    (GFX942, 64, 4, 40 * 1024, (1, "shared memory")),  # 64 KB of LDS per CU
])
def test_occupancy_from_the_devices_limits(device, registers, warps, shared, expected):
  assert stats.occupancy(device, registers, warps, shared) == expected


def test_splice_replaces_only_between_the_markers():
  page = f"intro\n{stats.BEGIN}\nold\n{stats.END}\nrest\n"
  assert stats.splice(page, "new") == f"intro\n{stats.BEGIN}\nnew\n{stats.END}\nrest\n"
  with pytest.raises(ValueError, match="no .* markers"):
    stats.splice("no markers here", "new")


def test_the_docs_list_the_shipped_launch_tables():
  page = (stats.DOCS / stats.TABLES_PAGE).read_text()
  assert stats.splice(page, stats.launch_tables_markdown(), stats.TABLES_BEGIN,
                      stats.TABLES_END) == page, \
      "docs/ops/gpu_defaults.md is stale: python -m pallet.bench.gpu_compile_stats --write"


def _row(device, spilled, ctas, note):
  return stats.Row("p", "k", device, "fwd", 4, 3, 128, spilled, 0, ctas, "registers", 1,
                   0.0, 0.0, note)


def test_spills_or_one_cta_on_sm90_need_a_reason():
  rows = [_row("sm_90", 8, 2, ""), _row("sm_90", 0, 1, ""), _row("sm_90", 0, 1, "why"),
          _row("sm_80", 8, 1, ""), _row("sm_90", 0, 2, "")]
  assert stats.missing_reasons(rows) == rows[:2]
  table = stats.table(rows)
  assert table.splitlines()[4].endswith("| why |")
