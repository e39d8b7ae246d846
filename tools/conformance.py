"""JAX's own Pallas test files, run on pallet and on JAX's Pallas, counted side by side.

    PALLET_JAX_SOURCE=/path/to/jax PYTHONPATH=src python tools/conformance.py \\
        tpu_pallas_pipeline_test fuser_block_spec_test [--backend triton] [-k NAME]

A development tool, not part of the test suite or the wheel: it needs a checkout of
jax-ml/jax (`PALLET_JAX_SOURCE`, a directory holding tests/pallas/) and absl-py. Each
file runs twice, each time in its own process:

- **pallet**: the file's `jax.experimental.pallas` imports (and the few `jax._src.pallas`
  modules the tests use) are routed to pallet, as `src/pallet/bench/jax_ops.py` routes JAX's
  kernel library; `--backend triton` runs every kernel through pallet's Triton backend
  under Triton's interpreter.
- **jax**: the file as written, on JAX's own Pallas in interpret mode.

Files named `tpu_*` (and the TPU fuser test) are TPU tests: their kernels run with
`interpret=True` (JAX: `pltpu.force_tpu_interpret_mode()`, inside an abstract mesh whose
device is a single-core TPU v5e, which JAX's TPU interpreter needs), and JAX's TPU-generation checks
(`jtu.is_device_tpu_at_least`, `jtu.is_device_tpu()`) pass, so the classes written for a
TPU run here. Test utilities that the installed jax lacks (a checkout is usually newer,
e.g. `jax._src.hypothesis_test_util`) are loaded from the checkout.

Counts are per test method (each parametrized case once); a test that errors counts as
failed. docs/compatibility.md records the results.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import os
import pathlib
import re
import subprocess
import sys
import time
import types
import unittest
from typing import Any

SOURCE_ENV = "PALLET_JAX_SOURCE"
ROOT = pathlib.Path(__file__).resolve().parent.parent
# The files of docs/compatibility.md's tables, and the backend each was measured on.
FILES = {
    "pallas_test": "xla", "ops_test": "xla", "indexing_test": "xla",
    "pallas_vmap_test": "xla", "triton_pallas_test": "triton", "gpu_ops_test": "triton",
    "gpu_attention_test": "xla", "gpu_paged_attention_test": "xla", "tpu_ops_test": "xla",
    "tpu_pallas_test": "xla", "tpu_pallas_pipeline_test": "xla",
    "tpu_pallas_random_test": "xla", "tpu_ragged_paged_attention_test": "xla",
    "tpu_gmm_test": "xla", "tpu_pallas_async_test": "xla", "fuser_block_spec_test": "xla",
    "fusion_test": "xla", "tpu_fusible_matmul_test": "xla",
}
# What a worker prints: one line per finished test, or one saying the file did not import.
_OUTCOME = "conformance-outcome: "
_ERROR = "conformance-error: "
_OUTCOMES = ("pass", "fail", "skip")
# `jax._src.pallas` modules the tests import, and pallet's module standing in for each.
_PALLET_INTERNALS = {
    "jax._src.pallas.primitives": "pallet",
    "jax._src.pallas.pallas_call": "pallet",
    "jax._src.pallas.einshape": "pallet.tpu",
    "jax._src.pallas.fuser.block_spec": "pallet.fuser",
    "jax._src.pallas.fuser.custom_fusion_lib": "pallet.fuser",
}
# Flags of a newer JAX that test files read at import, with the value that keeps the
# installed JAX's behaviour (both columns get them).
_NEWER_FLAGS = {"jax_pallas_use_mosaic_gpu": False}
# A Mosaic switch of these classes' setUp that has no counterpart to run here.
_LEFT_OUT_CLASSES = {"tpu_fusible_matmul_test": {"FusibleMatmulPrimitiveTest"}}


def is_tpu_file(name: str) -> bool:
  return name.startswith("tpu_")


# ------------------------------------------------------------------ the worker
class _Router(ast.NodeTransformer):
  """Rewrites every import into a `_conformance_import(dotted, attribute)` call, which
  decides per implementation where it comes from (line numbers are kept)."""

  def _assign(self, node: ast.AST, target: str, dotted: str, attribute: str | None):
    call = ast.Call(ast.Name("_conformance_import", ast.Load()),
                    [ast.Constant(dotted), ast.Constant(attribute)], [])
    return ast.copy_location(ast.Assign([ast.Name(target, ast.Store())], call), node)

  def visit_Import(self, node: ast.Import):
    out = []
    for alias in node.names:
      if alias.asname is None or not alias.name.startswith("jax."):
        out.append(ast.copy_location(ast.Import([alias]), node))
      else:
        out.append(self._assign(node, alias.asname, alias.name, None))
    return out

  def visit_ImportFrom(self, node: ast.ImportFrom):
    if node.level or not (node.module or "").startswith("jax"):
      return node
    return [self._assign(node, a.asname or a.name, node.module, a.name)
            for a in node.names]


class _Importer:
  """Imports for one implementation ("pallet" or "jax") of a routed test file."""

  def __init__(self, impl: str, source: pathlib.Path):
    self.impl, self.source = impl, source
    self.jax_ops = None
    if impl == "pallet":
      sys.path.insert(0, str(ROOT))
      from pallet.bench import jax_ops   # the router of JAX's kernel library
      self.jax_ops = jax_ops

  def __call__(self, dotted: str, attribute: str | None) -> Any:
    full = f"{dotted}.{attribute}" if attribute else dotted
    if self.impl == "pallet":
      if full in _PALLET_INTERNALS or dotted in _PALLET_INTERNALS:
        module = importlib.import_module(_PALLET_INTERNALS.get(full) or _PALLET_INTERNALS[dotted])
        if full in _PALLET_INTERNALS or attribute is None:
          return module
        return getattr(module, attribute)
      if self._kernel_library(full) or self._kernel_library(dotted):
        return self.jax_ops._route_import(dotted, attribute)
    module = self._module(full if attribute else dotted)
    if module is not None and attribute is not None:   # `from package import module`
      return module
    module = self._module(dotted)
    if module is None:
      raise ModuleNotFoundError(f"no module {dotted} in jax or the checkout")
    return module if attribute is None else getattr(module, attribute)

  def _kernel_library(self, dotted: str) -> bool:
    """Whether `src/pallet/bench/jax_ops.py` routes `dotted` (a Pallas namespace, JAX's
    kernel library, the PRNG registry)."""
    ops = "jax.experimental.pallas.ops"
    return (dotted in self.jax_ops.ROUTES or dotted == ops or dotted.startswith(ops + ".")
            or dotted == "jax._src.random.prng")

  def _module(self, dotted: str) -> types.ModuleType | None:
    try:
      return importlib.import_module(dotted)
    except ModuleNotFoundError:
      pass
    if not dotted.endswith("test_util"):
      return None
    path = self.source / (dotted.replace(".", "/") + ".py")
    if not path.exists():
      return None
    return _exec_module(dotted, path, self)


def _exec_module(name: str, path: pathlib.Path, importer: _Importer) -> types.ModuleType:
  """`path` executed as module `name`, its imports going through `importer`."""
  module = types.ModuleType(name)
  module.__file__ = str(path)
  module._conformance_import = importer
  sys.modules[name] = module
  tree = ast.fix_missing_locations(_Router().visit(ast.parse(path.read_text(), str(path))))
  exec(compile(tree, str(path), "exec"), module.__dict__)
  return module


def _define_newer_flags() -> None:
  from jax._src import config
  for name, default in _NEWER_FLAGS.items():
    if not hasattr(config, name):
      setattr(config, name, config.bool_state(name=name, default=default,
                                              help="defined by tools/conformance.py"))


def _pretend_tpu() -> None:
  """JAX's TPU-generation checks pass, so the classes written for a TPU run."""
  from jax._src import test_util as jtu
  jtu.is_device_tpu_at_least = lambda version: True
  real_is_tpu = jtu.is_device_tpu
  jtu.is_device_tpu = lambda version=None, variant="": (
      True if version is None else real_is_tpu(version, variant))


