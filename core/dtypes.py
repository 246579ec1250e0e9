"""The compute dtypes a teacher can run in and their element sizes.

One table for every reader: the execution config's ``--dtype`` choices
(:mod:`core.execution`), the stream geometry's expert bytes (:mod:`core.geometry`), the
checkpoint memory check (:mod:`replay.checkpoint`) and the teacher loader's torch dtypes
(:mod:`replay.teacher`). A new compute dtype is added here, and only here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

COMPUTE_DTYPE_BYTES: Mapping[str, int] = MappingProxyType({
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float64": 8,  # the exact-parity path on CPUs whose float32 kernels flip near ties
})
"""Bytes per element of each compute dtype, by its torch name."""
COMPUTE_DTYPES: tuple[str, ...] = tuple(COMPUTE_DTYPE_BYTES)
