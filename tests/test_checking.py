"""Checking mode (pallet/checking): each kind of report, on a bug and on its fixed twin.

Every case runs on the XLA backend; the `triton` variants run the generated Triton
code under Triton's interpreter (own process: `PALLET_TEST_BACKEND=triton
TRITON_INTERPRET=1 pytest tests/test_checking.py -o addopts="" -m triton_interpret`).
A bug must raise `pl.KernelCheckError` naming the kind, the kernel, the grid index,
the ref and the line marked `# <- bug`; the twin must match jax.numpy.
"""
from __future__ import annotations

import inspect
import os

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import pallet as pl
import pallet.tpu as pltpu
from helpers import assert_close, random_array, current_test_backend

F32 = jnp.float32
CHECKED = pl.InterpretParams(detect_races=True, out_of_bounds_reads="raise",
                             uninitialized_memory="nan")
ALL = pl.InterpretParams(detect_races=True, detect_nans=True, detect_int_overflow=True,
                         detect_unwritten_outputs=True, debug_checks=True)
PARALLEL = pltpu.CompilerParams(dimension_semantics=("parallel",))
_TRITON = os.environ.get("TRITON_INTERPRET") == "1"

BACKENDS = [
    "xla",
    pytest.param("triton", marks=[
        pytest.mark.triton_interpret,
        pytest.mark.skipif(not _TRITON, reason="needs TRITON_INTERPRET=1 (own process)")]),
]


def _marked_line(fn, marker: str = "# <- bug") -> int:
  lines, first = inspect.getsourcelines(fn)
  hits = [first + i for i, text in enumerate(lines) if marker in text]
  assert len(hits) == 1, hits
  return hits[0]


def _expect(call, *args, kind: str, ref: str | None, fn, grid_index=None):
  with pytest.raises(pl.KernelCheckError) as info:
    jax.block_until_ready(call(*args))
  err = info.value
  assert err.kind == kind, str(err)
  assert err.ref == ref, str(err)
  assert err.line.endswith(f"{os.path.basename(__file__)}:{_marked_line(fn)}"), str(err)
  if grid_index is not None:
    assert err.grid_index == grid_index, str(err)
  for part in (kind, err.kernel, err.line):
    assert part in str(err)
  return err


def _kw(backend: str, interpret=CHECKED) -> dict:
  return dict(backend=backend, interpret=interpret)


# ------------------------------------------------------------------ out of bounds
def _halo(bug: bool, backend: str):
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    nxt = i + 1 if bug else jnp.minimum(i + 1, 7)
    o_ref[...] = x_ref[pl.ds(i * 16, 16)] + x_ref[pl.ds(nxt * 16, 16)]  # <- bug
  return kernel, pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128,), F32), grid=(8,),
                                out_specs=pl.BlockSpec((16,), lambda i: (i,)), **_kw(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_slice_past_the_end(backend):
  x = random_array((128,))
  kernel, call = _halo(True, backend)
  _expect(call, x, kind="out_of_bounds", ref="x_ref", fn=kernel, grid_index=(7,))
  _, call = _halo(False, backend)
  blocks = x.reshape(8, 16)
  assert_close(call(x), (blocks + blocks[jnp.minimum(jnp.arange(8) + 1, 7)]).reshape(-1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_static_index_past_the_end(backend):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] - x_ref[200]  # <- bug

  # known while tracing: an error then, checked or not (pallet/core/static_bounds.py)
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128,), F32), **_kw(backend))
  with pytest.raises(pl.PalletError) as info:
    call(random_array((128,)))
  for part in ("index 200", "input 0 ('x_ref')", "(128,)",
               f"{os.path.basename(__file__)}:{_marked_line(kernel)}"):
    assert part in str(info.value), str(info.value)

  def twin(x_ref, o_ref):
    o_ref[...] = x_ref[...] - x_ref[-1]   # static negative indices count from the end

  x = random_array((128,))
  call = pl.pallas_call(twin, out_shape=jax.ShapeDtypeStruct((128,), F32), **_kw(backend))
  assert_close(call(x), x - x[-1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_array_index_out_of_range(backend):
  def kernel(x_ref, idx_ref, o_ref):
    o_ref[...] = x_ref[idx_ref[...]]  # <- bug

  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), F32), **_kw(backend))
  x = random_array((64,))
  bad = jnp.arange(16, dtype=jnp.int32) * 5   # 75 > 63
  _expect(call, x, bad, kind="out_of_bounds", ref="x_ref", fn=kernel)
  good = jnp.arange(16, dtype=jnp.int32) * 4
  assert_close(call(x, good), x[good])


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_leaves_out_of_range_lanes_enabled(backend):
  n, b = 100, 32

  def build(bug):
    def kernel(x_ref, o_ref):
      offs = pl.program_id(0) * b + jnp.arange(b)
      mask = offs <= n if bug else offs < n
      x = pl.load(x_ref, pl.ds(pl.program_id(0) * b, b), mask=mask, other=0.0)  # <- bug
      pl.store(o_ref, pl.ds(pl.program_id(0) * b, b), 2.0 * x, mask=offs < n)
    return kernel, pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), F32),
                                  grid=(pl.cdiv(n, b),), **_kw(backend))

  x = random_array((n,))
  kernel, call = build(True)
  _expect(call, x, kind="out_of_bounds", ref="x_ref", fn=kernel, grid_index=(3,))
  assert_close(build(False)[1](x), 2.0 * x)


