"""Loads, stores and `+=` through chained `.at[...]` views (pallet/core/discharge.py):
one window of the base array, with JAX's meaning, traced starts included (negative
ones wrap, overhanging ones are clamped per view). JAX's Pallas interpreter is the
oracle, on random chains; the structure test pins why (no copy of a double-buffered
scratch's slot per store)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pallet as pl
import pallet.tpu as pltpu
from helpers import assert_close, current_test_backend, random_array

SHAPE = (2, 4, 8, 128)


@st.composite
def _chain(draw):
  """Two or three views, each as per-dimension ("index", start) or ("slice", start,
  size); a start is a Python int or ("traced", value) read from SMEM at run time."""
  visible, chain = list(SHAPE), []
  for level in range(draw(st.integers(2, 3))):
    if not visible:
      break
    indices = []
    for d, extent in enumerate(visible):
      kind = draw(st.sampled_from(["all", "slice", "index"]))
      traced = draw(st.booleans())
      if kind == "all" or (kind == "index" and len(visible) - d == 1 and level == 0):
        indices.append(("slice", 0, extent))
      elif kind == "slice":
        size = draw(st.integers(1, extent))
        start = (("traced", draw(st.integers(-extent, extent))) if traced
                 else draw(st.integers(0, extent - size)))
        indices.append(("slice", start, size))
      else:
        start = (("traced", draw(st.integers(-extent, extent - 1))) if traced
                 else draw(st.integers(0, extent - 1)))
        indices.append(("index", start))
    chain.append(indices)
    visible = [ix[2] for ix in indices if ix[0] == "slice"]
  return chain


def _apply(ref, chain, s_ref, pl):
  """`ref.at[...]...` along `chain`; traced starts come from `s_ref` in order."""
  k = 0
  for indices in chain:
    idx = []
    for ix in indices:
      start = ix[1]
      if isinstance(start, tuple):
        start, k = s_ref[k], k + 1
      idx.append(pl.ds(start, ix[2]) if ix[0] == "slice" else start)
    ref = ref.at[tuple(idx)]
  return ref


def _traced_values(chain):
  return [ix[1][1] for indices in chain for ix in indices if isinstance(ix[1], tuple)]


def _corner(shape):
  """The leading corner of a (2, 4, 8, 128) array with `shape`'s trailing dimensions."""
  return (0,) * (len(SHAPE) - len(shape)) + tuple(slice(0, n) for n in shape)


def _call(pl, pltpu, chain, access, interpret):
  def kernel(s_ref, x_ref, y_ref, o_ref, r_ref, scr):
    scr[...] = x_ref[...]
    view = _apply(scr, chain, s_ref, pl)
    r_ref[...] = jnp.zeros(r_ref.shape, r_ref.dtype)
    if access == "load":
      value = view[...]
      r_ref[_corner(value.shape)] = value
    elif access == "store":
      view[...] = y_ref[_corner(view.shape)]
    else:
      view[...] += y_ref[_corner(view.shape)]
    o_ref[...] = scr[...]

  n = max(1, len(_traced_values(chain)))
  return pl.pallas_call(
      kernel, out_shape=(jax.ShapeDtypeStruct(SHAPE, jnp.float32),
                         jax.ShapeDtypeStruct(SHAPE, jnp.float32)),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(SHAPE, lambda: (0,) * 4),
                pl.BlockSpec(SHAPE, lambda: (0,) * 4)],
      out_specs=(pl.BlockSpec(SHAPE, lambda: (0,) * 4), pl.BlockSpec(SHAPE, lambda: (0,) * 4)),
      scratch_shapes=[pltpu.VMEM(SHAPE, jnp.float32)], interpret=interpret), n


# jaxlib 0.10.2's XLA folds a dynamic_slice of a dynamic_slice into one and drops the first
# one's clamp, so JAX's interpreter itself reads the wrong element there (a traced start of
# -1 clamped by one view, then indexed by the next: tests/test_ref_views.py compares
# pallet's windows with JAX's helpers op by op, where the bug does not apply).
_JAX_CLAMPS_NESTED_SLICES = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)


