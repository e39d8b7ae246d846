"""pallet.autotune: picks the faster config, remembers it across processes, prunes what
does not fit, tunes under jit but never under grad/vmap, keys on versions and backend."""
from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import pallet as pl
from helpers import assert_close, current_test_backend, pallas_call, random_array, sds

autotune_module = importlib.import_module("pallet.autotune")
# A `work` that makes a config far slower than work=1 (Triton's interpreter pays per
# loop step, so there fewer steps make the same gap).
SLOW = 8192 if current_test_backend() == "xla" else 32


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
  """Every test gets its own empty persistent cache."""
  monkeypatch.setenv("PALLET_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.delenv("PALLET_AUTOTUNE", raising=False)
  monkeypatch.delenv("PALLET_AUTOTUNE_VERBOSE", raising=False)
  return tmp_path / "cache"


def repeat_kernel(x_ref, o_ref, *, work: int):
  """o = x, computed as the running maximum of `work` copies: `work` sets the cost,
  not the result."""
  x = x_ref[...]
  o_ref[...] = jax.lax.fori_loop(0, work, lambda i, acc: jnp.maximum(acc, x),
                                 jnp.full_like(x, -jnp.inf))


def make_tuned(configs, traced: list, **options):
  """An autotuned copy kernel with tunable `work` and `block`; `traced` records the
  config of every trace of it."""
  @pl.autotune(configs=configs, key=("x",), **options)
  def copy(x, *, work: int = 1, block: int = 128):
    traced.append({"work": work, "block": block})
    spec = pl.BlockSpec((block,), lambda i: (i,))
    return pallas_call(functools.partial(repeat_kernel, work=work), sds(x),
                       grid=(pl.cdiv(x.shape[0], block),), in_specs=[spec],
                       out_specs=spec)(x)
  return copy


def test_picks_the_config_that_does_less_work():
  traced = []
  copy = make_tuned([{"work": SLOW}, {"work": 1}], traced, reps=7)
  x = random_array((8192,))
  assert_close(copy(x), x)
  choice = copy.last_choice
  assert choice.source == "tuned"
  assert choice.config == {"work": 1}
  times = {t.config["work"]: t.time_ms for t in choice.trials}
  assert times[SLOW] > times[1]
  assert "chosen" in choice.table() and f"work={SLOW}" in choice.table()
  # The second call of the same shapes reuses the choice without measuring.
  before = len(traced)
  assert_close(copy(x), x)
  assert copy.last_choice.source == "cache" and len(traced) == before + 1


def test_cache_is_persistent_and_a_hit_costs_no_tuning(cache_dir):
  script = textwrap.dedent("""
      import functools, json, sys
      import jax, jax.numpy as jnp
      import pallet as pl

      traced = []
      def kernel(x_ref, o_ref, *, scale):
        o_ref[...] = x_ref[...] * scale

      @pl.autotune(configs=[{"block": 256}, {"block": 512}, {"block": 1024}], key=("x",))
      def double(x, *, block=256):
        traced.append(block)
        spec = pl.BlockSpec((block,), lambda i: (i,))
        return pl.pallas_call(functools.partial(kernel, scale=2.0),
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(x.shape[0] // block,), in_specs=[spec], out_specs=spec)(x)

      x = jax.random.normal(jax.random.key(int(sys.argv[1])), (4096,))
      ok = bool(jnp.allclose(double(x), 2 * x))
      print(json.dumps({"traced": len(traced), "source": double.last_choice.source,
                        "config": double.last_choice.config, "ok": ok}))
  """)
  env = {**os.environ, "PALLET_CACHE_DIR": str(cache_dir), "JAX_PLATFORMS": "cpu"}

  def run(seed):
    done = subprocess.run([sys.executable, "-c", script, str(seed)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])

  first, second = run(1), run(2)
  assert first["ok"] and second["ok"]
  assert first["source"] == "tuned" and first["traced"] == 4   # 3 configs timed + the call
  assert second["source"] == "cache" and second["traced"] == 1
  assert second["config"] == first["config"]
  entries = json.loads((cache_dir / "autotune.json").read_text())["entries"]
  assert len(entries) == 1


def test_configs_that_do_not_fit_are_pruned(monkeypatch):
  monkeypatch.setenv("PALLET_AUTOTUNE", "0")   # only the pruning is under test here
  traced = []
  copy = make_tuned([{"block": 4096}, {"block": 96}, {"block": 64}], traced,
                    blocks=lambda c: {"x": (c["block"],)})
  x = random_array((1024,))
  choice = copy.choose(x)
  assert choice.config == {"block": 96} and choice.source == "default"
  assert [t.note for t in choice.trials] == [
      "block (4096,) of 'x' exceeds its shape (1024,)"]
  with pl.default_backend("triton"):
    choice = copy.choose(x)
  assert choice.config == {"block": 64}
  assert "not a power of two (Triton)" in choice.trials[-1].note
  assert_close(copy(x), x)

  small = make_tuned([{"block": 64}, {"block": 32}], traced,
                     prune=lambda c, shapes: shapes["x"].shape[0] % c["block"] != 0)
  assert small.choose(random_array((96,))).config == {"block": 32}
  with pytest.raises(pl.PalletError, match=r"(?s)no config fits.*\{block=64\}: prune\(\) dropped"):
    small.choose(random_array((33,)))


def test_a_config_that_fails_to_trace_is_dropped_with_a_note(caplog):
  traced = []
  copy = make_tuned([{"block": (8, 8)}, {"block": 256}], traced)
  x = random_array((1024,))
  with caplog.at_level(logging.INFO, logger="pallet.autotune"):
    assert_close(copy(x), x)
  choice = copy.last_choice
  assert choice.config == {"block": 256}
  failed = [t for t in choice.trials if t.status == "failed"]
  assert len(failed) == 1 and failed[0].note
  assert "dropped config {block=(8, 8)}" in caplog.text


def test_every_config_failing_is_an_error():
  copy = make_tuned([{"block": (8, 8)}, {"block": (2, 2)}], [])
  with pytest.raises(pl.PalletError, match="every config failed"):
    copy(random_array((1024,)))


def test_a_config_computing_something_else_is_dropped_with_a_warning():
  @pl.autotune(configs=[{"scale": 1.0}, {"scale": 3.0}], key=("x",))
  def scaled(x, *, scale):
    spec = pl.BlockSpec((256,), lambda i: (i,))
    return pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * scale),
                       sds(x), grid=(4,), in_specs=[spec], out_specs=spec)(x)

  x = random_array((1024,))
  with pytest.warns(UserWarning, match=r"\{scale=3.0\} computes a different result"):
    assert_close(scaled(x), x)
  assert [t.status for t in scaled.last_choice.trials] == ["ok", "mismatch"]


