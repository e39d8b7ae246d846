"""The oracle no project wrote for itself: a kernel of another project run on JAX's own
Pallas, its TPU kernels under JAX's TPU interpreter, in a child process.

`run_on_jax_pallas("tpu_inference.kernels.x.kernel", "fn", *args, **kwargs)` loads the
module from the project's checkout without routing its imports (the child process sets
`projects.PEER_VARIABLE`), calls `fn` inside `pltpu.force_tpu_interpret_mode()`, and
returns its result as NumPy arrays. A child process keeps JAX's Pallas and pallet's
routed copy of the same modules apart; arguments and results travel pickled, arrays as
NumPy arrays.
"""
from __future__ import annotations

import os
import pathlib
import pickle
import subprocess
import sys
import tempfile
from typing import Any

import jax
import numpy as np

from tests.foreign import projects

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_on_jax_pallas(dotted: str, function: str, *args: Any, timeout: int = 600,
                      **kwargs: Any) -> Any:
  """`dotted.function(*args, **kwargs)` on JAX's Pallas (TPU interpreter); skips the
  calling test when the project's checkout is not configured."""
  reason = projects.skip_reason(dotted.split(".")[0])
  if reason:
    import pytest
    pytest.skip(reason)
  with tempfile.TemporaryDirectory() as tmp:
    call, result = pathlib.Path(tmp, "call.pkl"), pathlib.Path(tmp, "result.pkl")
    project = projects.PROJECTS[dotted.split(".")[0]]
    call.write_bytes(pickle.dumps((project, dotted, function, _to_numpy(args),
                                   _to_numpy(kwargs))))
    env = {**os.environ, projects.PEER_VARIABLE: "1", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "tests.foreign.peer", tmp], cwd=_ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
      raise RuntimeError(f"{dotted}.{function} on JAX's Pallas failed:\n"
                         f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return pickle.loads(result.read_bytes())


def _to_numpy(tree: Any) -> Any:
  return jax.tree_util.tree_map(
      lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree)


def _main(tmp: str) -> None:
  from jax.experimental.pallas import tpu as jpltpu
  # Kernels size their blocks from pltpu.get_tpu_info(), which JAX answers for TPU
  # devices only: here it describes the chip pallet describes on a CPU (one TPU v5e
  # core). JAX 0.10 has no get_tpu_info.
  try:
    from jax._src import tpu_info
    tpu_info.registry[jax.devices()[0].device_kind] = (
        lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1))
  except ImportError:
    pass
  project, dotted, function, args, kwargs = pickle.loads(
      pathlib.Path(tmp, "call.pkl").read_bytes())
  projects.PROJECTS[dotted.split(".")[0]] = project
  module = projects.load(dotted)
  with jpltpu.force_tpu_interpret_mode(jpltpu.InterpretParams()):
    out = getattr(module, function)(*args, **kwargs)
    out = jax.block_until_ready(out)
  pathlib.Path(tmp, "result.pkl").write_bytes(pickle.dumps(_to_numpy(out)))


if __name__ == "__main__":
  _main(sys.argv[1])
