"""pallet.bench.compile_profile and the jax.numpy loop twins its --targets report uses."""
from __future__ import annotations

import jax
import pytest

from pallet.bench import catalog, compile_profile
from pallet.bench.checking import check_matches
from pallet.bench.loop_twins import LOOP_TWINS

TINY = {b.name: b for b in catalog.all_benchmarks("tiny")}


@pytest.mark.parametrize("name", sorted(LOOP_TWINS))
def test_loop_twin_computes_the_rows_result(name):
  bench = TINY[name]
  args = bench.make_inputs(jax.random.key(4))
  check_matches(bench, "jnp_loop", jax.jit(LOOP_TWINS[name]("tiny"))(*args),
                jax.jit(bench.reference)(*args))


def test_targets_report_classifies_rows_and_times_every_variant(capsys):
  assert compile_profile.main(["--size", "tiny", "--only", "softmax", "--only",
                               "flash_attention", "--rounds", "1", "--targets",
                               "--cpu-time"]) == 0
  out = capsys.readouterr().out
  rows = {line.split()[0]: line.split() for line in out.splitlines()
          if line.split() and line.split()[0] in ("softmax", "flash_attention")
          and ("free" in line or "loop" in line)}
  assert rows["softmax"][1] == "free" and "<=" in rows["softmax"]
  assert rows["flash_attention"][1] == "loop" and "loop" in rows["flash_attention"][-3:]
  assert "loop-free: " in out and "faster than interpret" in out
