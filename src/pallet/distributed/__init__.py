"""Kernels across devices: remote DMAs and signals, the lockstep run of a
mesh, derivatives behind a primitive boundary, automatic partitioning."""
