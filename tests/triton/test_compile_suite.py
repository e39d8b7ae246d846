"""Every kernel a previous test run generated compiles for sm_80, sm_90 and gfx942.

The kernels are recorded by running the suite under the interpreter with
PALLET_TRITON_DUMP_DIR set (see compile_suite.py); this test compiles that
directory and is skipped when the variable is not set.
"""
from __future__ import annotations

import glob
import os

import pytest

import compile_suite

DUMP_DIR = os.environ.get("PALLET_TRITON_DUMP_DIR", "")


@pytest.mark.skipif(not DUMP_DIR, reason="set PALLET_TRITON_DUMP_DIR to a directory of "
                                         "kernels recorded by an interpreted test run")
def test_every_recorded_kernel_compiles_for_the_three_targets(capsys):
  paths = glob.glob(os.path.join(DUMP_DIR, "*.json"))
  assert paths, f"no kernels recorded in {DUMP_DIR}"
  status = compile_suite.main([DUMP_DIR, "--jobs", str(os.cpu_count() or 1)])
  report = capsys.readouterr().out
  assert status == 0, report