def _on_a_tpu_v5e() -> contextlib.AbstractContextManager:
  """JAX's TPU interpret mode asks the device which TPU it targets; on a CPU an abstract
  mesh names one (as JAX's error message advises): a single-core TPU v5e."""
  import jax
  from jax._src import mesh as mesh_lib
  device = mesh_lib.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((), (), abstract_device=device))


def _interpreting_pallet() -> None:
  """pallet's `pallas_call` and `pl.kernel` with `interpret=True` where the test passes
  none, as JAX's `force_tpu_interpret_mode` makes of Pallas's."""
  import pallet
  for name in ("pallas_call", "kernel"):
    original = getattr(pallet, name)

    def forced(*args, _original=original, **kwargs):
      if not kwargs.get("interpret"):
        kwargs["interpret"] = True
      return _original(*args, **kwargs)
    forced.__wrapped__ = original
    setattr(pallet, name, forced)


class _Outcomes(unittest.TestResult):
  """Prints each test's outcome when it finishes (a failing subtest fails its test
  once), so the counts so far survive a run that is stopped."""

  def __init__(self, tracebacks: bool):
    super().__init__()
    self.outcome: dict[str, str] = {}
    self.tracebacks = tracebacks

  def _show(self, test, err):
    if self.tracebacks:
      print(f"--- {test.id()}\n{self._exc_info_to_string(err, test)}", file=sys.stderr,
            flush=True)

  def _set(self, test, outcome):
    if self.outcome.get(test.id()) != "fail":
      self.outcome[test.id()] = outcome

  def stopTest(self, test):
    super().stopTest(test)
    if test.id() in self.outcome:
      print(f"{_OUTCOME}{self.outcome[test.id()]} {test.id()}", flush=True)

  def addSuccess(self, test):
    self._set(test, "pass")

  def addFailure(self, test, err):
    self._set(test, "fail")
    self._show(test, err)

  def addError(self, test, err):
    self._set(test, "fail")
    self._show(test, err)
    if not isinstance(test, unittest.TestCase):   # a class's setUpClass: no stopTest follows
      print(f"{_OUTCOME}fail {test.id()}", flush=True)

  def addSkip(self, test, reason):
    self._set(test, "skip")

  def addExpectedFailure(self, test, err):
    self._set(test, "pass")

  def addUnexpectedSuccess(self, test):
    self._set(test, "fail")

  def addSubTest(self, test, subtest, err):
    if err is not None:
      self.outcome[test.id()] = "fail"
      self._show(subtest, err)


