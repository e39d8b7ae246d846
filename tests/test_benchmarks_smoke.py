"""Smoke tests for the benchmark suite: every kernel at tiny size through pallet,
checked against its jax.numpy program, plus the runner, report and CLI plumbing."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import pytest

from pallet.bench import catalog, report
from helpers import assert_close, random_array
from pallet.bench.__main__ import main
from pallet.bench.checking import MismatchError, check_matches
from pallet.bench.elementwise import vector_add
from pallet.bench.gpu import gpu_benchmarks, gpu_device
from pallet.bench.gpu import main as gpu_main
from pallet.bench.runner import BenchmarkResult, PeerPolicy, VariantResult, run_benchmark
from pallet.bench.variants import CPU_VARIANTS, cpu_variant

TINY = catalog.all_benchmarks("tiny")
GPU_ONLY = sorted({b.name for b in gpu_benchmarks("tiny")} - {b.name for b in TINY})
JNP_AND_PEER = [cpu_variant("jnp"), cpu_variant("interpret")]


@pytest.mark.parametrize("bench", TINY, ids=[b.name for b in TINY])
def test_kernel_matches_jnp_through_pallet(bench):
  args = bench.make_inputs(jax.random.key(1))
  expected = jax.jit(bench.reference)(*args)
  actual = jax.jit(cpu_variant("pallet").build(bench))(*args)
  check_matches(bench, "pallet", actual, expected)


@pytest.mark.parametrize("name", GPU_ONLY)
def test_gpu_suite_in_kernel_reduction_forms_match_jnp_on_cpu(name):
  bench = next(b for b in gpu_benchmarks("tiny") if b.name == name)
  args = bench.make_inputs(jax.random.key(2))
  expected = jax.jit(bench.reference)(*args)
  actual = jax.jit(cpu_variant("pallet").build(bench))(*args)
  check_matches(bench, "pallet", actual, expected)


GPU_TINY = gpu_benchmarks("tiny")


@pytest.mark.triton_interpret
@pytest.mark.parametrize("bench", GPU_TINY, ids=[b.name for b in GPU_TINY])
def test_gpu_suite_kernel_through_pallet_triton_interpreter(bench):
  """The GPU script's kernels are valid Triton kernels for pallet (no GPU needed)."""
  pytest.importorskip("triton")
  if os.environ.get("TRITON_INTERPRET", "") in ("", "0"):
    pytest.skip("needs TRITON_INTERPRET=1 (pytest -m triton_interpret, own process)")
  import pallet
  args = bench.make_inputs(jax.random.key(3))
  expected = jax.jit(bench.reference)(*args)
  actual = bench.build_pallas(pallet, backend="triton", interpret=True)(*args)
  check_matches(bench, "pallet triton (interpreted)", actual, expected)


def test_gpu_script_skips_cleanly_without_a_gpu(capsys):
  if gpu_device() is not None:
    pytest.skip("a GPU is present")
  assert gpu_main(["--only", "softmax"]) == 0
  assert "no GPU" in capsys.readouterr().out


_SMOKE_PROGRAMS = ("flash_attention fwd causal", "decode_attention", "ragged_dot")


def _op_benchmark(tmp_path, capsys, *only):
  from pallet.bench import gpu_op_cases
  if gpu_device() is not None:
    pytest.skip("a GPU is present: python -m pallet.bench.gpu times the real sizes")
  argv = ["--size", "tiny", "--reps", "1", "--out", str(tmp_path)]
  for name in only:
    argv += ["--only", name]
  assert gpu_main(argv) == 0
  out = capsys.readouterr().out
  data = json.loads((tmp_path / "perf_gpu_ops.json").read_text())
  expected = [c.name for c in gpu_op_cases.all_cases("tiny")
              if not only or any(o in c.name for o in only)]
  assert [r["program"] for r in data["results"]] == expected
  for row in data["results"]:
    assert row["variants"]["pallet"]["status"] == "ok" and row["variants"]["pallet"]["ms"] > 0
  return out, data


