"""Every Python code block in README.md and docs/ runs as written, so the docs cannot go
stale; every `pallet ...` shell line in them parses with the real command line.

A page reads top to bottom like a tutorial: its blocks run in order in one namespace, so
a block may use what an earlier block on the same page defined, and nothing else.
Listings of output (generated code, printed tables) use ```text fences."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks(language: str) -> list[tuple[str, int, str]]:
  found = []
  for path in DOCUMENTS:
    text = path.read_text()
    for m in FENCE.finditer(text):
      if m.group(1) == language:
        line = text.count("\n", 0, m.start()) + 1
        found.append((str(path.relative_to(ROOT)), line, m.group(2)))
  return found


# A Python block followed (after blank lines) by an output block whose first line is
# `SomeError: text` shows a failure: it must raise that error with that text (paths and
# line numbers aside).
ERROR_OUTPUT = re.compile(r"\s*```(?:text)?\n(\w+(?:Error|Exception)): ([^\n]*)\n")
PATH = re.compile(r"\S+\.(?:py|md):\d+")


def _expected_errors() -> dict[tuple[str, int], tuple[str, str]]:
  found = {}
  for path in DOCUMENTS:
    text = path.read_text()
    for m in FENCE.finditer(text):
      if m.group(1) == "python":
        shown = ERROR_OUTPUT.match(text, m.end())
        if shown:
          line = text.count("\n", 0, m.start()) + 1
          found[(str(path.relative_to(ROOT)), line)] = (shown.group(1), shown.group(2))
  return found


PYTHON_BLOCKS = _blocks("python")
SHELL_BLOCKS = _blocks("bash")


PAGES = sorted({where for where, _, _ in PYTHON_BLOCKS})


def test_the_docs_have_python_examples():
  assert len(PYTHON_BLOCKS) >= 20


# A page that starts with this comment runs in its own process on that many simulated
# CPU devices (the device count is fixed when JAX starts).
DEVICES = re.compile(r"<!-- docs-test: devices=(\d+) -->")


def _run_blocks(page: str) -> None:
  namespace = {"__name__": "__docs__"}
  errors = _expected_errors()
  for where, line, code in PYTHON_BLOCKS:
    if where != page:
      continue
    program = compile("\n" * line + code, str(ROOT / where), "exec")
    if (where, line) not in errors:
      exec(program, namespace)
      continue
    name, text = errors[(where, line)]
    try:
      exec(program, namespace)
    except Exception as e:   # the error the page shows, with the text it shows
      shown = PATH.sub("FILE", text)
      got = PATH.sub("FILE", str(e).splitlines()[0] if str(e) else "")
      assert type(e).__name__ == name and got == shown, (
          f"{where}:{line} shows {name}: {text}\nbut raised {type(e).__name__}: {e}")
    else:
      raise AssertionError(f"{where}:{line} shows {name}, but the block ran without error")


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_of_a_page_run_in_order(page):
  devices = DEVICES.search((ROOT / page).read_text())
  if devices is None:
    _run_blocks(page)
    return
  from helpers import run_on_simulated_devices
  code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
          f"import test_docs; test_docs._run_blocks({page!r}); print('DOCS OK')")
  output = run_on_simulated_devices(code, devices=int(devices.group(1)))
  assert output.rstrip().endswith("DOCS OK"), output[-3000:]


def _pallet_invocations() -> list[tuple[str, int, list[str]]]:
  found = []
  for where, line, code in SHELL_BLOCKS:
    for command in re.split(r"&&|\n|;", code):
      words = shlex.split(command.strip(), comments=True)
      if words[:1] == ["pallet"]:
        found.append((where, line, words[1:]))
  return found


@pytest.mark.parametrize("where,line,argv", _pallet_invocations(),
                         ids=[f"{w}:{n}:{' '.join(a)}" for w, n, a in _pallet_invocations()])
def test_pallet_command_lines_parse(where, line, argv):
  from pallet import cli
  parser = cli.build_parser()
  args, _ = parser.parse_known_args(argv)
  assert args.command == argv[0]
