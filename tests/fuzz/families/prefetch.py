"""Scalar prefetch: the blocks family (docs/fuzzing.md) with 1-2 int32 tables passed
through `pltpu.PrefetchScalarGridSpec`, read by index maps (gathers with repeated
blocks, scatters where the last write wins) and by the body (a table entry at a
program id added to each output); aliased buffers count the prefetch operands."""
from __future__ import annotations

import random

import numpy as np

from ..case import Case
from . import blocks


def generate(rng: random.Random, data: np.random.Generator) -> Case:
  case = blocks.generate(rng, data, prefetch=True)
  case.family = "prefetch"
  return case