def test_gpu_op_benchmark_runs_on_the_cpu_in_tiny_mode(tmp_path, capsys):
  out, data = _op_benchmark(tmp_path, capsys, *_SMOKE_PROGRAMS)
  assert "| flash_attention fwd causal | B1 H2 T64 D32 bf16 | TFLOP/s |" in out
  attention = next(r for r in data["results"] if r["program"] == "flash_attention fwd causal")
  assert attention["variants"]["cuDNN"]["status"] == "n/a"     # needs a GPU
  assert attention["variants"]["XLA"]["status"] == "ok"        # checked in its own layout
  ragged = next(r for r in data["results"] if r["program"] == "ragged_dot")
  assert ragged["variants"]["lax.ragged_dot"]["status"] == "ok"


@pytest.mark.slow
def test_gpu_op_benchmark_runs_every_program_on_the_cpu_in_tiny_mode(tmp_path, capsys):
  _op_benchmark(tmp_path, capsys)


def test_gpu_op_benchmark_reports_a_wrong_result_and_does_not_time_it():
  from pallet.bench import gpu_op_cases, gpu_ops
  case = next(c for c in gpu_op_cases.all_cases("tiny") if c.name == "softmax")
  wrong = dataclasses.replace(case, pallet=lambda x, w: case.pallet(x, w) * 1.1)
  result = gpu_ops.run_case(wrong, "tiny", reps=1, on_gpu=False, key=jax.random.key(0))
  pallet, xla = result.variants
  assert pallet.status == "mismatch" and pallet.seconds is None
  assert "max error" in pallet.message and xla.status == "ok" and xla.seconds > 0
  assert gpu_ops.problems([result]) == [f"softmax [tiny] pallet: mismatch: {pallet.message}"]


def test_gpu_op_benchmark_peaks_and_table():
  from pallet.bench import gpu_ops
  assert gpu_ops.peak_of("NVIDIA H100 80GB HBM3") == (989.0, 3.35)
  assert gpu_ops.peak_of("NVIDIA H100 PCIe") == (756.0, 2.0)
  assert gpu_ops.peak_of("NVIDIA A100-SXM4-40GB") == (312.0, 1.555)
  assert gpu_ops.peak_of("cpu") is None


def test_every_family_has_a_tiny_benchmark_with_several_grid_steps():
  names = {b.name for b in TINY}
  assert names == {b.name for b in catalog.all_benchmarks("full")}
  # JAX's grid-less example op (one program at every size) is the one exception
  assert all(b.grid_steps >= 2 for b in TINY if b.name != "op_tpu_example_double")


def test_check_matches_names_kernel_variant_and_worst_element():
  bench = TINY[0]
  expected = jnp.arange(8, dtype=jnp.float32)
  wrong = expected.at[5].set(-1.0)
  with pytest.raises(MismatchError, match=rf"{bench.name}: pallet differs .* index \(5,\)"):
    check_matches(bench, "pallet", wrong, expected)
  with pytest.raises(MismatchError, match="is int32"):
    check_matches(bench, "pallet", expected.astype(jnp.int32), expected)


def _wrong_vector_add(pl, **kwargs):
  """vector_add with the kernel's sign flipped: must be caught, never timed."""
  call = vector_add(pl, **kwargs)
  return lambda x, y: call(x, -y)


def test_runner_reports_a_wrong_pallet_result_as_mismatch_and_does_not_time_it():
  good = next(b for b in TINY if b.name == "vadd_b65536")
  bad = dataclasses.replace(
      good, build_pallas=functools.partial(_wrong_vector_add, n=128 * 1024, block=65536))
  result = run_benchmark(bad, CPU_VARIANTS[:2], reps=2, peer=PeerPolicy())
  pallet = result.variants["pallet"]
  assert pallet.status == "mismatch" and "vadd_b65536: pallet differs" in pallet.message
  assert pallet.samples_s == [] and result.ratio("pallet", "jnp") is None
  assert len(result.variants["jnp"].samples_s) == 2


def test_runner_reports_a_failing_variant_as_error():
  good = TINY[0]

  def broken(pl, **kwargs):
    raise ValueError("kernel refuses to build")

  result = run_benchmark(dataclasses.replace(good, build_pallas=broken), CPU_VARIANTS[:2],
                         reps=1, peer=PeerPolicy())
  assert result.variants["pallet"].status == "error"
  assert "ValueError: kernel refuses to build" in result.variants["pallet"].message


_TRACES: list[int] = []   # a global, so pallet's trace cache can hold the kernel


