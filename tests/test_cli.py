"""The `pallet` command: --version, demo (backends, interleaved timing, busy note),
tune, help texts with defaults, and bench/tune from an installed wheel (slow)."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import pallet as pl
from pallet import cli
from pallet.cli import demo

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("PALLET_CACHE_DIR", str(tmp_path / "cache"))
  return tmp_path / "cache"


@pytest.fixture
def tiny_gallery(monkeypatch):
  """The demo gallery at a size a test can afford (same kernels, same references)."""
  x, y = jnp.arange(2048.0), jnp.ones(2048)
  a = jax.random.normal(jax.random.key(1), (128, 128))
  rows = jax.random.normal(jax.random.key(2), (64, 128))
  gallery = [
      ("vector add", "2048 f32", lambda x, y: demo.vector_add(x, y, block=512),
       lambda x, y: x + y, (x, y), 1e-6),
      ("blocked matmul", "128^3 f32", lambda a, b: demo.matmul(a, b, block=64),
       lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32), (a, a), 1e-4),
      ("row softmax", "64x128", demo.row_softmax, lambda x: jax.nn.softmax(x, axis=-1),
       (rows,), 1e-5),
  ]
  monkeypatch.setattr(demo, "_gallery", lambda scale: gallery)


def test_version(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--version"])
  assert exit_info.value.code == 0
  assert capsys.readouterr().out.strip() == f"pallet {pl.__version__} (jax {jax.__version__})"


def test_every_flag_has_help_with_its_default():
  parser = cli.build_parser()
  subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
  checked = 0
  for name, sub in subparsers.choices.items():
    if name == "bench":   # its flags are the suite's own (pallet bench --help)
      continue
    for action in sub._actions:
      if isinstance(action, argparse._HelpAction):
        continue
      assert action.help, f"pallet {name} {action.option_strings}: no help"
      assert "default" in action.help, f"pallet {name} {action.option_strings}: {action.help}"
      checked += 1
  assert checked >= 10
  assert "--backend" in subparsers.choices["demo"].format_help()


def test_demo_checks_and_times_interleaved(tiny_gallery, capsys, monkeypatch):
  order = []
  real = demo.interleaved_ms

  def spy(fns, args, reps):
    wrapped = [lambda *a, fn=fn, i=i: (order.append(i), fn(*a))[1] for i, fn in enumerate(fns)]
    return real(wrapped, args, reps)

  monkeypatch.setattr(demo, "interleaved_ms", spy)
  monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0))
  assert cli.main(["demo", "--reps", "3"]) == 0
  out = capsys.readouterr().out
  assert "note: machine busy (1-min load average 64.00" in out
  assert "all kernels match jax.numpy" in out and out.count(" yes") == 3
  assert order[:6] == [0, 1, 0, 1, 0, 1]   # pallet and jnp alternate within rounds


def test_demo_quiet_machine_has_no_busy_note(tiny_gallery, capsys, monkeypatch):
  monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
  assert cli.main(["demo", "--reps", "1", "--backend", "xla"]) == 0
  out = capsys.readouterr().out
  assert "busy" not in out and "(backend 'xla')" in out


def test_demo_reports_a_kernel_that_differs(tiny_gallery, capsys, monkeypatch):
  wrong = [("broken add", "2048 f32", lambda x, y: demo.vector_add(x, y, block=512) + 1,
            lambda x, y: x + y, (jnp.ones(2048), jnp.ones(2048)), 1e-6)]
  monkeypatch.setattr(demo, "_gallery", lambda scale: wrong)
  assert cli.main(["demo", "--reps", "1"]) == 1
  assert "1 kernel(s) differ" in capsys.readouterr().out


@pytest.mark.skipif(not demo._triton_installed(), reason="triton not installed")
@pytest.mark.parametrize("interpret_env", ["1", None])
def test_demo_on_the_triton_backend_in_its_own_process(interpret_env):
  """Without a GPU, `--backend triton` runs Triton's interpreter whether or not
  TRITON_INTERPRET is set, as --help says."""
  code = ("import sys, jax.numpy as jnp; from pallet import cli; from pallet.cli import demo\n"
          "x = jnp.arange(1024.0)\n"
          "demo._gallery = lambda s: [('vector add', '1024', lambda x, y: "
          "demo.vector_add(x, y, block=256), lambda x, y: x + y, (x, x), 1e-6)]\n"
          "sys.exit(cli.main(['demo', '--backend', 'triton', '--reps', '1']))")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("TRITON_INTERPRET", None)
  if interpret_env is not None:
    env["TRITON_INTERPRET"] = interpret_env
  done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "(backend 'triton' under Triton's interpreter" in done.stdout


def test_tune_measures_then_reuses_the_cache(capsys):
  assert cli.main(["tune", "--size", "tiny", "--only", "demo/row_softmax", "--reps", "2"]) == 0
  out = capsys.readouterr().out
  assert "[1/1] demo/row_softmax" in out and "median ms" in out and "chosen" in out
  assert "speed-up" in out
  assert cli.main(["tune", "--size", "tiny", "--only", "demo/row_softmax"]) == 0
  out = capsys.readouterr().out
  assert "row_softmax: cache {rows=" in out and "median ms" not in out
  assert cli.main(["tune", "--size", "tiny", "--only", "demo/row_softmax", "--force",
                   "--reps", "1"]) == 0
  assert "median ms" in capsys.readouterr().out


def test_tune_confirm_times_default_and_choice_again(capsys, monkeypatch):
  autotuning = sys.modules["pallet.autotune"]
  compared = []
  real = autotuning.Autotuned.compare

  def spy(self, *args, configs=None, rounds=21, **kwargs):
    compared.append((configs, rounds))
    return real(self, *args, configs=configs, rounds=rounds, **kwargs)

  monkeypatch.setattr(autotuning.Autotuned, "compare", spy)
  assert cli.main(["tune", "--size", "tiny", "--only", "demo/vector_add", "--reps", "1",
                   "--confirm", "2"]) == 0
  out = capsys.readouterr().out
  summary = out.splitlines()[-1]
  if compared:   # the default lost: both timed again, 2 rounds
    ((configs, rounds),) = compared
    assert configs[0] == {"block": 65536} and rounds == 2
    assert "confirmed over 2 rounds" in out and "confirmed x2" in summary
  else:
    assert "default is best" in summary


def test_tune_reaches_the_benchmark_suite(capsys):
  from pallet.cli import tune
  assert tune.block_configs({"block": 128}) == [
      {"block": 128}, {"block": 32}, {"block": 64}, {"block": 256}, {"block": 512}]
  both = tune.block_configs({"block_q": 2, "block_k": 64})
  assert both[0] == {"block_q": 2, "block_k": 64} and {"block_q": 1, "block_k": 64} in both
  assert all(c["block_q"] >= 1 for c in both) and len(both) == len({str(c) for c in both})
  assert cli.main(["tune", "--size", "tiny", "--only", "bench/matmul", "--reps", "1"]) == 0
  out = capsys.readouterr().out
  assert "[1/1] bench/matmul" in out and "{block=16}" in out
  assert out.splitlines()[-1].startswith("bench/matmul")


def test_tune_lists_and_rejects_unknown_cases(capsys):
  assert cli.main(["tune", "--list"]) == 0
  listed = capsys.readouterr().out.split()
  assert {"demo/matmul", "demo/vector_add", "bench/matmul", "bench/flash_attention"} <= set(listed)
  assert cli.main(["tune", "--only", "nope"]) == 2
  assert "no case 'nope'" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    cli.main(["tune", "--reps", "0"])


@pytest.mark.skipif(demo._triton_installed(),
                    reason="triton installed: the message is for its absence")
def test_demo_on_triton_without_triton_says_what_to_install(capsys):
  assert cli.main(["demo", "--backend", "triton"]) == 2
  assert "needs the triton package" in capsys.readouterr().err


def test_bench_help_names_pallet_bench(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["bench", "--help"])
  assert exit_info.value.code == 0
  assert capsys.readouterr().out.startswith("usage: pallet bench ")


def test_python_m_benchmarks_from_a_checkout_forwards_to_pallet_bench():
  """The checkout's `benchmarks/` is only a shim: it finds src/ by itself."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  done = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "matmul" in done.stdout
  shim = sorted(p.name for p in (REPO / "benchmarks").glob("*.py"))
  assert shim == ["__init__.py", "__main__.py"], shim


