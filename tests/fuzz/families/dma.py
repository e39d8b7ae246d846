"""Manual DMAs and semaphores (TPU style; not on the Triton backend): operands in
`pl.ANY`, chunks of rows (optionally a column window) copied into VMEM scratch with
`pltpu.sync_copy`, `make_async_copy(...).start()/.wait()` or `pltpu.async_copy`, on
separate DMA semaphores or slots of a semaphore array, double-buffered across grid
steps or loop iterations (the next chunk's copy started before this one's wait),
results written through a blocked output or copied back by DMA, a REGULAR semaphore
signalled, read and waited, and a direct HBM-to-HBM copy into a second output.
Chunks are visited in order or reversed, over a grid or a `fori_loop` in one program.

The model moves the same rows with NumPy. JAX's TPU interpreter
(`pltpu.InterpretParams()`) is the other oracle.
"""
from __future__ import annotations

import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..case import Case, poison, random_array


def generate(rng: random.Random, data: np.random.Generator) -> Case:
  chunks, rows = rng.randint(1, 4), rng.choice([1, 2, 8])
  cols = rng.choice([1, 3, 8, 16])
  structure = rng.choice(["grid", "grid", "loop"])
  copy_in = rng.choice(["sync", "async", "async_copy", "double", "double", "blocked"]
                       if structure == "grid" else ["sync", "async", "async_copy", "double"])
  window = None
  if cols > 1 and copy_in != "blocked" and rng.random() < 0.3:
    start = rng.randint(0, cols - 1)
    window = (start, rng.randint(1, cols - start))
  out_paths = ["sync", "async"] + (["blocked"] if structure == "grid" and window is None else [])
  d = dict(chunks=chunks, rows=rows, cols=cols, structure=structure, copy_in=copy_in,
           copy_out=rng.choice(out_paths), window=window, reverse=rng.random() < 0.4,
           sem_array=rng.random() < 0.5, regular=rng.choice([0, 0, 1, 3]),
           read_count=rng.random() < 0.5, hbm_to_hbm=copy_in != "blocked" and rng.random() < 0.3,
           dtype=rng.choice(["float32", "int32"]),
           semantics=None)
  if structure == "grid":
    options = ["none", "arbitrary"] + (["parallel"] if copy_in != "double" else [])
    d["semantics"] = rng.choice(options)
  x = random_array(data, (chunks * rows, cols), d["dtype"])
  inputs = [x]
  d["alias_out"] = window is not None and d["copy_out"] != "blocked"
  if d["alias_out"]:
    inputs.append(poison(x.shape, x.dtype))
  return Case(family="dma", seed=-1, description={k: v for k, v in d.items()},
              inputs=tuple(inputs), run=lambda api, *a: _run(api, d, a),
              model=lambda *a: _model(d, a), triton="DMAs and semaphores are TPU memory "
              "movement (a lowering error on the Triton backend)", tpu_interpreter=True)


def _source(d: dict[str, Any], step: Any) -> Any:
  return d["chunks"] - 1 - step if d["reverse"] else step


def _model(d: dict[str, Any], args: tuple[np.ndarray, ...]) -> list[np.ndarray]:
  x = args[0]
  rows, (c0, w) = d["rows"], d["window"] or (0, d["cols"])
  out = poison(x.shape, x.dtype) if d["alias_out"] else np.zeros_like(x)
  copy = np.zeros_like(x)
  for step in range(d["chunks"]):
    src = _source(d, step)
    block = x[src * rows:(src + 1) * rows, c0:c0 + w]
    out[step * rows:(step + 1) * rows, c0:c0 + w] = block * 2 + 1 + d["regular"]
    copy[(d["chunks"] - 1 - step) * rows:(d["chunks"] - step) * rows] = x[step * rows:(step + 1) * rows]
  return [out, copy] if d["hbm_to_hbm"] else [out]


