"""Which checks a call runs: from `interpret=InterpretParams(...)` or `$PALLET_CHECKS`."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from pallet.core import checks
from pallet.core.interpret_params import InterpretParams

ENV_VAR = "PALLET_CHECKS"
_ON = ("1", "true", "on", "yes", "default")
_OFF = ("", "0", "false", "off", "no")
# $PALLET_CHECKS may also list kinds, e.g. "race,nan"; "all" adds every opt-in check.
_KIND_FIELDS = {"out_of_bounds": "bounds", "index_map": "bounds", "uninitialized": "uninitialized",
                "race": "races", "nan": "nans", "overflow": "overflow",
                "unwritten": "unwritten", "debug_check": "debug_checks", "hang": "hangs",
                "deadlock": "hangs", "aliasing": "races"}
DEFAULT_LOOP_BOUND = 1 << 20


@dataclasses.dataclass(frozen=True)
class CheckOptions:
  """The checks compiled into one call (hashable: part of cache keys)."""
  bounds: bool = True          # out_of_bounds and index_map
  uninitialized: bool = True   # reads before writes (also poisons fresh memory)
  races: bool = True
  nans: bool = False
  overflow: bool = False
  unwritten: bool = True      # output elements no program wrote
  debug_checks: bool = False
  hangs: bool = True           # loops that never finish, waits on later programs
  loop_bound: int = DEFAULT_LOOP_BOUND   # iterations of a while loop counted as a hang

  @property
  def any(self) -> bool:
    return any(v is True for v in dataclasses.astuple(self))


def from_interpret_params(params: InterpretParams) -> CheckOptions:
  return CheckOptions(bounds=params.out_of_bounds_reads == "raise",
                      uninitialized=params.uninitialized_memory == "nan",
                      races=bool(params.detect_races), nans=bool(params.detect_nans),
                      overflow=bool(params.detect_int_overflow),
                      unwritten=bool(params.detect_unwritten_outputs),
                      debug_checks=bool(params.debug_checks), hangs=bool(params.detect_hangs),
                      loop_bound=int(params.max_loop_iterations))


def from_environment(value: str | None = None) -> CheckOptions | None:
  """`$PALLET_CHECKS`: 1 (default checks), all (plus opt-in ones), or a comma list of kinds."""
  value = (os.environ.get(ENV_VAR, "") if value is None else value).strip().lower()
  if value in _OFF:
    return None
  if value in _ON:
    return CheckOptions()
  if value == "all":
    return CheckOptions(nans=True, overflow=True, debug_checks=True)
  fields: dict = {f: False for f in set(_KIND_FIELDS.values())}
  for kind in value.split(","):
    kind = kind.strip()
    if kind not in _KIND_FIELDS:
      raise ValueError(f"environment variable {ENV_VAR}={value!r}: unknown check {kind!r}; "
                       f"use 1, all, or a comma list of {sorted(_KIND_FIELDS)}")
    fields[_KIND_FIELDS[kind]] = True
  return CheckOptions(**fields)


def resolve(interpret: Any) -> CheckOptions | None:
  """The checks for a call with this `interpret=` argument (None: run unchecked)."""
  if isinstance(interpret, InterpretParams):
    options = from_interpret_params(interpret)
  else:
    options = from_environment()
  if options is not None and checks.allow_unwritten_outputs.value:
    options = dataclasses.replace(options, unwritten=False)
  return options if options is not None and options.any else None
