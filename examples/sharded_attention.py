"""Flash attention sharded over heads, forward and gradient, on several devices.

You will learn that a pallet kernel runs unchanged inside `jax.shard_map`, with JAX's
default checks on: each device runs the kernel on its own heads, the outputs are
typed as varying over the mesh axis their inputs vary over, and `jax.grad` works
through it. Run it on 4 simulated CPU devices: `python examples/sharded_attention.py`
(it sets `XLA_FLAGS=--xla_force_host_platform_device_count=4` when run as a script).
"""
# %%
import os

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=4")

import functools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pallet as pl  # noqa: E402


# %% The kernel: one (head, query block) per program, keys visited block by block
# with a running max and sum (the online softmax), so no (T, T) matrix is formed.
def flash_kernel(q_ref, k_ref, v_ref, o_ref, *, block_k: int):
  q = q_ref[...]                                   # (block_q, d)
  seq_len = k_ref.shape[0]

  def visit(j, carry):
    acc, row_max, row_sum = carry
    k = k_ref[pl.ds(j * block_k, block_k), :]
    v = v_ref[pl.ds(j * block_k, block_k), :]
    s = q @ k.T / jnp.sqrt(jnp.float32(q.shape[-1]))
    new_max = jnp.maximum(row_max, s.max(axis=-1))
    p = jnp.exp(s - new_max[:, None])
    scale = jnp.exp(row_max - new_max)
    return (acc * scale[:, None] + p @ v, new_max, row_sum * scale + p.sum(axis=-1))

  init = (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:1], -jnp.inf, jnp.float32),
          jnp.zeros(q.shape[:1], jnp.float32))
  acc, _, row_sum = lax.fori_loop(0, seq_len // block_k, visit, init)
  o_ref[...] = (acc / row_sum[:, None]).astype(o_ref.dtype)


def flash_attention(q, k, v, block_q: int = 32, block_k: int = 32):
  """Attention over (heads, seq, d) arrays; one kernel launch for all local heads."""
  heads, seq_len, d = q.shape
  q_spec = pl.BlockSpec((None, block_q, d), lambda h, i: (h, i, 0))
  kv_spec = pl.BlockSpec((None, seq_len, d), lambda h, i: (h, 0, 0))
  return pl.pallas_call(
      functools.partial(flash_kernel, block_k=block_k),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(heads, seq_len // block_q),
      in_specs=[q_spec, kv_spec, kv_spec], out_specs=q_spec)(q, k, v)


def attention_reference(q, k, v):
  s = jnp.einsum("hqd,hkd->hqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
  return jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(s, axis=-1), v)


# %% Heads sharded over a 1-D mesh of every device; shard_map's default checks stay on.
def sharded(fn, mesh):
  spec = P("heads")
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec))


def _mesh_and_inputs():
  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices), ("heads",))
  heads = 2 * len(devices)
  q, k, v = (jax.random.normal(jax.random.key(i), (heads, 128, 64)) for i in range(3))
  return mesh, q, k, v


def _max_difference(got, want) -> float:
  return float(jnp.max(jnp.abs(got - want)))


def check() -> None:
  mesh, q, k, v = _mesh_and_inputs()
  w = jax.random.normal(jax.random.key(3), q.shape)
  where = f"flash attention over {q.shape[0]} heads on {len(mesh.devices)} devices"

  out = sharded(flash_attention, mesh)(q, k, v)
  want = attention_reference(q, k, v)
  np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
  print(f"{where}: forward matches jax.numpy, max |difference| "
        f"{_max_difference(out, want):.1e}")

  def loss(attend):
    return lambda q, k, v: jnp.sum(sharded(attend, mesh)(q, k, v) * w)
  got = jax.grad(loss(flash_attention), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(attention_reference), argnums=(0, 1, 2))(q, k, v)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-4)
  print(f"{where}: grad matches jax.numpy, max |difference| "
        f"{max(map(_max_difference, got, want)):.1e}")


# %% Timing of the sharded forward pass against jax.numpy (median of `reps` runs after
# a warm-up that compiles; simulated devices share this machine's cores).
def median_ms(fn, *args, reps: int = 7) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def benchmark(reps: int = 7) -> None:
  mesh, q, k, v = _mesh_and_inputs()
  print(f"{'implementation':<22}{'ms':>10}")
  for label, fn in [("pallet kernel", flash_attention), ("jax.numpy", attention_reference)]:
    print(f"{label:<22}{median_ms(sharded(fn, mesh), q, k, v, reps=reps):>10.2f}")


if __name__ == "__main__":
  check()
  benchmark()
