"""pytest wiring for the Triton backend's tests.

Triton decides at import time whether `@triton.jit` functions (its own library
included) are compiled or interpreted, so the two kinds of tests run in separate
processes:

* `triton_interpret`-marked tests run the generated code under Triton's
  interpreter: `TRITON_INTERPRET=1 pytest -m triton_interpret tests/triton`;
* the others compile for GPU targets and lower for CUDA: `pytest tests/triton`.

Each kind skips itself in the other process; everything skips without triton.
"""
from __future__ import annotations

import importlib.util
import os

import jax
import pytest

# (tests/ is on sys.path, so without the real package `import triton` would find
# this directory as a namespace package: check for a package with a file.)
_spec = importlib.util.find_spec("triton")
if _spec is None or _spec.origin is None:
  collect_ignore_glob = ["test_*.py"]

INTERPRETING = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def pytest_collection_modifyitems(config, items):
  here = os.path.dirname(__file__)
  for item in items:
    if not str(item.fspath).startswith(here):
      continue
    interpreted = "triton_interpret" in item.keywords
    if interpreted and not INTERPRETING:
      item.add_marker(pytest.mark.skip(
          reason="runs under Triton's interpreter: TRITON_INTERPRET=1 pytest -m "
                 "triton_interpret tests/triton"))
    elif not interpreted and INTERPRETING:
      item.add_marker(pytest.mark.skip(
          reason="compiles with Triton, which TRITON_INTERPRET=1 turns off"))


@pytest.fixture(autouse=True)
def _default_matmul_precision():
  """These tests check what pallet generates by default (TF32 float32 dots), also on a
  GPU, where tests/conftest.py asks for full-precision dots everywhere else. (Elsewhere
  nothing is set: a precision context would also reach the traced dots' own params.)"""
  if jax.config.jax_default_matmul_precision != "highest":
    yield
    return
  with jax.default_matmul_precision("default"):
    yield
