"""The shape of pallet's source tree: few entries at the top, no import circles, and a
wheel that ships nothing but `pallet`.

The import graph is read from the source with `ast`: every `import`/`from` statement at
module level (including under module-level `if`/`try`), not those inside functions. A
module importing `a.b.c` also runs the `__init__` of `a.b` (and `a`), so that counts as
an edge too, except from inside the package itself (its `__init__` is already running).
"""
from __future__ import annotations

import ast
import fnmatch
import os
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
MAX_TOP_LEVEL = 25


def _modules() -> dict[str, pathlib.Path]:
  modules = {}
  for path in (SRC / "pallet").rglob("*.py"):
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    modules[".".join(parts)] = path
  return modules


def _module_level(tree: ast.Module):
  """Import statements run when the module is imported (not those inside functions)."""
  todo = list(tree.body)
  while todo:
    node = todo.pop()
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node
    elif isinstance(node, (ast.If, ast.Try, ast.With)):
      todo += [n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)]
      for handler in getattr(node, "handlers", ()):
        todo += handler.body


def import_graph() -> dict[str, set[str]]:
  modules = _modules()

  def existing(name: str) -> str | None:
    while name and name not in modules:
      name = name.rpartition(".")[0]
    return name or None

  graph = {}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in _module_level(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets |= {a.name for a in node.names}
        continue
      base = node.module or ""
      if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
      for alias in node.names:   # `from pkg import submodule` imports the submodule
        full = f"{base}.{alias.name}"
        targets.add(full if full in modules else base)
    edges = set()
    for target in targets:
      if not target.startswith("pallet"):
        continue
      target = existing(target)
      while target and target != name and not name.startswith(target + "."):
        edges.add(target)        # the module and every package __init__ it runs
        target = target.rpartition(".")[0]
    graph[name] = edges
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_no_import_circles():
  graph = import_graph()
  assert len(graph) > 100 and graph["pallet.pallas_call"], "the graph reads pallet's source"
  circles = cycles(graph)
  assert not circles, "import circles (move the shared piece down): " + "; ".join(
      " <-> ".join(c) for c in circles)


def test_the_graph_sees_a_circle():
  """The check itself: two modules importing each other are found."""
  assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_few_entries_at_the_top_of_src_pallet():
  entries = sorted(p.name for p in (SRC / "pallet").iterdir() if p.name != "__pycache__")
  assert len(entries) <= MAX_TOP_LEVEL, (
      f"{len(entries)} entries at the top of src/pallet (at most {MAX_TOP_LEVEL}): {entries}")


def _found_packages(where: pathlib.Path, include: list[str], exclude: list[str]) -> list[str]:
  """setuptools' `[tool.setuptools.packages.find]` with its pyproject default
  `namespaces = true`: every folder under `where` is a package candidate (with or
  without `__init__.py`), kept where its dotted name matches `include` and not
  `exclude` (fnmatch patterns)."""
  found = []
  for folder in where.rglob("*"):
    if not folder.is_dir() or "__pycache__" in folder.parts or folder.name.startswith("."):
      continue
    name = ".".join(folder.relative_to(where).parts)
    if (any(fnmatch.fnmatchcase(name, p) for p in include)
        and not any(fnmatch.fnmatchcase(name, p) for p in exclude)):
      found.append(name)
  return sorted(found)


def test_the_wheel_ships_only_pallet():
  """What setuptools packs, from pyproject.toml's own package discovery settings
  (the test environments lack setuptools, so its discovery rule is applied here)."""
  config = tomllib.loads((ROOT / "pyproject.toml").read_text())
  find = config["tool"]["setuptools"]["packages"]["find"]
  packages = []
  for where in find.get("where", ["."]):
    packages += _found_packages(ROOT / where, find.get("include", ["*"]), find.get("exclude", []))
  assert "pallet" in packages and "pallet.bench" in packages, packages
  assert all(p == "pallet" or p.startswith("pallet.") for p in packages), (
      "the wheel would ship " + ", ".join(p for p in packages if not p.startswith("pallet")))


JAX_PALLAS = ("jax.experimental.pallas", "jax._src.pallas")
PEER_MODULE = "pallet.bench.peer"


def _imported_names(tree: ast.AST):
  """Every module an import statement anywhere in `tree` names (inside functions too)."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      yield node.module
      yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _loads_jax_pallas(path: pathlib.Path) -> bool:
  tree = ast.parse(path.read_text())
  if any(n == p or n.startswith(p + ".") for n in _imported_names(tree) for p in JAX_PALLAS):
    return True
  # a module name built for importlib (the bare "jax.experimental.pallas" is jax_ops.py's
  # routing key, which routes to pallet)
  return any(isinstance(node, ast.Constant) and isinstance(node.value, str)
             and node.value.startswith(tuple(p + "." for p in JAX_PALLAS))
             for node in ast.walk(tree))


def test_only_the_benchmark_peer_loads_jax_pallas():
  """JAX's Pallas is the peer benchmarks time pallet against, nothing pallet runs on: one
  module of src/ loads it (inside functions), and only the benchmark suite uses that one."""
  modules = _modules()
  loaders = sorted(name for name, path in modules.items() if _loads_jax_pallas(path))
  assert loaders == [PEER_MODULE]
  users = sorted(name for name, path in modules.items()
                 if PEER_MODULE in set(_imported_names(ast.parse(path.read_text()))))
  assert users and all(u.startswith("pallet.bench.") for u in users), users
  peer_tree = ast.parse(modules[PEER_MODULE].read_text())
  assert not [n for n in _module_level(peer_tree)
              if any(p in ast.dump(n) for p in JAX_PALLAS)], "load the peer inside functions"


def test_pallet_and_jax_ops_routed_onto_it_never_load_jax_pallas():
  """At run time: pallet's namespaces, its ops, and JAX's kernel library loaded onto
  pallet (what the benchmarks and tests/test_jax_ops.py run) leave JAX's Pallas unloaded."""
  script = """
import sys
import pallet, pallet.tpu, pallet.triton, pallet.fuser, pallet.ops, pallet.named
from pallet.bench import jax_ops
for name in ("gpu/attention", "gpu/layer_norm", "tpu/flash_attention", "tpu/matmul"):
  if jax_ops.available(name):
    jax_ops.load(name)
print(sorted(m for m in sys.modules if m.startswith("jax.experimental.pallas")))
"""
  env = {**os.environ, "PYTHONPATH": str(SRC)}
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                       text=True, check=True).stdout
  assert out.strip() == "[]", out
