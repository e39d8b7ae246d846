"""A first call traces each kernel as few times as it can (XLA backend): what the
tracing pipeline skips is checked here, and every result against jax.numpy."""
from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
import pallet.tpu as pltpu
from helpers import assert_close, current_test_backend, pallas_call, random_array

f32 = jnp.float32
pytestmark = pytest.mark.skipif(current_test_backend() != "xla",
                                reason="the XLA backend's tracing pipeline")


def _kernel_of(fn, *args):
  jaxpr = jax.make_jaxpr(fn)(*args)
  return next(e.params["kernel"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call")


def _row_softmax(x):
  def kernel(x_ref, o_ref):
    v = x_ref[...]
    e = jnp.exp(v - jnp.max(v, axis=-1, keepdims=True))
    o_ref[...] = e / jnp.sum(e, axis=-1, keepdims=True)
  spec = pl.BlockSpec((4, x.shape[1]), lambda i: (i, 0))
  return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, f32),
                     grid=(x.shape[0] // 4,), in_specs=[spec], out_specs=spec)(x)


def test_vmap_keeps_the_traced_kernel_body():
  x = random_array((3, 16, 8))
  plain = _kernel_of(_row_softmax, x[0])
  batched = _kernel_of(jax.vmap(_row_softmax), x)
  # the same equations, one more (grid index) input: the body was not traced again
  assert [id(e) for e in batched.jaxpr.jaxpr.eqns] == [id(e) for e in plain.jaxpr.jaxpr.eqns]
  assert len(batched.jaxpr.jaxpr.invars) == len(plain.jaxpr.jaxpr.invars) + 1
  want = jax.nn.softmax(x, axis=-1)
  assert_close(jax.vmap(_row_softmax)(x), want, rtol=1e-5, atol=1e-6)
  assert_close(jax.vmap(_row_softmax, in_axes=1, out_axes=1)(jnp.moveaxis(x, 0, 1)),
               jnp.moveaxis(want, 0, 1), rtol=1e-5, atol=1e-6)


def _loop_kernel(x):
  """A while loop (trip count from the grid) whose every carry changes: no static
  index, nothing to hoist."""
  def kernel(x_ref, o_ref):
    v = x_ref[...]
    n = pl.program_id(0) + 2
    _, acc = jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 0.5 + v),
                                (0, jnp.zeros_like(v)))
    o_ref[...] = acc
  return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, f32), grid=(2,),
                     in_specs=[pl.BlockSpec((None, 8), lambda i: (i, 0))],
                     out_specs=pl.BlockSpec((None, 8), lambda i: (i, 0)))(x)


def _masked_row_load(x):
  """A Triton-style masked load through an index vector: a static-index rewrite."""
  def kernel(x_ref, o_ref):
    cols = jnp.arange(8)
    row = pl.load(x_ref.at[0, cols], mask=cols < 6, other=0.0)
    o_ref[...] = row[None, :] * 2
  return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4, 8), f32), grid=(4,),
                     in_specs=[pl.BlockSpec((1, 8), lambda i: (i, 0))],
                     out_specs=pl.BlockSpec((1, 8), lambda i: (i, 0)))(x)


def test_static_index_pass_traces_only_where_a_rewrite_can_fire(monkeypatch):
  from pallet.backends.xla import static_indices
  from pallet.core import trace_cache
  x = random_array((2, 8))
  want = jnp.stack([x[i] * sum(0.5 ** k for k in range(i + 2)) for i in range(2)])
  trace_cache.clear()
  folds = []
  real = static_indices._Folder
  monkeypatch.setattr(static_indices, "_Folder", lambda: folds.append(1) or real())
  assert_close(_loop_kernel(x), want, rtol=1e-5, atol=1e-5)
  assert folds == []            # nothing to rewrite: the body was not traced again
  y = random_array((4, 8))
  assert_close(_masked_row_load(y), jnp.where(jnp.arange(8) < 6, y * 2, 0.0))
  assert folds == [1]           # a rewrite fires: traced once


