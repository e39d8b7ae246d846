"""Every cache pallet keeps gives the answer of a fresh trace (docs/caching.md): a kernel
redefined around other values of the globals, closures, defaults and helpers it reads,
or called under other settings (x64, matmul precision, promotion rules, checking mode,
interpret mode, backend), is traced again; one that is the same still hits."""
from __future__ import annotations

import dataclasses
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
import pallet.tpu as pltpu
from pallet import backends
from pallet.core import trace_cache
from helpers import assert_close, current_test_backend, pallas_call, random_array, sds

f32 = jnp.float32

# Module globals the kernels below read; each test rebinds or mutates them.
SCALE = 1.0
OFFSETS = np.zeros(4, np.float32)
FACTORS = [1.0]
BLOCK_SHIFT = 0


class Settings:
  """A user class read by kernels through a class attribute and a method."""
  scale = 1.0

  @classmethod
  def doubled(cls):
    return 2 * cls.scale


class Knob:
  """A user object (hashed by identity, its attributes change)."""

  def __init__(self, value):
    self.value = value

  def times(self, x):
    return x * self.value


KNOB = Knob(1.0)
SETTINGS_MODULE = types.ModuleType("pallet_test_settings")   # a user module object
SETTINGS_MODULE.scale = 1.0


def scaled_by_global(x):
  """A helper a kernel calls; it reads the module global SCALE."""
  return x * SCALE


def calls_the_helper(x):
  """A helper of a helper."""
  return scaled_by_global(x) + 1.0


@pytest.fixture(autouse=True)
def _fresh_cache():
  trace_cache.clear()
  yield
  trace_cache.clear()


def _run(kernel, x, **kwargs):
  return pallas_call(kernel, out_shape=sds(x), **kwargs)(x)


# ------------------------------------------------------------------ the values a kernel reads
def test_kernel_redefined_in_a_loop_reads_the_current_global():
  # Issue 28: the trace of the first definition was reused (1.0 three times).
  global SCALE
  x = random_array((8, 128))
  try:
    for SCALE in (1.0, 2.0, 3.0):
      def k(x_ref, o_ref):
        o_ref[...] = x_ref[...] * SCALE
      assert_close(_run(k, x), x * SCALE)
  finally:
    SCALE = 1.0
  assert trace_cache.stats["miss"] == 3


def test_same_global_value_still_hits():
  x = random_array((8, 128))
  for _ in range(3):
    def k(x_ref, o_ref):
      o_ref[...] = jnp.tanh(x_ref[...]) * SCALE
    assert_close(_run(k, x), jnp.tanh(x) * SCALE)
  assert (trace_cache.stats["miss"], trace_cache.stats["hit"]) == (1, 2)


def test_one_kernel_object_reads_a_global_rebound_between_calls():
  global SCALE

  def k(x_ref, o_ref):
    o_ref[...] = x_ref[...] + SCALE

  x = random_array((16,))
  try:
    for SCALE in (1.0, -2.5, 1.0):
      assert_close(_run(k, x), x + SCALE)
  finally:
    SCALE = 1.0


def test_closures_and_default_arguments_redefined_in_a_loop():
  x = random_array((8, 128))
  for c in (1.0, 2.0, 3.0):
    def closure(x_ref, o_ref):
      o_ref[...] = x_ref[...] * c

    def default(x_ref, o_ref, *, c=c):
      o_ref[...] = x_ref[...] - c

    assert_close(_run(closure, x), x * c)
    assert_close(_run(default, x), x - c)


def test_helpers_the_kernel_calls_read_the_current_global():
  global SCALE
  x = random_array((8, 128))

  def k(x_ref, o_ref):
    o_ref[...] = calls_the_helper(x_ref[...])

  try:
    for SCALE in (1.0, 4.0):
      assert_close(_run(k, x), x * SCALE + 1.0)
  finally:
    SCALE = 1.0


def test_mutated_global_arrays_and_lists_are_read_again():
  x = random_array((4,))

  def k(x_ref, o_ref):
    o_ref[...] = x_ref[...] * FACTORS[0] + jnp.asarray(OFFSETS)

  try:
    for step in range(3):
      OFFSETS[:] = np.arange(4) * step
      FACTORS[0] = 1.0 + step
      assert_close(_run(k, x), x * FACTORS[0] + OFFSETS)
  finally:
    OFFSETS[:] = 0
    FACTORS[0] = 1.0


