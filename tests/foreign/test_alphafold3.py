"""google-deepmind/alphafold3's Pallas kernel (the fused gated linear unit, SwiGLU and
friends), run on pallet.

The kernels are read from a checkout (PALLET_ALPHAFOLD3_SOURCE) at test time; nothing of
alphafold3 is copied here. AlphaFold 3 shipped its own GPU kernels under
`src/alphafold3/jax/` up to commit 2e3703e (v3.0.1 and the commits after it; 3890782
replaced them with tokamax's): use a checkout at 2e3703e82a9592efbb3fa76ca9e0714aedabacdb
(later checkouts lack `alphafold3/jax/gated_linear_unit`, and the tests skip). Of those
kernels only the gated linear unit (`gated_linear_unit/matmul_ext.py`) is Pallas: the
flash attention (`attention/flash_attention.py`) is a raw Triton kernel launched with
jax_triton's `triton_call`, which pallet does not run. The GLU has no VJP (AlphaFold 3
runs it in inference only; its `custom_vmap` rule is the only transform it defines),
so the tests check values, under `jit` and `vmap` too.

The kernel's Pallas is the Triton-style dialect: `pl.load`/`pl.store` with a flat ref
and 2-D integer offset arrays (a strided `ArrayView` over the flattened weights, the
projection and gate halves of a `[K, 2, N]` array), masks with no `other`, program ids
regrouped for cache reuse from the GPU's SM count.

How alphafold3 is made to run here, without changing it:
- `triton_utils.has_triton_support` (platform == 'gpu') is made to answer True.
- `matmul_config` and `matmul_ext` size blocks and group program ids from
  `jax.devices()[0].core_count`, which a CPU device lacks: their `jax` reports a GPU with
  8 SMs (the grouping logic itself runs unchanged).
- `array_view` and `block` enter `jax.experimental.enable_x64()`, which JAX has since
  removed: their `jax` has it, as `jax.enable_x64(True)`. `array_view` annotates
  `ArrayLike | "ArrayView"`, which fails at import on a JAX whose `ArrayLike` is a PEP 604
  union: the module is loaded with `jax.typing.ArrayLike` made a `typing.Union` for the
  moment.
- The kernel's `pallas_call(..., backend='triton')` names its backend, which pallet obeys
  over `pallet.default_backend` (and which on a CPU cannot run without `interpret=True`):
  the call is made without `backend=`, so the backend under test runs it.
- The public entry point is called with `implementation='triton'`: AlphaFold's model calls
  it with `implementation=None`, which falls back to XLA on any exception and would hide
  a failure.
jaxtyping and typeguard (alphafold3's run-time shape checks) must be installed.

GPU kernels run on the backend under test (PALLET_TEST_BACKEND=triton: Triton's
interpreter).
"""
from __future__ import annotations

import functools
import sys
import types
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet
from pallet import backends
from tests.foreign import projects
from tests.helpers import current_test_backend

AF3 = "alphafold3.jax."
BACKEND = current_test_backend()


class _FakeGpu:
  platform, device_kind, core_count = "gpu", "fake GPU", 8


def _enable_x64(new_val=True):
  return jax.enable_x64(new_val)


class _Jax(types.SimpleNamespace):
  """`jax`, except that `devices()` reports a GPU with 8 SMs and `jax.experimental` still
  has `enable_x64`."""
  experimental = types.SimpleNamespace(enable_x64=_enable_x64)

  def __getattr__(self, name):
    return getattr(jax, name)

  def devices(self, *args):
    return [_FakeGpu()]


class _Pallas(types.SimpleNamespace):
  """pallet, except that `pallas_call` leaves the backend to the test's override."""

  def __getattr__(self, name):
    return getattr(pallet, name)

  def pallas_call(self, *args, backend=None, **kwargs):
    return pallet.pallas_call(*args, **kwargs)


def _load(name: str):
  pytest.importorskip("jaxtyping")
  pytest.importorskip("typeguard")
  import jax.typing as jax_typing
  array_like = jax_typing.ArrayLike
  jax_typing.ArrayLike = typing.Optional[array_like]
  # `triton_utils` imports triton (for the flash attention, which these tests do not run):
  # a stand-in where it is not installed, found before tests/triton/, which would
  # otherwise be imported as a namespace package named `triton`
  stand_in = None if backends.triton_installed() else projects._AbsentFinder(["triton"])
  if stand_in:
    sys.meta_path.insert(0, stand_in)
  try:
    return projects.load(AF3 + name)
  except ModuleNotFoundError as e:
    if e.name and e.name.startswith(AF3 + "gated_linear_unit"):
      pytest.skip(f"this alphafold3 checkout has no {e.name} (its own kernels are at "
                  f"commit 2e3703e and before)")
    raise
  finally:
    jax_typing.ArrayLike = array_like
    if stand_in:
      sys.meta_path.remove(stand_in)
      for module in [n for n in sys.modules if n.split(".")[0] == "triton"]:
        del sys.modules[module]


