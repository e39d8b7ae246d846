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


def test_sharded_attention_example_on_four_simulated_devices():
  """The distributed example as a script: its own process, 4 simulated CPU devices."""
  import os
  import subprocess
  import sys
  path = pathlib.Path(__file__).parent.parent / "examples" / "sharded_attention.py"
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
  done = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "on 4 devices: forward and grad match jax.numpy" in done.stdout
