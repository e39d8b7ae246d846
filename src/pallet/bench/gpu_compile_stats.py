"""Compile statistics of every pallet.ops kernel, without a GPU.

    python -m pallet.bench.gpu_compile_stats            # print the table
    python -m pallet.bench.gpu_compile_stats --write    # into docs/performance.md and
                                                      # docs/ops/gpu_defaults.md
    python -m pallet.bench.gpu_compile_stats --check    # CI: exit 1 if either is stale

For each op program of `pallet.bench.gpu_op_cases` at the issue's shapes (bf16), traced
with the launch table of each target (`pallet.ops.launch_table.using_device`), every
kernel is compiled by Triton for sm_90, sm_80 and gfx942 and reported with: its
launch parameters, registers per thread, spilled bytes, shared memory (LDS), the
occupancy those imply on the device (CTAs and warps per SM/CU, and which resource
limits it), its programs, FLOPs and bytes per launch. A kernel that spills, or fits
fewer than two CTAs per SM on sm_90, needs a note in its launch-table entry saying
why; `--check` fails where one is missing. Device limits: see DEVICES.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax

from pallet.bench.paths import DOCS_DIR

BEGIN = "<!-- gpu-compile-stats: begin (python -m pallet.bench.gpu_compile_stats --write) -->"
END = "<!-- gpu-compile-stats: end -->"
TABLES_BEGIN = "<!-- launch-tables: begin (python -m pallet.bench.gpu_compile_stats --write) -->"
TABLES_END = "<!-- launch-tables: end -->"
DOCS = DOCS_DIR
STATS_PAGE = "performance.md"
TABLES_PAGE = "ops/gpu_defaults.md"


@dataclasses.dataclass(frozen=True)
class Device:
  """Per-SM (NVIDIA) or per-CU (AMD) limits that bound occupancy.

  NVIDIA: CUDA C++ Programming Guide, "Technical Specifications per Compute
  Capability" (8.0: 64K 32-bit registers, 164 KB shared memory, 64 warps, 32 blocks
  per SM; 9.0: the same with 228 KB), registers allocated per warp in units of 256,
  and 1 KB of shared memory reserved per block (sm_80 and later). AMD CDNA3 (MI300,
  gfx942): 4 SIMDs per CU, at most 8 waves per SIMD, 512 VGPRs per lane and SIMD shared
  by a wave's VGPRs and AGPRs (allocated in granules of 8), 64 KB of LDS per CU
  (AMD Instinct MI300 ISA and CDNA3 white paper; LLVM AMDGPU's occupancy model,
  `llvm-calc-occupancy`)."""
  name: str
  target: tuple
  units: int                 # SMs or CUs of the reference part (H100 SXM, A100, MI300X)
  registers: int             # per SM (NVIDIA) / per SIMD lane (AMD)
  shared: int                # bytes per SM / CU
  max_warps: int             # per SM / per CU (waves)
  max_blocks: int            # per SM / CU
  reserved_shared: int = 0   # per block


DEVICES = {
    "sm_90": Device("sm_90", ("cuda", 90, 32), 132, 65536, 228 * 1024, 64, 32, 1024),
    "sm_80": Device("sm_80", ("cuda", 80, 32), 108, 65536, 164 * 1024, 64, 32, 1024),
    "gfx942": Device("gfx942", ("hip", "gfx942", 64), 304, 512, 64 * 1024, 32, 32),
}


@dataclasses.dataclass
class Row:
  case: str
  kernel: str
  device: str
  params: str
  warps: int
  stages: int
  registers: int
  spilled: int
  shared: int
  ctas: int
  limit: str
  programs: int
  gflop: float
  mbytes: float
  note: str

  @property
  def needs_reason(self) -> bool:
    return self.device == "sm_90" and (self.spilled > 0 or self.ctas < 2)


# ------------------------------------------------------------------ reading binaries
@functools.lru_cache(maxsize=None)
def _cuobjdump() -> str:
  from triton.backends.nvidia.compiler import get_ptxas
  return os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")


def nvidia_usage(cubin: bytes) -> tuple[int, int]:
  """(registers per thread, stack + local bytes per thread: where ptxas spills) of a
  cubin."""
  with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(cubin)
    f.flush()
    out = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name],
                         capture_output=True, text=True, check=True).stdout
  found = re.search(r"REG:(\d+) STACK:(\d+).*?LOCAL:(\d+)", out)
  if not found:
    raise RuntimeError(f"cuobjdump printed no resource usage:\n{out}")
  return int(found.group(1)), int(found.group(2)) + int(found.group(3))


def amd_usage(amdgcn: str) -> tuple[int, int]:
  """(VGPRs + AGPRs per lane, spilled registers + scratch bytes) of an AMDGPU kernel."""
  total = re.search(r"TotalNumVgprs:\s*(\d+)", amdgcn)
  spills = sum(int(n) for n in re.findall(r"\.[sv]gpr_spill_count:\s*(\d+)", amdgcn))
  scratch = sum(int(n) for n in re.findall(r"ScratchSize:\s*(\d+)", amdgcn))
  return int(total.group(1)), spills + scratch


def occupancy(device: Device, registers: int, warps: int, shared: int) -> tuple[int, str]:
  """(blocks resident per SM/CU, the resource that limits it)."""
  if device.target[0] == "cuda":
    per_warp = math.ceil(registers * 32 / 256) * 256
    by = {"registers": device.registers // (per_warp * warps),
          "warps": device.max_warps // warps, "blocks": device.max_blocks}
  else:
    per_wave = max(8, math.ceil(registers / 8) * 8)
    waves_per_simd = min(8, device.registers // per_wave)
    by = {"registers": waves_per_simd * 4 // warps,
          "warps": device.max_warps // warps, "blocks": device.max_blocks}
  if shared:
    by["shared memory"] = device.shared // (shared + device.reserved_shared)
  limit = min(by, key=lambda k: (by[k], k != "registers"))
  return by[limit], limit


# ------------------------------------------------------------------ compiling
def kernels_of(fn: Any, *args: Any) -> list:
  """The kernel descriptions of every pallas_call fn(*args) launches, in order."""
  from pallet.pallas_call import pallas_call_p
  found = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive is pallas_call_p:
        found.append(eqn.params["kernel"])
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub.jaxpr if hasattr(sub, "jaxpr") else sub)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def _launch_of(case: Any, device: str) -> tuple[list, dict[str, Any]]:
  """The kernels of `case` traced with `device`'s table, and the Launch it looked up."""
  import pallet as pl
  from pallet.ops import launch_table
  with pl.default_backend("triton"), launch_table.using_device(device), \
      launch_table.recording() as launches:
    kernels = kernels_of(case.pallet, *case.abstract_inputs())
  by_op = {launch.op: launch for launch in launches}
  return kernels, by_op