@pytest.fixture
def af3(monkeypatch):
  """alphafold3's GLU modules, patched to run here, their pallas_calls on the backend
  under test."""
  glu = _load("gated_linear_unit.gated_linear_unit")
  mods = types.SimpleNamespace(
      glu=glu,
      matmul_ext=_load("gated_linear_unit.matmul_ext"),
      block=_load("gated_linear_unit.block"),
      array_view=_load("common.array_view"))
  monkeypatch.setattr(_load("common.triton_utils"), "has_triton_support", lambda: True)
  for module in (mods.array_view, mods.block, mods.matmul_ext,
                 _load("gated_linear_unit.matmul_config")):
    monkeypatch.setattr(module, "jax", _Jax())
  monkeypatch.setattr(mods.matmul_ext, "pl", _Pallas())
  with pallet.default_backend(BACKEND):
    yield mods


def _normal(seed, shape, dtype=jnp.float32, scale=1.0):
  return (scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)).astype(dtype)


def _glu_reference(x, weight, activation):
  """activation(x @ weight[:, 0]) * (x @ weight[:, 1]); both products rounded to the input
  dtype first, as the kernel stores them."""
  dtype = x.dtype
  xf, wf = x.astype(jnp.float32), weight.astype(jnp.float32)
  gate = jnp.einsum("...mk,kn->...mn", xf, wf[:, 0], precision="highest")
  proj = jnp.einsum("...mk,kn->...mn", xf, wf[:, 1], precision="highest")
  gate = gate.astype(dtype).astype(jnp.float32)
  proj = proj.astype(dtype).astype(jnp.float32)
  return (proj * (gate if activation is None else activation(gate))).astype(dtype)


# relative to the output's largest magnitude: float32 sums in another order; bf16/f16
# products may round to the neighbouring value before the activation and the product
_RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def _close(actual, expected, dtype, what=""):
  expected = np.asarray(expected, np.float32)
  actual = np.asarray(actual, np.float32)
  assert actual.shape == expected.shape, what
  assert np.isfinite(actual).all(), what
  tol = _RTOL[jnp.dtype(dtype).type] * float(np.abs(expected).max())
  np.testing.assert_allclose(actual, expected, atol=tol, rtol=0, err_msg=what)
  if jnp.dtype(dtype).itemsize == 2:
    # the reference rounds where the kernel does: only a sum landing next to a rounding
    # boundary may differ (a few in 10^4 here), not a rounding step left out
    differ = float(np.mean(actual != expected))
    assert differ < 0.01, f"{what}: {differ:.1%} of the elements differ"


# (batch, M, K, N, dtype, activation). With 8 SMs the config is (block_m, block_n//2,
# block_k=32); the grid's program ids are regrouped in groups of `group` rows of blocks.
GLU_CASES = {
    "square": ((), 64, 64, 64, jnp.float32, jax.nn.swish),
    "ragged_mkn_batched": ((2,), 20, 50, 70, jnp.float32, None),
    "grouped_2": ((), 136, 40, 72, jnp.float32, jax.nn.sigmoid),      # groups of 2 rows
    "grouped_4_partial": ((), 160, 48, 160, jnp.bfloat16, jax.nn.gelu),  # last group of 1
    "n_below_m_k17": ((), 100, 17, 20, jnp.float16, jax.nn.relu),     # swapped config, K % 32
    "pair_like": ((3,), 24, 32, 64, jnp.bfloat16, jax.nn.swish),      # [N, N, C] activations
}


@pytest.mark.parametrize("case", list(GLU_CASES))
def test_gated_linear_unit(af3, case):
  """(The bfloat16 cases round both products to bfloat16 before the activation: under
  Triton's interpreter pallet did not round `astype(bfloat16)`, 35% of the elements
  one step off, until the conversion rounded.)"""
  batch, m, k, n, dtype, activation = GLU_CASES[case]
  x = _normal(0, (*batch, m, k), dtype)
  w = _normal(1, (k, 2, n), dtype, scale=k ** -0.5)
  out = af3.glu.gated_linear_unit(x, w, activation=activation, implementation="triton")
  assert out.shape == (*batch, m, n) and out.dtype == dtype
  _close(out, _glu_reference(x, w, activation), dtype, what=case)
  # and alphafold3's own XLA implementation
  xla = af3.glu.gated_linear_unit(x, w, activation=activation, implementation="xla")
  _close(out, xla, dtype, what=f"{case} vs implementation='xla'")


