"""A checkout's shim for the benchmark suite, which lives in `pallet.bench`
(src/pallet/bench/) so that it ships with pallet: `python -m benchmarks` from
a checkout runs `pallet bench`. Nothing else belongs here."""
