"""Where the benchmark suite writes: in a source checkout, its docs/ (a complete
full-size run) and bench_out/; from an installed pallet, ./bench_out."""
from __future__ import annotations

from pathlib import Path

# src/pallet/bench/paths.py -> the checkout's root, when this is a checkout
_ROOT = Path(__file__).resolve().parents[3]
IN_CHECKOUT = (_ROOT / "pyproject.toml").exists() and (_ROOT / "src" / "pallet").is_dir()
SCRATCH_DIR = (_ROOT if IN_CHECKOUT else Path.cwd()) / "bench_out"
# a complete full-size run replaces the committed results, in a checkout only
DOCS_DIR = _ROOT / "docs" if IN_CHECKOUT else SCRATCH_DIR
