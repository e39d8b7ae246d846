"""Every example in examples/ checks itself against jax.numpy; run those checks."""
import pathlib
import runpy

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_checks_itself(path):
  namespace = runpy.run_path(str(path), run_name="pallet_example")
  assert "check" in namespace, f"{path.name} must define check()"
  namespace["check"]()