def _run_worker(name: str, impl: str, pattern: str | None, tracebacks: bool) -> None:
  source = pathlib.Path(os.environ[SOURCE_ENV])
  path = source / "tests" / "pallas" / f"{name}.py"
  from absl import flags
  flags.FLAGS(sys.argv[:1], known_only=True)
  _define_newer_flags()
  if is_tpu_file(name):
    _pretend_tpu()
    if impl == "pallet":
      _interpreting_pallet()
  importer = _Importer(impl, source)
  try:
    module = _exec_module(f"conformance.{name}", path, importer)
  except Exception as e:  # e.g. a JAX-internal module this jax lacks
    print(f"{_ERROR}does not import: {type(e).__name__}: {e}", flush=True)
    return
  left_out = _LEFT_OUT_CLASSES.get(name, set())
  suite = unittest.TestSuite()
  loader = unittest.TestLoader()
  for attr, value in vars(module).items():
    if (isinstance(value, type) and issubclass(value, unittest.TestCase)
        and value.__module__ == module.__name__ and attr not in left_out):
      for test in _flat(loader.loadTestsFromTestCase(value)):
        if pattern is None or re.search(pattern, test.id()):
          suite.addTest(test)
  context = contextlib.nullcontext()
  if is_tpu_file(name) and impl == "jax":
    from jax.experimental.pallas import tpu as pltpu
    context = contextlib.ExitStack()
    context.enter_context(pltpu.force_tpu_interpret_mode())
    context.enter_context(_on_a_tpu_v5e())
  with context:
    suite.run(_Outcomes(tracebacks))


def _flat(suite):
  for test in suite:
    if isinstance(test, unittest.TestSuite):
      yield from _flat(test)
    else:
      yield test


