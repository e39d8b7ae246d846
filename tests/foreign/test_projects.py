"""The loader of other projects' kernels (tests/foreign/projects.py), on a project
made up in a temporary directory: routing, skipping, sub-packages, stand-ins."""
from __future__ import annotations

import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet
from tests.foreign import peer, projects

KERNEL = '''
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from fakeproj.kernels import helpers

def scale_rows(x, *, block=8):
  def kernel(x_ref, o_ref):
    o_ref[...] = helpers.twice(x_ref[...]) + pl.program_id(0)
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(x.shape[0] // block,),
                        in_specs=[pl.BlockSpec((block, x.shape[1]), lambda i: (i, 0))],
                        out_specs=pl.BlockSpec((block, x.shape[1]), lambda i: (i, 0)))(x)
'''


@pytest.fixture
def fake_project(tmp_path, monkeypatch):
  """A project `fakeproj` whose plumbing imports a library nobody has installed."""
  def write(relative, text):
    path = tmp_path / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
  write("fakeproj/__init__.py", "raise RuntimeError('the top-level __init__ must not run')\n")
  write("fakeproj/kernels/__init__.py", "import flax_like_zoo_not_installed\n")
  write("fakeproj/kernels/helpers.py", """
      from absent_lib_for_pallet_tests.logging import init_logger, BaseLogger
      logger = init_logger(__name__)
      class Logger(BaseLogger):
        pass
      def twice(v):
        logger.info("twice")
        return 2 * v
  """)
  write("fakeproj/kernels/scale.py", KERNEL)
  write("fakeproj/kernels/broken.py", "from fakeproj.kernels import no_such_module\n")
  monkeypatch.setitem(projects.PROJECTS, "fakeproj", projects.Project(
      "PALLET_FAKEPROJ_SOURCE", "", "nobody/fakeproj", absent=("absent_lib_for_pallet_tests",)))
  monkeypatch.setenv("PALLET_FAKEPROJ_SOURCE", str(tmp_path))
  yield tmp_path
  for name in [n for n in sys.modules if n.split(".")[0] == "fakeproj"]:
    del sys.modules[name]


def test_unset_checkout_skips_and_names_the_variable(monkeypatch):
  monkeypatch.delenv("PALLET_EJKERNEL_SOURCE", raising=False)
  with pytest.raises(pytest.skip.Exception, match="PALLET_EJKERNEL_SOURCE.*erfanzar/ejkernel"):
    projects.load("ejkernel.kernels")


def test_kernel_runs_on_pallet_with_its_own_helpers(fake_project):
  module = projects.load("fakeproj.kernels.scale")
  assert module.pl is pallet
  x = jax.random.normal(jax.random.key(3), (32, 16), jnp.float32)
  expected = 2 * x + jnp.repeat(jnp.arange(4, dtype=jnp.float32), 8)[:, None]
  np.testing.assert_allclose(module.scale_rows(x), expected, rtol=1e-6)
  # the stand-in library is gone once the project is loaded
  assert not any(n.startswith("absent_lib_for_pallet_tests") for n in sys.modules)
  # a sub-package whose __init__ needs a missing library stays an (empty) package
  assert "flax_like_zoo_not_installed" not in vars(sys.modules["fakeproj.kernels"])


def test_the_same_kernel_on_jax_pallas_in_a_child_process(fake_project):
  """The JAX-interpreter oracle: the unrouted module, run on JAX's Pallas."""
  x = jax.random.normal(jax.random.key(4), (16, 16), jnp.float32)
  theirs = peer.run_on_jax_pallas("fakeproj.kernels.scale", "scale_rows", x, block=8)
  assert isinstance(theirs, np.ndarray)
  np.testing.assert_allclose(theirs, 2 * x + jnp.repeat(jnp.arange(2.0), 8)[:, None], rtol=1e-6)
  ours = projects.load("fakeproj.kernels.scale").scale_rows(x, block=8)
  np.testing.assert_array_equal(ours, theirs)


def test_loaded_modules_keep_their_own_annotations(fake_project):
  """The loader's `from __future__ import annotations` does not leak into the modules
  it executes (tokamax builds pydantic models from real annotations)."""
  (fake_project / "fakeproj" / "kernels" / "typed.py").write_text(
      "def f(x: int) -> float:\n  return float(x)\n")
  module = projects.load("fakeproj.kernels.typed")
  assert module.f.__annotations__ == {"x": int, "return": float}


def test_missing_project_module_is_an_error(fake_project):
  with pytest.raises(ImportError, match="no_such_module"):
    projects.load("fakeproj.kernels.broken")


def test_missing_checkout_directory_skips(fake_project, monkeypatch, tmp_path):
  monkeypatch.setenv("PALLET_FAKEPROJ_SOURCE", str(tmp_path / "elsewhere"))
  with pytest.raises(pytest.skip.Exception, match="no fakeproj/"):
    projects.load("fakeproj.kernels.scale")
