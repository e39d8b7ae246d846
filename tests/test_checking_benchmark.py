"""The checking-mode benchmark (src/pallet/bench/checking.py): every kernel of the suite runs
clean under pallet's checks (no false alarm on correct kernels) and matches jax.numpy,
and the command line produces its table."""
from __future__ import annotations

import jax
import pytest

import pallet.tpu  # noqa: F401  (src/pallet/bench/matmul.py's matmul_scratch reads `pl.tpu`)
from pallet.bench import checking
from pallet.bench.checking import check_matches, checking_variants, suite_benchmarks

TINY = suite_benchmarks("tiny")


@pytest.mark.parametrize("bench", TINY, ids=[b.name for b in TINY])
def test_suite_kernel_runs_clean_checked_and_matches_jnp(bench):
  checked = next(v for v in checking_variants() if v.name == "checked")
  args = bench.make_inputs(jax.random.key(4))
  expected = jax.jit(bench.reference)(*args)
  check_matches(bench, "checked", jax.jit(checked.build(bench))(*args), expected)


def test_command_line_prints_the_cost_table(tmp_path, capsys):
  assert checking.main(["--size", "tiny", "--only", "vadd_b65536", "--reps", "2",
                        "--peer-reps", "1", "--out", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "checked/pallet" in out and "pallas_checked" in out
  assert (tmp_path / "checking_tiny.json").exists()