def test_class_module_and_object_attributes_are_read_again():
  x = random_array((8, 128))

  def k(x_ref, o_ref):
    o_ref[...] = KNOB.times(x_ref[...]) + Settings.doubled() + SETTINGS_MODULE.scale

  try:
    for v in (1.0, 3.0):
      Settings.scale, KNOB.value, SETTINGS_MODULE.scale = v, -v, 10 * v
      assert_close(_run(k, x), x * -v + 2 * v + 10 * v)
  finally:
    Settings.scale, KNOB.value, SETTINGS_MODULE.scale = 1.0, 1.0, 1.0


def test_index_maps_read_the_current_global():
  global BLOCK_SHIFT
  x = random_array((32,))

  def call(x):
    spec = pl.BlockSpec((8,), lambda i: ((i + BLOCK_SHIFT) % 4,))
    return pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2),
                       out_shape=sds(x), grid=(4,), in_specs=[spec],
                       out_specs=pl.BlockSpec((8,), lambda i: (i,)))(x)

  try:
    for BLOCK_SHIFT in (0, 1, 3):
      assert_close(call(x), jnp.roll(x, -8 * BLOCK_SHIFT) * 2)
  finally:
    BLOCK_SHIFT = 0


def test_a_large_mutable_global_array_is_not_cached():
  # Over MAX_ARRAY_BYTES a NumPy array cannot be compared on every call: traced afresh.
  big = np.zeros(trace_cache.MAX_ARRAY_BYTES // 4 + 1, np.float32)
  module = sys.modules[__name__]
  module.BIG = big
  x = random_array((4,))

  def k(x_ref, o_ref):
    o_ref[...] = x_ref[...] + BIG[0]   # noqa: F821 (set on the module above)

  try:
    for v in (1.0, 7.0):
      big[0] = v
      assert_close(_run(k, x), x + v)
    assert trace_cache.stats["uncacheable"] == 2
  finally:
    del module.BIG


def test_recursive_helpers_are_keyed_by_back_reference():
  def k(x_ref, o_ref):
    o_ref[...] = x_ref[...] + float(_count_down(3))

  x = random_array((4,))
  for _ in range(2):
    assert_close(_run(k, x), x + 3.0)
  assert (trace_cache.stats["miss"], trace_cache.stats["hit"]) == (1, 1)


def _count_down(n):
  return 0 if n == 0 else 1 + _count_down(n - 1)


@dataclasses.dataclass(frozen=True)
class Case:
  """A user dataclass a kernel closes over (its generated __repr__ closes over a set)."""
  scale: float


def test_user_dataclasses_and_objects_in_closures_still_hit():
  x = random_array((8, 128))

  def op(case, knob):
    def k(x_ref, o_ref):
      o_ref[...] = knob.times(x_ref[...]) * case.scale
    return _run(k, x)

  for scale in (2.0, 2.0, 3.0, 2.0):
    assert_close(op(Case(scale), Knob(0.5)), x * 0.5 * scale)
  assert dict(trace_cache.stats) == {"miss": 2, "hit": 2}


# ------------------------------------------------------------------ settings
def _bits_kernel(x_ref, o_ref):
  # Decided while tracing: 64 under x64, else 32.
  o_ref[...] = x_ref[...] + float(jnp.iinfo(jnp.asarray(0).dtype).bits)


def test_x64_on_and_off():
  x = random_array((8, 128))
  for x64 in (False, True, False):
    with jax.enable_x64(x64) if hasattr(jax, "enable_x64") else _x64(x64):
      assert_close(_run(_bits_kernel, x), x + (64.0 if x64 else 32.0))


def test_grid_loop_under_x64_counts_program_ids_in_int32():
  # fori_loop counts in int64 under x64; the grid's indices stay int32 (a grid of
  # 10 whole-array steps loops on the XLA backend: it failed in lax.rem, int64 x int32).
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    rows = pl.ds(i * 8, 8)
    o_ref[rows, :] = x_ref[rows, :] * 2.0 + i.astype(jnp.float32) + (i.dtype == jnp.int32)
  x = random_array((80, 128))
  with jax.enable_x64(True) if hasattr(jax, "enable_x64") else _x64(True):
    out = pallas_call(kernel, out_shape=sds(x), grid=(10,))(x)
  assert_close(out, x * 2.0 + jnp.repeat(jnp.arange(10.0), 8)[:, None] + 1.0)


def _x64(on: bool):
  from jax.experimental import enable_x64, disable_x64
  return enable_x64() if on else disable_x64()


def test_default_matmul_precision_is_part_of_the_trace():
  # The precision a dot is traced with follows the setting at the call.
  def k(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...])

  x, y = random_array((16, 16)), random_array((16, 16))

  def precision_in_trace():
    call = lambda x, y: pallas_call(k, out_shape=sds(x))(x, y)
    eqn = next(e for e in jax.make_jaxpr(call)(x, y).eqns if e.primitive.name == "pallas_call")
    dots = [e for e in eqn.params["kernel"].jaxpr.eqns if e.primitive.name == "dot_general"]
    assert_close(call(x, y), jnp.dot(x, y, precision="highest"), matmul=True)
    return dots[0].params["precision"]

  default = precision_in_trace()
  with jax.default_matmul_precision("highest"):
    highest = precision_in_trace()
  assert highest != default and "HIGHEST" in str(highest)
  assert precision_in_trace() == default


