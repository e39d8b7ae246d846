"""Every pallet.ops kernel (forward and backward) compiles for sm_80, sm_90 and gfx942
at a realistic size with that GPU's launch-table defaults (pallet.ops.launch_table),
without register spills unless the table entry says why."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from compiled import TARGETS, compile_for, kernels_of, spill_bytes
from helpers import random_array
import pallet as pl
from pallet import ops
from pallet.ops import launch_table

BF16 = jnp.bfloat16


def _grad_of(op, *argnums):
  """A program running op's forward and backward kernels (loss = sum of outputs)."""
  def loss(*args):
    out = op(*args)
    return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree_util.tree_leaves(out))
  return jax.grad(loss, argnums=argnums)


def _norm_case(op, residual):
  x, w, r = random_array((4096, 1024), BF16), random_array((1024,), BF16), \
      random_array((4096, 1024), BF16)
  if residual:
    return _grad_of(lambda x, w, r: op(x, w, residual=r), 0, 1, 2), (x, w, r)
  return _grad_of(op, 0, 1), (x, w)


def _cross_entropy_case():
  h, w = random_array((2048, 512), BF16), random_array((512, 8192), BF16)
  labels = jnp.arange(2048, dtype=jnp.int32) % 8192
  return _grad_of(lambda h, w: ops.linear_cross_entropy(h, w, labels), 0, 1), (h, w)


# name -> () -> (program, args); each program may launch several kernels, reading the
# launch-table sections SECTIONS[name] in order.
CASES = {
    "softmax": lambda: (_grad_of(ops.softmax, 0), (random_array((4096, 1024), BF16),)),
    "linear_cross_entropy": _cross_entropy_case,
    "flash_attention": lambda: (
        _grad_of(lambda q, k, v: ops.flash_attention(q, k, v, causal=True, softcap=30.0), 0, 1, 2),
        (random_array((1, 8, 1024, 128), BF16), random_array((1, 2, 1024, 128), BF16),
         random_array((1, 2, 1024, 128), BF16))),
    "flash_attention_segments_window": lambda: (
        _grad_of(lambda q, k, v, ids: ops.flash_attention(
            q, k, v, q_segment_ids=ids, kv_segment_ids=ids, window=256), 0, 1, 2),
        (random_array((1, 4, 1024, 64), BF16), random_array((1, 4, 1024, 64), BF16),
         random_array((1, 4, 1024, 64), BF16), jnp.arange(1024, dtype=jnp.int32)[None] // 300)),
    "decode_attention": lambda: (
        ops.decode_attention, (random_array((8, 32, 128), BF16),
                               random_array((8, 8, 4096, 128), BF16),
                               random_array((8, 8, 4096, 128), BF16),
                               jnp.arange(8, dtype=jnp.int32) * 500)),
    "paged_attention": lambda: (
        ops.paged_attention, (random_array((8, 32, 128), BF16),
                              random_array((8, 2048, 16, 128), BF16),
                              random_array((8, 2048, 16, 128), BF16),
                              jnp.arange(8, dtype=jnp.int32) * 500,
                              jnp.arange(2048, dtype=jnp.int32)[::-1].reshape(8, 256))),
    "rotary_embedding": lambda: (_grad_of(ops.rotary_embedding, 0),
                                 (random_array((2, 1024, 8, 128), BF16),)),
    "swiglu": lambda: (_grad_of(ops.swiglu, 0, 1), (random_array((4096, 2752), BF16),
                                                    random_array((4096, 2752), BF16))),
    "geglu": lambda: (_grad_of(lambda a, b: ops.glu(a, b, activation="gelu"), 0, 1),
                      (random_array((512, 1000), BF16), random_array((512, 1000), BF16))),
    "layer_norm": lambda: _norm_case(ops.layer_norm, False),
    "layer_norm_residual": lambda: _norm_case(ops.layer_norm, True),
    "rms_norm": lambda: _norm_case(ops.rms_norm, False),
    "rms_norm_residual": lambda: _norm_case(ops.rms_norm, True),
    "ragged_dot": lambda: (
        _grad_of(lambda a, b: ops.ragged_dot(a, b, jnp.asarray([900, 300, 0, 1200, 77, 600, 519,
                                                                500], jnp.int32)), 0, 1),
        (random_array((4096, 1024), BF16), random_array((8, 1024, 2048), BF16))),
}


_NORM = ("fwd", "bwd")
SECTIONS = {
    "softmax": _NORM, "linear_cross_entropy": ("fwd", "dlogits"),
    "flash_attention": ("fwd", "dq", "dkv"), "flash_attention_segments_window": ("fwd", "dq", "dkv"),
    "decode_attention": ("fwd", "combine"), "paged_attention": ("fwd", "combine"), "rotary_embedding": ("fwd", "fwd"),
    "swiglu": _NORM, "geglu": _NORM, "layer_norm": _NORM, "layer_norm_residual": _NORM,
    "rms_norm": _NORM, "rms_norm_residual": _NORM, "ragged_dot": ("fwd", "dlhs", "drhs"),
}


def _kernels():
  """(kernel, target, why it may spill: its launch-table note) for every kernel of every
  case, traced with the target's table as on that GPU."""
  params = []
  for name, make in CASES.items():
    fn, args = make()
    for target, device in (("sm80", "sm_80"), ("sm90", "sm_90"), ("gfx942", "gfx942")):
      with pl.default_backend("triton"), launch_table.using_device(device), \
          launch_table.recording() as launches:
        kernels = kernels_of(fn, *args)
      notes = launches[-1].notes
      assert len(kernels) == len(SECTIONS[name]), [k.name for k in kernels]
      for kd, section in zip(kernels, SECTIONS[name]):
        params.append(pytest.param(kd, target, notes.get(section, ""),
                                   id=f"{name}-{kd.name}-{section}-{target}"))
  return params


def _spills(compiled, target: str) -> int:
  if target == "sm80":
    return spill_bytes(compiled.asm["ptx"])
  if target == "sm90":  # ptxas for the PTX's own target (sm_90a)
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill", _ptxas_report(compiled)))
  counts = re.findall(r"\.[sv]gpr_spill_count:\s*(\d+)", compiled.asm["amdgcn"])
  scratch = re.findall(r"ScratchSize:\s*(\d+)", compiled.asm["amdgcn"])
  return sum(map(int, counts)) + sum(map(int, scratch))


def _ptxas_report(compiled) -> str:
  import subprocess
  import tempfile
  from triton.backends.nvidia.compiler import get_ptxas
  arch = re.search(r"^\.target\s+(\w+)", compiled.asm["ptx"], re.M).group(1)
  with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
    f.write(compiled.asm["ptx"])
    f.flush()
    done = subprocess.run([get_ptxas(90).path, "-v", f"--gpu-name={arch}", f.name, "-o", "/dev/null"],
                          capture_output=True, text=True, check=True)
  return done.stdout + done.stderr


@pytest.mark.parametrize("kernel,target,why", _kernels())
def test_op_kernel_compiles_without_spills_or_says_why(kernel, target, why):
  compiled = compile_for(kernel, target)
  assert _spills(compiled, target) == 0 or why
