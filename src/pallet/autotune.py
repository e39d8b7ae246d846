"""pallet.autotune: pick a kernel's fastest configuration by timing it, and remember it.

A kernel wrapper takes its tunable parameters (block shapes, num_warps, num_stages,
grid order, ...) as keyword arguments. `autotune` calls it with each candidate
configuration on inputs of the call's shapes and dtypes, times them on the current
backend (warm-up, then interleaved rounds, median), and keeps the fastest in memory
and in a JSON file keyed by everything that could change the answer: the function,
its configs, the key arguments' shapes and dtypes, the other scalar arguments, the
backend, the device and the pallet/JAX versions. See docs/autotune.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pallet import _internals as internals
from pallet import backends
from pallet.errors import PalletError

CACHE_DIR_ENV = "PALLET_CACHE_DIR"
VERBOSE_ENV = "PALLET_AUTOTUNE_VERBOSE"
ENABLE_ENV = "PALLET_AUTOTUNE"
CACHE_FILE = "autotune.json"
# A config replaces the default (the first that fits) only when it is this much faster.
DEFAULT_MARGIN = 0.03
_FORMAT = 1

log = logging.getLogger("pallet.autotune")

Config = dict[str, Any]
Shapes = dict[str, Any]   # argument name -> jax.ShapeDtypeStruct (or a pytree of them)


# ------------------------------------------------------------------ results
@dataclasses.dataclass
class Trial:
  """How one config fared: "ok" (timed), "pruned", "failed" (did not trace, compile
  or run) or "mismatch" (its output differs from the first config's)."""
  config: Config
  status: str
  time_ms: float | None = None
  note: str = ""


@dataclasses.dataclass
class Choice:
  """The config a call runs with, and where it came from: "tuned" (measured now),
  "cache" (measured before), "default" (not tuned: the first config that fits, see
  `note`) or "explicit" (the caller passed config values itself)."""
  config: Config
  source: str
  key: dict[str, Any]
  trials: list[Trial] = dataclasses.field(default_factory=list)
  note: str = ""

  def table(self) -> str:
    """The trials as a table: config, median time, status (the chosen one marked)."""
    rows = [(config_text(t.config), "-" if t.time_ms is None else f"{t.time_ms:.3f}",
             "chosen" if t.config == self.config and t.status == "ok"
             else t.status + (f": {t.note}" if t.note else "")) for t in self.trials]
    head = ("config", "median ms", "")
    width = [max(len(r[i]) for r in (head, *rows)) for i in range(2)]
    lines = [f"{head[0]:<{width[0]}}  {head[1]:>{width[1]}}"]
    lines += [f"{c:<{width[0]}}  {t:>{width[1]}}  {s}" for c, t, s in rows]
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Case:
  """One thing `pallet tune` tunes: `run()` calls autotuned code on example inputs."""
  name: str
  run: Callable[[], Any]


@dataclasses.dataclass
class Recorded:
  """One choice made inside `recording()`: by which function, for which arguments."""
  name: str
  choice: Choice
  fn: Autotuned
  args: tuple
  kwargs: dict


@dataclasses.dataclass
class Session:
  """The choices made inside `recording()`."""
  force: bool
  reps: int | None = None   # overrides every function's own `reps`
  choices: list[Recorded] = dataclasses.field(default_factory=list)
  tuned: set[str] = dataclasses.field(default_factory=set)


_session: Session | None = None


@contextlib.contextmanager
def recording(force: bool = False, reps: int | None = None) -> Iterator[Session]:
  """Collects every choice autotuned functions make inside the block; with `force`,
  each (function, key) is measured again once, ignoring both caches; `reps`
  overrides the timed rounds of every function tuned inside."""
  global _session
  outer, _session = _session, Session(force, reps)
  try:
    yield _session
  finally:
    _session = outer


# ------------------------------------------------------------------ the decorator
def autotune(fn: Callable[..., Any] | None = None, *, configs: Sequence[Mapping[str, Any]],
             key: Sequence[str] | None = None, warmup: int = 1, reps: int = 5,
             blocks: Callable[[Config], Mapping[str, Sequence[int | None]]] | None = None,
             prune: Callable[[Config, Shapes], bool | str] | None = None,
             check: bool = True, verbose: bool | None = None) -> Any:
  """Runs `fn` with the fastest of `configs`, measured once per problem and remembered.

  Use as `@pl.autotune(configs=[...], key=("x",))` or `pl.autotune(fn, configs=...)`.

  configs: dicts of keyword arguments of `fn` (block sizes, num_warps, ...); the first
    is the default, used where tuning is not possible (grad/vmap tracing).
  key: names of the array arguments whose shapes and dtypes key the cache (default:
    every array argument). Scalar arguments (bools, ints, strings) always count.
  warmup, reps: untimed calls per config (at least one, whose output is checked), then
    `reps` timed rounds, each calling every config once; a config's time is its median.
  blocks: `config -> {argument name: block shape}`; a config whose block exceeds the
    argument's shape, or on the Triton backend is not a power of two, is pruned.
  prune: `(config, shapes) -> bool | str`, true (or a reason) to drop a config for
    these shapes (`shapes` maps argument names to `jax.ShapeDtypeStruct`s).
  check: drop (with a warning) a config whose output differs from the first one's.
  verbose: print the table of trials after tuning (default: $PALLET_AUTOTUNE_VERBOSE).
  """
  if fn is None:
    return functools.partial(autotune, configs=configs, key=key, warmup=warmup, reps=reps,
                             blocks=blocks, prune=prune, check=check, verbose=verbose)
  return Autotuned(fn, configs=configs, key=key, warmup=warmup, reps=reps, blocks=blocks,
                   prune=prune, check=check, verbose=verbose)


class Autotuned:
  """A function wrapped by `autotune`; call it like the function itself."""

  def __init__(self, fn: Callable[..., Any], *, configs: Sequence[Mapping[str, Any]],
               key: Sequence[str] | None, warmup: int, reps: int,
               blocks: Callable[[Config], Mapping[str, Sequence[int | None]]] | None,
               prune: Callable[[Config, Shapes], bool | str] | None, check: bool,
               verbose: bool | None):
    functools.update_wrapper(self, fn)
    self.fn = fn
    self.name = getattr(fn, "__qualname__", None) or repr(fn)
    self.configs = [dict(c) for c in _validated_configs(self.name, configs)]
    self._configs_hash = hashlib.sha1(canonical(self.configs).encode()).hexdigest()[:12]
    self.signature = _signature(fn)
    self.key = None if key is None else (key,) if isinstance(key, str) else tuple(key)
    if reps < 1:
      raise PalletError(f"autotune of '{self.name}': reps must be >= 1, got {reps}")
    self.warmup, self.reps = max(1, int(warmup)), int(reps)
    self.blocks, self.prune, self.check, self.verbose = blocks, prune, check, verbose
    self._check_names()
    self._memory: dict[str, Config] = {}
    self.last_choice: Choice | None = None

  def __repr__(self) -> str:
    return f"<autotuned {self.name}: {len(self.configs)} configs>"

  def __get__(self, instance: Any, owner: Any = None) -> Any:
    return self if instance is None else functools.partial(self, instance)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    choice = self.choose(*args, **kwargs)
    return self.fn(*args, **{**kwargs, **choice.config})

  # ---------------------------------------------------------------- choosing
  def choose(self, *args: Any, **kwargs: Any) -> Choice:
    """The config a call with these arguments runs with (tuning now if need be)."""
    return self._choose(args, kwargs, force=False)

  def fitting(self, *args: Any, **kwargs: Any) -> list[Config]:
    """The configs that fit these arguments, in order (the first is the default)."""
    bound = self._bind(args, kwargs)
    shapes = {n: _shape_tree(v) for n, v in bound.items() if _has_arrays(v)}
    return self._fitting(shapes, environment()["backend"])[0]

  def tune(self, *args: Any, **kwargs: Any) -> Choice:
    """Measures every config for these arguments now, ignoring both caches."""
    return self._choose(args, kwargs, force=True)

  def _choose(self, args: tuple, kwargs: dict, force: bool) -> Choice:
    explicit = sorted(set(kwargs) & {k for c in self.configs for k in c})
    bound = self._bind(args, kwargs)
    key = self._cache_key(bound)
    if explicit:
      choice = Choice({}, "explicit", key, note=f"called with {explicit} given")
      self.last_choice = choice
      return choice
    key_text = canonical(key)
    session = _session
    force = force or (session is not None and session.force and key_text not in session.tuned)
    if not force and key_text in self._memory:
      return self._record(Choice(self._memory[key_text], "cache", key), key_text, args,
                          kwargs)
    shapes = {n: _shape_tree(v) for n, v in bound.items() if _has_arrays(v)}
    candidates, trials = self._fitting(shapes, key["backend"])
    if not candidates:
      raise PalletError(
          f"autotune of '{self.name}': no config fits the arguments "
          f"{ {n: _shapes_text(s) for n, s in shapes.items()} }:\n"
          + "\n".join(f"  {config_text(t.config)}: {t.note}" for t in trials))
    choice = None if force else self._cached(key_text, key, candidates)
    if choice is None:
      blocker = self._why_not_tune(args, kwargs)
      if blocker:
        choice = Choice(candidates[0], "default", key, trials, note=blocker)
        log.debug("autotune of '%s': %s; using the first fitting config %s", self.name,
                  blocker, config_text(candidates[0]))
      else:
        choice = self._measure(args, kwargs, key, candidates, trials)
        self._memory[key_text] = choice.config
        _store(key_text, choice)
        if self._verbose():
          print(f"pallet.autotune: {self.name} {_shapes_summary(shapes)} on "
                f"{key['backend']}\n{choice.table()}", file=sys.stderr)
    return self._record(choice, key_text, args, kwargs)

  def _record(self, choice: Choice, key_text: str, args: tuple, kwargs: dict) -> Choice:
    self.last_choice = choice
    if _session is not None:
      _session.choices.append(Recorded(self.name, choice, self, args, kwargs))
      if choice.source == "tuned":
        _session.tuned.add(key_text)
    return choice

  def _cached(self, key_text: str, key: dict, candidates: list[Config]) -> Choice | None:
    """The choice stored in the cache file, if it is still one of `candidates`."""
    entry = _load().get(key_text)
    by_text = {canonical(c): c for c in candidates}
    config = entry and by_text.get(canonical(entry.get("config")))
    if config is None:
      return None
    self._memory[key_text] = config
    if self._verbose():
      print(f"pallet.autotune: {self.name}: cached config {config_text(config)}",
            file=sys.stderr)
    return Choice(config, "cache", key, note=f"tuned {entry.get('when', '?')}")

  def _why_not_tune(self, args: tuple, kwargs: dict) -> str:
    if os.environ.get(ENABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
      return f"tuning is off (${ENABLE_ENV}={os.environ[ENABLE_ENV]})"
    for leaf in jax.tree.leaves((args, kwargs)):
      if not internals.is_tracer(leaf):
        continue
      if not internals.is_staging_tracer(leaf):
        return (f"not tuning under {type(leaf).__name__} tracing (grad/jvp/vmap); "
                f"tune with a plain or jitted call first")
      if _extended(leaf.dtype):
        return (f"cannot make a random input of dtype {leaf.dtype} to tune under jit; "
                f"call the function once outside jit to tune it")
    return ""

  def _verbose(self) -> bool:
    if self.verbose is not None:
      return self.verbose
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")

  # ---------------------------------------------------------------- pruning
  def _fitting(self, shapes: Shapes, backend: str) -> tuple[list[Config], list[Trial]]:
    fitting, trials = [], []
    for config in self.configs:
      why = self._misfit(config, shapes, backend)
      if why:
        trials.append(Trial(config, "pruned", note=why))
      else:
        fitting.append(config)
    return fitting, trials

  def _misfit(self, config: Config, shapes: Shapes, backend: str) -> str:
    if self.blocks is not None:
      for arg, block in self.blocks(dict(config)).items():
        if arg not in shapes:
          raise PalletError(f"autotune of '{self.name}': blocks() names argument "
                            f"{arg!r}, which is not an array argument (those are "
                            f"{sorted(shapes)})")
        shape = getattr(shapes[arg], "shape", ())
        for b, d in zip(block, shape):
          if not isinstance(b, int) or b is True or b is False:
            continue
          if b > d:
            return f"block {tuple(block)} of '{arg}' exceeds its shape {tuple(shape)}"
          if backend.startswith("triton") and b & (b - 1):
            return f"block {tuple(block)} of '{arg}' is not a power of two (Triton)"
    verdict = self.prune(dict(config), dict(shapes)) if self.prune is not None else False
    if verdict:
      return verdict if isinstance(verdict, str) else "prune() dropped it"
    return ""

  # ---------------------------------------------------------------- measuring
  def _measure(self, args: tuple, kwargs: dict, key: dict, candidates: list[Config],
               trials: list[Trial]) -> Choice:
    reps = (_session and _session.reps) or self.reps
    measured = self._trials(args, kwargs, candidates, reps)
    timed = [t for t in measured if t.status == "ok"]
    if not timed:
      raise PalletError(
          f"autotune of '{self.name}': every config failed:\n"
          + "\n".join(f"  {config_text(t.config)}: {t.status}: {t.note}" for t in measured))
    best = min(timed, key=lambda t: t.time_ms)
    default = measured[0]
    if default.status == "ok" and best.time_ms > default.time_ms * (1 - DEFAULT_MARGIN):
      best = default   # within noise of the default: keep the author's choice
    return Choice(best.config, "tuned", key, measured + trials)

  def compare(self, *args: Any, configs: Sequence[Mapping[str, Any]] | None = None,
              rounds: int = 21, **kwargs: Any) -> list[Trial]:
    """Times `configs` (default: all of them) on these arguments in `rounds`
    interleaved rounds, touching neither cache: e.g. the default against the choice."""
    chosen = [dict(c) for c in configs] if configs is not None else self.configs
    return self._trials(args, kwargs, chosen, rounds)

  def _trials(self, args: tuple, kwargs: dict, configs: list[Config],
              reps: int) -> list[Trial]:
    """Compiles each config, runs it `warmup` times (checking its output against the
    first one's), then times `reps` rounds, each calling every config once, each
    round starting with the next config."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]
    with internals.eval_context():
      inputs = _inputs([leaves[i] for i in dynamic])

      def run(config, *values):
        filled = list(leaves)
        for i, v in zip(dynamic, values):
          filled[i] = v
        a, kw = jax.tree.unflatten(treedef, filled)
        return self.fn(*a, **{**kw, **config})

      bar = _progress(len(configs) + reps, f"autotune {self.name}")
      ran: dict[int, Any] = {}
      samples: dict[int, list[float]] = {}
      outcome: dict[int, Trial] = {}
      expected, expected_from = None, None
      for i, config in enumerate(configs):
        try:
          exe = jax.jit(functools.partial(run, config)).lower(*inputs).compile()
          out = jax.block_until_ready(exe(*inputs))
          for _ in range(self.warmup - 1):
            jax.block_until_ready(exe(*inputs))
        except Exception as e:  # noqa: BLE001 - a config that cannot run is dropped
          note = _describe(e)
          outcome[i] = Trial(config, "failed", note=note)
          log.info("autotune of '%s': dropped config %s: %s", self.name,
                   config_text(config), note)
        else:
          diff = _difference(out, expected) if self.check and expected is not None else ""
          if diff:
            outcome[i] = Trial(config, "mismatch", note=diff)
            warnings.warn(f"autotune of '{self.name}': config {config_text(config)} "
                          f"computes a different result than {config_text(expected_from)} "
                          f"({diff}); one of them is wrong. Dropped it.",
                          stacklevel=_user_stacklevel())
          else:
            if expected is None:
              expected, expected_from = out, config
            ran[i], samples[i] = exe, []
        if bar is not None:
          bar.update(1)
      order = list(ran.items())
      for r in range(reps):
        # Each round starts one config later, so no config always runs first.
        shift = r % len(order) if order else 0
        for i, exe in order[shift:] + order[:shift]:
          start = time.perf_counter()
          jax.block_until_ready(exe(*inputs))
          samples[i].append(time.perf_counter() - start)
        if bar is not None:
          bar.update(1)
      if bar is not None:
        bar.close()
    for i, times in samples.items():
      outcome[i] = Trial(configs[i], "ok", 1e3 * statistics.median(times))
    return [outcome[i] for i in range(len(configs))]

  # ---------------------------------------------------------------- arguments and keys
  def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
    if self.signature is None:
      return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
    try:
      bound = self.signature.bind_partial(*args, **kwargs)
    except TypeError as e:
      raise TypeError(f"{self.name}: {e}") from None
    return dict(bound.arguments)

  def _cache_key(self, bound: dict[str, Any]) -> dict[str, Any]:
    shapes, static = {}, {}
    for name, value in bound.items():
      if _has_arrays(value):
        if self.key is None or name in self.key:
          shapes[name] = _shapes_text(value)
      elif _is_simple(value):
        static[name] = repr(value)
    return {"fn": f"{getattr(self.fn, '__module__', '?')}.{self.name}",
            "configs": self._configs_hash,
            "shapes": shapes, "static": static, **environment()}

  def _check_names(self) -> None:
    if self.signature is None:
      return
    params = self.signature.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for i, config in enumerate(self.configs):
      unknown = [k for k in config if k not in params and not takes_any]
      if unknown:
        raise PalletError(f"autotune of '{self.name}': config {i} {config_text(config)} "
                          f"sets {unknown}, which '{self.name}' does not take "
                          f"(its parameters: {list(params)})")
    unknown = [k for k in self.key or () if k not in params]
    if unknown:
      raise PalletError(f"autotune of '{self.name}': key names {unknown}, which are not "
                        f"parameters of '{self.name}' (its parameters: {list(params)})")


# ------------------------------------------------------------------ environment key
def environment() -> dict[str, Any]:
  """What besides the arguments decides which config is fastest: the backend calls
  resolve to now, the device, the settings that change the compiled kernels (x64,
  the default matmul precision, the checking mode) and the versions of pallet, JAX
  and (for Triton) Triton."""
  import pallet
  from pallet import checking
  name, interpret = backends.resolve(None, False)
  device = jax.devices()[0]
  checks = checking.options(False)
  env = {"backend": name + ("-interpret" if interpret and name == "triton" else ""),
         "device": f"{device.platform}:{device.device_kind}",
         "settings": {"x64": bool(jax.config.jax_enable_x64),
                      "matmul_precision": str(jax.config.jax_default_matmul_precision),
                      "checks": None if checks is None else repr(checks)},
         "versions": {"pallet": pallet.__version__, "jax": jax.__version__,
                      "jaxlib": _version("jaxlib")}}
  if device.platform == "cpu":
    env["host"] = f"{platform.machine()} {platform.processor()} x{os.cpu_count()}"
  if name == "triton":
    env["versions"]["triton"] = _version("triton")
  return env


@functools.lru_cache(maxsize=None)
def _version(dist: str) -> str | None:
  try:
    return metadata.version(dist)
  except metadata.PackageNotFoundError:
    return None


# ------------------------------------------------------------------ the JSON cache
def cache_dir() -> Path:
  """$PALLET_CACHE_DIR, else the user cache directory of the platform + /pallet."""
  override = os.environ.get(CACHE_DIR_ENV)
  if override:
    return Path(override).expanduser()
  if sys.platform == "win32":
    base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
  elif sys.platform == "darwin":
    base = Path.home() / "Library" / "Caches"
  else:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
  return base / "pallet"


def cache_path() -> Path:
  return cache_dir() / CACHE_FILE


def _load() -> dict[str, Any]:
  path = cache_path()
  try:
    data = json.loads(path.read_text())
  except FileNotFoundError:
    return {}
  except (OSError, ValueError) as e:
    log.warning("pallet.autotune: ignoring unreadable cache %s (%s)", path, e)
    return {}
  if not isinstance(data, dict) or data.get("format") != _FORMAT:
    return {}
  entries = data.get("entries")
  return entries if isinstance(entries, dict) else {}


def _store(key_text: str, choice: Choice) -> None:
  """Adds one entry; the file is re-read under a lock and replaced atomically, so
  processes tuning at once never corrupt it (the last of two writers of one key wins)."""
  path = cache_path()
  entry = {"config": json.loads(canonical(choice.config)),
           "time_ms": next((t.time_ms for t in choice.trials if t.config == choice.config
                            and t.status == "ok"), None),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_suffix(".lock")):
      entries = _load()
      entries[key_text] = entry
      tmp = path.with_suffix(f".{os.getpid()}.tmp")
      tmp.write_text(json.dumps({"format": _FORMAT, "entries": entries}, indent=1))
      os.replace(tmp, path)
  except OSError as e:
    log.warning("pallet.autotune: could not write the cache %s (%s); the choice is "
                "kept for this process only", path, e)


class _locked:
  """An exclusive lock on `path` where the platform has flock; a no-op elsewhere."""

  def __init__(self, path: Path):
    self.path, self.file = path, None

  def __enter__(self) -> None:
    try:
      import fcntl
    except ImportError:
      return
    self.file = open(self.path, "a")
    fcntl.flock(self.file, fcntl.LOCK_EX)

  def __exit__(self, *exc: Any) -> None:
    if self.file is not None:
      self.file.close()


def clear_cache() -> Path:
  """Deletes the persistent cache file (in-memory choices of live functions stay)."""
  path = cache_path()
  path.unlink(missing_ok=True)
  return path


# ------------------------------------------------------------------ small helpers
def _validated_configs(name: str, configs: Any) -> list[Mapping[str, Any]]:
  if isinstance(configs, Mapping) or not isinstance(configs, Sequence) or not configs:
    raise PalletError(f"autotune of '{name}': configs must be a non-empty list of dicts "
                      f"of keyword arguments, got {configs!r}")
  for i, c in enumerate(configs):
    if not isinstance(c, Mapping):
      raise PalletError(f"autotune of '{name}': config {i} must be a dict of keyword "
                        f"arguments, got {c!r}")
  return list(configs)


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
  try:
    return inspect.signature(fn)
  except (TypeError, ValueError):
    return None


def _is_array(x: Any) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)


def _has_arrays(value: Any) -> bool:
  return any(_is_array(x) for x in jax.tree.leaves(value))


def _is_simple(value: Any) -> bool:
  if value is None or isinstance(value, (bool, int, float, str)):
    return True
  return isinstance(value, tuple) and all(_is_simple(v) for v in value)


def _shape_tree(value: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if _is_array(x)
                      else x, value)


def _shapes_text(tree: Any) -> Any:
  leaves = [x for x in jax.tree.leaves(tree) if _is_array(x)]
  text = [f"{np.dtype(x.dtype).name}{list(x.shape)}" if not _extended(x.dtype)
          else f"{x.dtype}{list(x.shape)}" for x in leaves]
  return text[0] if len(text) == 1 and _is_array(tree) else text


def _shapes_summary(shapes: Shapes) -> str:
  return ", ".join(f"{n}={_shapes_text(s)}" for n, s in shapes.items())


def _extended(dtype: Any) -> bool:
  return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _inputs(examples: list[Any]) -> list[jax.Array]:
  """Inputs for timing: the call's own arrays when it has them, else random ones of
  the traced shapes (normal floats, random bools, zero integers: safe as indices)."""
  rng = np.random.default_rng(0)
  out = []
  for x in examples:
    if not internals.is_tracer(x):
      out.append(x)
      continue
    dtype = np.dtype(x.dtype)
    if np.issubdtype(dtype, np.inexact):
      value = rng.standard_normal(x.shape).astype(dtype)
    elif dtype == np.bool_:
      value = rng.integers(0, 2, x.shape).astype(bool)
    else:
      value = np.zeros(x.shape, dtype)
    out.append(jax.device_put(value))
  return out


def _difference(got: Any, want: Any) -> str:
  """'' when every output leaf of `got` is close to `want` (a dtype-fitting
  tolerance scaled by the output's size), else what differs."""
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    if g.shape != w.shape:
      return f"shape {g.shape} vs {w.shape}"
    if np.issubdtype(w.dtype, np.inexact) or w.dtype.kind == "V":
      g64, w64 = g.astype(np.float64), w.astype(np.float64)
      tol = 2e-2 if w.dtype.itemsize <= 2 else 1e-6 if w.dtype.itemsize >= 8 else 1e-3
      finite = np.isfinite(w64)
      scale = float(np.max(np.abs(w64[finite]), initial=1.0))
      close = np.isclose(g64, w64, rtol=tol, atol=tol * scale, equal_nan=True)
      if not close.all():
        return f"max abs difference {float(np.nanmax(np.abs(g64 - w64))):.3g}"
    elif not np.array_equal(g, w):
      return f"{int(np.sum(g != w))} elements differ"
  return ""


def canonical(value: Any) -> str:
  return json.dumps(value, sort_keys=True, default=_json_default, separators=(",", ":"))


def _json_default(value: Any) -> Any:
  if isinstance(value, (np.integer, np.floating, np.bool_)):
    return value.item()
  if isinstance(value, (set, frozenset)):
    return sorted(value, key=repr)
  return repr(value)


def config_text(config: Config | None) -> str:
  if config is None:
    return "{}"
  return "{" + ", ".join(f"{k}={v!r}" for k, v in config.items()) + "}"


def _describe(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _user_stacklevel() -> int:
  """The `stacklevel` that points a warning at the first frame outside this module."""
  frame, level = sys._getframe(1), 1
  while frame is not None and frame.f_code.co_filename == __file__:
    frame, level = frame.f_back, level + 1
  return level


def _progress(total: int, desc: str) -> Any:
  """A tqdm bar on stderr that shows after a second of tuning, only on a terminal."""
  if not sys.stderr.isatty():
    return None
  try:
    from tqdm import tqdm
  except ImportError:
    return None
  try:
    return tqdm(total=total, desc=desc, delay=1.0, leave=False, file=sys.stderr)
  except TypeError:   # tqdm older than 4.60 has no delay
    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr)


# `pallet.autotune` is the decorator (the package re-exports it over this module's
# name), so the cache helpers ride on it: `pl.autotune.cache_path()`.
autotune.cache_path = cache_path
autotune.clear_cache = clear_cache
autotune.environment = environment
autotune.Case = Case
autotune.recording = recording
