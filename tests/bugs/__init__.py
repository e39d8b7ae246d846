"""The seeded-bug corpus: buggy kernels, their fixed twins, and the runner test."""
