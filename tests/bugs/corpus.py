"""The seeded-bug corpus: a registry of buggy kernels and their fixed twins.

A case is a function `build(bug: bool, **call) -> program` registered with
`@bug_case(...)`. It writes its kernel as a Pallas user would (`import pallet as pl`),
selecting the one buggy line with `if bug:` at trace time, and passes `**call`
(backend, interpret) on to `pl.pallas_call`. The buggy line carries a `# BUG`
comment: the runner reads the source to learn which line the report must name.
Cases modeled on a bug someone reported cite the thread in their docstring.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

KINDS = ("out_of_bounds", "uninitialized", "race", "nan", "overflow", "unwritten",
         "debug_check", "index_map", "hang", "deadlock", "aliasing")
# Kinds whose check is off unless asked for (InterpretParams fields, see docs/checking.md).
OPT_IN_KINDS = ("nan", "overflow", "debug_check")


@dataclasses.dataclass(frozen=True)
class Case:
  """One seeded bug and its fixed twin."""

  name: str
  kind: str                      # KernelCheckError.kind the check must report
  ref: str | None                # the kernel parameter the report must name
  build: Callable[..., Callable]  # build(bug, **call) -> program of `inputs()`
  inputs: Callable[[], tuple]    # fresh random inputs
  reference: Callable            # jax.numpy program the fixed twin must match
  triton: str | None = None      # why the Triton backend cannot see this bug (skip)
  triton_runs: bool = True       # whether the Triton backend runs the kernel at all
  # Visible when the kernel is traced: a PalletError naming the ref and the line (which
  # pallet raises even unchecked) is as good a report as a KernelCheckError.
  static: bool = False
  matmul: bool = False           # looser tolerance for the twin's comparison
  # InterpretParams fields the case sets besides the checks (e.g. a smaller loop bound,
  # so that a loop that never finishes stops soon under Triton's interpreter).
  params: dict = dataclasses.field(default_factory=dict)

  @property
  def source_file(self) -> str:
    return inspect.getsourcefile(self.build)

  @property
  def bug_line(self) -> int:
    """The line number of the single `# BUG` marker inside the case's source."""
    lines, first = inspect.getsourcelines(self.build)
    marked = [first + i for i, text in enumerate(lines) if "# BUG" in text]
    if len(marked) != 1:
      raise AssertionError(f"case {self.name}: expected one '# BUG' line, found {marked}")
    return marked[0]


CASES: list[Case] = []


def bug_case(*, kind: str, ref: str | None, inputs: Callable[[], tuple],
             reference: Callable, triton: str | None = None, triton_runs: bool = True,
             static: bool = False, matmul: bool = False,
             params: dict | None = None) -> Callable[[Callable], Callable]:
  """Registers the decorated `build(bug, **call)` as a corpus case."""
  if kind not in KINDS:
    raise ValueError(f"unknown kind {kind!r}")

  def register(build: Callable) -> Callable:
    CASES.append(Case(build.__name__, kind, ref, build, inputs, reference, triton,
                      triton_runs, static, matmul, dict(params or {})))
    return build

  return register


def all_cases() -> list[Case]:
  """Every registered case (importing the case modules registers them)."""
  from bugs import (aliasing, bounds, hangs, opt_in, races, reports, tpu,  # noqa: F401
                    uninitialized)
  names = [c.name for c in CASES]
  duplicates = {n for n in names if names.count(n) > 1}
  if duplicates:
    raise AssertionError(f"duplicate case names {sorted(duplicates)}")
  return list(CASES)