def test_scratch_kernel_outside_the_accumulator_pattern_is_discharged_once(monkeypatch):
  from pallet.core import discharge
  from pallet.core import trace_cache

  def matmul(x, y):
    def kernel(x_ref, y_ref, o_ref, acc_ref):
      @pl.when(pl.program_id(2) == 0)
      def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, f32)
      acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=f32)

      @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
      def _():   # not an elementwise copy: the scratch proof fails, the plan loops
        o_ref[...] = acc_ref[...] + jnp.sum(acc_ref[...])
    return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), f32), grid=(2, 2, 2),
                       in_specs=[pl.BlockSpec((8, 8), lambda i, j, k: (i, k)),
                                 pl.BlockSpec((8, 8), lambda i, j, k: (k, j))],
                       out_specs=pl.BlockSpec((8, 8), lambda i, j, k: (i, j)),
                       scratch_shapes=[pltpu.VMEM((8, 8), f32)])(x, y)

  x, y = random_array((16, 16)), random_array((16, 16))
  trace_cache.clear()
  kernel = _kernel_of(matmul, x, y)
  discharged = []
  real = discharge.discharge_state
  monkeypatch.setattr(discharge, "discharge_state",
                      lambda j: discharged.append(j is kernel.jaxpr) or real(j))
  xy = x @ y
  blocks = xy.reshape(2, 8, 2, 8).sum(axis=(1, 3))
  want = xy + jnp.repeat(jnp.repeat(blocks, 8, 0), 8, 1)
  assert_close(matmul(x, y), want, matmul=True)
  assert discharged.count(True) == 1   # the scratch proof and the planner share it


def test_the_garbage_collector_is_paused_while_tracing_and_restored():
  seen = []

  def kernel(x_ref, o_ref):
    seen.append(gc.isenabled())
    o_ref[...] = x_ref[...] + 1

  x = random_array((8,))
  assert gc.isenabled()
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), f32))(x)
  assert_close(out, x + 1)
  assert seen == [False] and gc.isenabled()
  gc.disable()
  try:   # a caller's own setting is kept
    pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 3),
                out_shape=jax.ShapeDtypeStruct((8,), f32))(x)
    assert not gc.isenabled()
  finally:
    gc.enable()


def _blocked_matmul(x, y):
  """A k grid axis the plan sums over, i and j vectorized: slabs change layout."""
  def kernel(x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      o_ref[...] = jnp.zeros(o_ref.shape, f32)
    o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=f32)
  return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), f32),
                     grid=(2, 2, 2),
                     in_specs=[pl.BlockSpec((8, 8), lambda i, j, k: (i, k)),
                               pl.BlockSpec((8, 8), lambda i, j, k: (k, j))],
                     out_specs=pl.BlockSpec((8, 8), lambda i, j, k: (i, j)))(x, y)


def test_emitted_program_moves_axes_without_tracing_jnp_moveaxis(monkeypatch):
  # jnp.moveaxis is jitted: each new shape is a trace of its own on a first call
  from pallet.core import trace_cache
  calls = []
  real = jnp.moveaxis
  monkeypatch.setattr(jnp, "moveaxis", lambda *a, **k: calls.append(1) or real(*a, **k))
  x, y = random_array((16, 16)), random_array((16, 16))
  trace_cache.clear()
  assert_close(jax.jit(_blocked_matmul)(x, y), x @ y, matmul=True)
  z = random_array((4, 8))    # the static-index rewrite of a masked index-vector load
  assert_close(_masked_row_load(z), jnp.where(jnp.arange(8) < 6, z * 2, 0.0))
  assert calls == []


def test_gradient_program_is_not_traced_again_for_its_2d_products(monkeypatch):
  from pallet.backends.xla import canonical_dots
  from pallet.core import trace_cache
  traced = []
  real = canonical_dots.canonical
  monkeypatch.setattr(canonical_dots, "canonical", lambda c: traced.append(1) or real(c))
  rewritten = []
  real_dot = canonical_dots._dot
  monkeypatch.setattr(canonical_dots, "_dot", lambda *a: rewritten.append(1) or real_dot(*a))
  x, y = random_array((16, 16)), random_array((16, 16))
  loss = lambda x, y: jnp.sum(jnp.sin(_blocked_matmul(x, y)))
  trace_cache.clear()
  gx, gy = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, y)
  wx, wy = jax.grad(lambda x, y: jnp.sum(jnp.sin(x @ y)), argnums=(0, 1))(x, y)
  assert_close(gx, wx, matmul=True)
  assert_close(gy, wy, matmul=True)
  assert rewritten            # the vectorized product was made 2-D ...
  assert traced == []         # ... while the caller traced it, not in a trace of its own


