"""`pallet tune`: autotune the library's kernels on this machine, once, into the cache.

The cases come from `pallet.ops.tuning_cases(size)` where pallet.ops provides it, and
from the demo gallery (`pallet.demo.tuning_cases`). Each case calls autotuned code on
example inputs; every choice made meanwhile is reported: the table of configs tried,
and the default (first fitting) config's time beside the chosen one's.
"""
from __future__ import annotations

import contextlib
import importlib
from collections.abc import Sequence

import jax

import pallet as pl
from pallet import backends, demo

autotuning = importlib.import_module("pallet.autotune")


def cases(size: str) -> list:
  """Every case `pallet tune` knows for problem size `size`."""
  found = []
  try:
    ops = importlib.import_module("pallet.ops")
  except ModuleNotFoundError as e:
    if e.name not in ("pallet.ops",):
      raise
    ops = None
  make = getattr(ops, "tuning_cases", None)
  if make is not None:
    found += [c if "/" in c.name else autotuning.Case(f"ops/{c.name}", c.run)
              for c in make(size)]
  return found + demo.tuning_cases(size)


def select(every: Sequence, names: Sequence[str]) -> list:
  """The cases named in `names` (a name, or a prefix before '/'); all if none."""
  if not names:
    return list(every)
  unknown = [n for n in names if not any(_matches(c.name, n) for c in every)]
  if unknown:
    raise ValueError(f"--only: no case {', '.join(map(repr, unknown))}; choose from "
                     f"{[c.name for c in every]} or a prefix such as 'demo'")
  return [c for c in every if any(_matches(c.name, n) for n in names)]


def _matches(name: str, wanted: str) -> bool:
  return name == wanted or name.startswith(wanted.rstrip("/") + "/")


def run(*, only: Sequence[str] = (), list_only: bool = False, size: str = "full",
        reps: int | None = None, force: bool = False, backend: str | None = None,
        clear: bool = False) -> int:
  """Tunes the selected cases; 0 when every case ran, 1 otherwise."""
  context = backends.default_backend(backend) if backend else contextlib.nullcontext()
  with context:
    every = cases(size)
    if list_only:
      for c in every:
        print(c.name)
      return 0
    try:
      selected = select(every, only)
    except ValueError as e:
      print(f"pallet tune: {e}")
      return 2
    if clear:
      print(f"removed {autotuning.clear_cache()}")
    env = autotuning.environment()
    print(f"pallet {pl.__version__}, jax {jax.__version__}: tuning {len(selected)} case(s) "
          f"on {env['backend']} ({env['device']}); cache {autotuning.cache_path()}")
    note = demo.busy_note()
    if note:
      print(note, flush=True)
    rows, failures = [], 0
    for i, case in enumerate(selected):
      print(f"[{i + 1}/{len(selected)}] {case.name}", flush=True)
      with autotuning.recording(force=force, reps=reps) as session:
        try:
          jax.block_until_ready(case.run())
        except Exception as e:  # noqa: BLE001 - report, go on with the next case
          print(f"    failed: {type(e).__name__}: {e}")
          failures += 1
          continue
      for name, choice in _distinct(session.choices):
        rows.append((case.name, name, choice))
        if choice.source == "tuned":
          print("    " + choice.table().replace("\n", "\n    "))
        else:
          print(f"    {name}: {choice.source} {autotuning.config_text(choice.config)}"
                + (f" ({choice.note})" if choice.note else ""))
  print()
  print(summary(rows))
  return 1 if failures else 0


def _distinct(choices: list) -> list:
  seen, out = set(), []
  for name, choice in choices:
    ident = (name, autotuning.canonical(choice.key))
    if ident not in seen:
      seen.add(ident)
      out.append((name, choice))
  return out


def summary(rows: list) -> str:
  """One line per tuned function: default config and time, chosen config and time."""
  lines = [f"{'case':<22}{'function':<24}{'default':<22}{'ms':>9}  {'chosen':<22}"
           f"{'ms':>9}{'speed-up':>10}"]
  for case, name, choice in rows:
    timed = {autotuning.canonical(t.config): t for t in choice.trials if t.status == "ok"}
    default = next((t for t in choice.trials if t.status != "pruned"), None)
    best = timed.get(autotuning.canonical(choice.config))
    d_ms = default.time_ms if default is not None and default.status == "ok" else None
    b_ms = best.time_ms if best is not None else None
    speedup = f"{d_ms / b_ms:.2f}x" if d_ms and b_ms else choice.source
    lines.append(f"{case:<22}{name.split('.')[-1]:<24}"
                 f"{autotuning.config_text(default.config) if default else '-':<22}"
                 f"{_ms(d_ms):>9}  {autotuning.config_text(choice.config):<22}"
                 f"{_ms(b_ms):>9}{speedup:>10}")
  return "\n".join(lines)


def _ms(value: float | None) -> str:
  return "-" if value is None else f"{value:.3f}"
