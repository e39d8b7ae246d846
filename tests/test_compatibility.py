"""docs/compatibility.md must list every public name of JAX's Pallas namespaces.

The table is checked against the real modules of the installed JAX (0.12), so it
cannot drift: a name JAX adds or removes, or a row that claims support pallet
does not have, fails here.
"""
from __future__ import annotations

import importlib
import pathlib
import re
import types

import jax
import pytest

TABLE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"
# Section heading in the table -> (JAX module, pallet module)
NAMESPACES = {
    "jax.experimental.pallas": ("jax.experimental.pallas", "pallet"),
    "jax.experimental.pallas.tpu": ("jax.experimental.pallas.tpu", "pallet.tpu"),
    "jax.experimental.pallas.triton": ("jax.experimental.pallas.triton", "pallet.triton"),
    "jax.experimental.pallas.fuser": ("jax.experimental.pallas.fuser", "pallet.fuser"),
}
STATUSES = ("supported", "difference", "not supported")
_ROW = re.compile(r"^\|\s*`([A-Za-z_][A-Za-z0-9_]*)`\s*\|\s*([a-z ]+?)\s*\|(.*)\|\s*$")

needs_jax_012 = pytest.mark.skipif(
    tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12),
    reason="the table describes JAX 0.12's Pallas namespaces")


def table_rows() -> dict[str, dict[str, tuple[str, str]]]:
  """{section: {name: (status, note)}} parsed from docs/compatibility.md."""
  rows: dict[str, dict[str, tuple[str, str]]] = {}
  section = None
  for line in TABLE.read_text().splitlines():
    heading = re.match(r"^##\s+`([a-z_.]+)`", line)
    if heading:
      section = heading.group(1)
      rows.setdefault(section, {})
      continue
    m = _ROW.match(line)
    if m and section in NAMESPACES:
      name, status, note = m.group(1), m.group(2), m.group(3).strip()
      assert name not in rows[section], f"{section}.{name} is listed twice"
      rows[section][name] = (status, note)
  return rows


def public_names(module_name: str) -> set[str]:
  """Public, non-module names of a JAX namespace, deprecated-but-usable ones included."""
  module = importlib.import_module(module_name)
  names = {n for n in dir(module) if not n.startswith("_")
           and not isinstance(getattr(module, n, None), types.ModuleType)}
  for name, (_, value) in getattr(module, "_deprecations", {}).items():
    if value is not None:
      names.add(name)
  return names


def test_every_row_has_a_known_status_and_a_reason_where_needed():
  rows = table_rows()
  assert set(rows) == set(NAMESPACES)
  for section, entries in rows.items():
    for name, (status, note) in entries.items():
      assert status in STATUSES, f"{section}.{name}: unknown status {status!r}"
      if status != "supported":
        assert note, f"{section}.{name} is '{status}' but says neither how nor why"


@needs_jax_012
@pytest.mark.parametrize("section", sorted(NAMESPACES))
def test_table_lists_exactly_the_public_names_of_jax(section):
  jax_module, _ = NAMESPACES[section]
  listed = set(table_rows()[section])
  actual = public_names(jax_module)
  assert not actual - listed, f"names of {jax_module} missing from the table: {sorted(actual - listed)}"
  assert not listed - actual, f"rows for names {jax_module} does not have: {sorted(listed - actual)}"


@pytest.mark.parametrize("section", sorted(NAMESPACES))
def test_every_listed_name_exists_in_pallet(section):
  """Supported or not, every name resolves (unsupported ones raise a clear error when used,
  never an AttributeError at import time)."""
  _, pallet_module = NAMESPACES[section]
  module = importlib.import_module(pallet_module)
  missing = [n for n in table_rows()[section] if not hasattr(module, n)]
  assert not missing, f"{pallet_module} lacks {missing}"