def stats(case: Any, device_name: str) -> list[Row]:
  """One row per kernel of `case` compiled for `device_name`."""
  from triton.backends.compiler import GPUTarget
  from pallet.backends.triton import compiler, generated
  device = DEVICES[device_name]
  kernels, launches = _launch_of(case, device_name)
  names = [k.name for k in kernels]
  expected = [k[0] for k in case.kernels]
  if names != expected:
    raise RuntimeError(f"{case.name}: launches {names}, the case lists {expected}")
  launch = launches.get(case.op)
  rows = []
  for kd, (_, section, flops) in zip(kernels, case.kernels):
    gen = generated(kd)
    compiled = compiler.compile_kernel(gen, GPUTarget(*device.target))
    meta = compiled.metadata
    if device.target[0] == "cuda":
      registers, spilled = nvidia_usage(compiled.asm["cubin"])
    else:
      registers, spilled = amd_usage(compiled.asm["amdgcn"])
    ctas, limit = occupancy(device, registers, meta.num_warps, meta.shared)
    io = kd.grid_mapping
    mbytes = sum(math.prod(b.array_shape) * b.dtype.itemsize
                 for b in list(io.inputs) + list(io.outputs)) / 1e6
    rows.append(Row(case.name, kd.name, device_name, _params_text(launch, section),
                    meta.num_warps, meta.num_stages, registers, spilled, meta.shared,
                    ctas, limit, gen.schedule.num_programs, flops / 1e9, mbytes,
                    launch.notes.get(section, "") if launch else ""))
  return rows


def _params_text(launch: Any, section: str) -> str:
  if launch is None:
    return "(user tiles)"
  params = launch.sections.get(section, {})
  blocks = [f"{k.removeprefix('block_')}{v}" for k, v in params.items()
            if k not in ("num_warps", "num_stages") and v is not None]
  return f"{section}: " + " ".join(blocks) if blocks else section


def compile_cases() -> list:
  """The programs whose kernels are reported: one per kernel kind, at the issue's shapes."""
  from pallet.bench import gpu_op_cases
  cases = [c for c in gpu_op_cases.all_cases("full") if c.kernels]
  with_backward = {c.op for c in cases if "fwd+bwd" in c.name}
  return [c for c in cases if "fwd+bwd" in c.name or c.op not in with_backward]


def collect(devices: list[str], only: list[str]) -> list[Row]:
  rows = []
  for case in compile_cases():
    if only and not any(o in case.name for o in only):
      continue
    for device in devices:
      print(f"compiling {case.name} for {device} ...", file=sys.stderr, flush=True)
      rows.extend(stats(case, device))
  return rows


