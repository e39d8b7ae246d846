"""`pallet tune`: autotune the library's kernels on this machine, once, into the cache.

The cases come from `pallet.ops.tuning_cases(size)` where pallet.ops provides it,
from the demo gallery (`pallet.cli.demo.tuning_cases`) and from the benchmark suite's
kernels whose block sizes are builder keywords (bench/<name>: the suite's blocks are
the default, the others are them scaled by 1/4 to 4). Each case calls autotuned code on
example inputs; every choice made meanwhile is reported: the table of configs tried,
and the default (first fitting) config's time beside the chosen one's, timed again
in rounds of their own with `--confirm N`. On a GPU, a pallet.ops launch
configuration chosen over the default (`launch` configs, see pallet.ops.tuned) is also
written into the user's launch table for that GPU (pallet.ops.launch_table), which the
plain ops read.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import pallet as pl
from pallet import backends
from pallet.cli import demo

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
  return found + demo.tuning_cases(size) + bench_cases(size)


# ------------------------------------------------------------------ the benchmark suite
FACTORS = (0.25, 0.5, 2, 4)


def bench_cases(size: str) -> list:
  """The benchmark suite's kernels whose block sizes are keyword arguments of their
  builder (`benchmarks` ships with pallet), as cases named bench/<name>; empty when
  the suite cannot be imported."""
  try:
    from pallet.bench import catalog
  except ImportError:
    return []
  found = []
  for bench in catalog.all_benchmarks(size):
    build = bench.build_pallas
    keywords = getattr(build, "keywords", None) or {}
    blocks = {k: v for k, v in keywords.items()
              if k.startswith("block") and type(v) is int}
    if isinstance(build, functools.partial) and blocks:
      run = functools.partial(_run_bench, bench, _tuned_bench(bench, blocks))
      found.append(autotuning.Case(f"bench/{bench.name}", run))
  return found


def block_configs(blocks: dict[str, int]) -> list[dict[str, int]]:
  """The benchmark's own blocks first, then each block (and all of them together)
  scaled by FACTORS, kept to whole numbers."""
  configs = [dict(blocks)]
  scaled = [[k] for k in blocks] + ([list(blocks)] if len(blocks) > 1 else [])
  for names in scaled:
    for f in FACTORS:
      config = {k: int(v * f) if k in names else v for k, v in blocks.items()}
      if all(v >= 1 and v * f == int(v * f) for k, v in blocks.items() if k in names):
        configs.append(config)
  return list({autotuning.canonical(c): c for c in configs}.values())


def _tuned_bench(bench: Any, blocks: dict[str, int]) -> Any:
  build = bench.build_pallas

  def program(*args: Any, **chosen: int) -> Any:
    return build(pl, **chosen)(*args)

  program.__module__, program.__qualname__ = "benchmarks", f"bench.{bench.name}"
  return pl.autotune(program, configs=block_configs(blocks))


def _run_bench(bench: Any, tuned: Any) -> Any:
  """Runs the chosen config and checks it against the benchmark's jax.numpy reference."""
  args = bench.make_inputs(jax.random.key(0))
  with warnings.catch_warnings():
    # A scaled block that does not divide the problem computes something else; the
    # table shows it as "mismatch", no need to warn here.
    warnings.filterwarnings("ignore", message="autotune of .* computes a different result")
    out = tuned(*args)
  want = bench.reference(*args)
  for got, ref in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
    if not np.allclose(np.asarray(got, np.float64), np.asarray(ref, np.float64),
                       rtol=bench.rtol, atol=bench.atol, equal_nan=True):
      raise AssertionError(f"{bench.name}: the chosen config "
                           f"{autotuning.config_text(tuned.last_choice.config)} differs "
                           f"from jax.numpy")
  return out


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
        clear: bool = False, confirm: int = 0) -> int:
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
      with autotuning.recording(force=force, reps=reps) as session, \
          _launch_tables().recording() as launches:
        try:
          jax.block_until_ready(case.run())
        except Exception as e:  # noqa: BLE001 - report, go on with the next case
          print(f"    failed: {type(e).__name__}: {e}")
          failures += 1
          continue
      if backends.generated_code_on_gpu():
        for path, op in store_launch_choices(session.choices, launches, env["device"]):
          print(f"    {op}: launch-table entry written to {path}")
      for record in _distinct(session.choices):
        choice = record.choice
        if choice.source == "tuned":
          print("    " + choice.table().replace("\n", "\n    "))
        else:
          print(f"    {record.name}: {choice.source} "
                f"{autotuning.config_text(choice.config)}"
                + (f" ({choice.note})" if choice.note else ""))
        row = Row.of(case.name, record)
        if confirm:
          row = row.confirmed(record, confirm)
        rows.append(row)
  print()
  print(summary(rows))
  return 1 if failures else 0


