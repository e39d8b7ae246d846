"""Kernels inside shard_map across (virtual CPU) devices, forward and grad.

Device count is fixed at JAX start-up, so the check runs in its own process with
XLA_FLAGS asking for four host devices.
"""
import textwrap

from helpers import run_on_simulated_devices

SCRIPT = textwrap.dedent("""
    import inspect
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import pallet as pl

    assert len(jax.devices()) == 4, jax.devices()
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
        from jax.experimental.shard_map import shard_map
    # The checks-off setting; tests/test_distributed.py covers the default check_vma=True.
    check = ({"check_vma": False} if "check_vma" in inspect.signature(shard_map).parameters
             else {"check_rep": False})

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.tanh(x_ref[...]) * x_ref[...]

    def per_shard(x):
        spec = pl.BlockSpec((8, x.shape[1]), lambda i: (i, 0))
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(x.shape[0] // 8,), in_specs=[spec], out_specs=spec)(x)

    mesh = Mesh(np.array(jax.devices()), ("d",))
    f = jax.jit(shard_map(per_shard, mesh=mesh, in_specs=P("d"), out_specs=P("d"), **check))
    x = jax.random.normal(jax.random.key(0), (64, 16))
    np.testing.assert_allclose(f(x), jnp.tanh(x) * x, rtol=1e-6)
    g = jax.grad(lambda x: jnp.sum(f(x) ** 2))(x)
    want = jax.grad(lambda x: jnp.sum((jnp.tanh(x) * x) ** 2))(x)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
    print("SHARD_MAP_OK")
""")


def test_kernel_inside_shard_map_forward_and_grad():
  output = run_on_simulated_devices(SCRIPT)
  assert "SHARD_MAP_OK" in output, output
