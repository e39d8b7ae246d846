"""The seeded-bug corpus under the checking mode (docs/checking.md).

Every buggy kernel must be reported as a `pl.KernelCheckError` naming the right kind,
ref and source line (the case's `# BUG` line); every fixed twin must run clean with
all checks on and match its jax.numpy reference, checked and unchecked.

Runs on the backend under test: `PALLET_TEST_BACKEND=triton TRITON_INTERPRET=1 pytest
tests/bugs -o addopts=""` runs it under Triton's interpreter, where the cases the
Triton backend cannot see are skipped with the reason.
"""
from __future__ import annotations

import os

import jax
import pytest

import pallet as pl
from pallet import tpu as pltpu
from pallet.errors import KernelCheckError
from bugs.corpus import KINDS, OPT_IN_KINDS, Case, all_cases
from helpers import assert_close, current_test_backend, runs_on_gpu

CASES = all_cases()
BACKEND = current_test_backend()

# Pallas's spelling of the checking mode, and what each opt-in kind adds to it.
CHECKED = dict(detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan")
OPT_IN = {"nan": dict(detect_nans=True), "overflow": dict(detect_int_overflow=True),
          "debug_check": dict(debug_checks=True)}

# What the checks do not get right yet, as strict xfails: a case that starts passing
# fails until it is taken off these lists. (backend, case name) -> why.
NOT_YET_REPORTED: dict[tuple[str, str], str] = {}
FALSE_ALARMS: dict[tuple[str, str], str] = {}


def checked(*opt_in: str, case: Case | None = None) -> pl.InterpretParams:
  extra = {k: v for kind in opt_in for k, v in OPT_IN[kind].items()}
  if case is not None:
    extra.update(case.params)
  return pl.InterpretParams(**CHECKED, **extra)


def call_kwargs(interpret) -> dict:
  return dict(backend=BACKEND, interpret=interpret)


def _unchecked_kwargs() -> dict:
  return dict(backend=BACKEND, interpret=BACKEND != "xla" and not runs_on_gpu())


def _skip_unseeable(case: Case) -> None:
  if BACKEND != "xla" and case.triton:
    pytest.skip(f"{BACKEND} backend cannot see this bug: {case.triton}")


def _params(known: dict[tuple[str, str], str]) -> list:
  """The cases, with those listed in `known` for this backend as strict xfails."""
  out = []
  for case in CASES:
    reason = known.get((BACKEND, case.name))
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    out.append(pytest.param(case, id=case.name, marks=marks))
  return out


def _expected_line(case: Case) -> str:
  return f"{os.path.abspath(case.source_file)}:{case.bug_line}"


def _same_line(reported: str, case: Case) -> bool:
  path, _, line = str(reported).rpartition(":")
  return (line.isdigit() and int(line) == case.bug_line
          and os.path.abspath(path) == os.path.abspath(case.source_file))


@pytest.mark.parametrize("case", _params(NOT_YET_REPORTED))
def test_bug_is_reported_with_kind_ref_and_line(case: Case):
  _skip_unseeable(case)
  opt_in = [case.kind] if case.kind in OPT_IN_KINDS else []
  reports = (pl.KernelCheckError, pl.PalletError) if case.static else pl.KernelCheckError
  with pytest.raises(reports) as info:
    jax.block_until_ready(case.build(True, **call_kwargs(checked(*opt_in, case=case)))(
        *case.inputs()))
  err = info.value
  if not isinstance(err, pl.KernelCheckError):   # found when the kernel was traced
    assert case.ref in str(err) and _expected_line(case) in str(err), str(err)
    return
  assert (err.kind, err.ref) == (case.kind, case.ref), str(err)
  assert _same_line(err.line, case), f"reported {err.line}, expected {_expected_line(case)}"
  text = str(err)
  assert err.kind in text and str(err.line) in text and str(err.kernel) in text
  if case.ref is not None:
    assert case.ref in text


@pytest.mark.parametrize("case", _params(FALSE_ALARMS))
def test_fixed_twin_runs_clean_with_every_check(case: Case):
  _skip_unsupported_twin(case)
  program = case.build(False, **call_kwargs(checked(*OPT_IN_KINDS, case=case)))
  inputs = case.inputs()
  assert_close(program(*inputs), case.reference(*inputs), matmul=case.matmul)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fixed_twin_matches_unchecked_with_poisoned_buffers(case: Case):
  _skip_unsupported_twin(case)
  program = case.build(False, **_unchecked_kwargs())
  inputs = case.inputs()
  with pl.enable_poison_buffers(True):
    out = program(*inputs)
  assert_close(out, case.reference(*inputs), matmul=case.matmul)


def _skip_unsupported_twin(case: Case) -> None:
  if BACKEND != "xla" and not case.triton_runs:
    pytest.skip(f"{BACKEND} backend cannot run this kernel: {case.triton}")


def test_scratch_carry_prefix_sum_is_right_unchecked():
  """The blocked prefix sum carrying its total in scratch, no dimension_semantics: the
  default backend must run the grid in order (issue 9, section 1)."""
  case = next(c for c in CASES if c.name == "carry_across_declared_parallel_axis")
  x, = case.inputs()
  assert_close(case.build(False, **_unchecked_kwargs())(x), case.reference(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["halo_reads_next_block_past_end",
                                  "reduction_output_never_zeroed",
                                  "parallel_programs_write_one_block"])
def test_bug_under_jit_fails_with_the_report(name: str):
  """Inside jax.jit the report reaches the caller through JAX's runtime: its text
  still names the kind, the ref and the line."""
  case = next(c for c in CASES if c.name == name)
  program = jax.jit(case.build(True, **call_kwargs(checked())))
  with pytest.raises(Exception) as info:
    jax.block_until_ready(program(*case.inputs()))
  text = str(info.value)
  assert case.kind in text and case.ref in text, text
  assert f"{os.path.basename(case.source_file)}:{case.bug_line}" in text, text


def test_checking_mode_names_are_public():
  assert pl.InterpretParams is pltpu.InterpretParams
  assert pl.KernelCheckError is KernelCheckError


@pytest.mark.parametrize("name, setting", [("masked_load_mask_off_by_one", "1"),
                                           ("reduction_output_never_zeroed", "1"),
                                           ("softmax_without_max_subtraction", "all"),
                                           ("grid_rounds_down", "1"),
                                           # one case per class of issue 25, default set
                                           ("look_back_waits_on_the_next_block", "1"),
                                           ("in_place_shift_reads_the_next_block", "1"),
                                           ("work_counter_zeroed_inside_the_kernel", "1"),
                                           ("element_window_padding_assumed_zero", "1"),
                                           ("squared_index_overflows_int32", "all")])
def test_environment_variable_turns_checks_on_without_code_changes(name, setting, monkeypatch):
  case = next(c for c in CASES if c.name == name)
  _skip_unseeable(case)
  monkeypatch.setenv("PALLET_CHECKS", setting)
  with pytest.raises(pl.KernelCheckError) as info:
    jax.block_until_ready(case.build(True, **_unchecked_kwargs())(*case.inputs()))
  assert info.value.kind == case.kind and _same_line(info.value.line, case), str(info.value)


def test_corpus_has_thirty_cases_covering_every_kind():
  assert len(CASES) >= 30
  assert {c.kind for c in CASES} == set(KINDS)
  for c in CASES:
    assert c.bug_line > 0
