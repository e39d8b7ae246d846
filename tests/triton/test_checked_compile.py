"""Checked kernels compile for GPUs (no GPU, no interpreter): the checking mode's
checks are part of the generated code and report through an ordinary output (one row
per program, read by the host after the call), so a GPU runs the same checks as
Triton's interpreter. Covers the corpus cases of the kinds docs/checking.md lists as
found on the Triton backend (tests/bugs)."""
from __future__ import annotations

import pytest

import pallet as pl
from bugs.corpus import all_cases
from compiled import compile_for, kernels_of
from pallet.backends.triton import generated

CHECKED = pl.InterpretParams(detect_races=True, out_of_bounds_reads="raise",
                             uninitialized_memory="nan")
KINDS = ("hang", "deadlock", "aliasing", "unwritten", "race", "uninitialized")
CASES = [c for c in all_cases() if c.kind in KINDS and c.triton_runs and not c.triton]


def _checked_kernels(case, bug):
  program = case.build(bug, backend="triton", interpret=pl.InterpretParams(
      **{**CHECKED.__dict__, **case.params}))
  try:
    return kernels_of(program, *case.inputs())
  except (pl.KernelCheckError, pl.PalletError):   # found before the kernel runs
    return []


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_checked_corpus_kernels_compile_for_sm90_without_host_flags(case):
  buggy, fixed = _checked_kernels(case, True), _checked_kernels(case, False)
  assert fixed
  if buggy:   # traced (not refused before running): its checks record into an output
    assert any(b.origin == "check record" for k in buggy for b in k.grid_mapping.outputs)
  for kernel in buggy + fixed:
    assert not generated(kernel).check_messages, "a check left to the launcher's flags"
    assert compile_for(kernel, "sm90").asm["ttir"]
