"""tools/conformance.py (JAX's own Pallas test files on pallet and on JAX's Pallas),
run on a stand-in checkout: imports routed to pallet in one column only, TPU classes
running here (generation checks passing, kernels interpreted), counts per outcome."""
from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("absl.testing.absltest", reason="JAX's tests are absltest cases")

FAKE_TEST = '''
from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
from jax._src import test_util as jtu
from jax.experimental import pallas as pl


class TpuOnlyTest(jtu.JaxTestCase):

  def setUp(self):
    if not jtu.is_device_tpu_at_least(5):
      self.skipTest("needs a TPU v5 or newer")
    super().setUp()

  def test_pallas_is_pallet(self):
    self.assertEqual(pl.__name__, "pallet")

  def test_doubling_kernel(self):
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] * 2
    x = jnp.arange(8.0) - 3.5
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    np.testing.assert_array_equal(out, x * 2)

  def test_skipped_by_itself(self):
    self.skipTest("not here")
'''


def _tool():
  spec = importlib.util.spec_from_file_location("conformance", ROOT / "tools" / "conformance.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_counts_both_columns_of_a_stand_in_checkout(tmp_path, monkeypatch, capsys):
  (tmp_path / "tests" / "pallas").mkdir(parents=True)
  (tmp_path / "tests" / "pallas" / "tpu_stand_in_test.py").write_text(FAKE_TEST)
  monkeypatch.setenv("PALLET_JAX_SOURCE", str(tmp_path))
  assert _tool().main(["tpu_stand_in_test.py"]) == 0
  row = next(l for l in capsys.readouterr().out.splitlines()
             if l.startswith("tpu_stand_in_test.py"))
  # pallet: pass fail skip seconds | JAX: pass fail skip seconds
  numbers = [int(w.rstrip("s")) for w in row.split(")", 1)[1].split()]
  assert numbers[:3] == [2, 0, 1], row
  assert numbers[4:7] == [1, 1, 1], row   # JAX's Pallas is not pallet; its kernel interprets


def test_without_a_checkout_it_says_what_to_set(monkeypatch, capsys):
  monkeypatch.delenv("PALLET_JAX_SOURCE", raising=False)
  assert _tool().main(["tpu_pallas_pipeline_test"]) == 2
  assert "set PALLET_JAX_SOURCE" in capsys.readouterr().err
