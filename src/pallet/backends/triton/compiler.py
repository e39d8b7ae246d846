"""Generated source -> a Python module -> a compiled GPU kernel.

The source is written to pallet's cache directory under a name derived from its
hash and imported from there (Triton reads a kernel's source with `inspect`, so
it must live in a real file). Compiling for a `GPUTarget` goes through
`triton.compile`, whose on-disk cache (TRITON_CACHE_DIR, ~/.triton/cache)
stays on; in-process, each (source, target, options) compiles once.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
from types import ModuleType
from typing import Any

from pallet.backends.triton.codegen import GeneratedKernel
from pallet.errors import TritonLoweringError

DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3


def cache_dir() -> str:
  root = os.environ.get("PALLET_CACHE_DIR") or os.path.join(
      os.path.expanduser("~"), ".cache", "pallet")
  path = os.path.join(root, "triton_source")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    path = os.path.join(tempfile.gettempdir(), "pallet_triton_source")
    os.makedirs(path, exist_ok=True)
  return path


@functools.lru_cache(maxsize=1024)
def load_module(source: str, interpret: bool) -> ModuleType:
  """Imports the generated source; under `interpret` its `@triton.jit`
  functions become Triton interpreter functions (interpreter.py then runs libdevice
  on numpy)."""
  import triton
  digest = hashlib.sha256(source.encode()).hexdigest()[:16]
  path = os.path.join(cache_dir(), f"pallet_kernel_{digest}.py")
  if not os.path.exists(path):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      f.write(source)
    os.replace(tmp, path)
  name = f"pallet_kernel_{digest}_{'interpreted' if interpret else 'compiled'}"
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  knobs = triton.knobs.runtime
  previous = knobs.interpret
  knobs.interpret = interpret
  try:
    spec.loader.exec_module(module)
  finally:
    knobs.interpret = previous
  sys.modules[name] = module
  return module


def options_of(kernel_params: Any, default_warps: int = DEFAULT_NUM_WARPS) -> tuple[int, int]:
  """(num_warps, num_stages) from a kernel's compiler params (pallet.triton.CompilerParams)."""
  warps = getattr(kernel_params, "num_warps", None) or default_warps
  stages = getattr(kernel_params, "num_stages", None) or DEFAULT_NUM_STAGES
  return int(warps), int(stages)


# Shared memory (CUDA) or LDS (AMD) one program may use, in bytes, by target: CUDA's
# opt-in per-block maxima and AMD CDNA's LDS. Targets not listed are not checked here.
SHARED_MEMORY_LIMITS = {
    ("cuda", 75): 65536, ("cuda", 80): 166912, ("cuda", 86): 101376, ("cuda", 87): 166912,
    ("cuda", 89): 101376, ("cuda", 90): 232448, ("cuda", 100): 232448,
    ("cuda", 120): 101376, ("hip", "gfx90a"): 65536, ("hip", "gfx942"): 65536,
}


def compile_kernel(generated: GeneratedKernel, target: Any, num_warps: int | None = None,
                   num_stages: int | None = None) -> Any:
  """The `triton.compile`d kernel for `target` (a triton GPUTarget).

  Triton pipelines loads inside loops over `num_stages` buffers. Where the user did not
  choose `num_stages` and the default asks for more shared memory than the target has
  (a 128x128 float32 tile pair over 3 stages is 384 KiB), fewer stages are used, as
  Triton's autotuner would prune that config, and likewise for a `TableCompilerParams`
  num_stages (a per-device table's default); a choice the user made is an error."""
  kernel = generated.kernel
  check_target(generated.cuda_requirement, target, f"kernel '{kernel.name}' ({kernel.source})")
  warps, stages = options_of(kernel.compiler_params, generated.default_num_warps)
  chosen = num_stages or getattr(kernel.compiler_params, "num_stages", None)
  key = _target_key(target)
  limit = SHARED_MEMORY_LIMITS.get((target.backend, target.arch))
  for tried in range(int(chosen or stages), 0, -1):
    compiled = _compile(generated.source, generated.function_name,
                        tuple(generated.signature.items()), key, num_warps or warps, tried)
    used = getattr(compiled.metadata, "shared", 0) or 0
    if limit is None or used <= limit:
      return compiled
    if chosen and not getattr(kernel.compiler_params, "stages_shrink_to_fit", False):
      break
  raise TritonLoweringError(
      f"pallet Triton backend: kernel '{kernel.name}' ({kernel.source}) needs {used} bytes "
      f"of shared memory with num_stages={tried}, more than {target.backend} "
      f"{target.arch} has ({limit}); use smaller blocks"
      + ("" if not chosen else " or a smaller num_stages in pallet.triton.CompilerParams"))


def check_target(requirement: tuple[int, str] | None, target: Any, what: str) -> None:
  """A clear error where Triton cannot compile the kernel for this CUDA GPU."""
  if requirement is None or target.backend != "cuda" or target.arch >= requirement[0]:
    return
  capability, why = requirement
  raise TritonLoweringError(
      f"pallet Triton backend: {what} {why}, which Triton compiles for CUDA compute "
      f"capability {capability // 10}.{capability % 10} and newer; this GPU is sm_{target.arch}. "
      f"Run it on the XLA backend (backend='xla')")


def _target_key(target: Any) -> tuple:
  return (target.backend, target.arch, target.warp_size)


@functools.lru_cache(maxsize=512)
def _compile(source: str, function_name: str, signature: tuple, target_key: tuple,
             num_warps: int, num_stages: int) -> Any:
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource
  fn = getattr(load_module(source, False), function_name)
  sig = dict(signature)
  # Every pointer pallet passes is 16-byte aligned (XLA buffers, the workspace).
  attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values())
           if t.startswith("*")}
  src = ASTSource(fn=fn, signature=sig, attrs=attrs)
  return triton.compile(src, target=GPUTarget(*target_key),
                        options={"num_warps": num_warps, "num_stages": num_stages})


# ------------------------------------------------------------------ recorded kernels
def dump(generated: GeneratedKernel, directory: str) -> str:
  """Records a generated kernel (source, signature, options) as JSON in `directory`,
  so that another process can compile it for other targets (see `compile_recorded`)."""
  warps, stages = options_of(generated.kernel.compiler_params, generated.default_num_warps)
  record = {"kernel": generated.kernel.name, "where": generated.kernel.source,
            "function_name": generated.function_name, "signature": generated.signature,
            "num_warps": warps, "num_stages": stages, "source": generated.source,
            "cuda_requirement": generated.cuda_requirement}
  digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:20]
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f"{digest}.json")
  if not os.path.exists(path):
    with open(path, "w") as f:
      json.dump(record, f, indent=1)
  return path


def compile_recorded(record: dict, target: Any) -> Any:
  """Compiles a kernel recorded by `dump` for `target`."""
  requirement = record.get("cuda_requirement")
  check_target(tuple(requirement) if requirement else None, target,
               f"kernel '{record['kernel']}' ({record['where']})")
  return _compile(record["source"], record["function_name"],
                  tuple(record["signature"].items()), _target_key(target),
                  record["num_warps"], record["num_stages"])