def test_tunes_under_jit_on_the_traced_shapes():
  traced = []
  copy = make_tuned([{"work": SLOW}, {"work": 1}], traced)
  x = random_array((4096,))
  assert_close(jax.jit(copy)(x), x)
  assert copy.last_choice.source == "tuned" and copy.last_choice.config == {"work": 1}
  # Eagerly afterwards: the same shapes, so the choice made under jit is reused.
  assert_close(copy(x), x)
  assert copy.last_choice.source == "cache"


def test_never_tunes_under_grad_or_vmap(caplog):
  traced = []
  copy = make_tuned([{"work": SLOW}, {"work": 1}], traced)
  x = random_array((512,))
  with caplog.at_level(logging.DEBUG, logger="pallet.autotune"):
    g = jax.grad(lambda v: jnp.sum(copy(v) ** 2))(x)
  assert_close(g, 2 * x)
  assert copy.last_choice.source == "default" and copy.last_choice.config == {"work": SLOW}
  assert {t["work"] for t in traced} == {SLOW}
  assert "not tuning under" in caplog.text and "grad/jvp/vmap" in caplog.text
  xs = random_array((3, 512))
  assert_close(jax.vmap(copy)(xs), xs)
  assert copy.last_choice.source == "default"
  assert {t["work"] for t in traced} == {SLOW}
  # A config tuned before is what grad then uses.
  copy(x)
  assert copy.last_choice.config == {"work": 1}
  jax.grad(lambda v: jnp.sum(copy(v)))(x)
  assert copy.last_choice.source == "cache" and copy.last_choice.config == {"work": 1}


def test_the_cache_key_includes_versions_backend_and_shapes(monkeypatch):
  traced = []
  copy = make_tuned([{"work": 1}, {"work": 2}], traced)
  x = random_array((256,))
  key = copy.choose(x).key
  assert key["versions"]["pallet"] == pl.__version__
  assert key["versions"]["jax"] == jax.__version__
  assert key["backend"] == "xla" and key["shapes"] == {"x": "float32[256]"}
  assert key["device"].startswith(jax.devices()[0].platform)
  with pl.default_backend("triton"):
    assert copy.choose(x).key["backend"].startswith("triton")
  assert copy.choose(random_array((256,), jnp.bfloat16)).key["shapes"] == {
      "x": "bfloat16[256]"}
  # Settings that change the compiled kernels key the choice too.
  with jax.default_matmul_precision("highest"):
    assert copy.choose(x).key["settings"]["matmul_precision"] == "highest"
    assert copy.last_choice.source == "tuned"
  assert copy.choose(x).source == "cache"
  monkeypatch.setenv("PALLET_CHECKS", "1")
  assert copy.choose(x).key["settings"]["checks"] is not None
  monkeypatch.delenv("PALLET_CHECKS")
  # A new pallet version does not reuse what an older one measured.
  fresh = make_tuned([{"work": 1}, {"work": 2}], traced)
  assert fresh.choose(x).source == "cache"      # found on disk, same versions
  monkeypatch.setattr(pl, "__version__", "9.9.9")
  newer = make_tuned([{"work": 1}, {"work": 2}], traced)
  assert newer.choose(x).source == "tuned"


