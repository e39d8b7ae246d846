"""JAX's own fuser tests, run with pallet in place of Pallas.

The test files are read at test time from a jax checkout (`PALLET_JAX_SOURCE`, a
directory with tests/pallas/) or the bare jax-ml/jax mirror at
/work/.mirror/jax-ml+jax/repo, never copied here; without either (as on CI, which
has no GitHub access) or without absl-py (JAX's tests are absltest cases) the
tests skip. Their Pallas imports are routed to pallet; with `PALLET_FUSER_PEER=1`
they are left alone, which runs the same files on JAX's own Pallas for comparison.

`tpu_fusible_matmul_test.py` needs a TPU; its interpret-capable parts run here:
`fusible_matmul` defaults to `interpret=True`, the TPU generation checks pass, and
the class that switches Mosaic's pipeline primitive on is left out.
docs/compatibility.md (fuser section) explains every test that fails on pallet.
"""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import types
import unittest

import jax
import pytest

MIRROR = pathlib.Path("/work/.mirror/jax-ml+jax/repo")
FILES = ("fuser_block_spec_test", "fusion_test", "tpu_fusible_matmul_test")
PEER = os.environ.get("PALLET_FUSER_PEER") == "1"
# (module, name) imported by the tests -> the pallet module standing in for it.
ROUTES = {
    ("jax.experimental", "pallas"): "pallet",
    ("jax.experimental.pallas", "fuser"): "pallet.fuser",
    ("jax.experimental.pallas", "tpu"): "pallet.tpu",
    ("jax._src.pallas.fuser", "block_spec"): "pallet.fuser",
    ("jax._src.pallas.fuser", "custom_fusion_lib"): "pallet.fuser",
    ("jax._src.pallas", "einshape"): "pallet.tpu",
    ("jax._src.pallas", "primitives"): "pallet",
}
SKIPPED_CLASSES = {"FusibleMatmulPrimitiveTest"}   # Mosaic's pipeline primitive switch


def _source(name: str) -> tuple[str | None, str]:
  rel = f"tests/pallas/{name}.py"
  if os.environ.get("PALLET_JAX_SOURCE"):
    path = pathlib.Path(os.environ["PALLET_JAX_SOURCE"]) / rel
    return (path.read_text(), str(path)) if path.exists() else (None, f"no {path}")
  if MIRROR.exists():
    done = subprocess.run(["git", "-C", str(MIRROR), "show", f"HEAD:{rel}"],
                          capture_output=True, text=True)
    if done.returncode == 0:
      return done.stdout, f"{MIRROR}:{rel}"
    return None, f"the jax mirror has no {rel}"
  return None, ("no jax checkout: set PALLET_JAX_SOURCE to one (CI has no GitHub access, "
                "so these tests skip there)")


class _Router(ast.NodeTransformer):
  def visit_ImportFrom(self, node: ast.ImportFrom):
    if node.level or PEER:
      return node
    out = []
    for alias in node.names:
      target = ROUTES.get((node.module, alias.name))
      if target is None:
        out.append(ast.copy_location(ast.ImportFrom(node.module, [alias], 0), node))
        continue
      call = ast.parse(f"__import__('importlib').import_module({target!r})", mode="eval").body
      out.append(ast.copy_location(
          ast.Assign([ast.Name(alias.asname or alias.name, ast.Store())], call), node))
    return out


class _TpuAnywhere(types.ModuleType):
  """jax's test_util as the matmul tests see it: every TPU generation check passes."""

  def __init__(self, jtu: types.ModuleType):
    super().__init__(jtu.__name__)
    self._jtu = jtu

  def __getattr__(self, name: str):
    return getattr(self._jtu, name)

  @staticmethod
  def is_device_tpu_at_least(*_, **__) -> bool:
    return True


def _load(name: str) -> dict:
  text, where = _source(name)
  if text is None:
    return {"reason": where}
  tree = ast.fix_missing_locations(_Router().visit(ast.parse(text, where)))
  module = types.ModuleType(f"jax_fuser_tests.{name}")
  module.__file__ = where
  sys.modules[module.__name__] = module
  try:
    exec(compile(tree, where, "exec"), module.__dict__)
  except Exception as e:  # e.g. a JAX-internal module this jax lacks
    return {"reason": f"{name} does not import here: {type(e).__name__}: {e}"}
  if name == "tpu_fusible_matmul_test":
    module.jtu = _TpuAnywhere(module.jtu)
    module.fusible_matmul.__kwdefaults__["interpret"] = True
  return {"module": module}


def _import_absl() -> str | None:
  try:
    import absl.testing.parameterized  # noqa: F401
  except ImportError:
    return "JAX's tests are absltest cases and absl-py is not installed"
  if tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12):
    return f"JAX's 0.12 fuser tests need JAX 0.12 internals; this is jax {jax.__version__}"
  return None


_why_not = _import_absl()
for _name in FILES:
  _loaded = {"reason": _why_not} if _why_not else _load(_name)
  if "module" not in _loaded:
    def _skip(_reason=_loaded["reason"]):
      pytest.skip(_reason)
    globals()[f"test_{_name}"] = _skip
    continue
  for _attr, _value in vars(_loaded["module"]).items():
    if (isinstance(_value, type) and issubclass(_value, unittest.TestCase)
        and _value.__module__ == _loaded["module"].__name__
        and _attr not in SKIPPED_CLASSES):
      globals()[f"{_name}__{_attr}"] = _value
del _name, _loaded    # module-level loop names must not be collected as tests
if "_value" in globals():
  del _attr, _value
