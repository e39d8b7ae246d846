"""pallet.fuser: fused kernels against jax.numpy, block spec pull/push properties, the
materializing fallback and the errors."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pallet as pl
from pallet import fuser
from pallet.errors import UnfusibleError
from pallet.bench import fused
from helpers import current_test_backend, random_array, runs_on_gpu

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)


def _call_kwargs() -> dict:
  backend = current_test_backend()
  return {"backend": backend, **({} if backend == "xla" else {"interpret": not runs_on_gpu()})}


def _matmul(x, y, block=64):
  return fused.fusible_matmul(pl, x, y, bm=block, bn=block, **_call_kwargs())


def _assert_close(actual, expected, tol=1e-4):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=tol, atol=tol * 10)


# ------------------------------------------------------------------ fused matmul
def _program(x, y, scale, bias):
  out = _matmul((x * scale + 0.5).astype(jnp.float32), y)
  return jax.nn.relu(out + bias[None, :])


def _reference(x, y, scale, bias):
  out = jnp.dot(x * scale + 0.5, y, precision="highest")
  return jax.nn.relu(out + bias[None, :])


def _inputs():
  return (random_array((128, 64)), random_array((64, 128)), random_array((128, 64)),
          random_array((128,)))


def test_fused_matmul_forward_is_one_kernel():
  args = _inputs()
  program = fuser.fuse(_program)
  _assert_close(jax.jit(program)(*args), _reference(*args))
  names = [e.primitive.name for e in jax.make_jaxpr(program)(*args).jaxpr.eqns]
  assert names == ["pallas_call"], names   # scale, bias and relu all live in the kernel


def test_fused_matmul_grad():
  args = _inputs()
  loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
  got = jax.grad(loss(fuser.fuse(_program)), argnums=(0, 1, 2, 3))(*args)
  want = jax.grad(loss(_reference), argnums=(0, 1, 2, 3))(*args)
  for g, w in zip(got, want):
    _assert_close(g, w, 1e-3)


def test_fused_matmul_unfused_call_matches():
  x, y = random_array((128, 64)), random_array((64, 128))
  _assert_close(_matmul(x, y), jnp.dot(x, y, precision="highest"))


def test_dynamic_slice_input_uses_scalar_prefetch():
  x, y = random_array((128, 64)), random_array((3, 64, 128))

  @jax.jit
  @fuser.fuse
  def program(x, y, i):
    return _matmul(x, y[i]) * 2.0

  for i in range(3):
    _assert_close(program(x, y, i), 2.0 * jnp.dot(x, y[i], precision="highest"))


def test_unsupported_input_op_is_materialized_with_note(capsys):
  x, y = random_array((128, 64)), random_array((64, 128))

  @fuser.fuse(debug=True)
  def program(x, y):
    return _matmul(jnp.cumsum(x, axis=1), y)

  _assert_close(program(x, y), jnp.dot(jnp.cumsum(x, axis=1), y, precision="highest"))
  assert "materializing `cumsum`" in capsys.readouterr().out


def test_unsupported_output_op_runs_after_the_kernel_with_note(capsys):
  x, y = random_array((128, 64)), random_array((64, 128))

  @fuser.fuse(debug=True)
  def program(x, y):
    return jnp.cumsum(_matmul(x, y), axis=0)

  _assert_close(program(x, y), jnp.cumsum(jnp.dot(x, y, precision="highest"), axis=0), 1e-3)
  out = capsys.readouterr().out
  assert "`cumsum`" in out and "materialized" in out


def test_output_reduction_over_a_split_axis_falls_back(capsys):
  x, y = random_array((128, 64)), random_array((64, 128))

  @fuser.fuse(debug=True)
  def program(x, y):
    return jnp.sum(_matmul(x, y), axis=1)

  _assert_close(program(x, y), jnp.dot(x, y, precision="highest").sum(axis=1), 1e-3)
  assert "reduce_sum" in capsys.readouterr().out


# ------------------------------------------------------------------ properties
_UNARY = {"exp": lambda v: jnp.exp(v * 0.1), "tanh": jnp.tanh, "neg": lambda v: -v,
          "affine": lambda v: v * 3.0 - 1.0, "cast": lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)}


@st.composite
def _chains(draw):
  """(input shape, ops): a random elementwise/broadcast/transpose chain."""
  shape = tuple(draw(st.lists(st.sampled_from([4, 8, 16]), min_size=1, max_size=3)))
  ops, current = [], shape
  for _ in range(draw(st.integers(1, 5))):
    kind = draw(st.sampled_from(["unary", "value", "row", "transpose", "broadcast"]))
    if kind == "unary":
      ops.append(("unary", draw(st.sampled_from(sorted(_UNARY)))))
    elif kind == "value":
      ops.append(("value", current))
    elif kind == "row":
      ops.append(("row", (1,) + current[1:]))
    elif kind == "transpose":
      perm = tuple(draw(st.permutations(range(len(current)))))
      ops.append(("transpose", perm))
      current = tuple(current[p] for p in perm)
    elif len(current) < 4:
      ops.append(("broadcast", draw(st.sampled_from([2, 4]))))
      current = (ops[-1][1],) + current
  return shape, ops


def _apply(ops, x, values):
  it = iter(values)
  for kind, arg in ops:
    if kind == "unary":
      x = _UNARY[arg](x)
    elif kind in ("value", "row"):
      x = x + next(it)
    elif kind == "transpose":
      x = jnp.transpose(x, arg)
    else:
      x = jax.lax.broadcast_in_dim(x, (arg,) + x.shape, tuple(range(1, x.ndim + 1)))
  return x


def _values_for(ops, seed):
  return [random_array(arg, seed=seed + k) for k, (kind, arg) in enumerate(ops)
          if kind in ("value", "row")]


@st.composite
def _block_shapes(draw, shape):
  return tuple(draw(st.sampled_from([None, 1, max(d // 2, 1), d])) for d in shape)


def _spec(block_shape):
  return pl.BlockSpec(block_shape, lambda *g: g)


def _grid(shape, block_shape):
  return tuple(d if b is None else d // b for d, b in zip(shape, block_shape))


def _block_of(array, spec, grid_index):
  """What a kernel sees of `array` under `spec` at `grid_index`."""
  if spec is pl.no_block_spec:
    return array
  index = spec.index_map(*grid_index)
  pieces = []
  for b, i in zip(spec.block_shape, index):
    pieces.append(int(i) if b is None else slice(int(i) * b, (int(i) + 1) * b))
  return array[tuple(pieces)]


@pytest.mark.slow
@SETTINGS
@given(chain=_chains(), data=st.data())
def test_pull_block_spec_property(chain, data):
  shape, ops = chain
  x = random_array(shape, seed=1)
  values = _values_for(ops, 100)
  f = lambda x: _apply(ops, x, values)
  full = f(x)
  block_shape = data.draw(_block_shapes(full.shape))
  grid = _grid(full.shape, block_shape)
  f2, vals, prefetch = fuser.get_fusion_values(f, jax.ShapeDtypeStruct(shape, x.dtype))
  assert prefetch == ()
  kernel_fn, (value_specs, x_spec), _ = fuser.pull_block_spec(
      f2, _spec(block_shape), grid_len=len(grid))(vals, jax.ShapeDtypeStruct(shape, x.dtype))
  g = tuple(data.draw(st.integers(0, n - 1)) for n in grid)
  blocks = tuple(_block_of(v, s, g) for v, s in zip(vals, value_specs))
  got = kernel_fn(g, (), blocks, _block_of(x, x_spec, g))
  _assert_close(got, _block_of(full, _spec(block_shape), g), 1e-5)


@pytest.mark.slow
@SETTINGS
@given(chain=_chains(), data=st.data())
def test_push_block_spec_property(chain, data):
  shape, ops = chain
  x = random_array(shape, seed=2)
  values = _values_for(ops, 200)
  block_shape = data.draw(_block_shapes(shape))
  in_spec = _spec(block_shape)
  f = lambda x: _apply(ops, x, values)
  x_type = jax.ShapeDtypeStruct(shape, x.dtype)
  f2, vals, _ = fuser.get_fusion_values(f, x_type)
  kernel_fn, value_specs, _, out_type, out_spec = fuser.push_pull_block_spec(
      f2, in_spec, grid_len=len(shape))(vals, x_type)
  assert out_type.shape == f(x).shape
  g = tuple(data.draw(st.integers(0, n - 1)) for n in _grid(shape, block_shape))
  blocks = tuple(_block_of(v, s, g) for v, s in zip(vals, value_specs))
  got = kernel_fn(g, (), blocks, _block_of(x, in_spec, g))
  _assert_close(got, _block_of(f(x), out_spec, g), 1e-5)


# ------------------------------------------------------------------ rules and errors
def test_reshape_that_splits_a_block_is_an_unfusible_error():
  f2, vals, _ = fuser.get_fusion_values(lambda x: x.reshape(4, 8, 64),
                                        jax.ShapeDtypeStruct((32, 64), jnp.float32))
  with pytest.raises(UnfusibleError, match="reshape.*non-contiguous"):
    fuser.pull_block_spec(f2, pl.BlockSpec((2, 4, 16), lambda *g: g), grid_len=3)(
        vals, jax.ShapeDtypeStruct((32, 64), jnp.float32))


def test_reshape_keeping_blocks_whole_is_pulled():
  x = random_array((8, 4, 64))
  f2, vals, _ = fuser.get_fusion_values(lambda x: x.reshape(32, 64), x)
  kernel_fn, (_, spec), _ = fuser.pull_block_spec(
      f2, pl.BlockSpec((8, 64), lambda i, j: (i, j)), grid_len=2)(vals, x)
  assert spec.block_shape == (2, 4, 64) and spec.index_map(3, 0) == (3, 0, 0)
  _assert_close(kernel_fn((3, 0), (), vals, x[6:8]), x.reshape(32, 64)[24:32])


def test_unaligned_slice_becomes_element_offsets():
  x = random_array((64, 16))
  f2, vals, _ = fuser.get_fusion_values(lambda: x[3:35])
  _, (specs,), _ = fuser.pull_block_spec(f2, pl.BlockSpec((8, 16), lambda i: (i, 0)),
                                         grid_len=1)(vals)
  assert specs[0].block_shape == (pl.Element(8), 16)
  assert specs[0].index_map(2) == (19, 0)


def test_closed_over_ref_needs_the_stateful_variant():
  ref = jax.new_ref(jnp.zeros((8,)))
  with pytest.raises(ValueError, match="closes over Refs"):
    fuser.get_fusion_values(lambda: ref[...] + 1.0)
  f2, vals, _ = fuser.get_stateful_input_fusion_values(lambda: ref[...] + 1.0)
  _assert_close(f2(tuple(jnp.full((8,), 2.0) for _ in vals)), jnp.full((8,), 3.0))


def test_custom_fusion_requires_rules():
  @fuser.custom_fusion
  def double(x):
    return x * 2
  with pytest.raises(ValueError, match="evaluation rule"):
    double(jnp.ones(4))


def test_fuse_without_fusible_is_an_error():
  with pytest.raises(ValueError, match="no fusible"):
    fuser.fuse(lambda x: x + 1)(jnp.ones(4))


def test_names_match_jax_fuser():
  try:
    from jax.experimental.pallas import fuser as jax_fuser  # the peer
  except ImportError:
    pytest.skip("this jax has no jax.experimental.pallas.fuser")
  names = {n for n in dir(jax_fuser) if not n.startswith("_")}
  assert names <= set(dir(fuser)), names - set(dir(fuser))


def test_jax_ops_loader_routes_fuser():
  from pallet.bench import jax_ops
  assert jax_ops._route_import("jax.experimental.pallas", "fuser") is fuser
