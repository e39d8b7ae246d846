"""A differential fuzzer for pallet (docs/fuzzing.md).

Each family in `families/` turns a seed into a small random kernel description and
builds the kernel from it against a Pallas API passed in as modules (`pl`, `pltpu`,
`plgpu`), so the same body runs on pallet (XLA backend, or the Triton backend under
Triton's interpreter) and on JAX's own Pallas interpreter. The family also writes a
NumPy model of what the description means, without running any kernel. `runner.py`
runs a case everywhere and compares; `test_fuzz.py` runs fixed seeds under pytest;
`python -m tests.fuzz` runs campaigns.
"""
