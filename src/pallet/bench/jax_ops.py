"""JAX's own Pallas kernel library, run on pallet.

The kernels in `jax/experimental/pallas/ops/` (inside the installed jax wheel) are
real Pallas code that nobody here wrote. `load("gpu/softmax")` reads such a module
from the jax package, routes its `jax.experimental.pallas` imports to pallet and
executes it as a fresh module, so tests and benchmarks run those kernels on pallet
without copying any of their code into this repository.

Routing rewrites import statements only (line numbers are kept, so tracebacks
and pallet's error messages point into the original file):

    from jax.experimental import pallas as pl            -> pallet
    from jax.experimental.pallas import tpu as pltpu     -> pallet.tpu
    from jax.experimental.pallas import triton as plgpu  -> pallet.triton
    from jax.experimental.pallas.ops.X import Y          -> the routed copy of ops.X
    from jax._src.random import prng                     -> the PRNG registry, with the
        routed copy's PRNG impls filed under "<name>:pallet", so that jax's own copy of
        the same module (the Pallas peer) can still register its names
"""
from __future__ import annotations

import ast
import functools
import importlib
import pathlib
import sys
import types
import warnings
from typing import Any, Mapping

import jax

OPS_DIR = pathlib.Path(jax.__file__).parent / "experimental" / "pallas" / "ops"
_PALLAS = "jax.experimental.pallas"
_OPS = _PALLAS + ".ops"
# Where each Pallas namespace lives in pallet.
ROUTES = {
    _PALLAS: "pallet",
    _PALLAS + ".tpu": "pallet.tpu",
    _PALLAS + ".triton": "pallet.triton",
    _PALLAS + ".mosaic_gpu": "pallet.mosaic_gpu",
    _PALLAS + ".tpu_sc": "pallet.tpu_sc",
    _PALLAS + ".fuser": "pallet.fuser",
}
_PRNG = "jax._src.random.prng"
# Loaded modules are registered under this package name (never under jax's own).
PACKAGE = "pallet_jax_ops"
# The kernel library pallet is measured against; older jax wheels ship older kernels.
YARDSTICK = (0, 12)
_loaded: dict[str, types.ModuleType] = {}


def available(name: str) -> bool:
  """Whether the installed jax ships `ops/<name>.py` (JAX 0.10 ships fewer ops)."""
  return _path(name).exists()


def unavailable_reason(name: str) -> str | None:
  """Why `ops/<name>` of this jax is not the one to test or time (None when it is)."""
  if not available(name):
    return f"jax {jax.__version__} ships no ops/{name}"
  version = tuple(int(p) for p in jax.__version__.split(".")[:2])
  if version < YARDSTICK:
    return (f"needs the kernel library of JAX {'.'.join(map(str, YARDSTICK))}; "
            f"jax {jax.__version__} ships an older ops/{name}")
  return None


def load(name: str) -> types.ModuleType:
  """The module `ops/<name>` ("gpu/softmax", "tpu/megablox/gmm", ...) routed to pallet."""
  name = name.replace(".", "/").removesuffix("/py")
  if name in _loaded:
    return _loaded[name]
  path = _path(name)
  if not path.exists():
    raise FileNotFoundError(f"jax {jax.__version__} ships no {path}")
  module_name = f"{PACKAGE}.{name.replace('/', '.')}"
  module = types.ModuleType(module_name)
  _loaded[name] = module
  sys.modules[module_name] = module
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)  # e.g. "ops.gpu.softmax is deprecated"
      exec_routed(module, path)
  except BaseException:
    del _loaded[name], sys.modules[module_name]
    raise
  return module


