"""pytest wiring: markers and the backend the kernel tests run on."""
from __future__ import annotations

import pytest

from helpers import current_test_backend


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
