"""pallet's benchmark suite: each kernel written once, run by pallet, jax.numpy and the
`jax.experimental.pallas` interpreter, checked against jax.numpy and timed.

Run `python -m benchmarks --help` (or `pallet bench`); the method is described in
docs/performance.md. One module per kernel family (`elementwise`, `matmul`,
`rowwise`, `attention`, `stencil`, `reduction`, `indexing`), listed in `catalog`.
"""
