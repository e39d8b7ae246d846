"""Per-device launch defaults of pallet.ops: block sizes, `num_warps` and `num_stages`
by the GPU a kernel runs on.

The defaults ship as one JSON table per reference GPU (`launch_tables/<device>.json`
beside this module: sm_80, sm_90, gfx942); other GPUs use their family's table
(`family`). `pallet tune` on a GPU writes tables of the same format into the user
cache (`user_table_path`), whose entries come before the shipped ones. The XLA (CPU)
backend reads no table: the ops keep their own CPU choices there.

A table maps each op to a list of entries. An entry has an optional `when` (op
features that must match: a value, or an inclusive [low, high] range with null for
an open end), one or more *sections* (one per kernel or pass of the op, e.g. "fwd",
"dq", "dkv"), each a dict of parameters, a `source` saying where the numbers came
from and an optional `note` (why a choice that looks wrong is right, e.g. one
program per SM). For each section the first matching entry that has it wins, whole: specific
entries come first, the op's last entry (no `when`) covers every case and names
every section and parameter the op reads. A parameter value of null leaves the
choice to the backend (e.g. its own `num_warps` heuristic). See docs/ops/gpu_defaults.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pallet import _internals as internals
from pallet.errors import PalletError

FORMAT = 1
DEVICES = ("sm_80", "sm_90", "gfx942")
# The table used where a kernel is generated for no GPU in particular (Triton's
# interpreter on a machine without one, no device named): the compile statistics'
# reference target.
NO_GPU_DEVICE = "sm_90"
DEVICE_ENV = "PALLET_OPS_DEVICE"
SHIPPED_DIR = Path(__file__).resolve().parent / "launch_tables"
USER_SUBDIR = "launch_tables"

log = logging.getLogger("pallet.ops")

_device = internals.trace_context_state(
    DEVICE_ENV.lower(), "the GPU whose launch table pallet.ops reads (see "
                        "pallet.ops.launch_table.using_device)")
_override = internals.trace_context_state(
    "pallet_ops_launch_override", "launch sections pallet.ops uses before any table "
                                  "(see pallet.ops.launch_table.overriding)")


# ------------------------------------------------------------------ devices
def device_key(name: Any) -> str:
  """The table key of a GPU: "sm_<cc>" for NVIDIA (from 90, "9.0", "sm_90a", "cuda:90")
  or the gfx name for AMD (from "gfx942", "gfx942:sramecc+:xnack-")."""
  text = str(name).strip().lower()
  if text.startswith("cuda:"):
    text = text[5:]
  gfx = re.fullmatch(r"(gfx[0-9a-f]+)(:.*)?", text)
  if gfx:
    return gfx.group(1)
  digits = re.fullmatch(r"(?:sm_?)?(\d+)\.?(\d?)[a-z]?", text)
  if digits:
    major, minor = digits.groups()
    cc = int(major + minor) if minor else int(major)
    if cc < 10:   # "9" as in "9.0" without its minor part
      cc *= 10
    return f"sm_{cc}"
  raise PalletError(f"pallet.ops launch table: cannot tell the GPU from {name!r}; name "
                    f"it as sm_<compute capability> (e.g. sm_90) or gfx<arch> (e.g. gfx942)")


def family(device: str) -> str:
  """The shipped table a GPU uses: gfx* -> gfx942; sm_90 up to sm_11x (Hopper, datacenter
  Blackwell) -> sm_90; the rest (sm_8x, sm_12x consumer parts with ~100 KB of shared
  memory, older) -> sm_80."""
  key = device_key(device)
  if key.startswith("gfx"):
    return "gfx942"
  cc = int(key[3:])
  return "sm_90" if 90 <= cc < 120 else "sm_80"


def current_device() -> str:
  """The GPU whose table the ops read: the innermost `using_device` (or
  $PALLET_OPS_DEVICE), else the target Triton kernels are compiled for
  ($PALLET_TRITON_COMPUTE_CAPABILITY, $PALLET_TRITON_GPU_ARCH), else device 0 where
  it is a GPU, else NO_GPU_DEVICE."""
  chosen = _device.value
  if chosen:
    return device_key(chosen)
  for env in ("PALLET_TRITON_COMPUTE_CAPABILITY", "PALLET_TRITON_GPU_ARCH"):
    if os.environ.get(env):
      return device_key(os.environ[env])
  from pallet.triton import gpu_target
  if gpu_target.is_gpu_device():
    info = gpu_target.get_gpu_info()
    return device_key(info.arch_name if info.arch_name.startswith("gfx")
                      else info.compute_capability)
  return NO_GPU_DEVICE


# Streaming multiprocessors (NVIDIA) / compute units (AMD) of each table's reference
# part (H100 SXM, A100, MI300X): what ops that size their grid to the GPU (split-K
# decoding) assume where the kernel is traced for a GPU that is not present.
REFERENCE_MULTIPROCESSORS = {"sm_90": 132, "sm_80": 108, "gfx942": 304}


def multiprocessors() -> int:
  """SMs (CUs) of the GPU the ops are traced for: device 0's own count where that GPU
  is the one present (no other device named), else the reference part's of its
  table's family."""
  named = _device.value or any(os.environ.get(env) for env in (
      "PALLET_TRITON_COMPUTE_CAPABILITY", "PALLET_TRITON_GPU_ARCH"))
  from pallet.triton import gpu_target
  count = None if named else gpu_target.multiprocessor_count()
  return count or REFERENCE_MULTIPROCESSORS[family(current_device())]


