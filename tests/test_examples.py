"""Every example in examples/ checks itself against jax.numpy and says what it checked,
and times itself against jax.numpy; run those checks, and the timing at a tiny size."""
import pathlib
import re
import runpy

import pytest

from helpers import run_on_simulated_devices

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))
# The smallest problem each example's benchmark() takes (the timing code runs; the
# numbers are not looked at).
TINY_BENCHMARK = {"vector_add": {"sizes": (1024,)}, "matmul": {"sizes": (128,)},
                  "softmax_grad": {"rows": (8,)}}


def _load(path: pathlib.Path) -> dict:
  return runpy.run_path(str(path), run_name="pallet_example")


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_checks_itself_and_says_so(path, capsys):
  namespace = _load(path)
  assert "check" in namespace, f"{path.name} must define check()"
  namespace["check"]()
  out = capsys.readouterr().out
  assert re.search(r"matches jax\.numpy.*max \|difference\| \d\.\de[-+]\d\d", out), out


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_times_itself_against_jax_numpy(path, capsys):
  namespace = _load(path)
  assert "benchmark" in namespace, f"{path.name} must define benchmark()"
  namespace["benchmark"](reps=1, **TINY_BENCHMARK.get(path.stem, {}))
  out = capsys.readouterr().out
  assert "jax.numpy" in out and re.search(r"\d+\.\d{2,3}\b", out), out


def test_sharded_attention_example_on_four_simulated_devices():
  """The distributed example as a script: its own process, 4 simulated CPU devices."""
  path = pathlib.Path(__file__).parent.parent / "examples" / "sharded_attention.py"
  output = run_on_simulated_devices(path=str(path))
  assert "on 4 devices: forward matches jax.numpy" in output, output[-3000:]
  assert "on 4 devices: grad matches jax.numpy" in output, output[-3000:]
  assert "pallet kernel" in output, output[-3000:]
