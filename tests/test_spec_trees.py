"""in_specs/out_specs against pytrees of operands: JAX's prefix rule, registered
dataclasses whose fields may be None, lists for tuples, nested operands of pl.kernel,
and the errors when the structures do not line up."""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import pallet as pl
import pallet.tpu as pltpu
from helpers import assert_close, pallas_call, random_array, sds

f32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
  """A quantized-weights pytree as serving libraries pass it: optional parts are None."""
  w: Any
  scale: Any = None
  bias: Any = None


def _linear_kernel(x_ref, weights, o_ref):
  y = x_ref[...] @ weights.w[...]
  if weights.scale is not None:
    y = y * weights.scale[...]
  if weights.bias is not None:
    y = y + weights.bias[...]
  o_ref[...] = y


def _reference(x, weights):
  y = x @ weights.w
  if weights.scale is not None:
    y = y * weights.scale
  if weights.bias is not None:
    y = y + weights.bias
  return y


def _blocks():
  x_spec = pl.BlockSpec((8, 16), lambda i: (i, 0))
  w_spec = pl.BlockSpec((16, 32), lambda i: (0, 0))
  row_spec = pl.BlockSpec((1, 32), lambda i: (0, 0))
  return x_spec, w_spec, row_spec, pl.BlockSpec((8, 32), lambda i: (i, 0))


@pytest.mark.parametrize("with_scale,with_bias", [(False, False), (True, False), (True, True)])
def test_dataclass_operand_with_none_fields(with_scale, with_bias):
  x, w = random_array((32, 16)), random_array((16, 32))
  weights = Weights(w, random_array((1, 32)) if with_scale else None,
                    random_array((1, 32)) if with_bias else None)
  x_spec, w_spec, row_spec, o_spec = _blocks()
  w_specs = Weights(w_spec, row_spec if with_scale else None, row_spec if with_bias else None)
  out = pallas_call(_linear_kernel, out_shape=jax.ShapeDtypeStruct((32, 32), f32), grid=(4,),
                    in_specs=[x_spec, w_specs], out_specs=o_spec)(x, weights)
  assert_close(out, _reference(x, weights), matmul=True)


def test_dataclass_specs_with_a_spec_for_a_none_field_describe_nothing():
  """A None operand (or field) is an empty subtree: a spec given for it is unused."""
  x, w = random_array((32, 16)), random_array((16, 32))
  x_spec, w_spec, row_spec, o_spec = _blocks()
  out = pallas_call(_linear_kernel, out_shape=jax.ShapeDtypeStruct((32, 32), f32), grid=(4,),
                    in_specs=[x_spec, Weights(w_spec, row_spec, row_spec)],
                    out_specs=o_spec)(x, Weights(w))
  assert_close(out, x @ w, matmul=True)


def test_dataclass_operand_matches_jax_pallas_interpreter():
  from jax.experimental import pallas as jpl
  x, w = random_array((32, 16)), random_array((16, 32))
  weights = Weights(w, random_array((1, 32)), None)
  specs = [jpl.BlockSpec((8, 16), lambda i: (i, 0)),
           Weights(jpl.BlockSpec((16, 32), lambda i: (0, 0)),
                   jpl.BlockSpec((1, 32), lambda i: (0, 0)), None)]
  theirs = jpl.pallas_call(_linear_kernel, out_shape=jax.ShapeDtypeStruct((32, 32), f32),
                           grid=(4,), in_specs=specs,
                           out_specs=jpl.BlockSpec((8, 32), lambda i: (i, 0)),
                           interpret=True)(x, weights)
  x_spec, w_spec, row_spec, o_spec = _blocks()
  ours = pallas_call(_linear_kernel, out_shape=jax.ShapeDtypeStruct((32, 32), f32), grid=(4,),
                     in_specs=[x_spec, Weights(w_spec, row_spec, None)],
                     out_specs=o_spec)(x, weights)
  assert_close(ours, theirs, matmul=True)
  assert_close(ours, _reference(x, weights), matmul=True)


def test_one_spec_stands_for_a_whole_operand_subtree():
  """JAX's prefix rule: a spec where the operand has a subtree applies to all its arrays."""
  def kernel(pair, table, o_ref):
    a_ref, b_ref = pair
    o_ref[...] = a_ref[...] * b_ref[...] + table["u"][...] - table["v"][...]

  a, b, u, v = (random_array((16, 8)) for _ in range(4))
  spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
  out = pallas_call(kernel, out_shape=sds(a), grid=(4,), in_specs=[spec, spec],
                    out_specs=spec)((a, b), {"u": u, "v": v})
  assert_close(out, a * b + u - v)
  # one spec for every input, and None (the whole array) for a subtree
  whole = pallas_call(kernel, out_shape=sds(a), in_specs=None)((a, b), {"u": u, "v": v})
  assert_close(whole, a * b + u - v)


