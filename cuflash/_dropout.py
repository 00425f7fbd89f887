"""Dropout options -> the three kernel arguments (seed, threshold, scale) every kernel takes.

The mask itself is defined in kernels_cu/common.cuh (dropout_bits8) and, identically, in
cuflash/philox.py; this module only validates the options and packs them.
"""
from __future__ import annotations

import numpy as np

# What kernels get when dropout is off (their DROPOUT=false instantiation ignores it anyway).
OFF = (np.uint64(0), np.uint32(0), np.float32(1.0))


def kernel_args(dropout_p, seed):
    """(seed, threshold, scale) as kernel scalars, or None when nothing is dropped.

    Raises TypeError/ValueError naming the argument (dropout_p in [0, 1); seed required when
    dropout_p > 0, an int in [0, 2^64)).
    """
    if seed is None and (dropout_p == 0.0 or dropout_p is None):  # the common case, no import
        if dropout_p is None:
            raise TypeError("dropout_p must be a float in [0, 1), got None")
        return None
    from .philox import check_dropout, dropout_scale, dropout_threshold

    check_dropout(dropout_p, seed)
    p = float(dropout_p)
    threshold = dropout_threshold(p)
    if threshold == 0:
        return None
    return (np.uint64(int(seed)), np.uint32(threshold), np.float32(dropout_scale(p)))
