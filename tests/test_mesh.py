"""pl.kernel / pl.core_map over a TensorCore mesh on one CPU device."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallet as pl
import pallet.tpu as pltpu
from helpers import assert_close, random_array


@pytest.mark.parametrize("num_cores", [1, 2])
def test_kernel_decorator_over_cores(num_cores):
  mesh = pltpu.create_tensorcore_mesh("core", num_cores=num_cores)
  x = random_array((4, 128))
  rows = 4 // num_cores

  @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=mesh,
             scratch_types=[pltpu.VMEM((rows, 128), jnp.float32)])
  def double(x_ref, o_ref, scratch):
    core = jax.lax.axis_index("core")
    rows_here = pl.ds(core * rows, rows)
    scratch[...] = x_ref[rows_here, :] * 2
    o_ref[rows_here, :] = scratch[...] + core.astype(jnp.float32)

  expected = x * 2 + jnp.repeat(jnp.arange(num_cores, dtype=jnp.float32), rows)[:, None]
  assert_close(double(x), expected)


def test_kernel_call_form_and_tensorcore_mesh():
  mesh = pltpu.TensorCoreMesh(axis_name="x", num_cores=1)
  assert dict(mesh.shape) == {"x": 1} and mesh.core_type is pltpu.CoreType.TC
  a, b = random_array((8, 128)), random_array((8, 128))

  def add(a_ref, b_ref, o_ref):
    o_ref[...] = a_ref[...] + b_ref[...]
  out = pl.kernel(add, jax.ShapeDtypeStruct(a.shape, a.dtype), mesh=mesh,
                  compiler_params=pltpu.CompilerParams())(a, b)
  assert_close(out, a + b)


def test_core_map_in_run_state():
  mesh = pltpu.create_tensorcore_mesh("core", num_cores=2)
  x = random_array((2, 128))

  def stateful(refs):
    x_ref, o_ref = refs

    @pl.core_map(mesh)
    def _():
      i = jax.lax.axis_index("core")
      o_ref[pl.ds(i, 1), :] = x_ref[pl.ds(i, 1), :] + 1.0

  _, out = pl.run_state(stateful)((x, jnp.zeros_like(x)))
  assert_close(out, x + 1.0)


def test_scratch_dicts_are_keyword_refs_for_kernel_and_core_map():
  mesh = pltpu.create_tensorcore_mesh("core", num_cores=1)
  x = random_array((8, 128))

  @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=mesh,
             scratch_types={"b": pltpu.VMEM((8, 128), jnp.float32),
                            "a": pltpu.VMEM((8, 128), jnp.float32)})
  def twice_plus_one(x_ref, o_ref, *, a, b):
    a[...] = x_ref[...] * 2
    b[...] = a[...] + 1
    o_ref[...] = b[...]
  assert_close(twice_plus_one(x), x * 2 + 1)

  def stateful(refs):
    x_ref, o_ref = refs

    @pl.core_map(mesh, scratch_shapes={"tmp": pltpu.VMEM((8, 128), jnp.float32)})
    def _(tmp):
      tmp[...] = x_ref[...] - 1
      o_ref[...] = tmp[...] * 3

  _, out = pl.run_state(stateful)((x, jnp.zeros_like(x)))
  assert_close(out, (x - 1) * 3)


def test_run_on_first_core_and_barrier():
  mesh = pltpu.create_tensorcore_mesh("core", num_cores=2)
  x = random_array((8, 128))

  @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=mesh)
  def first(x_ref, o_ref):
    @pltpu.run_on_first_core("core")
    def _():
      o_ref[...] = x_ref[...] * 3
  assert_close(first(x), x * 3)

  @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=mesh)
  def barrier(x_ref, o_ref):
    pltpu.core_barrier(None, core_axis_name="core")
    o_ref[...] = x_ref[...]
  with pytest.raises(pl.PalletError, match="core_barrier over 2 cores in kernel 'barrier'"):
    barrier(x)


def test_mesh_errors():
  with pytest.raises(pl.PalletError, match="no named shape"):
    pl.kernel(lambda o: None, jax.ShapeDtypeStruct((8,), jnp.float32), mesh=object())()
  with pytest.raises(pl.PalletError, match="MPMD"):
    pl.kernel([lambda o: None] * 2, jax.ShapeDtypeStruct((8,), jnp.float32),
              mesh=[pltpu.create_tensorcore_mesh("c")] * 2)
