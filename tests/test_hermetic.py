"""The test suite keeps to temporary directories: a run with $HOME pointing to an empty
directory leaves it empty (conftest.py points the caches there)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Tests that write caches: autotune choices (the autotune page of the docs), matplotlib's
# font cache (the benchmark chart).
WRITERS = ["tests/test_docs.py::test_python_blocks_of_a_page_run_in_order[docs/autotune.md]",
           "tests/test_benchmarks_smoke.py::test_main_writes_table_json_and_chart"]


@pytest.mark.slow   # two pytest runs' worth of start-up, a chart and an autotune page
def test_a_test_run_leaves_home_untouched(tmp_path):
  home = tmp_path / "home"
  home.mkdir()
  env = {k: v for k, v in os.environ.items()
         if k not in ("PALLET_CACHE_DIR", "MPLCONFIGDIR", "TRITON_HOME", "XDG_CACHE_HOME",
                      "TRITON_CACHE_DIR")}
  env["HOME"] = str(home)
  done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         *WRITERS], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "2 passed" in done.stdout
  assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == []
