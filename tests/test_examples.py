"""Every example in examples/ checks itself against jax.numpy; run those checks."""
import pathlib
import runpy

import pytest

from helpers import run_on_simulated_devices

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_checks_itself(path):
  namespace = runpy.run_path(str(path), run_name="pallet_example")
  assert "check" in namespace, f"{path.name} must define check()"
  namespace["check"]()


def test_sharded_attention_example_on_four_simulated_devices():
  """The distributed example as a script: its own process, 4 simulated CPU devices."""
  path = pathlib.Path(__file__).parent.parent / "examples" / "sharded_attention.py"
  output = run_on_simulated_devices(path=str(path))
  assert "on 4 devices: forward and grad match jax.numpy" in output, output[-3000:]
