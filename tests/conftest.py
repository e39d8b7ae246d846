"""pytest wiring: a private cache directory, markers and the backend the kernel tests
run on."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# Hermetic: what pallet (autotune choices, compiled Triton kernels), matplotlib (its
# font cache) and Triton (its compile cache) would keep under the user's home goes
# to one temporary directory for the session, for every process the tests start too
# (tests/test_hermetic.py checks it). Set before any of them is imported.
SESSION_CACHE = tempfile.mkdtemp(prefix="pallet-tests-")
for _variable, _folder in (("PALLET_CACHE_DIR", "pallet"), ("MPLCONFIGDIR", "matplotlib"),
                           ("TRITON_HOME", "triton"), ("XDG_CACHE_HOME", "xdg-cache")):
  os.environ[_variable] = os.path.join(SESSION_CACHE, _folder)

# Triton backend: on a GPU the generated kernels run on the hardware; elsewhere under
# Triton's interpreter, which must be switched on before triton is first imported.
if os.environ.get("PALLET_TEST_BACKEND", "").strip().lower() == "triton":
  import jax
  if jax.devices()[0].platform in ("gpu", "cuda", "rocm"):
    # Kernel and jax.numpy twin both compute float32 dots in full precision (XLA and
    # pallet default to TF32 on GPUs), so the CPU tolerances hold.
    jax.config.update("jax_default_matmul_precision", "highest")
  else:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import current_test_backend  # noqa: E402


def pytest_unconfigure(config):
  shutil.rmtree(SESSION_CACHE, ignore_errors=True)


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "cpu_only: checks CPU-backend specifics (execution plan, debug output); "
      "skipped when PALLET_TEST_BACKEND selects another backend")


def pytest_collection_modifyitems(config, items):
  if current_test_backend() == "xla":
    return
  skip = pytest.mark.skip(reason=f"cpu_only test; backend under test is "
                                 f"{current_test_backend()!r}")
  for item in items:
    if "cpu_only" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def backend() -> str:
  """The backend name kernel tests run on."""
  return current_test_backend()