@pytest.mark.skipif(current_test_backend() != "xla", reason="TPU-style views, XLA backend")
@pytest.mark.skipif(not _JAX_CLAMPS_NESTED_SLICES,
                    reason="the oracle (JAX's interpreter) drops a clamp on jaxlib 0.10")
@settings(max_examples=40, deadline=None)
@given(_chain(), st.sampled_from(["load", "store", "update"]), st.integers(0, 2**16))
def test_chained_views_match_jax_pallas_interpreter(chain, access, seed):
  from jax.experimental import pallas as jpl
  from jax.experimental.pallas import tpu as jpltpu
  x, y = random_array(SHAPE, seed=seed), random_array(SHAPE, seed=seed + 1)
  ours, n = _call(pl, pltpu, chain, access, False)
  theirs, _ = _call(jpl, jpltpu, chain, access, True)
  starts = jnp.array((_traced_values(chain) + [0])[:n], jnp.int32)
  got = jax.jit(ours)(starts, x, y)
  want = theirs(starts, x, y)
  for g, w in zip(got, want):
    assert_close(g, w)


@pytest.mark.skipif(current_test_backend() != "xla", reason="the XLA backend's program")
def test_a_store_into_one_slot_of_a_scratch_writes_only_there():
  """`buf.at[slot][i, k] = v` in a loop (a double-buffered TPU scratch): one update of the
  base array per store, so XLA updates the buffer in place instead of copying the slot."""
  def kernel(n_ref, x_ref, o_ref, buf):
    buf[...] = jnp.zeros(buf.shape, buf.dtype)

    @pl.loop(0, n_ref[0])
    def _(i):
      slot = i % 2
      for row in range(4):
        for k in range(3):
          buf.at[slot][row, k] = x_ref[pl.ds(row + k, 1)] * (i + 1).astype(jnp.float32)
    o_ref[...] = buf[...].sum(axis=(0, 1)).reshape(3, 128)

  call = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((3, 128), jnp.float32),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)],
      scratch_shapes=[pltpu.VMEM((2, 4, 3, 1, 128), jnp.float32)])
  n, x = jnp.array([5], jnp.int32), random_array((8, 128))
  want = np.zeros((2, 4, 3, 1, 128), np.float32)
  for i in range(5):
    for row in range(4):
      for k in range(3):
        want[i % 2, row, k] = np.asarray(x[row + k:row + k + 1]) * (i + 1)
  assert_close(call(n, x), want.sum(axis=(0, 1)).reshape(3, 128))
  hlo = jax.jit(call).lower(n, x).compile().as_text()
  assert " copy(" not in "\n".join(line for line in hlo.splitlines()
                                   if "f32[2,4,3,1,128]" in line.split("=")[-1][:30])


@pytest.mark.skipif(current_test_backend() != "xla", reason="TPU-style views, XLA backend")
def test_a_start_clamped_by_one_view_then_indexed_by_the_next():
  """`at[..., pl.ds(-1, 2)]` on 128 lanes wraps to 127 and is clamped to lanes 126..127;
  index 0 of that is lane 126. On jaxlib 0.10 JAX's own rules, compiled, read lane 127
  (the nested slice's clamp dropped), which pallet did too until its chained views became
  one window (NumPy is the oracle here, on every JAX version)."""
  x = random_array(SHAPE)

  def kernel(s_ref, x_ref, o_ref, scr):
    scr[...] = x_ref[...]
    o_ref[...] = scr.at[0, :, :, pl.ds(s_ref[0], 2)].at[:, :, s_ref[1]][...]

  call = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((4, 8), jnp.float32),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(SHAPE, lambda: (0,) * 4)],
      out_specs=pl.BlockSpec((4, 8), lambda: (0, 0)),
      scratch_shapes=[pltpu.VMEM(SHAPE, jnp.float32)])
  out = jax.jit(call)(jnp.array([-1, 0], jnp.int32), x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(x)[0, :, :, 126])
