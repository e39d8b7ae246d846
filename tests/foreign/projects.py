"""Pallas kernels of other open projects, read from their checkouts at test time.

Serving engines and training libraries ship Pallas kernels written for TPUs (and some
for GPUs) that nobody here wrote. A test names a module of such a project,
`load("tpu_inference.kernels.flash_attention.kernel")`, and gets it executed from the
project's checkout with its Pallas imports routed to pallet (the routing JAX's own
kernel library gets, `pallet.bench.jax_ops.exec_routed`). Nothing of those projects
is copied into this repository.

Each project's checkout comes from an environment variable; without it the tests of
that project skip and say which variable to set:

    PALLET_TPU_INFERENCE_SOURCE=/path/to/tpu-inference  (vllm-project/tpu-inference)
    PALLET_MAXTEXT_SOURCE=/path/to/maxtext              (AI-Hypercomputer/maxtext)
    PALLET_SGLANG_JAX_SOURCE=/path/to/sglang-jax        (sgl-project/sglang-jax)
    PALLET_RECURRENTGEMMA_SOURCE=/path/to/recurrentgemma (google-deepmind/recurrentgemma)
    PALLET_EJKERNEL_SOURCE=/path/to/ejkernel            (erfanzar/ejkernel)
    PALLET_TOKAMAX_SOURCE=/path/to/tokamax              (openxla/tokamax)
    PALLET_AXLEARN_SOURCE=/path/to/axlearn              (apple/axlearn)
    PALLET_LEVANTER_SOURCE=/path/to/marin               (marin-community/marin, lib/levanter)
    PALLET_TORCH_XLA_SOURCE=/path/to/xla                (pytorch/xla: its JAX Pallas kernels)
    PALLET_ALPHAFOLD3_SOURCE=/path/to/alphafold3        (google-deepmind/alphafold3)
    PALLET_MAXDIFFUSION_SOURCE=/path/to/maxdiffusion    (AI-Hypercomputer/maxdiffusion)

A project's modules are found by an import hook for its top-level package, so the
kernels' imports of their own helpers work as written. The top-level package's
`__init__.py` is not run (it starts engines, reads settings, imports the rest of the
project). A sub-package's is, unless it needs a library this environment lacks (a
model zoo's `__init__` importing flax, say): then the sub-package stays an empty
package, and only what a test imports from it by module path works.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import pathlib
import re
import sys
import types

import pytest

from pallet.bench import jax_ops


@dataclasses.dataclass(frozen=True)
class Project:
  variable: str     # environment variable holding the checkout's path
  package_dir: str  # where the top-level package sits inside the checkout
  repository: str   # the public repository, for the skip message
  # Libraries the project's plumbing (logging, settings, torch interop) imports at
  # module level and its kernels never call: stand-ins while loading when not installed.
  absent: tuple[str, ...] = ()


PROJECTS = {
    "tpu_inference": Project("PALLET_TPU_INFERENCE_SOURCE", "", "vllm-project/tpu-inference",
                             absent=("vllm", "torch", "torchax")),
    "maxtext": Project("PALLET_MAXTEXT_SOURCE", "src", "AI-Hypercomputer/maxtext"),
    "sgl_jax": Project("PALLET_SGLANG_JAX_SOURCE", "python", "sgl-project/sglang-jax",
                       absent=("zmq", "fastapi")),
    "recurrentgemma": Project("PALLET_RECURRENTGEMMA_SOURCE", "",
                              "google-deepmind/recurrentgemma"),
    "ejkernel": Project("PALLET_EJKERNEL_SOURCE", "", "erfanzar/ejkernel",
                        absent=("jaxtyping",)),
    "tokamax": Project("PALLET_TOKAMAX_SOURCE", "", "openxla/tokamax", absent=("xprof",)),
    "axlearn": Project("PALLET_AXLEARN_SOURCE", "", "apple/axlearn"),
    "levanter": Project("PALLET_LEVANTER_SOURCE", "lib/levanter/src",
                        "marin-community/marin (lib/levanter)"),
    "torch_xla": Project("PALLET_TORCH_XLA_SOURCE", "", "pytorch/xla", absent=("torch",)),
    "alphafold3": Project("PALLET_ALPHAFOLD3_SOURCE", "src", "google-deepmind/alphafold3"),
    "maxdiffusion": Project("PALLET_MAXDIFFUSION_SOURCE", "src", "AI-Hypercomputer/maxdiffusion"),
}


def checkout(package: str) -> pathlib.Path | None:
  """The directory holding `package` in its project's checkout, or None when unset."""
  project = PROJECTS[package]
  root = os.environ.get(project.variable)
  if not root:
    return None
  return pathlib.Path(root) / project.package_dir


def skip_reason(package: str) -> str | None:
  """Why `package`'s kernels cannot run here (None when they can)."""
  project, where = PROJECTS[package], checkout(package)
  if where is None:
    return f"set {project.variable} to a checkout of {project.repository}"
  if not (where / package).is_dir():
    return f"{project.variable}: no {package}/ under {where}"
  return None


