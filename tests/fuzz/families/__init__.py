"""The families of generated kernels, by name (docs/fuzzing.md describes each)."""
from __future__ import annotations

import importlib
import zlib
import random

import numpy as np

from ..case import Case

NAMES = ("blocks", "accumulate", "scratch", "prefetch", "aliases", "run_scoped", "atomics", "dma", "pipeline", "transforms", "retrace", "control", "lanes", "matmul", "views", "overlaps", "overhang")


def generate(family: str, seed: int) -> Case:
  """The case of `family` for `seed`: the same every time, on every machine."""
  if family not in NAMES:
    raise ValueError(f"unknown fuzz family {family!r}; known: {', '.join(NAMES)}")
  module = importlib.import_module(f"{__name__}.{family}")
  rng = random.Random(f"{family}-{seed}")
  data = np.random.default_rng([seed, zlib.crc32(family.encode())])
  case = module.generate(rng, data)
  case.family, case.seed = family, seed
  return case
