"""GPU benchmarks, in one go: `python -m pallet.bench.gpu`.

By default it times every pallet.ops program of issue 24 (`pallet.bench.gpu_op_cases`:
flash attention forward and forward+backward, causal and not; linear cross-entropy;
decode and paged attention; ragged_dot; a user's k-loop matmul; the row-wise ops) at
the issue's shapes and two smaller ones against cuDNN, XLA and cuBLAS, results
checked against jax.numpy first, and prints TFLOP/s or GB/s, the time ratio and each
side's share of the device's peak (`pallet.bench.gpu_ops`). JAX's GPU memory
preallocation is turned off ($XLA_PYTHON_CLIENT_PREALLOCATE=false) so the baselines'
temporaries and pallet's compete for nothing reserved up front. `--size tiny` runs
the same programs at toy sizes, also on the CPU (a smoke run); other sizes without a
GPU print a note and exit 0.

`--suite` runs the older kernel suite instead: pallet's Triton backend vs jax.numpy
vs `jax.experimental.pallas` on Triton, reusing the CPU suite's kernels whose grid
steps are independent. Kernels that reduce over a grid axis (matmul's k axis,
colsumsq's row axis) rely on grid steps running in order, which Triton does not
promise, so there they are replaced by forms that loop over the reduction inside the
kernel.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallet.bench import catalog, gpu_op_cases, gpu_ops, jax_op_cases, matmul, reduction, report
from pallet.bench.case import Benchmark, Size
from pallet.bench.runner import PeerPolicy
from pallet.bench.suite import exit_code, positive_int, run_suite
from pallet.bench.paths import SCRATCH_DIR
from pallet.bench.variants import JNP, Variant

GRID_REDUCTION_BENCHMARKS = ("matmul", "colsumsq")
GPU_COLUMNS = report.Columns(reference="jnp", subject="pallet", peer="pallas_triton")


def matmul_k_loop_kernel(pl: ModuleType, *, block_k: int):
  """o[i, j] = sum over k blocks of x[i, k] @ y[k, j], looped inside the kernel."""

  def kernel(x_ref, y_ref, o_ref):
    def step(kk, acc):
      x = x_ref[:, pl.ds(kk * block_k, block_k)]
      y = y_ref[pl.ds(kk * block_k, block_k), :]
      return acc + jnp.dot(x, y, preferred_element_type=jnp.float32)

    acc = jnp.zeros(o_ref.shape, jnp.float32)
    o_ref[...] = lax.fori_loop(0, x_ref.shape[1] // block_k, step, acc)

  return kernel


# The k-loop's step: a 128x128 f32 tile pair per step, pipelined over Triton's default 3
# stages, asks for 384 KiB of shared memory, more than an H100 has (227 KiB).
GPU_BLOCK_K = 32
TF32_TOLERANCE = 2e-2


def matmul_k_loop(pl: ModuleType, *, m: int, n: int, k: int, block: int,
                  **call_kwargs: Any):
  return pl.pallas_call(
      matmul_k_loop_kernel(pl, block_k=min(block, GPU_BLOCK_K)),
      out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
      grid=(m // block, n // block),
      in_specs=[pl.BlockSpec((block, k), lambda i, j: (i, 0)),
                pl.BlockSpec((k, block), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((block, block), lambda i, j: (i, j)),
      **call_kwargs,
  )


def column_sum_squares_row_loop_kernel(pl: ModuleType, *, block_rows: int):
  def kernel(x_ref, o_ref):
    def step(i, acc):
      x = x_ref[pl.ds(i * block_rows, block_rows), :]
      return acc + jnp.sum(x * x, axis=0)

    acc = jnp.zeros(o_ref.shape, jnp.float32)
    o_ref[...] = lax.fori_loop(0, x_ref.shape[0] // block_rows, step, acc)

  return kernel


def column_sum_squares_row_loop(pl: ModuleType, *, rows: int, cols: int, block_rows: int,
                                block_cols: int, **call_kwargs: Any):
  return pl.pallas_call(
      column_sum_squares_row_loop_kernel(pl, block_rows=block_rows),
      out_shape=jax.ShapeDtypeStruct((cols,), jnp.float32),
      grid=(cols // block_cols,),
      in_specs=[pl.BlockSpec((rows, block_cols), lambda j: (0, j))],
      out_specs=pl.BlockSpec((block_cols,), lambda j: (j,)),
      **call_kwargs,
  )


def gpu_benchmarks(size: Size = "full") -> list[Benchmark]:
  """The CPU suite, with grid-axis reductions looped in-kernel instead (no TPU ops)."""
  replaced = {
      "matmul": dict(name="matmul_kloop", grid=lambda b: b.grid[:2],
                     build=functools.partial(matmul_k_loop, **matmul.SIZES[size])),
      "colsumsq": dict(name="colsumsq_rowloop", grid=lambda b: b.grid[:1],
                       build=functools.partial(column_sum_squares_row_loop,
                                               **reduction.SIZES[size])),
  }
  out = []
  for b in catalog.all_benchmarks(size):
    if b.family == jax_op_cases.TPU_FAMILY:   # TPU programs (DMAs, SMEM): no Triton form
      continue
    if b.family == "fused":   # CPU-sized row panels: one block exceeds a Triton tensor
      continue
    if b.name in replaced:
      r = replaced[b.name]
      b = Benchmark(name=r["name"], family=b.family, grid=r["grid"](b),
                    shapes=b.shapes + ", reduction looped in-kernel",
                    make_inputs=b.make_inputs, reference=b.reference,
                    build_pallas=r["build"], rtol=b.rtol, atol=b.atol)
    out.append(b)
  return out


def _pallet_triton(bench: Benchmark):
  import pallet
  return bench.build_pallas(pallet, backend="triton")


def _pallas_triton(bench: Benchmark):
  from pallet.bench.peer import peer_pallas
  peer = peer_pallas()
  return bench.build_pallas(peer, compiler_params=peer.triton.CompilerParams())


GPU_VARIANTS: tuple[Variant, ...] = (
    JNP, Variant("pallet", _pallet_triton), Variant("pallas_triton", _pallas_triton))


def gpu_device() -> jax.Device | None:
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return None
  return devices[0] if devices else None


OP_SIZES = ("full", "medium", "small")


def main(argv: list[str] | None = None) -> int:
  """Run the op benchmark (or the kernel suite, --suite); 0 if every variant ran and
  matched (or there is no GPU), 1 otherwise."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  p = argparse.ArgumentParser(prog="python -m pallet.bench.gpu", description=__doc__.split("\n")[0])
  p.add_argument("--size", action="append", choices=gpu_op_cases.SIZES, default=[],
                 help="op benchmark sizes (repeatable; default: full, medium and small; "
                      "tiny also runs on the CPU)")
  p.add_argument("--only", action="append", default=[], metavar="NAME",
                 help="run only programs (op benchmark) or benchmarks/families (--suite) "
                      "whose name contains / equals NAME (repeatable)")
  p.add_argument("--reps", type=positive_int, default=None, metavar="N",
                 help="timed rounds per program (default 11; --suite: 21)")
  p.add_argument("--out", type=Path, default=SCRATCH_DIR, metavar="DIR",
                 help="where the JSON results go (default: bench_out/ in the repository)")
  p.add_argument("--suite", action="store_true",
                 help="run the kernel suite (pallet vs jax.numpy vs Pallas on Triton) instead")
  p.add_argument("--matmul-precision", default=None, choices=("highest", "default"),
                 help="jax_default_matmul_precision (--suite: default highest, float32 dots "
                 "in full precision so results compare at float32 tolerances; 'default' "
                 "times TF32). The op benchmark runs bf16 at the default precision.")
  args = p.parse_args(argv)
  if args.suite:
    return _suite(p, args)
  sizes = args.size or list(OP_SIZES)
  device = gpu_device()
  if device is None and sizes != ["tiny"]:
    print("pallet.bench.gpu: no GPU visible to JAX; skipping the GPU benchmarks "
          "(--size tiny runs them on the CPU as a smoke test).")
    return 0
  if args.matmul_precision:
    jax.config.update("jax_default_matmul_precision", args.matmul_precision)
  chosen = [(size, [c for c in gpu_op_cases.all_cases(size)
                    if not args.only or any(o in c.name for o in args.only)])
            for size in sizes]
  if not any(cases for _, cases in chosen):
    p.error(f"--only {args.only}: no program matches; the programs are "
            f"{[c.name for c in gpu_op_cases.all_cases('tiny')]}")
  kind = device.device_kind if device is not None else jax.devices()[0].device_kind
  results = gpu_ops.run(chosen, reps=args.reps or 11, on_gpu=device is not None)
  print()
  print(f"{kind}, jax {jax.__version__}, {args.reps or 11} interleaved rounds, median:")
  print(gpu_ops.table(results, kind))
  bad = gpu_ops.problems(results)
  for line in bad:
    print(line)
  args.out.mkdir(parents=True, exist_ok=True)
  path = args.out / "perf_gpu_ops.json"
  path.write_text(json.dumps({"device": kind, "jax": jax.__version__, "reps": args.reps or 11,
                              "results": gpu_ops.numbers(results)}, indent=1))
  print(f"\nwrote {path}")
  return 1 if bad else 0