# ------------------------------------------------------------------ the driver
def _run_file(name: str, impl: str, backend: str, args: argparse.Namespace) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
  env.setdefault("JAX_PLATFORMS", "cpu")
  if impl == "pallet" and backend == "triton":
    env["PALLET_BACKEND"] = "triton"
    env["TRITON_INTERPRET"] = "1"
  command = [sys.executable, __file__, "--worker", name, "--impl", impl]
  if args.k:
    command += ["-k", args.k]
  if args.tracebacks:
    command += ["--tracebacks"]
  start = time.perf_counter()
  timed_out = False
  try:   # with --tracebacks the worker's stderr (the tracebacks) goes straight to ours
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE,
                          stderr=None if args.tracebacks else subprocess.PIPE,
                          timeout=args.timeout)
    stdout, stderr = done.stdout, done.stderr
  except subprocess.TimeoutExpired as e:
    timed_out, stdout, stderr = True, e.stdout or b"", e.stderr or b""
  stdout, stderr = stdout.decode(errors="replace"), (stderr or b"").decode(errors="replace")
  errors = [l[len(_ERROR):] for l in stdout.splitlines() if l.startswith(_ERROR)]
  if errors:
    return {"error": errors[-1]}
  outcomes = dict(reversed(l[len(_OUTCOME):].split(" ", 1))
                  for l in stdout.splitlines() if l.startswith(_OUTCOME))
  if not outcomes and not timed_out and done.returncode != 0:
    tail = (stderr or stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"exit {done.returncode}: {tail[0]}"}
  result = {k: sum(v == k for v in outcomes.values()) for k in _OUTCOMES}
  result["seconds"] = round(time.perf_counter() - start)
  result["failed"] = sorted(t for t, v in outcomes.items() if v == "fail")
  if timed_out:
    result["note"] = f"timed out after {args.timeout:.0f} s: counts so far"
  return result


def _cell(result: dict) -> str:
  if "error" in result:
    return result["error"]
  cell = f"{result['pass']:>5} {result['fail']:>5} {result['skip']:>5} {result['seconds']:>6}s"
  return cell + " (timed out: so far)" if "note" in result else cell


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python tools/conformance.py",
      description="Run JAX's own Pallas test files (from $PALLET_JAX_SOURCE/tests/pallas) "
                  "on pallet and on JAX's Pallas (interpret mode), and print per file "
                  "pass/fail/skip for both.")
  parser.add_argument("files", nargs="*",
                      help="test files of tests/pallas, with or without .py (default: the "
                           "files of docs/compatibility.md's tables, each on its backend)")
  parser.add_argument("--backend", choices=("xla", "triton"),
                      help="pallet's backend (default: the file's one in the tables, else xla)")
  parser.add_argument("--only", choices=("pallet", "jax"), help="run one column only")
  parser.add_argument("-k", help="run only the tests whose id matches this regex")
  parser.add_argument("--timeout", type=float, default=3600, help="seconds per file and column")
  parser.add_argument("--failures", action="store_true", help="list the failing test ids")
  parser.add_argument("--tracebacks", action="store_true",
                      help="print each failure's traceback as it happens")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  parser.add_argument("--impl", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)

  if args.worker:
    _run_worker(args.worker, args.impl, args.k, args.tracebacks)
    return 0

  source = os.environ.get(SOURCE_ENV)
  if not source or not (pathlib.Path(source) / "tests" / "pallas").is_dir():
    print(f"set {SOURCE_ENV} to a checkout of jax-ml/jax (a directory with tests/pallas/)",
          file=sys.stderr)
    return 2
  try:
    import absl.testing.absltest  # noqa: F401
  except ImportError:
    print("JAX's tests are absltest cases: pip install absl-py", file=sys.stderr)
    return 2
  names = [f.removesuffix(".py") for f in args.files] or list(FILES)
  impls = [args.only] if args.only else ["pallet", "jax"]
  header = f"{'pass':>5} {'fail':>5} {'skip':>5} {'time':>7}"
  print(f"{'file':<40} {'pallet (backend)':<30} {'JAX Pallas (interpret)':<30}")
  print(f"{'':<40} {header:<30} {header:<30}")
  failed_lists = {}
  for name in names:
    if not (pathlib.Path(source) / "tests" / "pallas" / f"{name}.py").exists():
      print(f"{name + '.py':<40} not in {source}/tests/pallas")
      continue
    backend = args.backend or FILES.get(name, "xla")
    cells = {}
    for impl in impls:
      result = _run_file(name, impl, backend, args)
      cells[impl] = _cell(result)
      if args.failures and result.get("failed"):
        failed_lists[f"{name} on {impl}"] = result["failed"]
    label = f"{name}.py ({backend})"
    print(f"{label:<40} {cells.get('pallet', '-'):<30} {cells.get('jax', '-'):<30}",
          flush=True)
  for what, tests in failed_lists.items():
    print(f"\nfailing on {what}:")
    for test in tests:
      print(f"  {test}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
