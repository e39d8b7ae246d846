"""Named axes for arrays, refs and kernels: index by name, not by position.

    import pallet.named as pn
    Batch, Feature = pn.make_axes(Batch=4, Feature=8)
    x = pn.random.normal(key, (Batch, Feature))
    r = pn.new_ref(x)
    r[{"Batch": 0}] = pn.zeros((Feature,))

See docs/named.md.
"""
from pallet.named import random, ref
from pallet.named.array import NamedArray, named
from pallet.named.axis import Axis, make_axes
from pallet.named.kernels import (NamedBlockSpec, NamedShapeDtype, num_programs, pallas_call,
                                  program_id)
from pallet.named.ops import (abs, arange, cos, dot, exp, full, full_like, log, max, maximum,
                              mean, min, minimum, ones, ones_like, sin, sqrt, square, sum, tanh,
                              where, zeros, zeros_like)
from pallet.named.ref import NamedRef, freeze, get, new_ref, swap
from pallet.core.primitives import ds

__all__ = [
    "Axis", "NamedArray", "NamedBlockSpec", "NamedRef", "NamedShapeDtype", "abs", "arange",
    "cos", "dot", "ds", "exp", "freeze", "full", "full_like", "get", "log", "make_axes", "max",
    "maximum", "mean", "min", "minimum", "named", "new_ref", "num_programs", "ones",
    "ones_like", "pallas_call", "program_id", "random", "ref", "sin", "sqrt", "square", "sum",
    "swap", "tanh", "where", "zeros", "zeros_like",
]
