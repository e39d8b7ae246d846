"""pallet.ops layer norm and RMS norm against their jax.numpy references."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from pallet import PalletError, ops
from ops_testing import DTYPES, check_op, inputs

# (shape, block_rows): odd row counts and widths that do not divide the blocks.
SHAPES = [((37, 100), 8), ((2, 5, 96), None), ((64, 256), 16), ((3, 130), 4)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,block_rows", SHAPES)
def test_layer_norm(shape, block_rows, dtype):
  x, w, b = inputs([shape, shape[-1:], shape[-1:]], dtype)
  check_op(ops.layer_norm, ops.layer_norm_reference, (x, w, b), argnums=(0, 1, 2),
           blocks=dict(block_rows=block_rows))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,block_rows", SHAPES[:2])
def test_layer_norm_with_residual(shape, block_rows, dtype):
  x, w, b, r = inputs([shape, shape[-1:], shape[-1:], shape], dtype)
  check_op(lambda x, w, b, r, **k: ops.layer_norm(x, w, b, r, **k),
           lambda x, w, b, r, **k: ops.layer_norm_reference(x, w, b, r),
           (x, w, b, r), argnums=(0, 1, 2, 3), blocks=dict(block_rows=block_rows))


def test_layer_norm_without_weight_and_bias():
  (x,) = inputs([(19, 48)], jnp.float32)
  check_op(ops.layer_norm, ops.layer_norm_reference, (x,), eps=1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,block_rows", SHAPES)
def test_rms_norm(shape, block_rows, dtype):
  x, w = inputs([shape, shape[-1:]], dtype)
  check_op(ops.rms_norm, ops.rms_norm_reference, (x, w), argnums=(0, 1), blocks=dict(block_rows=block_rows))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_rms_norm_with_residual(dtype):
  x, w, r = inputs([(45, 72), (72,), (45, 72)], dtype)
  check_op(lambda x, w, r, **k: ops.rms_norm(x, w, r, **k),
           lambda x, w, r, **k: ops.rms_norm_reference(x, w, r),
           (x, w, r), argnums=(0, 1, 2), blocks=dict(block_rows=8))


def test_errors_name_the_op_and_argument():
  x, w = inputs([(8, 16), (12,)], jnp.float32)
  with pytest.raises(PalletError, match=r"pallet.ops.layer_norm: weight has shape \(12,\)"):
    ops.layer_norm(x, w)
  with pytest.raises(PalletError, match="rms_norm: x must be a floating-point array"):
    ops.rms_norm(jnp.ones((4, 4), jnp.int32))
  with pytest.raises(PalletError, match="block_rows must be a positive int"):
    ops.rms_norm(x, block_rows=0)
  with pytest.raises(PalletError, match="residual has dtype bfloat16"):
    ops.rms_norm(x, residual=x.astype(jnp.bfloat16))