def _counting_vector_add(pl, *, n, block, **kwargs):
  """vector_add whose kernel counts how often pallet traces it."""
  def kernel(x_ref, y_ref, o_ref):
    _TRACES.append(1)
    o_ref[...] = x_ref[...] + y_ref[...]
  spec = pl.BlockSpec((block,), lambda i: (i,))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), jnp.float32),
                        grid=(n // block,), in_specs=[spec, spec], out_specs=spec, **kwargs)


def test_first_call_time_is_the_median_of_cold_compiles():
  good = next(b for b in TINY if b.name == "vadd_b65536")
  _TRACES.clear()
  bench = dataclasses.replace(good, build_pallas=functools.partial(
      _counting_vector_add, n=128 * 1024, block=65536))
  result = run_benchmark(bench, CPU_VARIANTS[:2], reps=1, peer=PeerPolicy(), compile_reps=3)
  for name in ("jnp", "pallet"):
    v = result.variants[name]
    assert len(v.compile_samples_s) == 3 and all(x > 0 for x in v.compile_samples_s)
    assert v.compile_s == sorted(v.compile_samples_s)[1]
  # every compile is a first call: pallet traced the kernel anew each time
  assert len(_TRACES) == 3
  peer = run_benchmark(bench, JNP_AND_PEER, reps=1, peer=PeerPolicy(), compile_reps=3)
  assert len(peer.variants["interpret"].compile_samples_s) == 1   # the slow peer: once


def test_peer_policy_single_run_and_budget():
  bench = next(b for b in TINY if b.name == "vadd_b65536")
  once = run_benchmark(bench, JNP_AND_PEER, reps=5,
                       peer=PeerPolicy(reps=3, single_run_s=0.0))
  assert once.variants["interpret"].status == "ok"
  assert len(once.variants["interpret"].samples_s) == 1
  assert len(once.variants["jnp"].samples_s) == 5
  spent = run_benchmark(bench, JNP_AND_PEER, reps=1, peer=PeerPolicy(budget_s=0.0))
  assert spent.variants["interpret"].status == "skipped"
  assert spent.variants["interpret"].message.startswith("n/a")


def _result(name, steps, jnp_ms, pallet_ms, interpret_ms):
  bench = dataclasses.replace(TINY[0], name=name, grid=(steps,))
  timed = lambda ms: VariantResult("ok", samples_s=[ms / 1e3])
  return BenchmarkResult(bench, {"jnp": timed(jnp_ms), "pallet": timed(pallet_ms),
                                 "interpret": timed(interpret_ms)})


def test_summary_geomean_max_and_peer_speedup():
  results = [_result("a", 512, 1.0, 2.0, 300.0), _result("b", 16, 2.0, 1.0, 5.0),
             _result("c", 256, 1.0, 1.5, 1000.0)]
  s = report.summarize(results)
  assert math.isclose(s.geomean, (2.0 * 0.5 * 1.5) ** (1 / 3))
  assert s.max_ratio == ("a", 2.0)
  assert s.min_peer_speedup == ("a", 150.0) and s.peer_count == 2
  text = "\n".join(s.lines())
  assert "max: 2.00 (a) (target <= 1.5: MISSED)" in text
  assert "150x (a)" in text


def test_main_writes_table_json_and_chart(tmp_path, capsys):
  code = main(["--size", "tiny", "--only", "vadd_b65536", "--only", "stencil", "--no-peer",
               "--reps", "2", "--out", str(tmp_path)])
  assert code == 0
  out = capsys.readouterr().out
  assert "pallet/jnp" in out and "vadd_b65536" in out and "stencil5" in out
  data = json.loads((tmp_path / "perf_cpu_tiny.json").read_text())
  assert [r["name"] for r in data["results"]] == ["vadd_b65536", "stencil5"]
  assert all(len(r["variants"]["pallet"]["samples_ms"]) == 2 for r in data["results"])
  assert "interpret" not in data["results"][0]["variants"]
  assert (tmp_path / "perf_cpu_tiny.png").read_bytes()[:4] == b"\x89PNG"


def test_main_rejects_unknown_benchmark_name(capsys):
  with pytest.raises(SystemExit) as exc:
    main(["--only", "no_such_kernel", "--no-peer"])
  assert exc.value.code == 2
  err = capsys.readouterr().err
  assert "'no_such_kernel'" in err and "vadd_b1024" in err


def test_runner_requires_the_jnp_reference_first():
  with pytest.raises(ValueError, match="first variant must be 'jnp'"):
    run_benchmark(TINY[0], CPU_VARIANTS[1:], reps=1, peer=PeerPolicy())


def test_unknown_variant_name_is_rejected():
  with pytest.raises(ValueError, match="unknown variant 'pallets'"):
    cpu_variant("pallets")


def test_main_rejects_nonpositive_reps(capsys):
  with pytest.raises(SystemExit):
    main(["--reps", "0"])
  assert "must be >= 1" in capsys.readouterr().err


def test_plain_twins_of_pallet_ops_match_the_ops_references():
  """The ops rows time pallet.ops against the fastest plain jax.numpy form; it must
  compute what the op's own reference computes."""
  from pallet.bench import ops as ops_rows
  from pallet.ops import attention_reference, decode_attention_reference
  q, k, v = (random_array(s) for s in ((2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8)))
  for causal in (False, True):
    assert_close(ops_rows.plain_attention(q, k, v, causal=causal),
                 attention_reference(q, k, v, causal=causal), rtol=1e-5, atol=1e-5)
  qd = random_array((3, 4, 8))
  lengths = jnp.array([1, 16, 9], jnp.int32)
  assert_close(ops_rows.plain_decode_attention(qd, k[:1].repeat(3, 0), v[:1].repeat(3, 0),
                                               lengths),
               decode_attention_reference(qd, k[:1].repeat(3, 0), v[:1].repeat(3, 0), lengths),
               rtol=1e-5, atol=1e-5)
  from pallet.ops import rotary_embedding_reference
  x = random_array((2, 12, 3, 16))
  assert_close(ops_rows.plain_rotary_embedding(x), rotary_embedding_reference(x),
               rtol=1e-5, atol=1e-5)


def test_gated_delta_twin_is_the_token_by_token_recurrence():
  from pallet.bench import scratch_kernels
  args = scratch_kernels._delta_inputs(1, 2, 64, 16, 8, jax.random.key(4))
  assert_close(scratch_kernels.gated_delta_reference(*args, chunk=16),
               scratch_kernels.gated_delta_recurrence(*args), rtol=1e-4, atol=1e-5)


def test_size_classes_run_one_after_another_each_with_its_json(tmp_path, capsys):
  code = main(["--size", "tiny,test", "--only", "vadd_b65536", "--no-peer", "--reps", "2",
               "--compile-reps", "1", "--out", str(tmp_path)])
  assert code == 0
  out = capsys.readouterr().out
  assert "===== size class tiny" in out and "===== size class test" in out
  for size, n in (("tiny", 128 * 1024), ("test", 256 * 1024)):
    data = json.loads((tmp_path / f"perf_cpu_{size}.json").read_text())
    assert data["meta"]["size"] == size and data["results"][0]["name"] == "vadd_b65536"
    assert str(n) in data["results"][0]["shapes"]


def test_small_flag_is_the_shrunk_suite_and_the_jax_test_class(capsys):
  from pallet.bench.__main__ import build_parser
  assert build_parser().parse_args(["--small"]).size == "small,test"
  assert build_parser().parse_args([]).size == "full,test"
  with pytest.raises(SystemExit):
    main(["--size", "huge"])
  assert "unknown size class 'huge'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["op_decode_attention", "op_paged_attention"])
def test_interpret_peer_runs_ops_that_call_sibling_op_modules(name):
  """decode and paged attention launch flash_decoding's kernels: the peer's copy of
  them must launch JAX's, not pallet's (it failed on pallet's BlockSpec before)."""
  from pallet.bench.ops import _peer_module
  import pallet
  sibling = _peer_module(name.removeprefix("op_")).flash_decoding
  assert sibling.pl is not pallet and sibling.__name__ == "pallet.ops.flash_decoding"
  bench = next(b for b in TINY if b.name == name)
  result = run_benchmark(bench, JNP_AND_PEER, reps=1, peer=PeerPolicy())
  peer = result.variants["interpret"]
  assert peer.status == "ok", peer.message