def test_value_gather_and_dynamic_slice_out_of_range():
  def kernel(x_ref, i_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = lax.dynamic_slice(x, (i_ref[0],), (8,))  # <- bug

  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), F32), interpret=CHECKED)
  x = random_array((32,))
  _expect(call, x, jnp.array([30], jnp.int32), kind="out_of_bounds", ref=None, fn=kernel)
  assert_close(call(x, jnp.array([24], jnp.int32)), x[24:])

  def gather(x_ref, i_ref, o_ref):
    o_ref[...] = jnp.take(x_ref[...], i_ref[...], mode="clip")  # <- bug

  call = pl.pallas_call(gather, out_shape=jax.ShapeDtypeStruct((4,), F32), interpret=CHECKED)
  _expect(call, x, jnp.array([0, 5, 40, 1], jnp.int32), kind="out_of_bounds", ref=None,
          fn=gather)
  assert_close(call(x, jnp.array([0, 5, 31, 1], jnp.int32)), x[jnp.array([0, 5, 31, 1])])


# ------------------------------------------------------------------ index maps
@pytest.mark.parametrize("backend", BACKENDS)
def test_index_map_returning_element_offsets(backend):
  def build(bug):
    if bug:
      spec = pl.BlockSpec((16,), lambda i: (i * 16,))  # <- bug
    else:
      spec = pl.BlockSpec((16,), lambda i: (i,))

    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] + 1.0
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64,), F32), grid=(4,),
                          in_specs=[spec], out_specs=pl.BlockSpec((16,), lambda i: (i,)),
                          **_kw(backend))

  x = random_array((64,))
  _expect(build(True), x, kind="index_map", ref="x_ref", fn=test_index_map_returning_element_offsets,
          grid_index=(1,))
  assert_close(build(False)(x), x + 1.0)


def test_index_map_from_scalar_prefetch_checked_at_run_time():
  def build(bug):
    def x_map(i, ids_ref):
      return (ids_ref[i] if bug else ids_ref[i] - 1, 0)  # <- bug

    def kernel(ids_ref, x_ref, o_ref):
      o_ref[...] = 2.0 * x_ref[...]

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(4,), in_specs=[pl.BlockSpec((16, 16), x_map)],
        out_specs=pl.BlockSpec((16, 16), lambda i, ids_ref: (i, 0)))
    return x_map, pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64, 16), F32),
                                 grid_spec=grid_spec, interpret=CHECKED)

  ids = jnp.array([4, 1, 3, 2], jnp.int32)
  x = random_array((64, 16))
  x_map, call = build(True)
  _expect(call, ids, x, kind="index_map", ref="x_ref", fn=x_map, grid_index=(0,))
  assert_close(build(False)[1](ids, x), 2.0 * x.reshape(4, 16, 16)[ids - 1].reshape(64, 16))