def _suite(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
  """The kernel suite: pallet's Triton backend vs jax.numpy vs Pallas on Triton."""
  precision = args.matmul_precision or "highest"
  jax.config.update("jax_default_matmul_precision", precision)
  benches = gpu_benchmarks()
  if precision == "default":
    # TF32 keeps 10 mantissa bits of each float32 input: kernels with dots agree with
    # jax.numpy (itself TF32) only to about 1e-2, whoever rounds first.
    benches = [dataclasses.replace(b, rtol=max(b.rtol, TF32_TOLERANCE),
                                   atol=max(b.atol, TF32_TOLERANCE)) for b in benches]
  try:
    selected = catalog.select(benches, args.only)
  except ValueError as e:
    p.error(str(e))
  device = gpu_device()
  if device is None:
    print("pallet.bench.gpu: no GPU visible to JAX; skipping the GPU benchmarks.")
    return 0
  reps = args.reps or 21
  results = run_suite(selected, GPU_VARIANTS, reps=reps, peer=PeerPolicy(), seed=0,
                      device=device)
  print()
  print(report.format_table(results, GPU_COLUMNS))
  for note in report.footnotes(results):
    print(note)
  print()
  for line in report.summarize(results, GPU_COLUMNS).lines(targets=False):
    print(line)
  args.out.mkdir(parents=True, exist_ok=True)
  report.write_json(args.out / "perf_gpu.json", results, {"device": str(device),
                                                            "jax": jax.__version__,
                                                            "reps": reps,
                                                            "matmul_precision": precision},
                     GPU_COLUMNS)
  print(f"\nwrote {args.out / 'perf_gpu.json'}")
  return exit_code(results)


if __name__ == "__main__":
  sys.exit(main())