def _launch_tables() -> Any:
  """pallet.ops.launch_table, or a stand-in that records nothing where pallet.ops is
  not importable."""
  try:
    return importlib.import_module("pallet.ops.launch_table")
  except ModuleNotFoundError:
    return _NoLaunchTables()


class _NoLaunchTables:
  @staticmethod
  @contextlib.contextmanager
  def recording():
    yield []


def store_launch_choices(records: Sequence, launches: Sequence, device_kind: str) -> list:
  """For each tuned choice of a `launch` config (pallet.ops.tuned), a user launch-table
  entry for the op on the GPU its lookups named, applying to the features of the
  tuned call; returns [(path, op)]. Choices of the default, of block keywords or from
  the cache write nothing."""
  tables = _launch_tables()
  written = []
  for record in _distinct(list(records)):
    choice = record.choice
    launch = choice.config.get("launch") if choice.source == "tuned" else None
    op = getattr(getattr(record.fn, "fn", None), "launch_op", None)
    if not launch or op is None:
      continue
    seen = [l for l in launches if l.op == op and l.device is not None]
    if not seen:
      continue
    path = tables.store(op, seen[-1].device, seen[-1].features, launch,
                        tables.tuned_source(device_kind))
    written.append((path, op))
  return written


def _distinct(records: list) -> list:
  seen, out = set(), []
  for record in records:
    ident = (record.name, autotuning.canonical(record.choice.key))
    if ident not in seen:
      seen.add(ident)
      out.append(record)
  return out


@dataclasses.dataclass
class Row:
  """One tuned function of a case: the default (first fitting) config beside the
  chosen one, with their times from the tuning rounds or, confirmed, from rounds
  of their own."""
  case: str
  function: str
  default: dict | None
  default_ms: float | None
  chosen: dict
  chosen_ms: float | None
  how: str

  @classmethod
  def of(cls, case: str, record: Any) -> Row:
    choice = record.choice
    timed = {autotuning.canonical(t.config): t.time_ms for t in choice.trials
             if t.status == "ok"}
    default = next((t.config for t in choice.trials if t.status != "pruned"), None)
    return cls(case, record.name.split(".")[-1], default,
               timed.get(autotuning.canonical(default)), choice.config,
               timed.get(autotuning.canonical(choice.config)), choice.source)

  def confirmed(self, record: Any, rounds: int) -> Row:
    """Times the default and the chosen config again, interleaved, `rounds` times."""
    default = record.fn.fitting(*record.args, **record.kwargs)[0]
    if default == self.chosen:
      return dataclasses.replace(self, default=default, how="default is best")
    trials = record.fn.compare(*record.args, configs=[default, self.chosen], rounds=rounds,
                               **record.kwargs)
    d_ms, c_ms = (t.time_ms for t in trials)
    print(f"    confirmed over {rounds} rounds: default {autotuning.config_text(default)} "
          f"{_ms(d_ms)} ms, chosen {autotuning.config_text(self.chosen)} {_ms(c_ms)} ms")
    return dataclasses.replace(self, default=default, default_ms=d_ms, chosen_ms=c_ms,
                               how=f"confirmed x{rounds}")


def summary(rows: list[Row]) -> str:
  """One line per tuned function: default config and time, chosen config and time."""
  table = [("case", "function", "default", "ms", "chosen", "ms", "speed-up", "timed")]
  for r in rows:
    speedup = f"{r.default_ms / r.chosen_ms:.2f}x" if r.default_ms and r.chosen_ms else "-"
    table.append((r.case, r.function,
                  autotuning.config_text(r.default) if r.default is not None else "-",
                  _ms(r.default_ms), autotuning.config_text(r.chosen), _ms(r.chosen_ms),
                  speedup, r.how))
  widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
  numeric = {3, 5, 6}
  return "\n".join("  ".join(cell.rjust(w) if i in numeric else cell.ljust(w)
                             for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
                   for row in table)


def _ms(value: float | None) -> str:
  return "-" if value is None else f"{value:.3f}"
