"""pallet.ops softmax and fused linear + cross-entropy against jax.numpy references."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import current_test_backend, random_array
import pallet as pl
from pallet import PalletError, ops
from ops_testing import DTYPES, check_op, inputs

DTYPE_IDS = lambda d: jnp.dtype(d).name  # noqa: E731


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,block_rows", [((37, 100), 8), ((2, 3, 64), None), ((5, 257), 2)])
def test_softmax(shape, block_rows, dtype):
  (x,) = inputs([shape], dtype)
  check_op(ops.softmax, ops.softmax_reference, (3 * x,), blocks=dict(block_rows=block_rows))


def _labels(n, vocab, seed, ignored=True):
  labels = np.random.default_rng(seed).integers(0, vocab, n)
  if ignored:
    labels[::7] = -100
  return jnp.asarray(labels, jnp.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n,hidden,vocab,block_n,block_v,block_h", [
    (37, 48, 300, 16, 64, 16),     # rows and vocabulary ragged, 3 hidden chunks
    (64, 32, 256, 32, 128, None),  # everything divides
    (20, 16, 1000, 16, 256, 16),
    (9, 40, 77, None, None, None),  # default blocks
])
def test_linear_cross_entropy(n, hidden, vocab, block_n, block_v, block_h, dtype):
  h = random_array((n, hidden), dtype)
  w = (random_array((hidden, vocab), jnp.float32) / np.sqrt(hidden)).astype(dtype)
  labels = _labels(n, vocab, seed=n + vocab)
  check_op(lambda h, w, **k: ops.linear_cross_entropy(h, w, labels, **k),
           lambda h, w: ops.linear_cross_entropy_reference(h, w, labels),
           (h, w), argnums=(0, 1), blocks=dict(block_n=block_n, block_v=block_v, block_h=block_h),
           scale=1 if dtype == jnp.float32 else 2)


@pytest.mark.parametrize("blocks", [dict(block_n=16, block_v=64, block_h=16), {}])
def test_linear_cross_entropy_grad_ignores_poisoned_rows_past_the_edge(blocks):
  # With poisoned memory the cotangent rows past the last row block's edge are NaN:
  # the gradient kernels must drop them, not multiply them by zero.
  n, hidden, vocab = 37, 48, 300
  h = random_array((n, hidden))
  w = random_array((hidden, vocab)) / np.sqrt(hidden)
  labels = _labels(n, vocab, seed=5)
  weights = random_array((n,))
  grad = lambda f: jax.grad(lambda h, w: jnp.sum(f(h, w) * weights), argnums=(0, 1))(h, w)
  with pl.enable_poison_buffers(True):
    got = grad(lambda h, w: ops.linear_cross_entropy(h, w, labels, **blocks))
  expected = grad(lambda h, w: ops.linear_cross_entropy_reference(h, w, labels))
  for g, e in zip(got, expected):
    np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n,hidden,vocab,block_n,block_v,block_h", [
    (37, 48, 300, 16, 64, 16),     # rows ragged, 3 hidden chunks
    (9, 40, 77, None, None, None),  # default blocks
])
def test_linear_cross_entropy_reduced(n, hidden, vocab, block_n, block_v, block_h, dtype,
                                      reduction):
  h = random_array((n, hidden), dtype)
  w = (random_array((hidden, vocab), jnp.float32) / np.sqrt(hidden)).astype(dtype)
  labels = _labels(n, vocab, seed=n * vocab)
  check_op(lambda h, w, **k: ops.linear_cross_entropy(h, w, labels, **k),
           lambda h, w, **k: ops.linear_cross_entropy_reference(h, w, labels, **k),
           (h, w), argnums=(0, 1), blocks=dict(block_n=block_n, block_v=block_v, block_h=block_h),
           scale=1 if dtype == jnp.float32 else 2, reduction=reduction)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_linear_cross_entropy_large_vocabulary(reduction):
  """Over 8K entries the CPU gradient kernel takes fewer rows per step (63 here: ragged)."""
  if current_test_backend() != "xla":
    pytest.skip("the CPU gradient kernel's row block (Triton: a minute interpreted)")
  n, hidden, vocab = 70, 16, 2**14 + 3
  h = random_array((n, hidden))
  w = random_array((hidden, vocab)) / np.sqrt(hidden)
  labels = _labels(n, vocab, seed=vocab)
  check_op(lambda h, w, **k: ops.linear_cross_entropy(h, w, labels, **k),
           lambda h, w, **k: ops.linear_cross_entropy_reference(h, w, labels, **k),
           (h, w), argnums=(0, 1), reduction=reduction)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_linear_cross_entropy_large_logits(dtype):
  # Logits of magnitude ~50: the GPU plan keeps exp(logits - tile max), at most 1, and
  # rescales it per tile, so nothing overflows and small probabilities stay accurate.
  n, hidden, vocab = 37, 48, 300
  h = random_array((n, hidden), dtype)
  w = (random_array((hidden, vocab), jnp.float32) * 8 / np.sqrt(hidden)).astype(dtype)
  labels = _labels(n, vocab, seed=11)
  check_op(lambda h, w, **k: ops.linear_cross_entropy(h, w, labels, **k),
           lambda h, w, **k: ops.linear_cross_entropy_reference(h, w, labels, **k),
           (h, w), argnums=(0, 1), blocks=dict(block_n=16, block_v=64, block_h=16),
           scale=1 if dtype == jnp.float32 else 2, reduction="mean")


def _pallas_calls_and_dots(fn, *args):
  from pallet.pallas_call import pallas_call_p
  calls, dots = [], []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive is pallas_call_p:
        calls.append(eqn)
      elif eqn.primitive.name == "dot_general":
        dots.append(eqn)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub.jaxpr if hasattr(sub, "jaxpr") else sub)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return calls, dots


def test_linear_cross_entropy_gpu_plan_does_the_twins_work():
  # On a GPU (traced for sm_90): one logits pass that keeps exp(logits - tile max) in
  # bf16, one elementwise kernel turning it into d logits in place, and the two
  # products dh and dW: 6 n h v FLOPs, as the twin holding float32 logits.
  from pallet.ops import launch_table
  n, hidden, vocab = 512, 256, 4096
  h = jax.ShapeDtypeStruct((n, hidden), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((hidden, vocab), jnp.bfloat16)
  labels = jnp.zeros((n,), jnp.int32)
  grad = jax.value_and_grad(
      lambda h, w: ops.linear_cross_entropy(h, w, labels, reduction="mean"), argnums=(0, 1))
  with pl.default_backend("triton"), launch_table.using_device("sm_90"):
    calls, dots = _pallas_calls_and_dots(grad, h, w)
  fwd, dlogits = calls
  assert [c.params["kernel"].name for c in calls] == ["linear_cross_entropy_fwd",
                                                      "linear_cross_entropy_dlogits"]
  e = fwd.outvars[0].aval
  assert (e.shape, e.dtype) == ((n, vocab), jnp.bfloat16)
  assert dlogits.params["kernel"].input_output_aliases == ((0, 0),)   # d overwrites e
  grid = fwd.params["kernel"].grid_mapping.grid
  tile = 128   # sm_90's table: 128x128 tiles over 64-wide steps of the hidden axis
  assert grid == (vocab // tile, n // tile)
  shapes = sorted(tuple(d.outvars[0].aval.shape) for d in dots)
  assert shapes == [(hidden, vocab), (n, hidden)]          # dW, dh


def test_linear_cross_entropy_mean_counts_only_rows_not_ignored():
  h, w = random_array((16, 8)), random_array((8, 40))
  labels = _labels(16, 40, seed=3)
  rows = ops.linear_cross_entropy(h, w, labels)
  mean = ops.linear_cross_entropy(h, w, labels, reduction="mean")
  np.testing.assert_allclose(float(mean), float(rows.sum()) / int((labels >= 0).sum()),
                             rtol=1e-6)
  import jax
  dh = jax.grad(lambda h: ops.linear_cross_entropy(h, w, labels, reduction="mean"))(h)
  assert float(jnp.abs(dh[labels < 0]).sum()) == 0 < float(jnp.abs(dh).sum())


def test_linear_cross_entropy_ignored_rows_have_no_loss_or_gradient():
  h, w = random_array((16, 8)), random_array((8, 40))
  labels = jnp.full((16,), -100, jnp.int32).at[3].set(5)
  loss = ops.linear_cross_entropy(h, w, labels, block_n=16, block_v=16)
  assert float(jnp.abs(loss).sum()) == float(jnp.abs(loss[3])) > 0
  import jax
  dh = jax.grad(lambda h: ops.linear_cross_entropy(h, w, labels, block_n=16,
                                                   block_v=16).sum())(h)
  assert float(jnp.abs(dh).sum()) == float(jnp.abs(dh[3]).sum()) > 0


def test_errors_name_the_op_and_argument():
  h, w = random_array((8, 16)), random_array((12, 32))
  with pytest.raises(PalletError, match=r"linear_cross_entropy: w has shape \(12, 32\)"):
    ops.linear_cross_entropy(h, w, jnp.zeros(8, jnp.int32))
  with pytest.raises(PalletError, match=r"linear_cross_entropy: reduction 'avg' is not one of "
                                        r"\['none', 'sum', 'mean'\]"):
    ops.linear_cross_entropy(h, w.T[:16], jnp.zeros(8, jnp.int32), reduction="avg")
  with pytest.raises(PalletError, match="labels must be integers"):
    ops.linear_cross_entropy(h, w.T[:16], jnp.zeros(8))
  with pytest.raises(PalletError, match="softmax: x must be a floating-point array"):
    ops.softmax(jnp.ones((2, 2), jnp.int32))
