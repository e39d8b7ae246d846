"""Hardware-only names import fine and fail clearly (kernel name + source line) when used."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallet as pl
import pallet.tpu as pltpu
from helpers import pallas_call


@pytest.mark.parametrize("name", ["matmul_push_rhs", "matmul_acc_lhs", "matmul_pop",
                                  "pack_fp6", "unpack_fp6"])
def test_tpu_hardware_only_in_kernel(name):
  op = getattr(pltpu, name)

  def uses_hardware(x_ref, o_ref):
    op(x_ref)
    o_ref[...] = x_ref[...]
  with pytest.raises(pl.PalletError) as info:
    pallas_call(uses_hardware, jax.ShapeDtypeStruct((8,), jnp.float32))(jnp.zeros(8))
  message = str(info.value)
  assert f"pltpu.{name} is not supported on this backend (TPU hardware only)" in message
  assert "kernel 'uses_hardware'" in message and "test_unsupported.py:" in message


def test_tpu_hardware_only_outside_kernel():
  with pytest.raises(pl.PalletError, match=r"matmul_pop .*outside a kernel"):
    pltpu.matmul_pop()


def test_subclassing_an_unsupported_class_fails_clearly():
  with pytest.raises(pl.PalletError, match=r"pltpu.BufferedRef is not supported on this "
                     r"backend .*test_unsupported.py:\d+.*emit_pipeline"):
    class MyBufferedRef(pltpu.BufferedRef):   # noqa: F841
      pass


def test_mosaic_gpu_and_sparse_core_import_and_fail_clearly():
  from pallet import mosaic_gpu as plgpu_mgpu
  from pallet import tpu_sc as plsc
  from pallet.mosaic_gpu import Barrier, kernel  # noqa: F401  (importing is fine)
  with pytest.raises(pl.PalletError, match="does not run Mosaic-GPU.*pallet.triton"):
    plgpu_mgpu.kernel(lambda: None)
  with pytest.raises(pl.PalletError, match="does not run SparseCore"):
    plsc.parallel_loop(0, 8)
  with pytest.raises(pl.PalletError, match="VectorSubcoreMesh"):
    plsc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s")
  with pytest.raises(AttributeError):
    plsc._private_name