@contextlib.contextmanager
def using_device(name: str) -> Iterator[None]:
  """Ops traced inside read the launch table of GPU `name` (e.g. "sm_80", "gfx942"),
  whatever device is present: for compiling ahead of time for another GPU."""
  with _device(device_key(name)):
    yield


@contextlib.contextmanager
def overriding(op: str, sections: Mapping[str, Mapping[str, Any]]) -> Iterator[None]:
  """Op `op` traced inside uses these sections before any table's (what `pallet tune`
  times). Sections not given still come from the tables."""
  current = dict(json.loads(_override.value)) if _override.value else {}
  current[op] = {**current.get(op, {}), **{s: dict(p) for s, p in sections.items()}}
  with _override(json.dumps(current, sort_keys=True)):
    yield


# ------------------------------------------------------------------ tables
@dataclasses.dataclass(frozen=True)
class Entry:
  """One row of a table: where it applies, the sections it sets, where it came from."""
  when: Mapping[str, Any]
  sections: Mapping[str, Mapping[str, Any]]
  source: str
  note: str = ""

  def applies(self, features: Mapping[str, Any]) -> bool:
    return all(_matches(features.get(name), want) for name, want in self.when.items())

  def as_json(self) -> dict[str, Any]:
    out: dict[str, Any] = {"when": dict(self.when)} if self.when else {}
    out.update({s: dict(p) for s, p in self.sections.items()})
    out["source"] = self.source
    if self.note:
      out["note"] = self.note
    return out


def _matches(value: Any, want: Any) -> bool:
  if isinstance(want, list):
    low, high = want
    return (value is not None and not isinstance(value, bool)
            and (low is None or value >= low) and (high is None or value <= high))
  return value == want


_NOT_SECTIONS = ("when", "source", "note")


def parse(data: Any, where: str) -> dict[str, list[Entry]]:
  """A table's JSON (already decoded) as {op: [entries]}; a PalletError naming `where`
  and the bad part otherwise."""
  def bad(why: str) -> PalletError:
    return PalletError(f"pallet.ops launch table {where}: {why}")

  if not isinstance(data, dict) or data.get("format") != FORMAT:
    raise bad(f"expected a JSON object with \"format\": {FORMAT}")
  ops = data.get("ops")
  if not isinstance(ops, dict):
    raise bad("expected \"ops\": {op name: [entries]}")
  table = {}
  for op, rows in ops.items():
    if not isinstance(rows, list):
      raise bad(f"{op}: expected a list of entries")
    entries = []
    for i, row in enumerate(rows):
      if not isinstance(row, dict) or not isinstance(row.get("source"), str):
        raise bad(f"{op} entry {i}: expected an object with a \"source\" string")
      when = row.get("when", {})
      if not isinstance(when, dict) or any(
          isinstance(v, list) and len(v) != 2 for v in when.values()):
        raise bad(f"{op} entry {i}: \"when\" must map features to values or "
                  f"[low, high] ranges")
      if not isinstance(row.get("note", ""), str):
        raise bad(f"{op} entry {i}: \"note\" must be a string")
      sections = {k: v for k, v in row.items() if k not in _NOT_SECTIONS}
      if not sections or not all(isinstance(p, dict) for p in sections.values()):
        raise bad(f"{op} entry {i}: expected one or more sections, each an object of "
                  f"parameters")
      entries.append(Entry(when, sections, row["source"], row.get("note", "")))
    table[op] = entries
  return table