# ------------------------------------------------------------------ the table
HEAD = ("program", "kernel", "GPU", "tiles", "warps", "stages", "regs", "spill B",
        "smem KiB", "CTAs/SM", "warps/SM", "limited by", "programs", "GFLOP", "MB", "why")
# "why": the launch-table entry's note, on rows that spill or fit one CTA per SM


def table(rows: list[Row]) -> str:
  lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
  for r in rows:
    gflop = f"{r.gflop:.1f}" if r.gflop else "-"
    cells = (r.case, f"`{r.kernel}`", r.device, r.params, r.warps, r.stages, r.registers,
             r.spilled, f"{r.shared / 1024:.1f}", r.ctas, r.ctas * r.warps, r.limit,
             r.programs, gflop, f"{r.mbytes:.0f}",
             r.note if r.spilled or r.ctas < 2 else "")
    lines.append("| " + " | ".join(str(c) for c in cells) + " |")
  return "\n".join(lines)


def launch_tables_markdown() -> str:
  """Every entry of the shipped launch tables, per GPU: where it applies, its sections'
  parameters, its source and note."""
  from pallet.ops import launch_table
  out = []
  for device in launch_table.DEVICES:
    data = json.loads((launch_table.SHIPPED_DIR / f"{device}.json").read_text())
    out += [f"### {device}", "", data.get("about", ""), "",
            "| op | when | parameters per section | source | note |", "|---|---|---|---|---|"]
    for op, entries in launch_table.shipped(device).items():
      for e in entries:
        when = ", ".join(f"{k} {_range(v)}" for k, v in e.when.items()) or "always"
        params = "<br>".join(
            f"**{sec}**: " + (", ".join(f"{k} {v}" for k, v in p.items() if v is not None)
                              or "the backend's own")
            for sec, p in e.sections.items())
        out.append(f"| {op} | {when} | {params} | {e.source} | {e.note} |")
    out.append("")
  return "\n".join(out).rstrip()


def _range(value: Any) -> str:
  if isinstance(value, list):
    low, high = value
    return (f">= {low}" if high is None else f"<= {high}" if low is None
            else f"{low}..{high}")
  return f"= {str(value).lower() if isinstance(value, bool) else value}"


def missing_reasons(rows: list[Row]) -> list[Row]:
  return [r for r in rows if r.needs_reason and not r.note]


def splice(text: str, block: str, begin: str = BEGIN, end: str = END) -> str:
  """`text` with the part between the `begin` and `end` markers replaced by `block`."""
  if begin not in text or end not in text:
    raise ValueError(f"the page has no {begin!r} ... {end!r} markers")
  head, rest = text.split(begin, 1)
  _, tail = rest.split(end, 1)
  return f"{head}{begin}\n{block}\n{end}{tail}"


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m pallet.bench.gpu_compile_stats",
                              description=__doc__.splitlines()[0])
  p.add_argument("--write", action="store_true",
                 help=f"replace the tables between the markers in {STATS_PAGE} and "
                      f"{TABLES_PAGE}")
  p.add_argument("--check", action="store_true",
                 help="exit 1 if either page's table differs from a fresh one (CI)")
  p.add_argument("--docs", type=Path, default=DOCS, metavar="DIR",
                 help="the docs directory (default: the repository's)")
  p.add_argument("--device", action="append", choices=sorted(DEVICES), default=[],
                 help="only these targets (default: sm_90, sm_80, gfx942)")
  p.add_argument("--only", action="append", default=[], metavar="NAME",
                 help="only programs whose name contains NAME")
  args = p.parse_args(argv)
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
  devices = args.device or ["sm_90", "sm_80", "gfx942"]
  rows = collect(devices, args.only)
  block = table(rows)
  print(block)
  code = 0
  for r in missing_reasons(rows):
    print(f"MISSING REASON: {r.case} {r.kernel} on {r.device}: "
          f"{'spills' if r.spilled else f'{r.ctas} CTA(s) per SM'} and its launch-table "
          f"entry has no note saying why", file=sys.stderr)
    code = 1
  pages = [(args.docs / STATS_PAGE, block, BEGIN, END),
           (args.docs / TABLES_PAGE, launch_tables_markdown(), TABLES_BEGIN, TABLES_END)]
  if args.only or args.device:
    if args.write or args.check:
      p.error("--write and --check need every program on every GPU (no --only, --device)")
    return code
  for page, text, begin, end in pages:
    old = page.read_text()
    new = splice(old, text, begin, end)
    if args.write and new != old:
      page.write_text(new)
      print(f"wrote {page}", file=sys.stderr)
    elif args.check and new != old:
      print(f"{page}: stale; regenerate with python -m pallet.bench.gpu_compile_stats "
            f"--write", file=sys.stderr)
      code = 1
  return code


if __name__ == "__main__":
  sys.exit(main())
