"""Hi-typed operands (JAX's `hijax.HiType`) of `pallas_call` and `pltpu.emit_pipeline`:
a pair of arrays passed, cut into blocks and written back as one value."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import pallet as pl
from pallet import tpu as pltpu
from pallet.errors import PalletError
from helpers import assert_close, random_array

hijax = pytest.importorskip("jax._src.hijax", reason="this JAX has no hijax (user-defined "
                            "high-level types)")
if not hasattr(hijax, "HiType"):
  pytest.skip("this JAX's hijax has no HiType", allow_module_level=True)
from jax._src import state  # noqa: E402
from jax._src.state import primitives as state_primitives  # noqa: E402

ANY = pl.BlockSpec(memory_space=pltpu.ANY)


@dataclasses.dataclass(frozen=True)
class Pair:
  """Two arrays of one shape and dtype, one value to the user."""
  first: jax.Array
  second: jax.Array

  shape = property(lambda self: self.first.shape)
  dtype = property(lambda self: self.first.dtype)


def _views(ref, idx):
  """The pair's two lo refs, each viewed through the hi ref's transforms and `idx`."""
  pair, transforms = ref._refs, tuple(ref.transforms) + (idx,)
  return [state.TransformedRef(r, transforms) for r in (pair.first, pair.second)]


@dataclasses.dataclass(frozen=True)
class PairType(hijax.HiType):
  shape: tuple[int, ...]
  dtype: jnp.dtype

  def update(self, *, shape=None, dtype=None, **_):
    return PairType(self.shape if shape is None else shape,
                    self.dtype if dtype is None else dtype)

  def lo_ty(self):
    return [hijax.ShapedArray(self.shape, self.dtype)] * 2

  def lower_val(self, value):
    return [value.first, value.second]

  def raise_val(self, first, second):
    return Pair(first, second)

  def _lo_ref_aval(self, ref_aval):
    return ref_aval.update(inner_aval=hijax.ShapedArray(self.shape, self.dtype))

  def ref_get_abstract_eval(self, ref_aval, *args, tree):
    out, effects = state_primitives.get_p.abstract_eval(self._lo_ref_aval(ref_aval), *args,
                                                        tree=tree)
    return PairType(out.shape, out.dtype), effects

  def ref_swap_abstract_eval(self, ref_aval, val_aval, *args, tree):
    out, effects = state_primitives.swap_p.abstract_eval(
        self._lo_ref_aval(ref_aval), hijax.ShapedArray(val_aval.shape, val_aval.dtype),
        *args, tree=tree)
    return PairType(out.shape, out.dtype), effects

  def ref_get_to_lojax(self, ref, idx):
    return Pair(*[view[...] for view in _views(ref, idx)])

  def ref_swap_to_lojax(self, ref, value, idx):
    old = [state_primitives.ref_swap(view, ..., v) for view, v in
           zip(_views(ref, idx), (value.first, value.second))]
    return Pair(*old)

  def lower_block_spec(self, spec):
    return [spec, spec]


hijax.register_hitype(Pair, lambda p: PairType(p.shape, p.dtype))


def _random_pair(shape):
  return Pair(random_array(shape), random_array(shape))


def _pipelined_call(x: Pair) -> Pair:
  """A kernel running emit_pipeline over the whole hi refs, 4 row blocks."""
  def body(x_ref, o_ref):
    v = x_ref[...]
    o_ref[...] = Pair(v.first * 2.0 + v.second, v.second - v.first)

  def kernel(x_hbm, o_hbm):
    block = (x_hbm.shape[0] // 4, x_hbm.shape[1])
    pltpu.emit_pipeline(body, grid=(4,), in_specs=[pl.BlockSpec(block, lambda i: (i, 0))],
                        out_specs=pl.BlockSpec(block, lambda i: (i, 0)))(x_hbm, o_hbm)

  return pl.pallas_call(kernel, out_shape=PairType(x.shape, x.dtype), in_specs=[ANY],
                        out_specs=ANY)(x)


def _check(out, x):
  assert isinstance(out, Pair)
  assert_close(out.first, x.first * 2.0 + x.second)
  assert_close(out.second, x.second - x.first)


def test_hi_operand_through_pallas_call_and_emit_pipeline():
  x = _random_pair((32, 128))
  _check(_pipelined_call(x), x)


def test_hi_operand_under_jit():
  x = _random_pair((32, 128))
  _check(jax.jit(_pipelined_call)(x), x)


def test_hi_operand_cut_into_blocks_by_pallas_call():
  x, y = _random_pair((16, 128)), random_array((16, 128))

  def kernel(x_ref, y_ref, o_ref):
    assert x_ref.shape == (8, 128)   # the block's hi type
    v = x_ref[...]
    o_ref[...] = Pair(v.first + y_ref[...], v.second * y_ref[...])

  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  out = pl.pallas_call(kernel, out_shape=PairType(x.shape, x.dtype), grid=(2,),
                       in_specs=[spec, spec], out_specs=spec)(x, y)
  assert_close(out.first, x.first + y)
  assert_close(out.second, x.second * y)


def test_a_block_spec_without_lower_block_spec_is_a_clear_error():
  @dataclasses.dataclass(frozen=True)
  class Opaque(PairType):
    lower_block_spec = None

  x = _random_pair((16, 128))
  with pytest.raises(PalletError, match=r"kernel 'copy'.*hi type .* no lower_block_spec"):
    pl.pallas_call(lambda x_ref, o_ref: None, name="copy", out_shape=Opaque(x.shape, x.dtype),
                   grid=(2,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                   out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))(x)
