"""The backend-neutral kernel model: specs, the grid mapping, the in-kernel
primitives and their rules, tracing into a `KernelDescription`, the checks and
analyses every backend relies on. Nothing here is re-exported: users reach these
names through `pallet`, `pallet.tpu` and `pallet.triton`."""