@functools.lru_cache(maxsize=None)
def shipped(device: str) -> dict[str, list[Entry]]:
  """The table pallet ships for one of DEVICES."""
  if device not in DEVICES:
    raise PalletError(f"pallet.ops launch table: pallet ships tables for {list(DEVICES)}, "
                      f"not {device!r}")
  path = SHIPPED_DIR / f"{device}.json"
  return parse(json.loads(path.read_text()), str(path))


def user_table_path(device: str) -> Path:
  """Where `pallet tune` keeps the entries it measured on GPU `device`."""
  from pallet.autotune import cache_dir
  return cache_dir() / USER_SUBDIR / f"{device_key(device)}.json"


def user(device: str) -> dict[str, list[Entry]]:
  """The user's table for `device` (empty where there is none); an unreadable or
  malformed one is ignored with a warning."""
  path = user_table_path(device)
  try:
    stamp = path.stat().st_mtime_ns
  except OSError:
    return {}
  return _read_user(str(path), stamp)


@functools.lru_cache(maxsize=32)
def _read_user(path: str, stamp: int) -> dict[str, list[Entry]]:
  try:
    table = parse(json.loads(Path(path).read_text()), path)
  except (OSError, ValueError, PalletError) as e:
    log.warning("pallet.ops: ignoring the launch table %s (%s)", path, e)
    return {}
  return {op: [e for e in entries if _known(op, e, path)] for op, entries in table.items()}


def _known(op: str, entry: Entry, path: str) -> bool:
  """Whether a user entry only names sections and parameters the op reads (those of
  its shipped final entry); one that does not is ignored, with a warning."""
  try:
    names = parameter_names(op)
  except PalletError:
    log.warning("pallet.ops: %s names op %r, which has no launch table; ignored", path, op)
    return False
  for section, params in entry.sections.items():
    unknown = set(params) - names.get(section, set())
    if section not in names or unknown:
      log.warning("pallet.ops: %s: %s entry %s sets %s, which %s does not read; ignored",
                  path, op, entry.as_json(), sorted(unknown) or section, op)
      return False
  return True


def parameter_names(op: str) -> dict[str, set[str]]:
  """{section: parameter names} an op reads: those of its final entry in the sm_90 table."""
  entries = shipped(NO_GPU_DEVICE).get(op)
  if not entries:
    raise PalletError(f"pallet.ops launch table: no op {op!r}")
  return {s: set(p) for s, p in entries[-1].sections.items()}


# ------------------------------------------------------------------ lookups
@dataclasses.dataclass(frozen=True)
class Launch:
  """The launch parameters of one op call, per section; empty on the XLA backend,
  where the ops keep their own CPU choices."""
  op: str
  device: str | None
  features: Mapping[str, Any]
  sections: Mapping[str, Mapping[str, Any]]
  sources: Mapping[str, str]
  notes: Mapping[str, str] = dataclasses.field(default_factory=dict)

  @property
  def on_gpu(self) -> bool:
    return self.device is not None

  def get(self, section: str, name: str, default: Any = None) -> Any:
    """A parameter; `default` where the table gives none (or null), or off a GPU."""
    value = self.sections.get(section, {}).get(name)
    return default if value is None else value

  def compiler_params(self, section: str, *, explicit: bool = False,
                      dimension_semantics: tuple[str, ...] | None = None) -> Any:
    """The compiler params of a section's pallas_call on a GPU (None elsewhere): its
    num_warps and num_stages (left to the backend where `explicit`: the caller chose
    the blocks, so the table's warps for other blocks do not apply), whose num_stages
    shrinks to fit the GPU's shared memory, as the backend's own default does."""
    if not self.on_gpu:
      return None
    from pallet.triton.gpu_target import TableCompilerParams
    warps = None if explicit else self.get(section, "num_warps")
    stages = None if explicit else self.get(section, "num_stages")
    return TableCompilerParams(num_warps=warps, num_stages=stages,
                               dimension_semantics=dimension_semantics)