def test_explicit_config_values_are_not_tuned():
  traced = []
  copy = make_tuned([{"work": 1}, {"work": 2}], traced)
  x = random_array((256,))
  assert_close(copy(x, work=3), x)
  assert copy.last_choice.source == "explicit" and traced == [{"work": 3, "block": 128}]


def test_verbose_prints_the_table(capsys, monkeypatch):
  monkeypatch.setenv("PALLET_AUTOTUNE_VERBOSE", "1")
  copy = make_tuned([{"work": 1}, {"work": 2}], [])
  copy(random_array((256,)))
  err = capsys.readouterr().err
  assert "median ms" in err and "chosen" in err and "{work=2}" in err


def test_misuse_is_a_clear_error():
  def f(x, *, block=8):
    return x
  with pytest.raises(pl.PalletError,
                     match=r"config 1 \{blok=8\} sets \['blok'\], which '\S*f' does not take"):
    pl.autotune(f, configs=[{"block": 8}, {"blok": 8}])
  with pytest.raises(pl.PalletError, match=r"key names \['y'\]"):
    pl.autotune(f, configs=[{"block": 8}], key=("y",))
  with pytest.raises(pl.PalletError, match="non-empty list of dicts"):
    pl.autotune(f, configs=[])
  with pytest.raises(pl.PalletError, match="non-empty list of dicts"):
    pl.autotune(f, configs={"block": 8})


def test_cache_dir_follows_the_environment(cache_dir):
  assert pl.autotune.cache_path() == cache_dir / "autotune.json"
  copy = make_tuned([{"work": 1}, {"work": 2}], [])
  copy(random_array((256,)))
  assert pl.autotune.cache_path().exists()
  pl.autotune.clear_cache()
  assert not pl.autotune.cache_path().exists()
  assert autotune_module.cache_dir() == cache_dir


def test_progress_bar_only_on_a_terminal_and_only_with_tqdm(monkeypatch):
  bars = []

  class FakeBar:
    def __init__(self, total, **options):
      self.total, self.done, self.options = total, 0, options
      bars.append(self)

    def update(self, n):
      self.done += n

    def close(self):
      self.closed = True

  fake_tqdm = type(sys)("tqdm")
  fake_tqdm.tqdm = FakeBar
  monkeypatch.setitem(sys.modules, "tqdm", fake_tqdm)
  copy = make_tuned([{"work": 1}, {"work": 2}], [], reps=3)
  monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
  copy(random_array((256,)))
  assert bars == []                      # not a terminal: no bar
  monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
  copy.tune(random_array((256,)))
  (bar,) = bars
  assert bar.total == bar.done == 2 + 3 and bar.closed and bar.options["delay"] > 0
  monkeypatch.setitem(sys.modules, "tqdm", None)   # tqdm not installed: no bar, no error
  copy.tune(random_array((256,)))
  assert len(bars) == 1


def test_prng_key_arguments_under_jit_use_the_default():
  @pl.autotune(configs=[{"block": 128}, {"block": 256}], key=("x",))
  def noisy(x, seed_key, *, block):
    noise = jax.random.uniform(seed_key, x.shape)
    spec = pl.BlockSpec((block,), lambda i: (i,))
    return pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]), sds(x),
                       grid=(x.shape[0] // block,), in_specs=[spec], out_specs=spec)(x + noise)

  x, k = random_array((512,)), jax.random.key(3)
  assert_close(jax.jit(noisy)(x, k), x + jax.random.uniform(k, x.shape))
  assert noisy.last_choice.source == "default"
  assert "call the function once outside jit" in noisy.last_choice.note
  noisy(x, k)   # outside jit the call's own key serves as input: tuned
  assert noisy.last_choice.source == "tuned"


def test_compare_and_fitting_leave_the_caches_alone(cache_dir):
  traced = []
  copy = make_tuned([{"block": 16384}, {"work": 1, "block": 128},
                     {"work": SLOW, "block": 128}],
                    traced, blocks=lambda c: {"x": (c["block"],)})
  x = random_array((8192,))
  assert copy.fitting(x) == [{"work": 1, "block": 128}, {"work": SLOW, "block": 128}]
  trials = copy.compare(x, configs=copy.fitting(x), rounds=5)
  assert [t.status for t in trials] == ["ok", "ok"] and trials[0].time_ms < trials[1].time_ms
  assert copy.last_choice is None and not (cache_dir / "autotune.json").exists()