def load(dotted: str) -> types.ModuleType:
  """The project module `dotted`, its Pallas imports routed to pallet; skips the
  calling test when the project's checkout is not configured."""
  package = dotted.split(".")[0]
  reason = skip_reason(package)
  if reason:
    pytest.skip(reason)
  _install_finder()
  stand_ins = [name for name in PROJECTS[package].absent
               if name not in sys.modules and importlib.util.find_spec(name) is None]
  finder = _AbsentFinder(stand_ins)
  sys.meta_path.append(finder)
  try:
    return importlib.import_module(dotted)
  finally:
    sys.meta_path.remove(finder)
    for name in [n for n in sys.modules if n.split(".")[0] in stand_ins]:
      del sys.modules[name]


class _AbsentType(type):
  """A stand-in class: attributes are stand-ins too, instances accept any call."""

  def __getattr__(cls, name: str):
    if name.startswith("__"):
      raise AttributeError(name)
    return _absent(f"{cls.__qualname__}.{name}")


def _absent(name: str) -> type:
  def attribute(self, attr):
    if attr.startswith("__"):
      raise AttributeError(attr)
    return _absent(f"{name}().{attr}")
  return _AbsentType(name, (), {"__init__": lambda self, *a, **k: None,
                                "__getattr__": attribute})


class _AbsentModule(types.ModuleType):
  """A library that is not installed, as its importers see it while a project loads."""

  def __getattr__(self, name: str):
    if name.startswith("__"):
      raise AttributeError(name)
    return _absent(f"{self.__name__}.{name}")


class _AbsentLoader(importlib.abc.Loader):
  def create_module(self, spec):
    module = _AbsentModule(spec.name)
    module.__path__ = []
    return module

  def exec_module(self, module):
    pass


class _AbsentFinder(importlib.abc.MetaPathFinder):
  """Finds stand-ins for the `roots` libraries (last on the path: only when absent)."""

  def __init__(self, roots: list[str]):
    self.roots = roots

  def find_spec(self, fullname, path=None, target=None):
    if fullname.split(".")[0] not in self.roots:
      return None
    return importlib.machinery.ModuleSpec(fullname, _AbsentLoader(), is_package=True)


class _RoutedLoader(importlib.abc.Loader):
  """Executes a project file with its Pallas imports routed (top-level package: no code)."""

  def __init__(self, path: pathlib.Path | None):
    self.path = path

  def create_module(self, spec):
    return None

  def exec_module(self, module: types.ModuleType) -> None:
    if self.path is None:
      return
    if self.path.name != "__init__.py":
      _execute(module, self.path)
      return
    try:
      _execute(module, self.path)
    except ImportError as e:
      # a name from a sub-package that was itself emptied counts as missing too
      emptied = getattr(sys.modules.get(e.name or ""), "_emptied", False)
      if not emptied and (not isinstance(e, ModuleNotFoundError)
                          or (e.name and e.name.split(".")[0] in PROJECTS)):
        raise
      # a missing third-party library: keep the package, without its re-exports
      for name in [n for n in vars(module) if not n.startswith("__")]:
        delattr(module, name)
      module._emptied = True


# Set in the child process of `run_on_jax_pallas`: modules run on JAX's own Pallas.
PEER_VARIABLE = "PALLET_FOREIGN_ON_JAX_PALLAS"


# JAX's private TPU modules that projects import kernel functions from (`sync_copy`,
# `to_pallas_key`): routed to pallet like the public namespaces. Other private modules
# (tpu_info, core, utils: plumbing) are imported as they are.
PRIVATE_ROUTES = {
    "jax._src.pallas.mosaic.helpers": "pallet.tpu",
    "jax._src.pallas.mosaic.random": "pallet.tpu.random",
}


def _execute(module: types.ModuleType, path: pathlib.Path) -> None:
  if os.environ.get(PEER_VARIABLE):
    module.__file__ = str(path)
    exec(compile(path.read_text(), str(path), "exec", dont_inherit=True), module.__dict__)
    return
  text = path.read_text()
  for dotted in set(re.findall(r"\bjax\._src\.pallas(?:\.\w+)+", text)):
    _import_module_part(dotted)
  jax_ops.exec_routed(module, path, routes={**jax_ops.ROUTES, **PRIVATE_ROUTES})


def _import_module_part(dotted: str) -> None:
  """Imports the longest module `dotted` starts with: code that names JAX's private
  Pallas modules as attributes (`jax._src.pallas.mosaic.primitives.AsyncCopyDescriptor`
  in an annotation) relies on `jax.experimental.pallas.tpu` having imported them, which
  the routed import does not."""
  parts = dotted.split(".")
  for n in range(len(parts), 2, -1):
    try:
      importlib.import_module(".".join(parts[:n]))
      return
    except ImportError:
      continue


class _ProjectFinder(importlib.abc.MetaPathFinder):
  """Finds the modules of the configured projects' packages in their checkouts."""

  def find_spec(self, fullname, path=None, target=None):
    parts = fullname.split(".")
    if parts[0] not in PROJECTS or skip_reason(parts[0]):
      return None
    base = checkout(parts[0]).joinpath(*parts)
    if base.is_dir():
      init = base / "__init__.py"
      code = init if len(parts) > 1 and init.exists() else None
      spec = importlib.machinery.ModuleSpec(fullname, _RoutedLoader(code), is_package=True,
                                            origin=str(code) if code else None)
      spec.submodule_search_locations = [str(base)]
      return spec
    file = base.with_suffix(".py")
    if file.exists():
      return importlib.machinery.ModuleSpec(fullname, _RoutedLoader(file), origin=str(file))
    return None


def _install_finder() -> None:
  if not any(isinstance(f, _ProjectFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _ProjectFinder())
