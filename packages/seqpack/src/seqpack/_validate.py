"""Input checks shared by the seqpack modules: lengths lists and positive integer parameters.

Owns only validation and the error messages (which name the value received and the fix); no packing logic.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger(__name__)


def check_positive_int(value: object, name: str) -> int:
    """Return `value` as an int, or raise naming `name` when it is not an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1, got {value!r} of type {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def as_lengths(lengths: Sequence[int] | np.ndarray, name: str = "lengths") -> np.ndarray:
    """Validate a non-empty 1-D list of positive integer lengths; return it as an int64 array."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of ints, got an array of shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty: pass at least one sequence length")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold ints, got dtype {arr.dtype} (e.g. {arr.reshape(-1)[0]!r})")
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero(arr <= 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{name}[{i}] = {int(arr[i])}: every sequence needs length >= 1 "
            f"({bad.size} non-positive lengths in total); drop empty sequences before packing"
        )
    return arr


def check_fit(lengths: np.ndarray, capacity: int, name: str = "capacity") -> None:
    """Raise naming the first sequence longer than `capacity` (its index and length)."""
    over = np.flatnonzero(lengths > capacity)
    if over.size:
        i = int(over[0])
        raise ValueError(
            f"sequence {i} has length {int(lengths[i])} > {name}={capacity} "
            f"({over.size} sequences too long in total); raise {name} or truncate the sequence"
        )
