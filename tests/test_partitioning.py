"""Automatic partitioning: kernels on sharded arrays under jax.jit run shard-locally.

Device count is fixed at JAX start-up, so the cases run in one process of their own
with XLA_FLAGS asking for four host devices; each test checks that its case printed
its OK marker. Every case compares with a jax.numpy reference and with the
single-device run, forward and grad; partitioned cases also check that the compiled
HLO has no all-gather, fallback cases that the debug notes say why.
"""
import textwrap

import pytest

from helpers import run_on_simulated_devices

SCRIPT = textwrap.dedent("""
    import contextlib, io, sys, traceback
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import pallet as pl
    from pallet import tpu as pltpu

    assert len(jax.devices()) == 4, jax.devices()

    def mesh(shape, names):
        devices = np.array(jax.devices()).reshape(shape)
        auto = getattr(jax.sharding, "AxisType", None)
        if auto is None:
            return Mesh(devices, names)
        return Mesh(devices, names, axis_types=(auto.Auto,) * len(names))

    MESH1 = mesh((4,), ("d",))
    MESH2 = mesh((2, 2), ("x", "y"))

    def rand(shape, seed):
        return jax.random.normal(jax.random.key(seed), shape, jnp.float32)

    # ---------------------------------------------------------------- kernels
    def elementwise(x, block=(8, None), debug=False):
        rows, cols = block[0], block[1] or x.shape[1]
        def kernel(x_ref, o_ref):
            o_ref[...] = jnp.tanh(x_ref[...]) * x_ref[...]
        spec = pl.BlockSpec((rows, cols), lambda i, j: (i, j))
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(x.shape[0] // rows, x.shape[1] // cols),
                              in_specs=[spec], out_specs=spec, debug=debug)(x)

    def elementwise_ref(x):
        return jnp.tanh(x) * x

    def layer_norm(x, w, b, block=8, debug=False):
        d = x.shape[1]
        def kernel(x_ref, w_ref, b_ref, o_ref):
            v = x_ref[...]
            mean = jnp.mean(v, axis=1, keepdims=True)
            var = jnp.mean((v - mean) ** 2, axis=1, keepdims=True)
            o_ref[...] = (v - mean) * jax.lax.rsqrt(var + 1e-5) * w_ref[...] + b_ref[...]
        row = pl.BlockSpec((block, d), lambda i: (i, 0))
        vec = pl.BlockSpec((d,), lambda i: (0,))
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(x.shape[0] // block,), in_specs=[row, vec, vec],
                              out_specs=row, debug=debug)(x, w, b)

    def layer_norm_ref(x, w, b):
        mean = jnp.mean(x, axis=1, keepdims=True)
        var = jnp.mean((x - mean) ** 2, axis=1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * w + b

    def matmul(x, w, debug=False):
        def kernel(x_ref, w_ref, o_ref):
            o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
        m, k = x.shape
        n = w.shape[1]
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((m, n), x.dtype), grid=(m // 8, n // 8),
            in_specs=[pl.BlockSpec((8, k), lambda i, j: (i, 0)),
                      pl.BlockSpec((k, 8), lambda i, j: (0, j))],
            out_specs=pl.BlockSpec((8, 8), lambda i, j: (i, j)), debug=debug)(x, w)

    def matmul_k(x, w, debug=False):
        # The contraction runs over a sequential grid axis (an accumulator).
        def kernel(x_ref, w_ref, o_ref):
            @pl.when(pl.program_id(1) == 0)
            def _():
                o_ref[...] = jnp.zeros_like(o_ref)
            o_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
        m, k = x.shape
        n = w.shape[1]
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((m, n), x.dtype), grid=(m // 8, k // 8),
            in_specs=[pl.BlockSpec((8, 8), lambda i, kk: (i, kk)),
                      pl.BlockSpec((8, n), lambda i, kk: (kk, 0))],
            out_specs=pl.BlockSpec((8, n), lambda i, kk: (i, 0)), debug=debug)(x, w)

    def pairwise(x, block=8, debug=False):
        # Large per-program intermediates: the XLA plan chunks the row axis into a loop,
        # which XLA's partitioner would run on a gathered array.
        def kernel(x_ref, o_ref):
            v = x_ref[...]
            o_ref[...] = jnp.sum(jnp.tanh(v[:, :, None] * v[:, None, :]), axis=2)
        spec = pl.BlockSpec((block, x.shape[1]), lambda i: (i, 0))
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(x.shape[0] // block,), in_specs=[spec], out_specs=spec,
                              debug=debug)(x)

    def pairwise_ref(x):
        return jnp.sum(jnp.tanh(x[:, :, None] * x[:, None, :]), axis=2)

    def offset_rows(x, debug=False):
        # Reads program_id: each row block adds its (global) block index.
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] + pl.program_id(0).astype(jnp.float32)
        spec = pl.BlockSpec((8, x.shape[1]), lambda i: (i, 0))
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(x.shape[0] // 8,), in_specs=[spec], out_specs=spec,
                              debug=debug)(x)

    def offset_rows_ref(x):
        return x + (jnp.arange(x.shape[0]) // 8)[:, None].astype(jnp.float32)

    def permute_rows(x, debug=False):
        # Scalar prefetch: output block i reads input block order[i].
        order = jnp.arange(x.shape[0] // 8)[::-1]
        def kernel(order_ref, x_ref, o_ref):
            o_ref[...] = x_ref[...] * 2.0
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), debug=debug,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(x.shape[0] // 8,),
                in_specs=[pl.BlockSpec((8, x.shape[1]), lambda i, o: (o[i], 0))],
                out_specs=pl.BlockSpec((8, x.shape[1]), lambda i, o: (i, 0))))(order, x)

    def permute_rows_ref(x):
        return 2.0 * x.reshape(-1, 8, x.shape[1])[::-1].reshape(x.shape)

    def dma_rows(x, debug=False):
        # Copies its row block from the whole array by DMA.
        def kernel(x_hbm, o_ref, buf):
            pltpu.sync_copy(x_hbm.at[pl.ds(pl.program_id(0) * 8, 8)], buf)
            o_ref[...] = buf[...] + 1.0
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 8,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((8, x.shape[1]), lambda i: (i, 0)),
            scratch_shapes=[pltpu.VMEM((8, x.shape[1]), x.dtype)], debug=debug)(x)

    # ---------------------------------------------------------------- checking
    def hlo(f, *args):
        return jax.jit(f).lower(*args).compile().as_text()

    def notes_of(f, *args):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.jit(f).lower(*args).compile()
        return out.getvalue()

    def check(name, f, ref, args, shardings, partitioned, note=None, debug_f=None, tol=1e-5,
              gathers=False):
        try:
            placed = [jax.device_put(a, s) for a, s in zip(args, shardings)]
            got = jax.jit(f)(*placed)
            single = jax.jit(f)(*args)
            want = ref(*args)
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
            np.testing.assert_allclose(got, single, rtol=tol, atol=tol)
            loss = lambda fn: (lambda *a: jnp.sum(fn(*a) ** 2))
            argnums = tuple(range(len(args)))
            g = jax.jit(jax.grad(loss(f), argnums))(*placed)
            g_want = jax.grad(loss(ref), argnums)(*args)
            for a, b in zip(g, g_want):
                # Gradients sum hundreds of terms (pairwise: up to thousands in size), so
                # summation order moves a small element by float32 eps times their scale.
                scale = max(1.0, float(np.max(np.abs(b))))
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * scale)
            text = hlo(f, *placed)
            if not gathers:
                assert "all-gather" not in text, text
            if partitioned:
                assert "custom_partitioning" in text, "kernel not custom-partitioned"
            if note is not None:
                notes = notes_of(debug_f, *placed)
                assert note in notes, notes
            print(f"CASE {name} OK")
        except Exception:
            print(f"CASE {name} FAILED")
            traceback.print_exc(file=sys.stdout)

    x = rand((64, 32), 0)
    w_vec, b_vec = rand((32,), 1), rand((32,), 2)
    w_mat = rand((32, 16), 3)
    row1 = NamedSharding(MESH1, P("d"))
    rep1 = NamedSharding(MESH1, P())

    # Vectorized XLA plans are lowered plainly: XLA's partitioner keeps them shard-local.
    plain = "plain lowering: the XLA plan vectorizes every parallel axis"
    check("elementwise_1d", elementwise, elementwise_ref, [x], [row1], False, note=plain,
          debug_f=lambda x: elementwise(x, debug=True))
    check("elementwise_2d", lambda x: elementwise(x, block=(8, 16)), elementwise_ref, [x],
          [NamedSharding(MESH2, P("x", "y"))], False)
    check("layer_norm_1d", layer_norm, layer_norm_ref, [x, w_vec, b_vec], [row1, rep1, rep1],
          False)
    check("layer_norm_2d", layer_norm, layer_norm_ref, [x, w_vec, b_vec],
          [NamedSharding(MESH2, P(("x", "y")))] + [NamedSharding(MESH2, P())] * 2, False)
    check("matmul_rows_1d", matmul, lambda x, w: x @ w, [x, w_mat], [row1, rep1], False)
    check("matmul_2d", matmul, lambda x, w: x @ w, [x, w_mat],
          [NamedSharding(MESH2, P("x")), NamedSharding(MESH2, P(None, "y"))], False)
    # A looped plan: custom-partitioned, each device runs its own rows.
    xp = rand((128, 512), 4)
    check("pairwise_1d", pairwise, pairwise_ref, [xp], [row1], True, tol=1e-4,
          note="axis 0 split over mesh axes ('d',): 4 blocks per shard",
          debug_f=lambda x: pairwise(x, debug=True))
    check("pairwise_2d", pairwise, pairwise_ref, [xp], [NamedSharding(MESH2, P(("x", "y")))],
          True, tol=1e-4, note="axis 0 split over mesh axes ('x', 'y')",
          debug_f=lambda x: pairwise(x, debug=True))
    # fallbacks: right answers, and a note saying why the axis stays whole
    check("sequential_axis_sharded", matmul_k, lambda x, w: x @ w, [x, w_mat],
          [NamedSharding(MESH1, P(None, "d")), NamedSharding(MESH1, P("d"))], False,
          note="axis 1 not split: sequential", debug_f=lambda *a: matmul_k(*a, debug=True),
          gathers=True)
    # 3 blocks of 32 rows over 4 devices (24 rows each): blocks straddle shards.
    check("straddling_blocks", lambda x: pairwise(x, block=32), pairwise_ref,
          [rand((96, 512), 5)], [row1], True, tol=1e-4, gathers=True, note="straddle",
          debug_f=lambda x: pairwise(x, block=32, debug=True))
    check("reads_program_id", offset_rows, offset_rows_ref, [x], [row1], False,
          note="reads program_id(0)", debug_f=lambda x: offset_rows(x, debug=True))
    check("scalar_prefetch", permute_rows, permute_rows_ref, [x], [row1], False, gathers=True,
          note="scalar prefetch", debug_f=lambda x: permute_rows(x, debug=True))
    check("dma_kernel", dma_rows, lambda x: x + 1.0, [x], [row1], False, gathers=True,
          note="DMAs", debug_f=lambda x: dma_rows(x, debug=True))

    # Explicit mesh axes: right answers forward and grad, no all-gather, the looped
    # kernel custom-partitioned (outputs keep their inputs' sharding: pallas_call's
    # explicit-sharding rules, see test_distributed.py).
    AxisType = getattr(jax.sharding, "AxisType", None)
    if AxisType is not None:
        explicit = Mesh(np.array(jax.devices()), ("d",), axis_types=(AxisType.Explicit,))
        rowx, repx = NamedSharding(explicit, P("d")), NamedSharding(explicit, P())
        check("explicit_pairwise", pairwise, pairwise_ref, [xp], [rowx], True, tol=1e-4)
        check("explicit_layer_norm", layer_norm, layer_norm_ref, [x, w_vec, b_vec],
              [rowx, repx, repx], False)
    else:
        print("CASE explicit_pairwise OK")
        print("CASE explicit_layer_norm OK")

    # The benchmark family runs only with 4 devices; its rows agree with their references.
    try:
        from pallet.bench import sharded
        rows = sharded.benchmarks("tiny")
        assert [b.name for b in rows] == ["sharded_layernorm", "sharded_pairwise"], rows
        for b in rows:
            args = b.make_inputs(jax.random.key(0))
            got = jax.jit(b.build_pallas(pl))(*args)
            np.testing.assert_allclose(got, b.reference(*args), rtol=b.rtol, atol=b.atol)
            assert "all-gather" not in hlo(b.build_pallas(pl), *args)
        print("CASE benchmark_rows OK")
    except Exception:
        print("CASE benchmark_rows FAILED")
        traceback.print_exc(file=sys.stdout)
""")

CASES = ["elementwise_1d", "elementwise_2d", "layer_norm_1d", "layer_norm_2d", "matmul_rows_1d",
         "matmul_2d", "pairwise_1d", "pairwise_2d", "sequential_axis_sharded",
         "straddling_blocks", "reads_program_id", "scalar_prefetch", "dma_kernel",
         "explicit_pairwise", "explicit_layer_norm",
         "benchmark_rows"]


@pytest.fixture(scope="module")
def output() -> str:
  return run_on_simulated_devices(SCRIPT)


@pytest.mark.parametrize("case", CASES)
def test_partitioning_case(output: str, case: str) -> None:
  assert f"CASE {case} OK" in output, _section(output, case)


def _section(output: str, case: str) -> str:
  """The failure report of one case (or the whole output if the script died)."""
  start = output.find(f"CASE {case} FAILED")
  if start < 0:
    return output[-6000:]
  return output[max(0, start - 4000):start + 100]