def test_gated_linear_unit_highest_precision(af3):
  x = _normal(2, (2, 40, 96))
  w = _normal(3, (96, 2, 48), scale=96 ** -0.5)
  out = af3.glu.gated_linear_unit(x, w, activation=jax.nn.swish,
                                  precision=jax.lax.Precision.HIGHEST,
                                  implementation="triton")
  _close(out, _glu_reference(x, w, jax.nn.swish), jnp.float32)


def test_gated_linear_unit_jit_vmap(af3):
  """`jax.vmap` goes through the op's `custom_vmap` rule (a sequential map)."""
  x = _normal(4, (3, 2, 24, 40))
  w = _normal(5, (40, 2, 48), scale=40 ** -0.5)
  f = jax.jit(jax.vmap(functools.partial(af3.glu.gated_linear_unit, activation=jax.nn.swish,
                                         implementation="triton"), in_axes=(0, None)))
  _close(f(x, w), _glu_reference(x, w, jax.nn.swish), jnp.float32)


def test_gated_linear_unit_x64(af3):
  """With `jax_enable_x64` on, as `_get_pids` allows for: int64 program-id arithmetic.
  (pallet's XLA backend failed here: its grid loop counted in int64 under x64.)"""
  x = _normal(6, (136, 40))
  w = _normal(7, (40, 2, 72), scale=40 ** -0.5)
  with jax.enable_x64(True):
    out = af3.glu.gated_linear_unit(x, w, activation=jax.nn.sigmoid, implementation="triton")
  _close(out, _glu_reference(x, w, jax.nn.sigmoid), jnp.float32)


def test_gated_linear_unit_on_strided_views(af3):
  """`matmul_ext.gated_linear_unit` on views: x a window of a larger array (an offset,
  row stride 70), the weights transposed views (element stride K along N)."""
  av, me = af3.array_view, af3.matmul_ext
  big = _normal(12, (50, 70))
  x = av.ArrayView(big)[5:45, 7:31]               # [40, 24]
  w_nk = _normal(13, (2, 56, 24), scale=24 ** -0.5)  # [gate/proj, N, K]
  w_view = av.ArrayView(w_nk)
  out = me.gated_linear_unit(x, w_view[1].T, w_view[0].T, activation=jax.nn.swish)
  w = jnp.transpose(w_nk, (2, 0, 1))              # [K, 2, N]
  _close(out, _glu_reference(big[5:45, 7:31], w, jax.nn.swish), jnp.float32)


def test_gated_linear_unit_into_view_with_epilogue(af3):
  """The internal entry point alphafold3's fused ops build on: the output written in place
  into a strided view of a larger buffer (`dst`, aliased), an epilogue adding a residual
  read with `block.load_block` at the block's program ids."""
  av, block, me = af3.array_view, af3.block, af3.matmul_ext
  m, k, n = 40, 24, 48
  x = _normal(8, (m, k))
  w = _normal(9, (k, 2, n), scale=k ** -0.5)
  residual = _normal(10, (m, n))
  buffer = _normal(11, (m + 3, 2 * n))           # dst: rows 3.., the second half of columns
  dst = av.ArrayView(buffer)[3:, n:]
  config = me.matmul_config.get_config(x, w[:, 0])

  def add_residual(out, refs, pid_m, pid_n):
    (r_ref,) = refs
    return out + block.load_block(r_ref, (pid_m, pid_n),
                                  block_shape=(config.block_m, config.block_n))

  w_view = av.ArrayView(w)
  out = me._gated_linear_unit(x, w_view[:, 1], w_view[:, 0], dst=dst, activation=jax.nn.swish,
                              epilogue=add_residual, epilogue_args=(residual,), precision=None)
  # the result is the whole aliased buffer (flattened): the view's window replaced
  got = np.asarray(jax.tree.leaves(out)[0]).reshape(m + 3, 2 * n)
  want = np.array(buffer)
  want[3:, n:] = np.asarray(_glu_reference(x, w, jax.nn.swish) + residual)
  _close(got, want, jnp.float32)