def test_none_spec_stands_for_a_whole_subtree():
  def kernel(pair, table, o_ref):
    a_ref, b_ref = pair
    rows = pl.ds(pl.program_id(0) * 4, 4)
    o_ref[...] = a_ref[...] * b_ref[...] + table["u"][rows] - table["v"][rows]

  a, b, u, v = (random_array((16, 8)) for _ in range(4))
  spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
  out = pallas_call(kernel, out_shape=sds(a), grid=(4,), in_specs=[spec, None],
                    out_specs=spec)((a, b), {"u": u, "v": v})
  assert_close(out, a * b + u - v)


def test_prefix_spec_over_dataclass_operand():
  x, w = random_array((32, 16)), random_array((16, 32))
  full = pl.BlockSpec(memory_space=pl.ANY)

  def kernel(x_ref, weights, o_ref):
    o_ref[...] = x_ref[...] @ weights.w[...] + weights.bias[...]

  bias = random_array((1, 32))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((32, 32), f32),
                    in_specs=[full, full], out_specs=full)(x, Weights(w, None, bias))
  assert_close(out, x @ w + bias, matmul=True)


@pytest.mark.parametrize("specs_as,operands_as", [(list, tuple), (tuple, list)])
def test_lists_and_tuples_interchangeable_at_every_level(specs_as, operands_as):
  def kernel(refs, o_ref):
    (a_ref, b_ref), c_ref = refs
    o_ref[...] = a_ref[...] + 2 * b_ref[...] - c_ref[...]

  a, b, c = (random_array((12, 8)) for _ in range(3))
  spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
  specs = specs_as([specs_as([spec, spec]), spec])
  operands = operands_as([operands_as([a, b]), c])
  out = pallas_call(kernel, out_shape=sds(a), grid=(3,), in_specs=[specs],
                    out_specs=spec)(operands)
  assert_close(out, a + 2 * b - c)


def test_pl_kernel_takes_nested_operand_pytrees():
  mesh = pltpu.create_tensorcore_mesh("core")
  x, w = random_array((16, 8)), random_array((8, 8))
  weights = Weights(w, random_array((1, 8)), None)

  def body(inputs, weights, o_ref):
    x_ref, (y_ref,) = inputs
    acc = x_ref[...] @ weights.w[...] * weights.scale[...]
    o_ref[...] = acc + y_ref[...]

  y = random_array((16, 8))
  out = pl.kernel(body, out_type=sds(x), mesh=mesh)((x, [y]), weights)
  assert_close(out, x @ w * weights.scale + y, matmul=True)


def _raises(*fragments):
  return pytest.raises(pl.PalletError, match=".*".join(re.escape(f) for f in fragments))


def test_dataclass_spec_for_another_node_type_names_argument_and_place():
  @jax.tree_util.register_dataclass
  @dataclasses.dataclass
  class Other:
    w: Any
    scale: Any = None
    bias: Any = None

  x, w = random_array((32, 16)), random_array((16, 32))
  x_spec, w_spec, _, o_spec = _blocks()
  with _raises("kernel '_linear_kernel'", "in_specs", "structure", "input 1 ('weights')",
               "Other pytree", "Weights pytree"):
    pallas_call(_linear_kernel, out_shape=jax.ShapeDtypeStruct((32, 32), f32), grid=(4,),
                in_specs=[x_spec, Other(w_spec)], out_specs=o_spec)(x, Weights(w))


def test_nested_length_mismatch_names_argument_and_place():
  def kernel(refs, o_ref):
    o_ref[...] = refs[0][0][...]

  a = random_array((8, 8))
  spec = pl.BlockSpec((8, 8), lambda: (0, 0))
  with _raises("kernel 'kernel'", "in_specs", "input 0 ('refs')[0]", "a list of 2",
               "a tuple of 3"):
    pallas_call(kernel, out_shape=sds(a), in_specs=[[[spec, spec]]], out_specs=spec)(
        ((a, a, a),))


def test_spec_container_where_operand_is_an_array():
  a = random_array((8, 8))
  spec = pl.BlockSpec((8, 8), lambda: (0, 0))
  with _raises("kernel '<lambda>'", "out_specs", "structure", "a dict with keys ['x']",
               "an array float32[8, 8]"):
    pallas_call(lambda x_ref, o_ref: None, out_shape=sds(a), in_specs=[spec],
                out_specs={"x": spec})(a)


def test_dict_keys_mismatch():
  def kernel(d, o_ref):
    o_ref[...] = d["a"][...]

  a = random_array((8, 8))
  spec = pl.BlockSpec((8, 8), lambda: (0, 0))
  with _raises("in_specs", "input 0 ('d')", "a dict with keys ['b']", "a dict with keys ['a']"):
    pallas_call(kernel, out_shape=sds(a), in_specs=[{"b": spec}], out_specs=spec)({"a": a})