# ------------------------------------------------------------------ uninitialized
@pytest.mark.parametrize("backend", BACKENDS)
def test_output_accumulated_without_zeroing(backend):
  def build(bug):
    def kernel(x_ref, o_ref):
      if not bug:
        @pl.when(pl.program_id(0) == 0)
        def _():
          o_ref[...] = jnp.zeros_like(o_ref)
      o_ref[...] += x_ref[...]  # <- bug
    return kernel, pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), F32),
                                  grid=(4,), in_specs=[pl.BlockSpec((16,), lambda i: (i,))],
                                  out_specs=pl.BlockSpec((16,), lambda i: (0,)), **_kw(backend))

  x = random_array((64,))
  kernel, call = build(True)
  _expect(call, x, kind="uninitialized", ref="o_ref", fn=kernel, grid_index=(0,))
  assert_close(build(False)[1](x), x.reshape(4, 16).sum(0))


def test_scratch_and_run_scoped_read_before_written():
  def build(bug):
    def kernel(x_ref, o_ref, acc_ref):
      @pl.when(pl.program_id(0) == (1 if bug else 0))
      def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)
      acc_ref[...] += x_ref[...]  # <- bug
      o_ref[...] = acc_ref[...]
    return kernel, pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((16,), F32), grid=(4,),
        in_specs=[pl.BlockSpec((16,), lambda i: (i,))],
        out_specs=pl.BlockSpec((16,), lambda i: (0,)),
        scratch_shapes=[pltpu.VMEM((16,), F32)], interpret=CHECKED)

  x = random_array((64,))
  kernel, call = build(True)
  _expect(call, x, kind="uninitialized", ref="acc_ref", fn=kernel, grid_index=(0,))
  assert_close(build(False)[1](x), x.reshape(4, 16).sum(0))

  def scoped(bug):
    def kernel(x_ref, o_ref):
      def body(total_ref):
        if not bug:
          total_ref[...] = jnp.zeros_like(total_ref)
        total_ref[...] += x_ref[...]  # <- bug
        o_ref[...] = total_ref[...]
      pl.run_scoped(body, pltpu.VMEM((8,), F32))
    return kernel, pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), F32),
                                  interpret=CHECKED)

  x = random_array((8,))
  kernel, call = scoped(True)
  _expect(call, x, kind="uninitialized", ref="total_ref", fn=kernel)
  assert_close(scoped(False)[1](x), x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_edge_block_padding_summed_into_the_output(backend):
  n, b = 100, 32

  def build(bug):
    def kernel(x_ref, o_ref):
      @pl.when(pl.program_id(0) == 0)
      def _():
        o_ref[...] = jnp.zeros_like(o_ref)
      rows = pl.program_id(0) * b + jnp.arange(b)[:, None]
      x = x_ref[...] if bug else jnp.where(rows < n, x_ref[...], 0.0)
      o_ref[...] += jnp.sum(x, axis=0)  # <- bug
    return kernel, pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), F32),
                                  grid=(pl.cdiv(n, b),),
                                  in_specs=[pl.BlockSpec((b, 8), lambda i: (i, 0))],
                                  out_specs=pl.BlockSpec((8,), lambda i: (0,)), **_kw(backend))

  x = random_array((n, 8))
  kernel, call = build(True)
  _expect(call, x, kind="uninitialized", ref="x_ref", fn=kernel, grid_index=(3,))
  assert_close(build(False)[1](x), x.sum(0), rtol=1e-5, atol=1e-4)