def _run(api: Any, d: dict[str, Any], args: tuple[Any, ...]) -> list[Any]:
  pl, pltpu = api.pl, api.pltpu
  dtype = jnp.dtype(d["dtype"])
  rows, cols, chunks = d["rows"], d["cols"], d["chunks"]
  c0, w = d["window"] or (0, cols)
  cut = (lambda r: (pl.ds(r, rows), pl.ds(c0, w))) if d["window"] else (lambda r: pl.ds(r, rows))
  grid_mode = d["structure"] == "grid"
  n_in = len(args)

  def kernel(*refs):
    x_ref, refs = refs[0], refs[n_in:]
    o_ref, refs = refs[0], refs[1:]
    c_ref = None
    if d["hbm_to_hbm"]:
      c_ref, refs = refs[0], refs[1:]
    buf, out_buf, in_sems, out_sem, reg = refs

    def sem(slot):
      return in_sems.at[slot] if d["sem_array"] else in_sems[slot]

    def copy_in(step, slot):
      src = x_ref.at[cut(_source(d, step) * rows)]
      return pltpu.make_async_copy(src, buf.at[slot], sem(slot))

    def process(step, slot):
      if d["copy_in"] == "blocked":
        y = x_ref[...]
      else:
        y = buf[slot]
      y = y * 2 + 1
      if d["regular"]:
        pl.semaphore_signal(reg, d["regular"])
        if d["read_count"]:   # JAX's TPU interpreter cannot lower semaphore_read on a CPU
          y = y + pl.semaphore_read(reg).astype(dtype)
        else:
          y = y + d["regular"]
        pl.semaphore_wait(reg, d["regular"])
      if d["copy_out"] == "blocked":
        o_ref[...] = y
        return
      out_buf[...] = y
      dst = o_ref.at[cut(step * rows)]
      if d["copy_out"] == "sync":
        pltpu.sync_copy(out_buf, dst)
      else:
        out = pltpu.make_async_copy(out_buf, dst, out_sem)
        out.start()
        out.wait()

    def fetch(step, slot):
      if d["copy_in"] == "sync":
        pltpu.sync_copy(x_ref.at[cut(_source(d, step) * rows)], buf.at[slot])
      elif d["copy_in"] == "async":
        c = copy_in(step, slot)
        c.start()
        c.wait()
      elif d["copy_in"] == "async_copy":
        pltpu.async_copy(x_ref.at[cut(_source(d, step) * rows)], buf.at[slot], sem(slot)).wait()

    def on_slot(slot, fn):
      """fn(slot); separate semaphores (a list) need the slot as a Python int."""
      if d["sem_array"]:
        fn(slot)
        return
      for s in (0, 1):
        pl.when(slot == s)(lambda: fn(s))

    def step_body(step, first, has_next):
      if d["copy_in"] == "double":
        slot = step % 2

        @pl.when(first)
        def _():
          on_slot(slot, lambda s: copy_in(step, s).start())

        @pl.when(has_next)
        def _():
          on_slot(1 - slot, lambda s: copy_in(step + 1, s).start())
        on_slot(slot, lambda s: copy_in(step, s).wait())
        process(step, slot)
      else:
        fetch(step, 0)
        process(step, 0)

    if grid_mode:
      i = pl.program_id(0)
      step_body(i, i == 0, i + 1 < pl.num_programs(0))
    else:
      def body(k, carry):
        step_body(k, k == 0, k + 1 < chunks)
        return carry
      lax.fori_loop(0, chunks, body, 0)
    if c_ref is not None:
      @pl.when(pl.program_id(0) == 0 if grid_mode else True)
      def _():
        for step in range(chunks):
          pltpu.sync_copy(x_ref.at[pl.ds(step * rows, rows)],
                          c_ref.at[pl.ds((chunks - 1 - step) * rows, rows)])

  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  if d["copy_in"] == "blocked":
    x_spec = pl.BlockSpec((rows, cols), lambda i: (_source(d, i), 0))
  else:
    x_spec = any_spec
  o_spec = (pl.BlockSpec((rows, cols), lambda i: (i, 0)) if d["copy_out"] == "blocked"
            else any_spec)
  in_specs = [x_spec] + ([any_spec] if d["alias_out"] else [])
  out_shape = [jax.ShapeDtypeStruct((chunks * rows, cols), dtype)]
  out_specs = [o_spec]
  if d["hbm_to_hbm"]:
    out_shape.append(jax.ShapeDtypeStruct((chunks * rows, cols), dtype))
    out_specs.append(any_spec)
  slots = 2 if d["copy_in"] == "double" else 1
  block = (rows, w)
  sems = (pltpu.SemaphoreType.DMA((slots,)) if d["sem_array"]
          else [pltpu.SemaphoreType.DMA for _ in range(slots)])
  scratch = [pltpu.VMEM((slots, *block), dtype), pltpu.VMEM(block, dtype), sems,
             pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.REGULAR]
  options: dict[str, Any] = dict(in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch)
  if grid_mode:
    options["grid"] = (chunks,)
    if d["semantics"] != "none":
      options["compiler_params"] = pltpu.CompilerParams(dimension_semantics=(d["semantics"],))
  if d["alias_out"]:
    options["input_output_aliases"] = {1: 0}
  return list(api.pallas_call(kernel, out_shape, **options)(*args))
