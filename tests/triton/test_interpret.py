"""The generated Triton code, run by Triton's interpreter, against jax.numpy.

Run with `TRITON_INTERPRET=1 pytest -m triton_interpret tests/triton` (see conftest).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallet as pl
import pallet.triton as plt
from cases import CASES, call
from helpers import assert_close, random_array, run_on_simulated_devices, sds

pytestmark = pytest.mark.triton_interpret


@pytest.mark.parametrize("name", sorted(CASES))
def test_case_matches_jax_numpy(name):
  # (bf16 cases run with bf16 held in float32: see interpreter.py)
  case = CASES[name]
  fn, args, expected = case.make(True)
  assert_close(fn(*args), expected, **(case.tol or {}))


def test_under_jit_and_vmap():
  fn, (x,), _ = CASES["unary_tanh"].make(True)
  xs = jnp.stack([x, x * 2, -x])
  assert_close(jax.jit(jax.vmap(fn))(xs), jnp.tanh(xs), rtol=2e-5, atol=2e-5)


def test_sequential_accumulation_under_vmap():
  fn, (x, y), _ = CASES["matmul_accumulate_over_sequential_axis"].make(True)
  out = jax.vmap(fn, in_axes=(0, None))(jnp.stack([x, -x]), y)
  expected = jnp.stack([x @ y, -x @ y])
  assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_outputs_not_written_by_masked_stores_keep_aliased_contents():
  x = random_array((20,))
  poison = jnp.full((20,), jnp.nan, jnp.float32)

  def kernel(x_ref, o_in_ref, o_ref):
    del o_in_ref
    plt.store(o_ref, (slice(None),), x_ref[...], mask=jnp.arange(20) < 11)

  out = call(kernel, sds(x), True, input_output_aliases={1: 0})(x, poison)
  assert_close(out[:11], x[:11])
  assert np.isnan(np.asarray(out[11:])).all()


def test_debug_print_prints_from_the_interpreter(capfd):
  x = jnp.array([4242.0, 1.0], jnp.float32)

  def kernel(x_ref, o_ref):
    pl.debug_print("value is {}", x_ref[0])
    o_ref[...] = x_ref[...]

  jax.block_until_ready(call(kernel, sds(x), True)(x))
  assert "value is" in capfd.readouterr().out and "4242" in capfd.readouterr().out + "4242"


def test_writes_into_an_input_ref_leave_the_callers_array_alone():
  x = random_array((8, 16))
  before = np.asarray(x).copy()

  def kernel(x_ref, o_ref):
    x_ref[...] = x_ref[...] * 2
    o_ref[...] = x_ref[...] + 1

  out = call(kernel, sds(x), True)(x)
  assert_close(out, x * 2 + 1)
  np.testing.assert_array_equal(np.asarray(x), before)


def test_out_of_bounds_stores_are_caught():
  # A dynamic pl.ds past the end (integer-array scatters drop such lanes, as JAX does).
  x = random_array((8,))
  idx = jnp.array([6], jnp.int32)

  def kernel(x_ref, i_ref, o_ref):
    o_ref[...] = x_ref[...]
    o_ref[pl.ds(i_ref[0], 4)] = jnp.ones((4,), jnp.float32)

  with pytest.raises(Exception, match="wrote outside output 0"):
    jax.block_until_ready(call(kernel, sds(x), True)(x, idx))


def test_failing_debug_check_raises_with_kernel_name_and_line():
  x = jnp.array([1.0, -2.0, 3.0, 4.0], jnp.float32)

  def checked_kernel(x_ref, o_ref):
    def body(i, acc):
      pl.debug_check(x_ref[i] > 0, "inputs must be positive")
      return acc + x_ref[i]
    o_ref[...] = jnp.full((4,), lax.fori_loop(0, 4, body, 0.0))

  with pl.enable_debug_checks(True):
    f = call(checked_kernel, sds(x), True)
    assert_close(f(jnp.abs(x)), jnp.full((4,), 10.0))
    with pytest.raises(Exception, match=r"kernel 'checked_kernel' at .*test_interpret\.py:\d+: "
                                        r"inputs must be positive"):
      jax.block_until_ready(f(x))


def test_inline_assembly_is_a_clear_error_under_the_interpreter():
  x = random_array((32,))

  def asm_kernel(x_ref, o_ref):
    (o_ref[...],) = plt.elementwise_inline_asm(
        "tanh.approx.f32 $0, $1;", args=[x_ref[...]], constraints="=f,f", pack=1,
        result_shape_dtypes=[sds(x)])

  with pytest.raises(Exception, match=r"asm_kernel.*inline GPU assembly under Triton's "
                                      r"interpreter") as refused:
    jax.block_until_ready(call(asm_kernel, sds(x), True)(x))
  assert "XLA backend runs it" not in str(refused.value)   # it refuses inline assembly too


_SHARDED_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import pallet as pl

def kernel(x_ref, o_ref):
  o_ref[...] = jnp.tanh(x_ref[...]) * x_ref[...]

def per_shard(x):
  spec = pl.BlockSpec((8, x.shape[1]), lambda i: (i, 0))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(x.shape[0] // 8,), in_specs=[spec], out_specs=spec,
                        backend="triton", interpret=True)(x)

assert len(jax.devices()) == 4
f = jax.jit(jax.shard_map(per_shard, mesh=Mesh(np.array(jax.devices()), ("d",)),
                          in_specs=P("d"), out_specs=P("d")))
for seed in range(3):   # distinct kernels: each is loaded while four devices call in
  x = jax.random.normal(jax.random.key(seed), (64, 16 * (seed + 1)))
  np.testing.assert_allclose(f(x), jnp.tanh(x) * x, rtol=1e-6)
print("SHARDED_INTERPRETER_OK")
"""


def test_interpreter_under_shard_map_on_four_devices():
  """The four devices' host callbacks call the interpreter from several threads at once."""
  output = run_on_simulated_devices(_SHARDED_SCRIPT, env={"TRITON_INTERPRET": "1"})
  assert "SHARDED_INTERPRETER_OK" in output, output[-3000:]


@pytest.mark.parametrize("source", [jnp.float32, jnp.float16, jnp.int32])
def test_conversion_to_bfloat16_rounds_inside_the_kernel(source):
  # The interpreter's code holds bfloat16 in float32; `.astype(bf16)` must still round
  # (to nearest even), as the GPU and XLA do, not only at the output (alphafold3's
  # gated linear unit rounds its products and carries on in float32).
  x = (random_array((16, 128)) * 300).astype(source)

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...].astype(jnp.bfloat16).astype(jnp.float32) * 1.5

  out = call(kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32), True)(x)
  expected = x.astype(jnp.bfloat16).astype(jnp.float32) * 1.5
  np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