def test_edge_blocks_used_elementwise_are_not_reported():
  x = random_array((100, 8))

  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.exp(x_ref[...]) * 2.0 - x_ref[...].sum(axis=1, keepdims=True)

  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((100, 8), F32), grid=(4,),
                        in_specs=[pl.BlockSpec((32, 8), lambda i: (i, 0))],
                        out_specs=pl.BlockSpec((32, 8), lambda i: (i, 0)), interpret=CHECKED)
  assert_close(call(x), jnp.exp(x) * 2.0 - x.sum(1, keepdims=True), rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------ races
@pytest.mark.parametrize("backend", BACKENDS)
def test_parallel_programs_writing_one_block(backend):
  def build(bug):
    def kernel(x_ref, o_ref):
      o_ref[...] = 2.0 * x_ref[...]  # <- bug
    out_map = (lambda i: (0,)) if bug else (lambda i: (i,))
    return kernel, pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16 if bug else 64,), F32),
                                  grid=(4,), in_specs=[pl.BlockSpec((16,), lambda i: (i,))],
                                  out_specs=pl.BlockSpec((16,), out_map),
                                  compiler_params=PARALLEL, **_kw(backend))

  x = random_array((64,))
  kernel, call = build(True)
  with pytest.warns(Warning):
    err = _expect(call, x, kind="race", ref="o_ref", fn=kernel, grid_index=(1,))
  assert "parallel" in str(err)
  assert_close(build(False)[1](x), 2.0 * x)


def test_plain_store_mixed_with_atomics():
  def build(bug):
    def kernel(v_ref, zeros_ref, o_ref):
      counts = jnp.sum(v_ref[...][:, None] == jnp.arange(8)[None, :], axis=0, dtype=jnp.int32)
      pl.atomic_add(o_ref, pl.ds(0, 8), counts)
      if bug:
        @pl.when(pl.program_id(0) == 3)
        def _():
          o_ref[...] = jnp.zeros_like(o_ref)  # <- bug
    return kernel, pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.int32), grid=(4,),
        in_specs=[pl.BlockSpec((32,), lambda i: (i,)), None], input_output_aliases={1: 0},
        compiler_params=PARALLEL, interpret=CHECKED)

  v = random_array((128,), jnp.int32, low=0, high=7)
  zeros = jnp.zeros((8,), jnp.int32)
  kernel, call = build(True)
  _expect(call, v, zeros, kind="race", ref="o_ref", fn=kernel, grid_index=(3,))
  assert_close(build(False)[1](v, zeros), jnp.bincount(v, length=8).astype(jnp.int32))


def test_scratch_carried_across_a_parallel_axis_is_a_race():
  def build(bug):
    def kernel(x_ref, o_ref, carry_ref):
      @pl.when(pl.program_id(0) == 0 if bug else True)
      def _():
        carry_ref[...] = jnp.zeros_like(carry_ref)
      carry_ref[...] += x_ref[...]  # <- bug
      o_ref[...] = carry_ref[...]
    return kernel, pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((64,), F32), grid=(4,),
        in_specs=[pl.BlockSpec((16,), lambda i: (i,))],
        out_specs=pl.BlockSpec((16,), lambda i: (i,)),
        scratch_shapes=[pltpu.VMEM((16,), F32)], compiler_params=PARALLEL, interpret=CHECKED)

  x = random_array((64,))
  kernel, call = build(True)
  with pytest.warns(Warning):
    _expect(call, x, kind="race", ref="carry_ref", fn=kernel, grid_index=(1,))
  assert_close(build(False)[1](x), x)


# ------------------------------------------------------------------ opt-in kinds
def test_nan_produced_in_the_kernel():
  def build(bug):
    def kernel(x_ref, o_ref):
      x = x_ref[...]
      o_ref[...] = jnp.log(x if bug else jnp.abs(x) + 1.0)  # <- bug
    return kernel, pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((32,), F32),
                                  interpret=ALL)

  x = random_array((32,))
  kernel, call = build(True)
  _expect(call, x, kind="nan", ref=None, fn=kernel)
  assert_close(build(False)[1](x), jnp.log(jnp.abs(x) + 1.0))
  # off unless asked for
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((32,), F32), interpret=CHECKED)
  assert jnp.isnan(call(x)).any()