_recorders: list[list[Launch]] = []


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
  """Collects every Launch looked up inside the block (what `pallet tune` stores)."""
  found: list[Launch] = []
  _recorders.append(found)
  try:
    yield found
  finally:
    _recorders.remove(found)


def lookup(op: str, **features: Any) -> Launch:
  """The launch parameters of `op` for a call with these features on the backend the
  call resolves to: empty on the XLA backend; on Triton, per section, the first
  matching entry of the override (`overriding`), the user's table for the current
  device, then the shipped table of its family."""
  from pallet.ops._common import target_backend
  if target_backend() == "xla":
    launch = Launch(op, None, features, {}, {}, {})
  else:
    device = current_device()
    layers = [("override", _override_entries(op)),
              (f"user table {user_table_path(device)}", user(device).get(op, [])),
              (f"shipped {family(device)}", shipped(family(device)).get(op, []))]
    sections: dict[str, Mapping[str, Any]] = {}
    sources: dict[str, str] = {}
    notes: dict[str, str] = {}
    for where, entries in layers:
      for entry in entries:
        if not entry.applies(features):
          continue
        for name, params in entry.sections.items():
          if name not in sections:
            sections[name], sources[name] = dict(params), f"{where}: {entry.source}"
            notes[name] = entry.note
    if not sections:
      raise PalletError(f"pallet.ops launch table: no entry for op {op!r} on {device}")
    launch = Launch(op, device, features, sections, sources, notes)
  for found in _recorders:
    found.append(launch)
  return launch


def _override_entries(op: str) -> list[Entry]:
  if not _override.value:
    return []
  sections = json.loads(_override.value).get(op)
  return [Entry({}, sections, "pallet.ops.launch_table.overriding")] if sections else []


# ------------------------------------------------------------------ the user's tables
def store(op: str, device: str, features: Mapping[str, Any],
          sections: Mapping[str, Mapping[str, Any]], source: str) -> Path:
  """Adds an entry for `op` on `device` applying to exactly these features (replacing
  one with the same `when`) to the user's table; returns its path. Entries written
  later come first."""
  from pallet.autotune import _locked
  path = user_table_path(device)
  entry = Entry(dict(features), {s: dict(p) for s, p in sections.items()}, source)
  path.parent.mkdir(parents=True, exist_ok=True)
  with _locked(path.with_suffix(".lock")):
    try:
      data = json.loads(path.read_text())
      parse(data, str(path))
    except (OSError, ValueError, PalletError):
      data = {"format": FORMAT, "device": device_key(device), "ops": {}}
    rows = [r for r in data["ops"].get(op, []) if r.get("when", {}) != entry.when]
    data["ops"][op] = [entry.as_json()] + rows
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(dumps(data))
    os.replace(tmp, path)
  return path


def dumps(data: Mapping[str, Any]) -> str:
  """A table as JSON with one line per `when` and section (what the shipped files look
  like, so that an entry reads at a glance)."""
  ops = []
  for op, rows in data["ops"].items():
    entries = []
    for row in rows:
      lines = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in row.items()]
      entries.append("   {" + ",\n    ".join(lines) + "}")
    ops.append(f"  {json.dumps(op)}: [\n" + ",\n".join(entries) + "\n  ]")
  head = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items() if k != "ops"]
  return "{\n" + ",\n".join(head + [' "ops": {\n' + ",\n".join(ops) + "\n }"]) + "\n}\n"


def tuned_source(device_kind: str) -> str:
  """The `source` of an entry `pallet tune` measured now on a GPU of this kind."""
  return f"pallet tune on {device_kind}, {time.strftime('%Y-%m-%d', time.gmtime())}"
