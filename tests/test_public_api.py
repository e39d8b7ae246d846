"""Every public name of pallet's public modules stays where users find it.

`tests/public_api.json` records, for each module users import (`import pallet as pl`,
`import pallet.tpu as pltpu`, `pltpu.core`, `pallet.triton`, ...), every name `dir()`
shows without a leading underscore and what kind of object it is. Moving pallet's
internal modules around must leave it unchanged; a deliberate change of the public
API updates the snapshot with `python tests/test_public_api.py --write`.

Submodules that Python's import system sets as attributes of their package (for
example `pallet.core.specs` after anything imported it) are recorded only when they are
themselves public modules, so the snapshot does not depend on import order; modules
from outside pallet (jax, numpy, the standard library) are not recorded.
"""
from __future__ import annotations

import importlib
import inspect
import json
import pathlib
import sys
import types

SNAPSHOT = pathlib.Path(__file__).with_name("public_api.json")

# The modules users import, as README.md, docs/ and tests/test_public_classes.py name them.
PUBLIC_MODULES = (
    "pallet",
    "pallet.tpu",
    "pallet.tpu.core",
    "pallet.triton",
    "pallet.tpu_sc",
    "pallet.mosaic_gpu",
    "pallet.fuser",
    "pallet.named",
    "pallet.ops",
    "pallet.ops.tuned",
    "pallet.ops.launch_table",
    "pallet.checking",
    "pallet.backends",
)


def _module(path: str) -> types.ModuleType:
  if path == "pallet.tpu.core":   # JAX's `pltpu.core` is reached as an attribute
    return importlib.import_module("pallet.tpu").core
  return importlib.import_module(path)


def _kind(module: types.ModuleType, value: object) -> str | None:
  if isinstance(value, types.ModuleType):
    if not value.__name__.startswith("pallet"):
      return None   # jax, numpy, the standard library: the module's own business
    public = value.__name__ in PUBLIC_MODULES or (
        value.__name__ == "pallet.tpu.core")   # today's home of pltpu.core
    if value.__name__.startswith(module.__name__ + ".") and not public:
      return None   # set by the import system, not part of the API
    return "module"
  if inspect.isclass(value):
    return "class"
  if inspect.isfunction(value) or inspect.isbuiltin(value):
    return "function"
  return type(value).__name__


def public_api() -> dict[str, dict[str, str]]:
  modules = {path: _module(path) for path in PUBLIC_MODULES}   # all first: the same
  api = {}                                                     # names in any order
  for path, module in modules.items():
    names = {}
    for name in dir(module):
      if name.startswith("_"):
        continue
      kind = _kind(module, getattr(module, name))
      if kind is not None:
        names[name] = kind
    api[path] = names
  return api


def test_public_names_unchanged():
  recorded = json.loads(SNAPSHOT.read_text())
  current = public_api()
  for path in PUBLIC_MODULES:
    missing = sorted(set(recorded[path]) - set(current[path]))
    added = sorted(set(current[path]) - set(recorded[path]))
    changed = sorted(n for n in set(recorded[path]) & set(current[path])
                     if recorded[path][n] != current[path][n])
    assert not (missing or added or changed), (
        f"{path}: missing {missing}, added {added}, changed kind {changed}; "
        "a deliberate API change updates tests/public_api.json "
        "(python tests/test_public_api.py --write)")


if __name__ == "__main__":
  if sys.argv[1:] == ["--write"]:
    SNAPSHOT.write_text(json.dumps(public_api(), indent=1, sort_keys=True) + "\n")
  else:
    print(json.dumps(public_api(), indent=1, sort_keys=True))
