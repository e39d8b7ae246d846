"""pallet against a direct NumPy model of Pallas semantics (docs/semantics.md §2-7).

The model runs the grid as a row-major loop; at each step it cuts every block out of
its array per BlockSpec, runs the kernel body on NumPy values and writes the output
block back, dropping what lies past the array edge. Values read past an edge are
unspecified: the model marks them (and everything computed from them) as such and the
comparison skips those elements. Hypothesis draws grids, block shapes (dividing the
array or not), index maps (moving, revisiting, reversed, fixed), a scratch carried
across steps and reset under a condition on the grid indices, outputs written or
accumulated, and dimension_semantics. A declared "parallel" axis that carries state
runs in order (with a GridOrderWarning), so every case must match the row-major model.
Outputs alias a NaN buffer, so an element pallet fails to write shows.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

import pallet as pl
from pallet import tpu as pltpu
from helpers import pallas_call, poisoned, random_array

SETTINGS = settings(max_examples=16, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------ the case
@dataclasses.dataclass(frozen=True)
class IndexMap:
  """Per array dimension: (kind, grid axis or constant); kinds are
  "id" (ids[g]), "half" (ids[g] // 2), "rev" (n - 1 - ids[g]), "const" (c)."""
  dims: tuple[tuple[str, int], ...]
  nblocks: tuple[int, ...]

  def __call__(self, *ids):
    out = []
    for (kind, g), nb in zip(self.dims, self.nblocks):
      if kind == "const":
        out.append(g % nb)
      elif kind == "id":
        out.append(ids[g] % nb)
      elif kind == "half":
        out.append((ids[g] // 2) % nb)
      else:
        out.append(nb - 1 - ids[g] % nb)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Case:
  grid: tuple[int, ...]
  shape: tuple[int, ...]
  block: tuple[int, ...]
  in_map: IndexMap
  out_map: IndexMap
  scratch_reset: tuple | None   # None: no scratch; ("axis", g) / ("first",) / ("always",)
  decay: float                  # scratch = scratch * decay + x
  out_reset: tuple | None       # None: o = value (+ program term); else o += value after reset
  semantics: tuple[str, ...] | None


def _holds(cond: tuple, ids) -> bool:
  """A reset condition on the grid indices (Python ints or traced values)."""
  if cond[0] == "always":
    return True
  if cond[0] == "first":
    return functools.reduce(lambda a, b: a & b, [i == 0 for i in ids])
  return ids[cond[1]] == 0


@st.composite
def cases(draw) -> Case:
  G = draw(st.integers(1, 3))
  grid = tuple(draw(st.integers(1, 4)) for _ in range(G))
  rank = draw(st.integers(1, 2))
  shape = tuple(draw(st.integers(1, 9)) for _ in range(rank))
  block = tuple(draw(st.integers(1, n)) for n in shape)
  nblocks = tuple(math.ceil(n / b) for n, b in zip(shape, block))

  def index_map():
    dims = []
    for _ in range(rank):
      kind = draw(st.sampled_from(["id", "id", "half", "rev", "const"]))
      dims.append((kind, draw(st.integers(0, 3)) if kind == "const" else
                   draw(st.integers(0, G - 1))))
    return IndexMap(tuple(dims), nblocks)

  resets = st.one_of(st.tuples(st.just("axis"), st.integers(0, G - 1)),
                     st.just(("first",)), st.just(("always",)))
  semantics = st.one_of(st.none(), st.tuples(*[st.sampled_from(["parallel", "arbitrary"])] * G))
  return Case(grid, shape, block, index_map(), index_map(),
              draw(st.one_of(st.none(), resets)), draw(st.sampled_from([1.0, 0.5])),
              draw(st.one_of(st.none(), resets)), draw(semantics))


def _program_term(ids) -> float:
  """Distinguishes programs, so that which one wrote a block last shows."""
  return sum((10.0 ** g) * i for g, i in enumerate(ids))


# ------------------------------------------------------------------ the NumPy model
def _window(starts, block, shape):
  """Slices of the in-range part of a block in the array and in the block."""
  arr, blk = [], []
  for s, b, n in zip(starts, block, shape):
    hi = min(s + b, n)
    arr.append(slice(s, max(s, hi)))
    blk.append(slice(0, max(0, hi - s)))
  return tuple(arr), tuple(blk)


def model(case: Case, x: np.ndarray, buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(output, unspecified mask) of the kernel under Pallas semantics."""
  out, out_unspec = buf.astype(np.float32).copy(), np.zeros(buf.shape, bool)
  acc = np.zeros(case.block, np.float32)
  acc_unspec = np.ones(case.block, bool)          # scratch starts unspecified
  for ids in itertools.product(*[range(n) for n in case.grid]):
    starts = [i * b for i, b in zip(case.in_map(*ids), case.block)]
    a, k = _window(starts, case.block, case.shape)
    xb = np.zeros(case.block, np.float32)
    xu = np.ones(case.block, bool)
    xb[k], xu[k] = x[a], False
    if case.scratch_reset is not None:
      if _holds(case.scratch_reset, ids):
        acc, acc_unspec = np.zeros_like(acc), np.zeros_like(acc_unspec)
      acc = (acc * np.float32(case.decay) + xb).astype(np.float32)
      acc_unspec = acc_unspec | xu
      value, value_unspec = acc.copy(), acc_unspec.copy()
    else:
      value, value_unspec = xb * 2, xu.copy()
    starts = [i * b for i, b in zip(case.out_map(*ids), case.block)]
    a, k = _window(starts, case.block, case.shape)
    ob = np.zeros(case.block, np.float32)
    ou = np.ones(case.block, bool)                # past the edge: unspecified
    ob[k], ou[k] = out[a], out_unspec[a]
    if case.out_reset is None:
      ob, ou = value + np.float32(_program_term(ids)), value_unspec
    else:
      if _holds(case.out_reset, ids):
        ob, ou = np.zeros_like(ob), np.zeros_like(ou)
      ob, ou = ob + value, ou | value_unspec
    out[a], out_unspec[a] = ob[k], ou[k]          # writes past the edge are dropped
  return out, out_unspec


# ------------------------------------------------------------------ the kernel
def run_pallet(case: Case, x: jax.Array, buf: jax.Array) -> jax.Array:
  ids_of = lambda: tuple(pl.program_id(g) for g in range(len(case.grid)))

  def kernel(x_ref, buf_ref, o_ref, *scratch):
    ids = ids_of()
    if case.scratch_reset is not None:
      (acc_ref,) = scratch

      @pl.when(_holds(case.scratch_reset, ids))
      def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)
      acc_ref[...] = acc_ref[...] * case.decay + x_ref[...]
      value = acc_ref[...]
    else:
      value = x_ref[...] * 2
    if case.out_reset is None:
      o_ref[...] = value + sum((10.0 ** g) * i.astype(jnp.float32) for g, i in enumerate(ids))
    else:
      @pl.when(_holds(case.out_reset, ids))
      def _():
        o_ref[...] = jnp.zeros_like(o_ref)
      o_ref[...] += value

  in_spec = pl.BlockSpec(case.block, case.in_map)
  out_spec = pl.BlockSpec(case.block, case.out_map)
  scratch = [] if case.scratch_reset is None else [pltpu.VMEM(case.block, jnp.float32)]
  params = (None if case.semantics is None else
            pltpu.CompilerParams(dimension_semantics=case.semantics))
  fn = pallas_call(kernel, jax.ShapeDtypeStruct(case.shape, jnp.float32), grid=case.grid,
                   in_specs=[in_spec, out_spec], out_specs=out_spec, scratch_shapes=scratch,
                   input_output_aliases={1: 0}, compiler_params=params)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", pl.GridOrderWarning)   # tested in test_grid_soundness
    return fn(x, buf)


def _integers(shape, seed):
  """Small integers as float32 (sums stay exact; halving decays stay within rounding)."""
  return random_array(shape, jnp.int32, seed=seed, low=-8, high=8).astype(jnp.float32)


@SETTINGS
@given(cases(), st.integers(0, 2 ** 16))
def test_pallet_matches_the_numpy_model_of_pallas(case, seed):
  x = _integers(case.shape, seed)
  buf = poisoned(case.shape)
  expected, unspecified = model(case, np.asarray(x), np.asarray(buf))
  got = np.asarray(run_pallet(case, x, buf))
  np.testing.assert_allclose(np.where(unspecified, 0, got), np.where(unspecified, 0, expected),
                             rtol=1e-6, atol=1e-6, err_msg=str(case))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(cases())
def test_the_model_itself_follows_row_major_order(case):
  # The model is only a reference if it is right: a kernel that records each step's
  # program term in a fully covered output gives, per block, the last visitor.
  # (Input and output blocks coincide, so no value read past an edge lands in range.)
  case = dataclasses.replace(case, in_map=case.out_map, scratch_reset=None, out_reset=None)
  x = np.zeros(case.shape, np.float32)
  out, unspecified = model(case, x, np.full(case.shape, np.nan, np.float32))
  last = {}
  for ids in itertools.product(*[range(n) for n in case.grid]):
    last[case.out_map(*ids)] = _program_term(ids)
  for index in np.ndindex(case.shape):
    block = tuple(i // b for i, b in zip(index, case.block))
    if block in last:
      assert out[index] == last[block] and not unspecified[index]
    else:
      assert np.isnan(out[index])