def test_int32_overflow_in_index_arithmetic():
  def build(bug):
    def kernel(x_ref, o_ref):
      i = pl.program_id(0)
      scale = 70000 if bug else 7
      flat = (i + 1) * scale * scale  # <- bug
      o_ref[...] = x_ref[...] + (flat % 3).astype(F32)
    return kernel, pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((32,), F32), grid=(2,),
                                  in_specs=[pl.BlockSpec((16,), lambda i: (i,))],
                                  out_specs=pl.BlockSpec((16,), lambda i: (i,)), interpret=ALL)

  x = random_array((32,))
  kernel, call = build(True)
  _expect(call, x, kind="overflow", ref=None, fn=kernel, grid_index=(0,))
  assert_close(build(False)[1](x), x + ((jnp.arange(32) // 16 + 1) * 49 % 3).astype(F32))


def test_output_elements_never_written():
  def kernel(x_ref, o_ref):  # <- bug
    @pl.when(pl.program_id(0) < 3)
    def _():
      o_ref[...] = x_ref[...]

  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64,), F32), grid=(4,),
                        in_specs=[pl.BlockSpec((16,), lambda i: (i,))],
                        out_specs=pl.BlockSpec((16,), lambda i: (i,)), interpret=ALL)
  err = _expect(call, random_array((64,)), kind="unwritten", ref="o_ref", fn=kernel)
  assert "48" in str(err)

  def twin(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  x = random_array((64,))
  call = pl.pallas_call(twin, out_shape=jax.ShapeDtypeStruct((64,), F32), grid=(4,),
                        in_specs=[pl.BlockSpec((16,), lambda i: (i,))],
                        out_specs=pl.BlockSpec((16,), lambda i: (i,)), interpret=ALL)
  assert_close(call(x), x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_debug_check(backend):
  def kernel(x_ref, o_ref):
    pl.debug_check(jnp.all(x_ref[...] > 0), "inputs must be positive")  # <- bug
    o_ref[...] = jnp.sqrt(x_ref[...])

  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64,), F32), grid=(4,),
                        in_specs=[pl.BlockSpec((16,), lambda i: (i,))],
                        out_specs=pl.BlockSpec((16,), lambda i: (i,)),
                        **_kw(backend, ALL))
  x = jnp.abs(random_array((64,))) + 0.5
  err = _expect(call, x.at[40].set(-1.0), kind="debug_check", ref=None, fn=kernel,
                grid_index=(2,))
  assert "inputs must be positive" in str(err)
  assert_close(call(x), jnp.sqrt(x))


# ------------------------------------------------------------------ switching it on
def _oob_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[pl.ds(pl.program_id(0) * 16 + 8, 16)]


def _oob_call(**kw):
  return pl.pallas_call(_oob_kernel, out_shape=jax.ShapeDtypeStruct((64,), F32), grid=(4,),
                        out_specs=pl.BlockSpec((16,), lambda i: (i,)), **kw)


def test_unchecked_calls_have_no_checks(monkeypatch):
  monkeypatch.delenv("PALLET_CHECKS", raising=False)
  x = random_array((64,))
  jaxpr = jax.make_jaxpr(_oob_call())(x)
  assert "pallet_check" not in str(jaxpr)
  jax.block_until_ready(_oob_call()(x))     # clamped, silently: nothing checks it


def test_environment_variable_turns_checks_on(monkeypatch):
  monkeypatch.setenv("PALLET_CHECKS", "1")
  with pytest.raises(pl.KernelCheckError) as info:
    jax.block_until_ready(_oob_call()(random_array((64,))))
  assert info.value.kind == "out_of_bounds" and info.value.grid_index == (3,)
  monkeypatch.setenv("PALLET_CHECKS", "race,nan")
  jax.block_until_ready(_oob_call()(random_array((64,))))   # bounds not asked for
  monkeypatch.setenv("PALLET_CHECKS", "bogus")
  with pytest.raises(pl.PalletError, match="PALLET_CHECKS"):
    _oob_call()(random_array((64,)))


def test_checks_under_jit_and_vmap():
  x = random_array((64,))
  with pytest.raises(Exception) as info:
    jax.block_until_ready(jax.jit(_oob_call(interpret=CHECKED))(x))
  text = str(info.value)
  assert "out_of_bounds" in text and "x_ref" in text and "(3,)" in text
  assert "test_checking.py" in text

  def good(x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(pl.program_id(0) * 16, 16)] * 2.0
  call = pl.pallas_call(good, out_shape=jax.ShapeDtypeStruct((64,), F32), grid=(4,),
                        out_specs=pl.BlockSpec((16,), lambda i: (i,)), interpret=CHECKED)
  xs = random_array((3, 64))
  assert_close(jax.jit(jax.vmap(call))(xs), 2.0 * xs)


