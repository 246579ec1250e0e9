"""One table of compute dtypes (core.dtypes) and every reader agrees with it and torch."""

from __future__ import annotations

import pytest
import torch

from hebrus_flywheel.core.dtypes import COMPUTE_DTYPE_BYTES, COMPUTE_DTYPES
from hebrus_flywheel.core.execution import Execution
from hebrus_flywheel.core.geometry import weight_dtype_bytes
from hebrus_flywheel.replay.checkpoint import STORED_DTYPES
from hebrus_flywheel.replay.teacher import DTYPES


@pytest.mark.parametrize("name", COMPUTE_DTYPES)
def test_every_compute_dtype_has_torch_s_element_size_everywhere(name: str) -> None:
    torch_dtype = DTYPES[name]
    assert str(torch_dtype) == f"torch.{name}"
    assert torch.empty(0, dtype=torch_dtype).element_size() == COMPUTE_DTYPE_BYTES[name]
    assert weight_dtype_bytes(name) == COMPUTE_DTYPE_BYTES[name]
    assert Execution(device="cpu", dtype=name).dtype == name


def test_the_teacher_loader_knows_exactly_the_compute_dtypes_and_stores_a_subset() -> None:
    assert tuple(DTYPES) == COMPUTE_DTYPES
    assert set(STORED_DTYPES) < set(COMPUTE_DTYPES)