def test_unknown_arguments_are_an_error_outside_bench():
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["demo", "--bogus"])
  assert exit_info.value.code == 2


@pytest.mark.slow
def test_bench_and_tune_work_from_an_installed_wheel(tmp_path):
  """Build the wheel, install it (without deps) into a fresh venv that borrows this
  environment's jax, and run the commands from a directory that is no checkout."""
  src = tmp_path / "src"
  shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
      ".git", "*.egg-info", "build", "bench_out", ".pytest_cache", ".hypothesis", ".gpu",
      "__pycache__", "tests", "docs", "examples"))
  wheels = tmp_path / "wheels"
  subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "-w", str(wheels),
                  "--no-deps", "-q"], check=True, timeout=600)
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
  (wheel,) = wheels.glob("pallet-*.whl")
  subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps",
                  str(wheel)], check=True, timeout=300)
  site = next(p for p in sys.path if p.endswith("site-packages"))
  work = tmp_path / "elsewhere"
  work.mkdir()
  env = {**os.environ, "PYTHONPATH": site, "PALLET_CACHE_DIR": str(tmp_path / "cache"),
         "JAX_PLATFORMS": "cpu"}

  def pallet(*args):
    done = subprocess.run([venv / "bin" / "pallet", *args], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout

  where = subprocess.run([venv / "bin" / "python", "-c", "import pallet.bench; "
                          "print(pallet.__file__, pallet.bench.__file__)"], cwd=work, env=env,
                         capture_output=True, text=True, check=True).stdout
  assert str(REPO) not in where and str(venv) in where
  no_benchmarks = subprocess.run([venv / "bin" / "python", "-c", "import benchmarks"], cwd=work,
                                 env=env, capture_output=True, text=True)
  assert "No module named 'benchmarks'" in no_benchmarks.stderr   # the wheel holds only pallet
  assert "--only NAME" in pallet("bench", "--help")
  assert "--force" in pallet("tune", "--help")
  assert "matmul" in pallet("bench", "--list")
  out = pallet("bench", "--size", "tiny", "--only", "matmul", "--no-peer", "--reps", "1")
  assert (work / "bench_out" / "perf_cpu_tiny.json").exists(), out
  assert "speed-up" in pallet("tune", "--size", "tiny", "--only", "demo/vector_add",
                              "--reps", "1")
