"""pallas_call as real Pallas code calls it: metadata=, named grids with lax.axis_index,
Python scalar and None operands, optional kernel parameters, jax.disable_jit, the
trace cache and Element padding."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallet as pl
import pallet.tpu as pltpu
from pallet.core import trace_cache
from helpers import assert_close, pallas_call, random_array, sds

f32 = jnp.float32


def _rows(i, j):
  return (i, j)


def test_metadata_is_accepted():
  x = random_array((8,))
  out = pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2),
                    out_shape=sds(x), metadata={"origin": "test"})(x)
  assert_close(out, x * 2)


# ------------------------------------------------------------------ named grids
def test_named_grid_axis_index_is_program_id():
  def kernel(x_ref, o_ref):
    i, j = lax.axis_index("i"), lax.axis_index("j")
    assert lax.axis_size("j") == 4
    base = x_ref[...] + (10 * i + j).astype(f32)

    @pl.when(lax.axis_index("j") % 2 == 1)       # inside a cond
    def _():
      o_ref[...] = base + 100 * (pl.program_id(1) == lax.axis_index("j")).astype(f32)

    @pl.when(j % 2 == 0)
    def _():
      o_ref[...] = lax.fori_loop(                # inside a loop body
          0, 2, lambda k, acc: acc + lax.axis_index("i").astype(f32), base)

  x = random_array((4, 8))
  spec = pl.BlockSpec((2, 2), _rows)
  out = pallas_call(kernel, out_shape=sds(x), grid=(("i", 2), ("j", 4)),
                    in_specs=[spec], out_specs=spec)(x)
  i = jnp.arange(4)[:, None] // 2
  j = jnp.arange(8)[None, :] // 2
  base = x + (10 * i + j)
  expected = jnp.where(j % 2 == 1, base + 100, base + 2 * i)
  assert_close(out, expected.astype(f32))


def test_named_grid_under_vmap_and_jit():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * (lax.axis_index("row") + 1).astype(f32)

  spec = pl.BlockSpec((1, 8), lambda r: (r, 0))
  call = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((3, 8), f32),
                     grid=(("row", 3),), in_specs=[spec], out_specs=spec)
  xs = random_array((2, 3, 8))
  assert_close(jax.jit(jax.vmap(call))(xs), xs * jnp.arange(1, 4, dtype=f32)[:, None])


def test_partly_named_grid_is_an_error():
  with pytest.raises(pl.PalletError, match="kernel '<lambda>'.*names every axis"):
    pallas_call(lambda x_ref, o_ref: None, out_shape=sds(random_array((4,))),
                grid=(("i", 2), 3))(random_array((4,)))


def test_unknown_axis_name_is_still_an_error():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + lax.axis_index("k")

  with pytest.raises(Exception, match="k"):
    pallas_call(kernel, out_shape=sds(random_array((4,))), grid=(("i", 1),))(
        random_array((4,)))


# ------------------------------------------------------------------ operands
def test_python_scalars_as_operands():
  def kernel(x_ref, scale_ref, shift_ref, o_ref):
    o_ref[...] = x_ref[...] * scale_ref[...] + shift_ref[...]

  x = random_array((16,))
  out = pallas_call(kernel, out_shape=sds(x))(x, 2.5, 3)
  assert out.dtype == f32
  assert_close(out, x * 2.5 + 3)


def test_none_operands_and_specs_are_empty():
  def kernel(x_ref, bias_ref, y_ref, o_ref):
    assert bias_ref is None
    o_ref[...] = x_ref[...] + y_ref[...]

  x, y = random_array((16,)), random_array((16,))
  spec = pl.BlockSpec((4,), lambda i: (i,))
  out = pallas_call(kernel, out_shape=sds(x), grid=(4,),
                    in_specs=[spec, None, spec], out_specs=spec)(x, None, y)
  assert_close(out, x + y)


def test_none_and_pytree_scalar_prefetch_operands():
  # As megablox's gmm: a tuple of prefetch arrays, an optional one that is None.
  def index_map(i, meta, offset):
    assert offset is None
    starts, _ = meta
    return (starts[i],)

  def kernel(meta, offset_ref, x_ref, o_ref):
    assert offset_ref is None
    _, scales = meta
    o_ref[...] = x_ref[...] * scales[pl.program_id(0)]

  x = random_array((16,))
  starts = jnp.array([3, 0, 2, 1], jnp.int32)
  scales = random_array((4,))
  spec = pl.BlockSpec((4,), index_map)
  out = pallas_call(kernel, out_shape=sds(x),
                    grid_spec=pltpu.PrefetchScalarGridSpec(
                        num_scalar_prefetch=2, grid=(4,), in_specs=[spec],
                        out_specs=pl.BlockSpec((4,), lambda i, meta, offset: (i,))))(
                            (starts, scales), None, x)
  blocks = x.reshape(4, 4)[starts] * scales[:, None]
  assert_close(out, blocks.reshape(-1))


# ------------------------------------------------------------------ optional parameters
def _norm_kernel(x_ref, o_ref, mean_ref=None):
  x = x_ref[...]
  o_ref[...] = x - jnp.mean(x, axis=1, keepdims=True)
  if mean_ref is not None:
    mean_ref[...] = jnp.mean(x, axis=1)


def test_kernel_parameters_with_defaults_are_optional_refs():
  x = random_array((8, 16))
  centred = x - x.mean(1, keepdims=True)
  assert_close(pallas_call(_norm_kernel, out_shape=sds(x))(x), centred)
  out, mean = pallas_call(_norm_kernel,
                          out_shape=(sds(x), jax.ShapeDtypeStruct((8,), f32)))(x)
  assert_close((out, mean), (centred, x.mean(1)))


def test_arity_error_reports_the_range():
  x = random_array((8, 16))
  with pytest.raises(pl.PalletError, match="_norm_kernel' takes 2 to 3 positional.*4 refs"):
    pallas_call(_norm_kernel, out_shape=(sds(x), sds(x), sds(x)))(x)


# ------------------------------------------------------------------ disable_jit
def test_call_under_disable_jit():
  x = random_array((16,))
  call = pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., jnp.exp(x_ref[...])),
                     out_shape=sds(x), grid=(2,),
                     in_specs=[pl.BlockSpec((8,), lambda i: (i,))],
                     out_specs=pl.BlockSpec((8,), lambda i: (i,)))
  with jax.disable_jit():
    out = call(x)
  assert_close(out, jnp.exp(x))


# ------------------------------------------------------------------ trace cache
def _traces() -> int:
  """Kernels traced so far (a counter outside every kernel's key: a log the kernel
  itself appended to would be part of the key and change it)."""
  assert not trace_cache.stats["uncacheable"]
  return trace_cache.stats["miss"]


def test_second_call_with_same_shapes_does_not_retrace():
  def kernel(x_ref, o_ref, *, scale):
    o_ref[...] = x_ref[...] * scale

  trace_cache.clear()
  x, y = random_array((16,)), random_array((16,))
  for scale in (2, 2, 2.0):
    call = pallas_call(functools.partial(kernel, scale=scale), out_shape=sds(x))
    assert_close(call(x), x * scale)
    assert_close(call(y), y * scale)
  assert _traces() == 2                      # 2 and 2.0 are different keys; repeats hit
  z = random_array((8,))
  assert_close(pallas_call(functools.partial(kernel, scale=2), out_shape=sds(z))(z), z * 2)
  assert _traces() == 3                      # a new shape traces again


def test_ops_that_build_fresh_kernels_and_index_maps_hit_the_cache():
  # As JAX's ops do: every call defines the kernel and its index-map lambdas anew.
  def op(x, scale, block):
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] * scale

    spec = pl.BlockSpec((block,), lambda i: (i,))
    return pallas_call(kernel, out_shape=sds(x), grid=(x.shape[0] // block,),
                       in_specs=[spec], out_specs=spec)(x)

  trace_cache.clear()
  x = random_array((16,))
  for scale, block in [(3, 4), (3, 4), (5, 4), (3, 8), (3, 4)]:
    assert_close(op(x, scale, block), x * scale)
  assert _traces() == 3                     # closure values are part of the key


def test_unhashable_partial_arguments_trace_every_time():
  traces = []

  def kernel(x_ref, o_ref, *, table):
    traces.append(1)
    o_ref[...] = x_ref[...] + jnp.asarray(table)

  x = random_array((4,))
  for t in (np.arange(4.0), np.arange(4.0) * 3):
    out = pallas_call(functools.partial(kernel, table=t), out_shape=sds(x))(x)
    assert_close(out, x + jnp.asarray(t, f32))
  assert len(traces) == 2


def test_cache_freezes_types():
  assert trace_cache.freeze(1) != trace_cache.freeze(1.0) != trace_cache.freeze(True)
  assert trace_cache.freeze([1, (2, "a")]) == trace_cache.freeze((1, [2, "a"]))
  # arrays by content (kernels closing over a fresh array each call still hit)
  assert trace_cache.freeze(np.zeros(3)) == trace_cache.freeze(np.zeros(3))
  assert trace_cache.freeze(np.zeros(3)) != trace_cache.freeze(np.zeros(3, np.int32))
  assert trace_cache.freeze(jnp.arange(3)) != trace_cache.freeze(jnp.arange(3) + 1)
  with pytest.raises(Exception):   # too large to compare on every call
    trace_cache.freeze(np.zeros(trace_cache.MAX_ARRAY_BYTES))


# ------------------------------------------------------------------ Element padding
def test_element_padding_offsets_count_in_the_padded_array():
  # Rows padded by 2 in front and 1 behind; window r starts at padded row 3*r, i.e.
  # array row 3*r - 2. The kernel masks rows that fall in the padding.
  x = random_array((9, 4))

  def kernel(x_ref, o_ref):
    r = pl.program_id(0)
    rows = 3 * r - 2 + lax.broadcasted_iota(jnp.int32, (5, 4), 0)
    w = jnp.where((rows >= 0) & (rows < 9), x_ref[...], 0.0)
    o_ref[...] = jnp.sum(w, axis=0, keepdims=True)

  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4, 4), f32), grid=(4,),
                    in_specs=[pl.BlockSpec((pl.Element(5, padding=(2, 1)), 4),
                                           lambda r: (3 * r, 0))],
                    out_specs=pl.BlockSpec((1, 4), lambda r: (r, 0)))(x)
  xp = jnp.pad(x, ((2, 3), (0, 0)))
  expected = jnp.stack([xp[3 * r:3 * r + 5].sum(0) for r in range(4)])
  assert_close(out, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ BoundedSlice
def test_bounded_slice_blocks_start_at_the_slice_start():
  # Ragged rows: program g reads rows starts[g] : starts[g] + sizes[g] (sizes <= 4)
  # through a BoundedSlice(4) window and sums the valid ones.
  x = random_array((12, 8))
  starts = jnp.array([0, 3, 5, 8], jnp.int32)
  sizes = jnp.array([3, 2, 3, 4], jnp.int32)

  def kernel(starts_ref, sizes_ref, x_ref, o_ref):
    g = pl.program_id(0)
    valid = lax.broadcasted_iota(jnp.int32, (4, 8), 0) < sizes_ref[g]
    o_ref[...] = jnp.sum(jnp.where(valid, x_ref[...], 0.0), axis=0, keepdims=True)

  spec = pl.BlockSpec((pl.BoundedSlice(4), 8),
                      lambda g, st, sz: (pl.ds(st[g], sz[g]), 0))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4, 8), f32),
                    grid_spec=pltpu.PrefetchScalarGridSpec(
                        num_scalar_prefetch=2, grid=(4,), in_specs=[spec],
                        out_specs=pl.BlockSpec((1, 8), lambda g, st, sz: (g, 0))))(
                            starts, sizes, x)
  expected = jnp.stack([x[s:s + n].sum(0) for s, n in zip([0, 3, 5, 8], [3, 2, 3, 4])])
  assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bounded_slice_errors():
  x = random_array((8,))
  with pytest.raises(pl.PalletError, match="in_specs\\[0\\].*Must return a pl.ds from the index_map for a BoundedSlice dimension"):
    pallas_call(lambda x_ref, o_ref: None, out_shape=sds(x), grid=(2,),
                in_specs=[pl.BlockSpec((pl.BoundedSlice(4),), lambda i: (i,))])(x)
  with pytest.raises(pl.PalletError, match="out_specs\\[0\\].*inputs only"):
    pallas_call(lambda x_ref, o_ref: None, out_shape=sds(x), grid=(2,),
                out_specs=pl.BlockSpec((pl.BoundedSlice(4),), lambda i: (pl.ds(i, 4),)))(x)


def _sum_rows_of_slices(sizes_ok_bound: int, starts, sizes, x):
  """Sums rows starts[g] : starts[g] + sizes[g] of x through pl.BoundedSlice windows."""
  def kernel(starts_ref, sizes_ref, x_ref, o_ref):
    g = pl.program_id(0)
    valid = lax.broadcasted_iota(jnp.int32, x_ref.shape, 0) < sizes_ref[g]
    o_ref[...] = jnp.sum(jnp.where(valid, x_ref[...], 0.0), axis=0, keepdims=True)

  spec = pl.BlockSpec((pl.BoundedSlice(sizes_ok_bound), 8),
                      lambda g, st, sz: (pl.ds(st[g], sz[g]), 0))
  return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((len(starts), 8), f32),
                     grid_spec=pltpu.PrefetchScalarGridSpec(
                         num_scalar_prefetch=2, grid=(len(starts),), in_specs=[spec],
                         out_specs=pl.BlockSpec((1, 8), lambda g, st, sz: (g, 0))))(
                             starts, sizes, x)


@pytest.mark.parametrize("jit", [False, True])
def test_bounded_slice_size_over_its_bound_fails_the_call(jit):
  # Program 2 asks for 5 rows from a BoundedSlice(4) block: Pallas copies `size`
  # rows into an n-row buffer, so a larger size has no meaning; pallet would read 4.
  x = random_array((12, 8))
  starts = jnp.array([0, 3, 5, 8], jnp.int32)
  call = jax.jit(_sum_rows_of_slices, static_argnums=0) if jit else _sum_rows_of_slices
  out = call(4, starts, jnp.array([3, 2, 3, 4], jnp.int32), x)
  assert_close(out[3], x[8:12].sum(0), rtol=1e-5, atol=1e-5)
  with pytest.raises(Exception, match=r"index_map in kernel 'kernel' at grid index \(2,\).*"
                     r"pl.BoundedSlice dimensions \(0,\) that must lie in \[0, 4\] \(size 5\)"):
    jax.block_until_ready(call(4, starts, jnp.array([3, 2, 5, 4], jnp.int32), x))


def test_bounded_slice_size_from_grid_indices_is_checked_when_called():
  x = random_array((16, 8))

  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.sum(x_ref[...], axis=0, keepdims=True)

  def call(size_of):
    spec = pl.BlockSpec((pl.BoundedSlice(4), 8), lambda i: (pl.ds(4 * i, size_of(i)), 0))
    return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4, 8), f32), grid=(4,),
                       in_specs=[spec], out_specs=pl.BlockSpec((1, 8), lambda i: (i, 0)))(x)

  assert_close(call(lambda i: jnp.minimum(4, 16 - 4 * i)), x.reshape(4, 4, 8).sum(1),
               rtol=1e-5, atol=1e-5)
  with pytest.raises(pl.KernelCheckError, match=r"grid index \(2,\).*got sizes \(5,\)"):
    call(lambda i: 3 + i)
  with pytest.raises(pl.PalletError, match=r"in_specs\[0\].*index_map result 0 is "
                     r"pl.ds\(..., size=5\) but its pl.BoundedSlice\(4\) block holds at "
                     r"most 4 elements"):
    call(lambda i: 5)


def test_index_maps_with_optional_prefetch_parameters_and_none_outputs():
  # As splash attention: index maps take an optional trailing prefetch ref that may be
  # passed as None, and an optional output is None in out_shape and out_specs.
  def index_map(i, scale_ref, extra_ref=None):
    return (i,)

  def kernel(scale_ref, extra_ref, x_ref, o_ref, lse_ref):
    assert extra_ref is None and lse_ref is None
    o_ref[...] = x_ref[...] * scale_ref[0]

  x = random_array((16,))
  scale = random_array((1,))
  spec = pl.BlockSpec((4,), index_map)
  out, none_out = pallas_call(
      kernel, out_shape=[sds(x), None],
      grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=(4,),
                                             in_specs=[spec], out_specs=[spec, None]))(
                                                 scale, None, x)
  assert none_out is None
  assert_close(out, x * scale[0])


def test_index_map_arity_range_error():
  x = random_array((8,))
  with pytest.raises(pl.PalletError, match="index_map takes 2 to 3 positional.*must take 1"):
    pallas_call(lambda x_ref, o_ref: None, out_shape=sds(x), grid=(2,),
                in_specs=[pl.BlockSpec((4,), lambda i, j, k=0: (i,))])(x)


@pytest.mark.parametrize("padding", [(-1, 0), (1,), 2])
def test_element_padding_must_be_a_pair_of_non_negative_ints(padding):
  x = random_array((8,))
  with pytest.raises(pl.PalletError, match="in_specs\\[0\\].*padding must be a pair"):
    pallas_call(lambda x_ref, o_ref: None, out_shape=sds(x), grid=(2,),
                in_specs=[pl.BlockSpec((pl.Element(4, padding=padding),), lambda i: (i,))])(x)


def test_cache_keys_cycles_by_back_reference():
  # Mutually recursive closures and self-containing lists freeze (the value reached
  # again inside itself is keyed by its depth on the path), so kernels calling them hit.
  def even(n):
    return n == 0 or odd(n - 1)

  def odd(n):
    return n != 0 and even(n - 1)

  cyclic = []
  cyclic.append(cyclic)
  other = [[]]
  other[0].append(other)
  assert trace_cache.freeze(even) == trace_cache.freeze(even)
  assert trace_cache.freeze(cyclic) == trace_cache.freeze(cyclic)
  assert trace_cache.freeze(cyclic) != trace_cache.freeze(other)

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + float(even(2))

  trace_cache.clear()
  x = random_array((4,))
  for _ in range(2):
    assert_close(pallas_call(kernel, out_shape=sds(x))(x), x + 1)
  assert trace_cache.stats["miss"] == 1 and trace_cache.stats["hit"] == 1


def test_scalar_prefetch_with_an_empty_grid():
  """grid=() is one program; its index maps still see the prefetch operand."""
  def kernel(s_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] * s_ref[1]

  x = random_array((16, 8))
  prefetch = jnp.array([1, -3], jnp.int32)   # (block row to read, scale)
  spec = pl.BlockSpec((8, 8), lambda s: (s[0], 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(), in_specs=[spec],
                                           out_specs=pl.BlockSpec((8, 8), lambda s: (0, 0)))
  out = pallas_call(kernel, jax.ShapeDtypeStruct((8, 8), jnp.float32),
                    grid_spec=grid_spec)(prefetch, x)
  assert_close(out, x[8:] * -3)
