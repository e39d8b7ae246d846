"""The differential fuzzer under pytest (docs/fuzzing.md): fixed seeds of every family
run on the backend under test and on every oracle that applies; a disagreement fails
the test named `family-seed`, reproducible with `python -m tests.fuzz --family FAMILY
--seed SEED --verbose`. The long run (`-m slow`) takes more seeds.

On the Triton backend (`PALLET_TEST_BACKEND=triton TRITON_INTERPRET=1`, own process)
the families that Triton cannot express (DMAs, emit_pipeline) skip with the reason.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import current_test_backend

from .apis import jax_api, pallet_api
from .case import Case, mismatch, poison
from .families import NAMES, generate
from .runner import run_case

BACKEND = current_test_backend()
SHORT_SEEDS = range(4)
LONG_SEEDS = range(100, 130)

# Seeds that hit a known bug on a backend: strict xfails, so each must come off this
# list when its fix lands. (backend, case id) -> the bug. Issue 28's four bugs were
# found here (retrace, scratch and pipeline seeds) and are fixed.
KNOWN: dict[tuple[str, str], str] = {}


def _params(seeds: range) -> list:
  params = []
  for family in NAMES:
    for seed in seeds:
      case_id = f"{family}-{seed}"
      reason = KNOWN.get((BACKEND, case_id))
      marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
      params.append(pytest.param(family, seed, id=case_id, marks=marks))
  return params


def _check(family: str, seed: int) -> None:
  outcome = run_case(generate(family, seed), BACKEND)
  if outcome.status == "skipped":
    pytest.skip(outcome.reason)
  assert outcome.status == "passed", outcome.report()


@pytest.mark.parametrize("family,seed", _params(SHORT_SEEDS))
def test_fuzz(family: str, seed: int):
  _check(family, seed)


@pytest.mark.slow
@pytest.mark.parametrize("family,seed", _params(LONG_SEEDS))
def test_fuzz_long(family: str, seed: int):
  _check(family, seed)


# ------------------------------------------------------------------ the fuzzer itself
@pytest.mark.parametrize("family", NAMES)
def test_a_seed_gives_the_same_case_every_time(family):
  a, b = generate(family, 7), generate(family, 7)
  assert a.describe() == b.describe()
  assert len(a.inputs) == len(b.inputs)
  for x, y in zip(a.inputs, b.inputs):
    assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes())
  assert generate(family, 8).describe() != a.describe()


def test_blocks_rejects_a_padding_store_that_a_later_program_overwrites():
  """Program 0 copies the edge block of a 6-element input (two lanes past its end)
  into the output's only block; program 1 overwrites it with the full first block. The
  final output holds no padding, but program 0 stored some where the output holds data
  (the checking mode reports that store), so the generator must redraw."""
  from .families import blocks
  from .layout import Dim, Layout
  x = Layout((6,), (Dim("blocked", 4, ("rev", 0, False)),))
  out = Layout((4,), (Dim("blocked", 4, ("const", 0)),))
  draw = dict(grid=(2,), ins=[x], outs=[out], exprs=[("in", 0)], tables=[])
  written, padded = blocks._coverage(draw)
  assert written[0].all()
  assert padded[0].tolist() == [False, False, True, True]
  clean = dict(draw, ins=[Layout((8,), x.dims)])     # no edge block: nothing to report
  assert not blocks._coverage(clean)[1][0].any()


# Seeds whose kernels stored block padding into output data before the generator
# counted overwritten stores (docs/fuzzing.md); now redrawn.
_PADDING_SEEDS = [("blocks", 1), ("blocks", 7), ("blocks", 11), ("prefetch", 2),
                  ("prefetch", 5), ("prefetch", 6), ("prefetch", 15)]


@pytest.mark.parametrize("family,seed", _PADDING_SEEDS, ids=[f"{f}-{s}" for f, s in _PADDING_SEEDS])
def test_generated_blocks_pass_the_checking_mode(family, seed, monkeypatch):
  monkeypatch.setenv("PALLET_CHECKS", "1")
  _check(family, seed)


def _half_written_case(writes_all: bool) -> Case:
  """A kernel that (unless `writes_all`) leaves the second half of its output, aliased
  to a poisoned buffer, unwritten; its model says the whole output is 2 x."""
  def run(api, x, buffer):
    import jax

    def kernel(x_ref, buf_ref, o_ref):
      if writes_all:
        o_ref[...] = x_ref[...] * 2
      else:
        o_ref[:4] = x_ref[:4] * 2
    return api.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                           input_output_aliases={1: 0})(x, buffer)

  x = np.arange(1, 9, dtype=np.float32)
  return Case(family="handmade", seed=0, description={}, inputs=(x, poison((8,), np.float32)),
              run=run, model=lambda x, buffer: x * 2)


def test_an_unwritten_output_element_is_a_disagreement():
  assert run_case(_half_written_case(writes_all=True), BACKEND).status == "passed"
  outcome = run_case(_half_written_case(writes_all=False), BACKEND)
  assert outcome.status == "disagreed"
  assert "4 of 8 elements differ" in outcome.reason


def test_a_wrong_model_is_a_disagreement():
  case = generate("blocks", 0)
  model = case.model
  case.model = lambda *args: [o + 1 if o.dtype.kind != "b" else o for o in model(*args)]
  outcome = run_case(case, BACKEND)
  assert outcome.status == "disagreed" and "pallet != model" in outcome.reason


def test_jax_interpreter_counts_a_repeated_atomic_index_once():
  """The known oracle error the atomics family works around (docs/fuzzing.md): JAX's
  discharge of atomic_add applies an index repeated within one call once; pallet and
  the model count every lane. If JAX fixes this, the atomics family can use it."""
  import jax

  def run(api, idx, values, init):
    def kernel(i_ref, v_ref, init_ref, o_ref):
      api.plgpu.atomic_add(o_ref, (i_ref[...],), v_ref[...])
    return api.pallas_call(kernel, jax.ShapeDtypeStruct((4,), jnp.float32),
                           input_output_aliases={2: 0})(idx, values, init)

  idx = jnp.array([0, 1, 1, 3, 0, 0], jnp.int32)
  values = jnp.arange(1, 7, dtype=jnp.float32)
  init = jnp.zeros(4, jnp.float32)
  expected = np.array([1 + 5 + 6, 2 + 3, 0, 4], np.float32)
  assert mismatch(np.asarray(run(pallet_api(BACKEND), idx, values, init)), expected) is None
  assert mismatch(np.asarray(run(jax_api(False), idx, values, init)), expected) is not None


def test_command_line_counts_outcomes(capsys):
  from .__main__ import main
  assert main(["--family", "retrace", "--seed", "1", "--backend", BACKEND]) in (0, 1)
  assert "retrace: 1 cases" in capsys.readouterr().out