def exec_routed(module: types.ModuleType, path: pathlib.Path,
                routes: Mapping[str, str] = ROUTES) -> None:
  """Executes the Python file `path` as `module`'s code, its Pallas imports routed to
  pallet (what `load` does for JAX's kernels; tests use it for other projects' kernels,
  with `routes` for modules of JAX those import besides ROUTES)."""
  module.__file__ = str(path)
  module.__dict__["_route_import"] = functools.partial(_route_import, routes=routes)
  tree = _Router(routes).visit(ast.parse(path.read_text(), str(path)))
  ast.fix_missing_locations(tree)
  # dont_inherit: this module's `from __future__ import annotations` must not turn the
  # loaded module's annotations into strings (pydantic and dataclasses read them)
  exec(compile(tree, str(path), "exec", dont_inherit=True), module.__dict__)


def _path(name: str) -> pathlib.Path:
  file = OPS_DIR / f"{name}.py"
  return file if file.exists() else OPS_DIR / name / "__init__.py"


def _route_import(dotted: str, attribute: str | None,
                  routes: Mapping[str, str] = ROUTES) -> Any:
  """`import dotted` (attribute None) or `from dotted import attribute`, routed."""
  if f"{dotted}.{attribute}" == _PRNG or (attribute is None and dotted == _PRNG):
    return _PrngRegistry()
  if attribute is not None and f"{dotted}.{attribute}" in routes:
    return importlib.import_module(routes[f"{dotted}.{attribute}"])
  if dotted in routes:
    module = importlib.import_module(routes[dotted])
  elif dotted == _OPS or dotted.startswith(_OPS + "."):
    rel = dotted[len(_OPS) + 1:].replace(".", "/")
    if attribute is not None and _path(f"{rel}/{attribute}").exists():
      return load(f"{rel}/{attribute}")
    module = load(rel)
  elif dotted.startswith(_PALLAS + "."):
    raise ImportError(f"{dotted} is JAX's Pallas, which pallet does not run on and has "
                      "no route for (ROUTES in pallet/bench/jax_ops.py)")
  else:
    module = importlib.import_module(dotted)
    if attribute is not None and not hasattr(module, attribute):
      return importlib.import_module(f"{dotted}.{attribute}")
  return module if attribute is None else getattr(module, attribute)


def _routed(dotted: str, routes: Mapping[str, str]) -> bool:
  return (dotted in routes or dotted == _OPS or dotted.startswith(_OPS + ".")
          or any(r.startswith(dotted + ".") for r in (*routes, _PRNG)) or dotted == _PRNG)


class _PrngRegistry(types.ModuleType):
  """jax's PRNG module as a routed module sees it: `register_prng` files the impl
  under "<name>:pallet" (jax's own copy of the module registers "<name>")."""

  def __init__(self):
    super().__init__(_PRNG)
    self._prng = importlib.import_module(_PRNG)

  def __getattr__(self, attribute: str) -> Any:
    return getattr(self._prng, attribute)

  def register_prng(self, impl: Any) -> None:
    self._prng.prngs[f"{impl.name}:pallet"] = impl


class _Router(ast.NodeTransformer):
  """Rewrites imports of Pallas namespaces into `_route_import` assignments."""

  def __init__(self, routes: Mapping[str, str]):
    self.routes = routes

  def _assign(self, node: ast.AST, target: str, dotted: str, attribute: str | None):
    call = ast.Call(ast.Name("_route_import", ast.Load()),
                    [ast.Constant(dotted), ast.Constant(attribute)], [])
    return ast.copy_location(ast.Assign([ast.Name(target, ast.Store())], call), node)

  def visit_Import(self, node: ast.Import):
    if not any(_routed(a.name, self.routes) for a in node.names):
      return node
    out = []
    for a in node.names:
      if not _routed(a.name, self.routes):
        out.append(ast.copy_location(ast.Import([a]), node))
      elif a.asname is None:   # `import jax.experimental.pallas` binds `jax`: leave it
        out.append(ast.copy_location(ast.Import([a]), node))
      else:
        out.append(self._assign(node, a.asname, a.name, None))
    return out

  def visit_ImportFrom(self, node: ast.ImportFrom):
    if node.level or not node.module or not _routed(node.module, self.routes):
      return node
    return [self._assign(node, a.asname or a.name, node.module, a.name)
            for a in node.names]
