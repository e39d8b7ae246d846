"""Helpers for tests that compile generated kernels (no interpreter, no GPU)."""
from __future__ import annotations

import functools
import re
import subprocess
import tempfile
from typing import Any, Callable

import jax

from pallet.backends.triton import compiler, generated
from pallet.pallas_call import pallas_call_p

TARGETS = {"sm80": ("cuda", 80, 32), "sm90": ("cuda", 90, 32), "gfx942": ("hip", "gfx942", 64)}


def kernels_of(fn: Callable, *args: Any) -> list:
  """The kernel descriptions of every pallas_call that `fn(*args)` launches."""
  found = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive is pallas_call_p:
        found.append(eqn.params["kernel"])
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub.jaxpr if hasattr(sub, "jaxpr") else sub)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def compile_for(kernel: Any, target: str) -> Any:
  from triton.backends.compiler import GPUTarget
  return compiler.compile_kernel(generated(kernel), GPUTarget(*TARGETS[target]))


@functools.lru_cache(maxsize=None)
def _ptxas_path() -> str:
  from triton.backends.nvidia.compiler import get_ptxas
  return get_ptxas(80).path


def spill_bytes(ptx: str, arch: int = 80) -> int:
  """Bytes of register spills ptxas reports for a PTX module (stores + loads)."""
  with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
    f.write(ptx)
    f.flush()
    out = subprocess.run([_ptxas_path(), "-v", f"--gpu-name=sm_{arch}", f.name, "-o",
                          "/dev/null"], capture_output=True, text=True, check=True)
  spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", out.stdout + out.stderr)
  return sum(int(s) for s in spills)
