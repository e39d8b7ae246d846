"""Kernels across (virtual CPU) devices: shard_map with and without its vma checks,
1-D and 2-D meshes, Explicit-sharding meshes; forward, grad and vmap, each compared
with the single-device result and a jax.numpy reference on random inputs.

Device count is fixed at JAX start-up, so the cases run in one child process with
XLA_FLAGS asking for four host devices; each case prints a marker the tests check.
"""
import textwrap

import pytest

from helpers import run_on_simulated_devices

SCRIPT = textwrap.dedent("""
    import functools, traceback
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, ManualAxisType, NamedSharding, PartitionSpec as P
    import pallet as pl

    assert len(jax.devices()) == 4, jax.devices()

    def kernel(x_ref, w_ref, o_ref):
      o_ref[...] = jnp.tanh(x_ref[...]) * w_ref[...] + 1.0

    def layer(x, w, varying=None):
      rows, cols = x.shape
      spec = pl.BlockSpec((8, cols), lambda i: (i, 0))
      wspec = pl.BlockSpec((1, cols), lambda i: (0, 0))
      out = jax.ShapeDtypeStruct(x.shape, x.dtype) if varying is None else \\
          jax.ShapeDtypeStruct(x.shape, x.dtype, manual_axis_type=ManualAxisType(varying=varying))
      return pl.pallas_call(kernel, out_shape=out, grid=(rows // 8,), in_specs=[spec, wspec],
                            out_specs=spec)(x, w)

    ref = lambda x, w: jnp.tanh(x) * w + 1.0
    loss = lambda f: (lambda x, w: jnp.sum(f(x, w) ** 2))
    x = jax.random.normal(jax.random.key(0), (64, 16))
    w = jax.random.normal(jax.random.key(1), (1, 16))
    xs = jax.random.normal(jax.random.key(2), (3, 64, 16))
    single = jax.jit(layer)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)

    def check(f, tag):
      # forward, grad in both operands, vmap over x: against one device and jax.numpy
      try:
        for want in (single, ref):
          close(f(x, w), want(x, w))
          for g, h in zip(jax.grad(loss(f), (0, 1))(x, w), jax.grad(loss(want), (0, 1))(x, w)):
            close(g, h)
          close(jax.vmap(f, (0, None))(xs, w), jax.vmap(want, (0, None))(xs, w))
        print("CASE_OK", tag, flush=True)
      except Exception:
        traceback.print_exc()

    mesh1 = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))
    mesh2 = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    for check_vma in (True, False):
      check(jax.jit(jax.shard_map(layer, mesh=mesh1, in_specs=(P("d"), P()), out_specs=P("d"),
                                  check_vma=check_vma)), f"shard_map_1d_{check_vma}")
      check(jax.jit(jax.shard_map(layer, mesh=mesh2, in_specs=(P("a", "b"), P(None, "b")),
                                  out_specs=P("a", "b"), check_vma=check_vma)),
            f"shard_map_2d_{check_vma}")
    # derivatives of derivatives, and vmap of grad, inside shard_map(check_vma=True)
    try:
      f = jax.jit(jax.shard_map(layer, mesh=mesh1, in_specs=(P("d"), P()), out_specs=P("d")))
      for want in (single, ref):
        for g, h in zip(jax.vmap(jax.grad(loss(f), (0, 1)), (0, None))(xs, w),
                        jax.vmap(jax.grad(loss(want), (0, 1)), (0, None))(xs, w)):
          close(g, h)
        hvp = lambda f: jax.grad(lambda x: jnp.sum(jax.grad(loss(f))(x, w) * xs[0]))(x)
        close(hvp(f), hvp(want))
      print("CASE_OK higher_order", flush=True)
    except Exception:
      traceback.print_exc()

    # a kernel reading its device's position: the output varies over that axis even
    # where the operands do not (replicated x), so out_specs=P("d") is accepted
    def shifted_kernel(x_ref, o_ref):
      o_ref[...] = jnp.sin(x_ref[...]) * (1.0 + jax.lax.axis_index("d").astype(jnp.float32))
    shifted = lambda x: pl.pallas_call(shifted_kernel,
                                       out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    shifted_ref = lambda x: jnp.sin(x) * (1.0 + jax.lax.axis_index("d").astype(jnp.float32))
    try:
      for check_vma in (True, False):
        for spec in (P("d"), P()):
          run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh1, in_specs=spec, out_specs=P("d"),
                                                check_vma=check_vma))
          close(run(shifted)(x), run(shifted_ref)(x))
          g = lambda f: jax.grad(lambda x: jnp.sum(run(f)(x) ** 2))(x)
          close(g(shifted), g(shifted_ref))
      print("CASE_OK axis_index", flush=True)
    except Exception:
      traceback.print_exc()

    # Pallas's own annotation: the output varies over "d" (what pallet infers anyway)
    check(jax.jit(jax.shard_map(lambda x, w: layer(x, w, frozenset({"d"})), mesh=mesh1,
                                in_specs=(P("d"), P()), out_specs=P("d"))), "annotated")
    try:
      jax.jit(jax.shard_map(lambda x, w: layer(x, w, frozenset()), mesh=mesh1,
                            in_specs=(P("d"), P()), out_specs=P("d")))(x, w)
    except pl.PalletError as e:
      if ("annotated as varying over mesh axes []" in str(e) and "kernel 'kernel'" in str(e)
          and "must vary over ['d']" in str(e)):
        print("CASE_OK annotation_error", flush=True)

    # Explicit meshes: sharded operands under jit
    mesh1 = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
    mesh2 = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    for mesh, xspec, wspec, tag in ((mesh1, P("d"), P(), "explicit_1d"),
                                    (mesh2, P("a", "b"), P(None, "b"), "explicit_2d")):
      put = lambda v, s: jax.device_put(v, NamedSharding(mesh, s))
      f = jax.jit(layer)
      try:
        sx, sw = put(x, xspec), put(w, wspec)
        for want in (single, ref):
          close(f(sx, sw), want(x, w))
          for g, h in zip(jax.jit(jax.grad(loss(layer), (0, 1)))(sx, sw),
                          jax.grad(loss(want), (0, 1))(x, w)):
            close(g, h)
          close(jax.jit(jax.vmap(layer, (0, None)))(put(xs, P(None, *xspec)), sw),
                jax.vmap(want, (0, None))(xs, w))
        # rows tiled by the grid stay sharded: no gather, forward or backward
        assert jax.typeof(f(sx, sw)).sharding.spec[0] == xspec[0], jax.typeof(f(sx, sw))
        if tag == "explicit_1d":
          with jax.set_mesh(mesh):   # eager (JAX's eager grad wants the mesh set)
            close(layer(sx, sw), ref(x, w))
            for g, h in zip(jax.grad(loss(layer), (0, 1))(sx, sw),
                            jax.grad(loss(ref), (0, 1))(x, w)):
              close(g, h)
          grad = jax.jit(jax.grad(loss(layer), (0, 1)))
          for hlo in (f.lower(sx, sw).compile().as_text(),
                      grad.lower(sx, sw).compile().as_text()):
            assert "all-gather" not in hlo, hlo
        print("CASE_OK", tag, flush=True)
      except Exception:
        traceback.print_exc()

    # shard_map over one axis of an Explicit 2-D mesh; operands also sharded over the other
    try:
      sx, sw = (jax.device_put(x, NamedSharding(mesh2, P("a", "b"))),
                jax.device_put(w, NamedSharding(mesh2, P(None, "b"))))
      with jax.set_mesh(mesh2):
        f = jax.jit(jax.shard_map(layer, in_specs=(P("a"), P()), out_specs=P("a"),
                                  axis_names={"a"}))
        for want in (single, ref):
          close(f(sx, sw), want(x, w))
          for g, h in zip(jax.jit(jax.grad(loss(f), (0, 1)))(sx, sw),
                          jax.grad(loss(want), (0, 1))(x, w)):
            close(g, h)
      print("CASE_OK partial_manual", flush=True)
    except Exception:
      traceback.print_exc()
""")

CASES = ["shard_map_1d_True", "shard_map_1d_False", "shard_map_2d_True", "shard_map_2d_False",
         "higher_order", "axis_index", "annotated", "annotation_error", "explicit_1d", "explicit_2d",
         "partial_manual"]


@pytest.fixture(scope="module")
def child_output():
  return run_on_simulated_devices(SCRIPT)


@pytest.mark.parametrize("case", CASES)
def test_distributed(child_output, case):
  assert f"CASE_OK {case}\n" in child_output, child_output