def test_rank_promotion_setting_is_part_of_the_trace():
  def k(x_ref, b_ref, o_ref):
    o_ref[...] = x_ref[...] + b_ref[...]     # (8, 128) + (128,): rank promotion

  x, b = random_array((8, 128)), random_array((128,))
  call = lambda: pallas_call(k, out_shape=sds(x))(x, b)
  assert_close(call(), x + b)
  with jax.numpy_rank_promotion("raise"):
    with pytest.raises(Exception, match="rank"):
      call()
  assert_close(call(), x + b)


def _half_written(x_ref, o_ref):
  o_ref[:4] = x_ref[:4] * 2


def test_interpret_mode_on_and_off():
  # interpret=True poisons unwritten output (NaN); without it the CPU backend gives zeros.
  if current_test_backend() != "xla":
    pytest.skip("output poisoning is the XLA backend's interpret mode")
  x = random_array((8,))
  for interpret in (False, True, False):
    out = pl.pallas_call(_half_written, out_shape=sds(x), interpret=interpret)(x)
    assert_close(out[:4], x[:4] * 2)
    assert bool(jnp.all(jnp.isnan(out[4:]))) == interpret


def _accumulates_unset(x_ref, o_ref):
  o_ref[...] += x_ref[...]          # reads the output before any write


def test_checking_mode_on_and_off(monkeypatch):
  x = random_array((8, 128))
  ok = lambda: _run(_accumulates_unset, jnp.abs(x) + 1)
  assert bool(jnp.all(jnp.isfinite(ok())))
  monkeypatch.setenv("PALLET_CHECKS", "1")
  with pytest.raises(Exception, match="(?i)uninitiali[sz]ed|before.*writ"):
    jax.block_until_ready(ok())
  monkeypatch.delenv("PALLET_CHECKS")
  assert bool(jnp.all(jnp.isfinite(ok())))


def test_debug_checks_on_and_off():
  def k(x_ref, o_ref):
    pl.debug_check(jnp.all(x_ref[...] < 0), "positive input")
    o_ref[...] = x_ref[...]

  x = jnp.abs(random_array((8, 128))) + 1
  assert_close(_run(k, x), x)
  with pl.enable_debug_checks(True):
    with pytest.raises(Exception, match="positive input"):
      jax.block_until_ready(_run(k, x))
  assert_close(_run(k, x), x)


@pytest.mark.skipif("triton" not in backends.available(),
                    reason="the Triton backend needs a GPU or TRITON_INTERPRET=1")
def test_backend_switch():
  x = random_array((8, 128))

  def k(x_ref, o_ref):
    o_ref[...] = jnp.sin(x_ref[...]) * SCALE

  for backend in ("xla", "triton", "xla"):
    out = pl.pallas_call(k, out_shape=sds(x), backend=backend,
                         interpret=backend == "triton")(x)
    assert_close(out, jnp.sin(x) * SCALE)