def test_tpu_namespace_and_other_pallas_fields():
  params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager",
                                 num_cores_or_threads=2, random_seed=3)
  assert params is not None and pltpu.InterpretParams is pl.InterpretParams
  with pytest.raises(pl.KernelCheckError):
    jax.block_until_ready(_oob_call(interpret=params)(random_array((64,))))
  # out_of_bounds_reads="uninitialized" switches the bounds checks off, as in Pallas
  off = pl.InterpretParams(out_of_bounds_reads="uninitialized")
  jax.block_until_ready(_oob_call(interpret=off)(random_array((64,))))


# ------------------------------------------------------------------ one error, once
def test_eager_vmap_and_grad_raise_the_check_error_itself_and_log_nothing(caplog):
  call = _oob_call(interpret=CHECKED)
  runs = [(call, random_array((64,))), (jax.vmap(call), random_array((2, 64))),
          (jax.grad(lambda x: call(x).sum()), random_array((64,)))]
  for run, x in runs:
    with caplog.at_level("DEBUG"), pytest.raises(pl.KernelCheckError) as info:
      jax.block_until_ready(run(x))
    assert info.value.kind == "out_of_bounds" and info.value.grid_index == (3,)
  assert not [r for r in caplog.records if r.levelname in ("ERROR", "WARNING")], caplog.text


def test_under_jit_the_report_surfaces_once_when_the_result_is_materialized(caplog):
  with caplog.at_level("DEBUG"), pytest.raises(jax.errors.JaxRuntimeError) as info:
    jax.block_until_ready(jax.jit(_oob_call(interpret=CHECKED))(random_array((64,))))
  assert "out_of_bounds in kernel '_oob_kernel' at grid index (3,), ref 'x_ref'" in str(info.value)
  assert "callback failed" not in caplog.text, caplog.text


def test_checks_call_nothing_back_inside_the_kernel():
  """The checks record failures in an output the host reads after the call: the
  checked kernel binds no host callback, so a GPU runs the same checks."""
  jaxpr = jax.make_jaxpr(_oob_call(interpret=CHECKED))(random_array((64,)))
  (kernel,) = [e.params["kernel"] for e in jaxpr.eqns if e.primitive is pl.pallas_call_p]
  assert "pallet_check" not in str(kernel.jaxpr)
  assert "pallet_check_report" in str(jaxpr)


# ------------------------------------------------------------------ unwritten (default)
def test_unwritten_outputs_are_reported_by_default_and_can_be_allowed():
  def kernel(x_ref, o_ref):  # <- bug
    @pl.when(pl.program_id(0) < 3)
    def _():
      o_ref[...] = x_ref[...]

  def call(interpret=CHECKED):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64,), F32), grid=(4,),
                          in_specs=[pl.BlockSpec((16,), lambda i: (i,))],
                          out_specs=pl.BlockSpec((16,), lambda i: (i,)), interpret=interpret)
  x = random_array((64,))
  _expect(call(), x, kind="unwritten", ref="o_ref", fn=kernel)
  quiet = pl.InterpretParams(detect_races=True, detect_unwritten_outputs=False)
  assert_close(call(quiet)(x)[:48], x[:48])
  with pl.allow_unwritten_outputs():
    assert_close(call()(x)[:48], x[:48])
  _expect(call(), x, kind="unwritten", ref="o_ref", fn=kernel)   # restored afterwards


def test_outputs_stored_whole_on_each_step_need_no_shadow():
  """Whole-block stores (unconditional, or under pl.when on grid indices) whose blocks
  tile the output prove it written: its checked kernel carries no shadow."""
  import importlib
  from pallet.checking.options import CheckOptions
  checking_run = importlib.import_module("pallet.checking.run")

  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += x_ref[...]

  def call(**kw):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64,), F32), grid=(4, 2),
                          in_specs=[pl.BlockSpec((16,), lambda i, k: (i,))],
                          out_specs=pl.BlockSpec((16,), lambda i, k: (i,)), **kw)
  x = random_array((64,))
  assert_close(call(interpret=CHECKED)(x), 2.0 * x)
  (description,) = [e.params["kernel"] for e in jax.make_jaxpr(call())(x).eqns
                    if e.primitive is pl.pallas_call_p]
  _, layout = checking_run.checked_kernel(description, CheckOptions(), ("x_ref", "o_ref"),
                                          False, False)
  assert layout.shadowed_outputs == ()


