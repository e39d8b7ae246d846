"""Every pallet.ops op at its default arguments, with each reference GPU's launch table
(sm_80, sm_90, gfx942), against its jax.numpy reference: forward and VJP on the Triton
backend (Triton's interpreter without a GPU). Shapes the tables' blocks do not divide."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallet as pl
from helpers import current_test_backend, random_array
from ops_testing import check_op
from pallet import ops
from pallet.ops import launch_table

pytestmark = pytest.mark.skipif(
    current_test_backend() != "triton",
    reason="the launch tables are read on the Triton backend only: "
           "PALLET_TEST_BACKEND=triton TRITON_INTERPRET=1 pytest ...")

F32 = jnp.float32


def _attention():
  q = random_array((1, 4, 200, 64))
  kv = random_array((1, 2, 200, 64)), random_array((1, 2, 200, 64))
  return (q, *kv)


CASES = {
    "flash_attention": lambda: dict(op=ops.flash_attention, reference=ops.attention_reference,
                                    args=_attention(), argnums=(0, 1, 2)),
    "flash_attention_causal": lambda: dict(
        op=ops.flash_attention, reference=ops.attention_reference, args=_attention(),
        argnums=(0, 1, 2), causal=True),
    "linear_cross_entropy": lambda: dict(
        op=ops.linear_cross_entropy, reference=ops.linear_cross_entropy_reference,
        args=(random_array((100, 128)), random_array((128, 300)) / 8,
              jnp.arange(100, dtype=jnp.int32) * 7 % 300),
        argnums=(0, 1), reduction="mean"),
    "decode_attention": lambda: dict(
        op=ops.decode_attention, reference=ops.decode_attention_reference,
        args=(random_array((2, 4, 32)), random_array((2, 2, 300, 32)),
              random_array((2, 2, 300, 32)), jnp.array([300, 17], jnp.int32)), grad=False),
    "paged_attention": lambda: dict(
        op=ops.paged_attention, reference=ops.paged_attention_reference,
        args=(random_array((2, 4, 32)), random_array((2, 40, 16, 32)),
              random_array((2, 40, 16, 32)), jnp.array([300, 17], jnp.int32),
              jnp.arange(40, dtype=jnp.int32)[::-1].reshape(2, 20)), grad=False),
    "ragged_dot": lambda: dict(
        op=ops.ragged_dot, reference=ops.ragged_dot_reference,
        args=(random_array((200, 96)), random_array((3, 96, 160)),
              jnp.array([50, 0, 150], jnp.int32)), argnums=(0, 1)),
    "layer_norm": lambda: dict(op=ops.layer_norm, reference=ops.layer_norm_reference,
                               args=(random_array((37, 300)), random_array((300,)),
                                     random_array((300,))), argnums=(0, 1, 2)),
    "rms_norm": lambda: dict(op=ops.rms_norm, reference=ops.rms_norm_reference,
                             args=(random_array((37, 300)), random_array((300,))),
                             argnums=(0, 1)),
    "softmax": lambda: dict(op=ops.softmax, reference=ops.softmax_reference,
                            args=(random_array((37, 300)),)),
    "swiglu": lambda: dict(op=ops.swiglu, reference=ops.swiglu_reference,
                           args=(random_array((37, 1100)), random_array((37, 1100))),
                           argnums=(0, 1)),
    "rotary_embedding": lambda: dict(op=ops.rotary_embedding,
                                     reference=ops.rotary_embedding_reference,
                                     args=(random_array((2, 33, 2, 64)),)),
}


def _sections(spec, device):
  """The launch sections the op reads on `device` for this call (traced, not run)."""
  kwargs = {k: v for k, v in spec.items() if k not in ("op", "reference", "args", "argnums",
                                                       "grad")}
  with pl.default_backend("triton"), launch_table.using_device(device), \
      launch_table.recording() as seen:
    jax.eval_shape(lambda *a: spec["op"](*a, **kwargs), *spec["args"])
  return seen[-1].sections


@pytest.mark.parametrize("device", launch_table.DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_op_defaults_match_the_reference(case, device):
  spec = CASES[case]()
  earlier = launch_table.DEVICES[:launch_table.DEVICES.index(device)]
  same = [d for d in earlier if _sections(spec, d) == _sections(spec, device)]
  if same:
    pytest.skip(f"{device}'s table gives this call {same[0]}'s launch configuration")
  with launch_table.using_device(device):
    check_op(spec.pop("op"), spec.pop("reference"), spec.pop("args"), **spec)
