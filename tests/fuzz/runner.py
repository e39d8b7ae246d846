"""Runs a case on pallet, on JAX's interpreter and on its model, and compares."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import traceback
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .apis import jax_api, pallet_api
from .case import Case, mismatch, to_numpy

_REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class Outcome:
  """`status` is "passed", "disagreed" or "skipped"; `reason` says why (for skips, a
  short stable phrase the campaign counts by)."""
  case: Case
  status: str
  reason: str = ""
  checked: tuple[str, ...] = ()
  pallet: str = ""

  def report(self) -> str:
    return (f"{self.status} ({self.pallet}): {self.reason}\n{self.case.describe()}\n"
            f"reproduce: python -m tests.fuzz --family {self.case.family} "
            f"--seed {self.case.seed} --verbose")


@dataclasses.dataclass
class _Result:
  value: Any = None
  error: BaseException | None = None
  trace: str = ""

  def describe_error(self) -> str:
    first = str(self.error).strip().splitlines()
    return f"{type(self.error).__name__}: {first[0] if first else ''}"


def _attempt(fn, *args) -> _Result:
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      return _Result(value=to_numpy(jax.block_until_ready(fn(*args))))
  except Exception as e:  # noqa: BLE001 - every failure is a result to report
    return _Result(error=e, trace=traceback.format_exc())


def run_case(case: Case, backend: str = "xla") -> Outcome:
  """Runs `case` on pallet's `backend` and on every oracle that applies."""
  outcome = _run_case(case, backend)
  outcome.pallet = pallet_api(backend, case.seed % 3 == 2).name
  return outcome


def _run_case(case: Case, backend: str) -> Outcome:
  if backend != "xla" and case.triton:
    return Outcome(case, "skipped", f"not expressible on Triton: {case.triton}")
  def inputs() -> tuple[jax.Array, ...]:   # fresh for every run: a run may donate them
    return tuple(jnp.asarray(x) for x in case.inputs)

  model = _attempt(case.model, *case.inputs) if case.model is not None else None
  if model is not None and model.error is not None:
    return Outcome(case, "disagreed", f"the model failed (generator bug): "
                   f"{model.describe_error()}\n{model.trace}")
  # One case in three runs the XLA backend with interpret=True (poisoned fresh memory).
  api = pallet_api(backend, case.seed % 3 == 2)
  pallet = _attempt(case.run, api, *inputs())
  jax_result = None
  if case.jax_oracle is None:
    jax_result = _attempt(case.run, jax_api(case.tpu_interpreter), *inputs())

  scale = case.tolerance_scale
  if pallet.error is not None:
    jax_refused = jax_result is not None and jax_result.error is not None
    if jax_refused and case.may_refuse:
      return Outcome(case, "skipped", f"pallet and JAX's interpreter both refuse "
                     f"({case.may_refuse})")
    also = f" (JAX's interpreter refused too: {jax_result.describe_error()})" if jax_refused else ""
    return Outcome(case, "disagreed",
                   f"pallet raised {pallet.describe_error()}{also}\n{pallet.trace}")
  jax_ran = jax_result is not None and jax_result.error is None
  notes = ""
  if jax_result is not None and jax_result.error is not None:
    notes = f"JAX interpreter refused: {_short(jax_result.describe_error())}"
  if model is not None:
    found = mismatch(pallet.value, model.value, scale=scale)
    if found:
      if jax_ran:
        jax_vs_model = mismatch(jax_result.value, model.value, scale=scale)
        found += ("; JAX interpreter agrees with the model" if jax_vs_model is None
                  else "; JAX interpreter differs from the model too")
      return Outcome(case, "disagreed", f"pallet != model: {found}")
  if jax_ran:
    found = mismatch(pallet.value, jax_result.value, scale=scale)
    if found and model is not None and _agrees_without_fusion(case, pallet.value, scale):
      notes = ("JAX interpreter right only when XLA does not fuse (an XLA:CPU miscompile, "
               "docs/fuzzing.md)")
    elif found:
      who = "pallet and the model agree" if model is not None else "no model"
      return Outcome(case, "disagreed", f"pallet != JAX interpreter ({who}): {found}")
  checked = tuple(name for name, used in (("model", model is not None), ("jax", jax_ran)) if used)
  if not checked:
    why = case.jax_oracle or notes
    return Outcome(case, "skipped", f"no oracle: JAX interpreter unusable ({why}) and no model")
  return Outcome(case, "passed", notes, checked)


_WITHOUT_FUSION = """
import sys, numpy as np, jax, jax.numpy as jnp
from tests.fuzz.families import generate
from tests.fuzz.apis import jax_api
case = generate(sys.argv[1], int(sys.argv[2]))
out = case.run(jax_api(case.tpu_interpreter), *(jnp.asarray(x) for x in case.inputs))
np.savez(sys.argv[3], *(np.asarray(a) for a in jax.tree_util.tree_leaves(out)))
"""


def _agrees_without_fusion(case: Case, expected: Any, scale: float) -> bool:
  """Whether JAX's interpreter gives `expected` when XLA does not fuse (a fresh process
  with `--xla_disable_hlo_passes=fusion`). XLA:CPU mis-compiles some updates of an
  array with values read from elsewhere in it (openxla/xla#49176), in the loop JAX's
  interpreter compiles as in any program; pallet guards against it
  (backends/xla/self_updates.py), JAX does not."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "out.npz")
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                                      + " --xla_disable_hlo_passes=fusion").strip())
    done = subprocess.run([sys.executable, "-c", _WITHOUT_FUSION, case.family,
                           str(case.seed), path], env=env, capture_output=True,
                          cwd=_REPOSITORY, timeout=600)
    if done.returncode != 0:
      return False
    with np.load(path) as saved:
      leaves = [saved[f"arr_{i}"] for i in range(len(saved.files))]
  treedef = jax.tree_util.tree_structure(expected)
  if treedef.num_leaves != len(leaves):
    return False
  return mismatch(expected, jax.tree_util.tree_unflatten(treedef, leaves), scale=scale) is None


def _short(text: str, limit: int = 120) -> str:
  return text if len(text) <= limit else text[:limit] + "..."
