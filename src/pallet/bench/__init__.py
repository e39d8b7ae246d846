"""pallet's benchmark suite: each kernel written once, run by pallet, jax.numpy and the
`jax.experimental.pallas` interpreter, checked against jax.numpy and timed.

Run `pallet bench --help` (from a checkout also `python -m benchmarks --help`); the method is described in
docs/performance.md. One module per kernel family (`elementwise`, `matmul`,
`rowwise`, `attention`, `stencil`, `reduction`, `indexing`), listed in `catalog`.
"""