def test_masked_index_vector_access_discharges_without_jnp_indexing(monkeypatch):
  # jax.numpy's `.at[...]` analyses the index in Python and traces jitted helpers per
  # shape: the load and store below discharge to the same gather and scatter without it
  from jax._src.numpy import indexing
  from jax._src.ops import scatter
  from pallet.core import trace_cache
  calls = []
  take, update = indexing.rewriting_take, scatter._scatter_update
  monkeypatch.setattr(indexing, "rewriting_take", lambda *a, **k: calls.append(1) or take(*a, **k))
  monkeypatch.setattr(scatter, "_scatter_update",
                      lambda *a, **k: calls.append(2) or update(*a, **k))

  def kernel(x_ref, o_ref):
    cols = jnp.arange(8)
    row = pl.load(x_ref.at[0, cols], mask=cols < 6, other=-1.0)
    pl.store(o_ref, (0, cols), row * 2, mask=cols > 0)
  x = random_array((4, 8))
  trace_cache.clear()
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4, 8), f32), grid=(4,),
                    in_specs=[pl.BlockSpec((1, 8), lambda i: (i, 0))],
                    out_specs=pl.BlockSpec((1, 8), lambda i: (i, 0)))(x)
  assert calls == []
  cols = np.arange(8)
  want = np.where(cols < 6, np.asarray(x) * 2, -2.0)
  assert_close(np.asarray(out)[:, 1:], want[:, 1:])    # column 0 is never written


@pytest.mark.parametrize("shape,index_shapes", [((), []), ((16,), [(5,)]),
                                                ((4, 6), [(3, 1), (1, 5)]),
                                                ((3, 4, 5), [(2,), (2,), (2,)])])
def test_lax_gather_and_scatter_match_jax_numpy_indexing(shape, index_shapes):
  from pallet.core import array_ops
  rng = np.random.default_rng(len(shape))
  x = random_array(shape)
  # positions in and out of bounds, negative ones too (counted from the end)
  positions = [jnp.asarray(rng.integers(-n - 2, n + 2, s), jnp.int32)
               for n, s in zip(shape, index_shapes)]
  want = x.at[tuple(positions)].get(mode="fill", fill_value=-7.0)
  np.testing.assert_array_equal(array_ops.take_or_fill(x, positions, -7.0), want)
  flat = x.reshape(-1)
  index = jnp.asarray(rng.permutation(np.arange(-3, flat.size + 3))[:flat.size // 2], jnp.int32)
  updates = random_array(index.shape)
  np.testing.assert_array_equal(array_ops.set_or_drop(flat, index, updates),
                                flat.at[index].set(updates, mode="drop"))
  if shape:
    moved = array_ops.moveaxis(x, [0], [len(shape) - 1])
    np.testing.assert_array_equal(moved, jnp.moveaxis(x, 0, -1))


def test_kernel_and_index_maps_are_traced_without_make_jaxpr(monkeypatch):
  # make_jaxpr runs jit's argument handling around each trace: a fixed cost that a
  # first call would pay for the kernel and each of its index maps
  from pallet.core import trace_cache
  calls = []
  real = jax.make_jaxpr
  monkeypatch.setattr(jax, "make_jaxpr", lambda *a, **k: calls.append(1) or real(*a, **k))
  x = random_array((16, 8))
  trace_cache.clear()
  traced = jax.jit(_row_softmax).trace(x)
  assert calls == []
  kernel = next(e.params["kernel"] for e in traced.jaxpr.jaxpr.eqns
                if e.primitive.name == "pallas_call")
  assert len(kernel.jaxpr.jaxpr.invars) == 3      # the grid index and two block refs
  assert_close(jax.jit(_row_softmax)(x), jax.nn.softmax(x, axis=-1), rtol=1e-5, atol=1e-6)


def test_masked_atomic_into_a_scalar_output():
  # the element offsets of a 0-d ref (indexed by ()) are the ref itself
  import pallet.triton as plgpu

  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.zeros((), f32)
    row = jnp.sum(x_ref[...])
    plgpu.atomic_add(o_ref, (), row, mask=row > 0)
  x = random_array((6, 8))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((), f32), grid=(6,),
                    in_specs=[pl.BlockSpec((1, 8), lambda i: (i, 0))],
                    out_specs=pl.BlockSpec((), lambda i: ()))(x)
  rows = jnp.sum(x, axis=1)
  assert_close(out, jnp.sum(jnp.where(rows > 0, rows, 0.0)), rtol=1e-5, atol=1e-5)