def _merge(bug: bool, backend: str):
  def kernel(x_ref, o_ref):  # <- bug
    p = pl.program_id(0)
    rows = lax.broadcasted_iota(jnp.int32, (16, 4), 0)
    mine = (rows >= 8 * p) & (rows < 8 * p + (4 if bug else 8))
    o_ref[...] = jnp.where(mine, 2.0 * x_ref[...], o_ref[...])
  return kernel, pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 4), F32), grid=(2,),
                                in_specs=[pl.BlockSpec((16, 4), lambda i: (0, 0))],
                                out_specs=pl.BlockSpec((16, 4), lambda i: (0, 0)),
                                **_kw(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_writes_carry_old_values_and_count_only_selected_lanes(backend):
  """o[...] = where(mine, new, o[...]) (JAX's grouped matmul) writes only its lanes:
  carrying the others is no read of uninitialized memory, and lanes no program
  selects are still reported as never written."""
  x = random_array((16, 4))
  assert_close(_merge(False, backend)[1](x), 2.0 * x)
  kernel, call = _merge(True, backend)
  _expect(call, x, kind="unwritten", ref="o_ref", fn=kernel)


# ------------------------------------------------------------------ loops
SHORT = pl.InterpretParams(detect_races=True, max_loop_iterations=1024)


def _loop_call(kernel, backend, n_out=1):
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n_out,), jnp.int32),
                        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                        out_specs=pl.BlockSpec(memory_space=pl.ANY),
                        **_kw(backend, SHORT))


@pytest.mark.parametrize("backend", BACKENDS)
def test_counted_loops_may_run_past_the_bound_and_others_may_not(backend):
  def counted(n_ref, o_ref):
    o_ref[0] = lax.fori_loop(0, n_ref[0], lambda i, c: c + 1, 0)

  n = jnp.array([3000], jnp.int32)
  assert int(_loop_call(counted, backend)(n)[0]) == 3000

  def uncounted(n_ref, o_ref):
    k = lax.while_loop(lambda c: c < n_ref[0], lambda c: c + 1, 0)  # <- bug
    o_ref[0] = k

  err = _expect(_loop_call(uncounted, backend), n, kind="hang", ref=None, fn=uncounted)
  assert "1024" in str(err)
  assert int(_loop_call(uncounted, backend)(jnp.array([1000], jnp.int32))[0]) == 1000


@pytest.mark.parametrize("backend", BACKENDS)
def test_spin_wait_with_an_attempt_counter_is_a_deadlock_at_once(backend):
  """The attempt counter changes every iteration but cannot end the loop: only what
  steers the condition (here the flag in memory) counts as progress."""
  def kernel(flag_ref, o_ref):
    attempts = lax.while_loop(lambda c: flag_ref[0] == 0, lambda c: c + 1, 0)  # <- bug
    o_ref[0] = attempts

  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
                        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                        out_specs=pl.BlockSpec(memory_space=pl.ANY),
                        **_kw(backend, pl.InterpretParams(detect_races=True)))
  err = _expect(call, jnp.zeros((1,), jnp.int32), kind="deadlock", ref="flag_ref", fn=kernel)
  assert "(iterations 1)" in str(err)
  assert int(call(jnp.ones((1,), jnp.int32))[0]) == 0


