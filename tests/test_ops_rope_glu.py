"""pallet.ops rotary position embedding and GLU/SwiGLU against jax.numpy references."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallet import PalletError, ops
from helpers import current_test_backend
from ops_testing import DTYPES, check_op, inputs

DTYPE_IDS = lambda d: jnp.dtype(d).name  # noqa: E731


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,block_seq", [((2, 37, 3, 64), 8), ((1, 16, 4, 96), None),
                                             ((3, 5, 1, 10), 4)])
def test_rotary_embedding(shape, block_seq, dtype):
  (x,) = inputs([shape], dtype)
  check_op(ops.rotary_embedding, ops.rotary_embedding_reference, (x,),
           blocks=dict(block_seq=block_seq))


def test_rotary_embedding_at_given_positions():
  (x,) = inputs([(2, 11, 2, 32)], jnp.float32)
  positions = jnp.asarray(np.random.default_rng(0).integers(0, 4096, (2, 11)), jnp.int32)
  check_op(lambda x, **k: ops.rotary_embedding(x, positions, **k),
           lambda x: ops.rotary_embedding_reference(x, positions), (x,), scale=10,
           blocks=dict(block_seq=4))


@pytest.mark.skipif(current_test_backend() != "xla", reason="the CPU/XLA backend's form")
def test_rotary_embedding_on_the_cpu_stores_without_padded_halves():
  """XLA:CPU runs a fusion of zero-padded halves (or of a reverse) as a scalar loop,
  1.7-1.9x jax.numpy's time at the test size (issue 26): the CPU form swaps the
  halves with one concatenation, forward and backward."""
  (x,) = inputs([(2, 24, 2, 16)], jnp.float32)
  for fn in (ops.rotary_embedding, jax.grad(lambda x: ops.rotary_embedding(x).sum())):
    text = jax.jit(fn).lower(x).as_text()
    assert "stablehlo.pad" not in text and "stablehlo.reverse" not in text
    assert "stablehlo.concatenate" in text


@pytest.mark.parametrize("activation", ["silu", "gelu", "sigmoid"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,blocks", [((37, 100), (8, 64)), ((2, 3, 300), (None, None)),
                                          ((5, 2048), (2, 512))])
def test_glu(shape, blocks, activation, dtype):
  a, b = inputs([shape, shape], dtype)
  check_op(ops.glu, ops.glu_reference, (a, b), argnums=(0, 1), activation=activation,
           blocks=dict(block_rows=blocks[0], block_cols=blocks[1]))


def test_swiglu_is_glu_with_silu():
  a, b = inputs([(4, 24), (4, 24)], jnp.float32)
  check_op(ops.swiglu, ops.swiglu_reference, (a, b), argnums=(0, 1))


def test_errors_name_the_op_and_argument():
  (x,) = inputs([(2, 4, 3, 6)], jnp.float32)
  with pytest.raises(PalletError, match="rotary_embedding: x must be .* even head_dim"):
    ops.rotary_embedding(x[..., :5])
  with pytest.raises(PalletError, match=r"positions has shape \(3,\)"):
    ops.rotary_embedding(x, jnp.arange(3))
  with pytest.raises(PalletError, match="activation 'relu' is not one of"):
    ops.glu(x, x, activation="relu")
  with pytest.raises(PalletError, match=r"glu: b has shape \(2, 6\), expected \(4, 6\)"):
    ops.glu(x[0, :, 0], x[:, 0, 0])