# ------------------------------------------------------------------ padding
@pytest.mark.parametrize("backend", BACKENDS)
def test_constants_put_in_rows_past_the_edge_are_no_data(backend):
  """`where(cols < n, s, -inf)` on a block whose rows overhang: the -inf lanes of
  those rows are outside the array too, so a row-wise max of them mixes nothing in
  (the false alarm linear_cross_entropy had); masking rows with `& (rows < n)`
  decides them whatever the padding holds."""
  n, b = 20, 16

  def kernel(x_ref, o_ref, count_ref):
    s = x_ref[...]
    cols = lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(cols < 6, s, -jnp.inf)
    o_ref[...] = jnp.max(s, axis=1)
    rows = pl.program_id(0) * b + lax.broadcasted_iota(jnp.int32, (b,), 0)
    counted = (x_ref[:, 0] > 0) & (rows < n)
    count_ref[pl.program_id(0)] = jnp.sum(counted.astype(jnp.int32))

  x = random_array((n, 8))
  call = pl.pallas_call(
      kernel, out_shape=(jax.ShapeDtypeStruct((n,), F32), jax.ShapeDtypeStruct((2,), jnp.int32)),
      grid=(2,), in_specs=[pl.BlockSpec((b, 8), lambda i: (i, 0))],
      out_specs=(pl.BlockSpec((b,), lambda i: (i,)), pl.BlockSpec(memory_space=pl.ANY)),
      **_kw(backend))
  m, count = call(x)
  assert_close(m, jnp.max(x[:, :6], axis=1))
  assert int(count.sum()) == int(jnp.sum(x[:, 0] > 0))


@pytest.mark.skipif(current_test_backend() != "xla", reason="TPU DMAs run on the XLA backend")
@pytest.mark.parametrize("wait_first", [False, True])
def test_a_scoped_buffer_written_while_a_dma_still_copies_from_it(wait_first):
  """A `run_scoped` buffer copied out by a DMA and refilled before (a race on a TPU,
  reported) or after (clean) the copy's wait."""
  def kernel(x_ref, o_hbm):
    def body(buf, sem):
      buf[...] = x_ref[...]
      pltpu.make_async_copy(buf, o_hbm, sem).start()
      if wait_first:
        pltpu.make_async_copy(buf, o_hbm, sem).wait()
      buf[...] = x_ref[...] + 1.0
      if not wait_first:
        pltpu.make_async_copy(buf, o_hbm, sem).wait()
    pl.run_scoped(body, pltpu.VMEM((8, 128), F32), pltpu.SemaphoreType.DMA)

  x = random_array((8, 128))
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, F32),
                        out_specs=pl.BlockSpec(memory_space=pltpu.ANY), interpret=CHECKED)
  if wait_first:
    assert_close(call(x), x)
  else:
    with pytest.raises(pl.KernelCheckError, match=r"race .* 'run_scoped buffer|race .*while a "
                                                  r"DMA started earlier still copies") as info:
      jax.block_until_ready(call(x))
    assert info.value.kind == "race"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_report_names_the_ref_after_a_none_operand(backend):
  """A `None` argument (a kernel's optional operand, as torch_xla's paged attention
  passes its absent scales) has no ref: later refs keep their own names."""
  def kernel(x_ref, scale_ref, o_ref, acc_ref):
    assert scale_ref is None
    o_ref[...] = x_ref[...] + acc_ref[...]  # <- bug

  x = random_array((8, 128))
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, F32),
                        in_specs=[pl.BlockSpec((8, 128), lambda: (0, 0)), None],
                        out_specs=pl.BlockSpec((8, 128), lambda: (0, 0)),
                        scratch_shapes=[pltpu.VMEM((8, 128), F32)], **_kw(backend))
  _expect(call, x, None, kind="uninitialized", ref="acc_ref", fn=kernel)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bug", [False, True])
def test_a_dead_load_is_not_a_read(bug, backend):
  """`acc_ref[0] = jnp.zeros(acc_ref[0].shape)` loads only for the shape: the load is
  dead and reads nothing (compilers drop it); reading row 1, never written, is a bug."""
  def kernel(x_ref, o_ref, acc_ref):
    acc_ref[0] = jnp.zeros(acc_ref[0].shape, F32)
    o_ref[...] = x_ref[...] + acc_ref[1 if bug else 0]  # <- bug

  x = random_array((8, 128))
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, F32),
                        scratch_shapes=[pltpu.VMEM((2, 8, 128), F32)], **_kw(backend))
  if bug:
    _expect(call, x, kind="uninitialized", ref="acc_ref", fn=kernel)
  else:
    assert_close(call(x), x)
