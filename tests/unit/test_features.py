"""The sidecar feature contract: a deterministic seeded projection, its digest and lift."""

from __future__ import annotations

import numpy as np
import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.features import (
    FeatureProjection,
    check_contract,
    projection_digest,
    projection_matrix,
)

# Pinned: a different value means the feature contract changed (NumPy's PCG64 raw stream,
# Box-Muller, the scaling or the digest layout). Features made before are then
# incompatible; bump PROJECTION_FORMAT instead of editing this value.
GOLDEN_DIGEST_0_64_64 = "ed95d93b8c529e0e681d80342d9c67ab1b47c8fbde5036ab5db549b2c330e9e5"


def test_projection_is_a_pinned_function_of_seed_and_shape() -> None:
    first = FeatureProjection.create(seed=0, hidden_size=64, feature_dim=64)
    again = FeatureProjection.create(seed=0, hidden_size=64, feature_dim=64)
    assert first.digest == again.digest == GOLDEN_DIGEST_0_64_64
    assert np.array_equal(first.matrix_HD, again.matrix_HD)
    assert first.matrix_HD.dtype == np.float32 and not first.matrix_HD.flags.writeable
    others = [projection_matrix(1, 64, 64), projection_matrix(0, 64, 32),
              projection_matrix(0, 32, 64)]
    digests = {projection_digest(m, s) for m, s in zip(others, (1, 0, 0), strict=True)}
    assert len(digests | {first.digest}) == 4


def test_projection_is_scaled_to_preserve_norms() -> None:
    projection = FeatureProjection.create(seed=3, hidden_size=256, feature_dim=128)
    matrix = projection.matrix_HD.astype(np.float64)
    assert abs(matrix.mean()) < 0.01
    assert matrix.std() * np.sqrt(128) == pytest.approx(1.0, rel=0.03)
    x = np.random.default_rng(0).standard_normal((500, 256)).astype(np.float32)
    ratio = (np.linalg.norm(projection.reduce(x, dtype="float32"), axis=-1)
             / np.linalg.norm(x, axis=-1))
    assert ratio.mean() == pytest.approx(1.0, rel=0.05)


def test_lift_inverts_the_projection() -> None:
    x = np.random.default_rng(1).standard_normal((20, 3, 64)).astype(np.float32)
    full = FeatureProjection.create(seed=0, hidden_size=64, feature_dim=96)
    lifted = full.lift(full.reduce(x, dtype="float32"))
    np.testing.assert_allclose(lifted, x, atol=1e-3)
    half = full.reduce(x)  # float16 storage still lifts closely
    assert half.dtype == np.float16
    assert np.abs(full.lift(half) - x).max() < 0.05
    narrow = FeatureProjection.create(seed=0, hidden_size=64, feature_dim=16)
    features = narrow.reduce(x, dtype="float32")
    np.testing.assert_allclose(narrow.reduce(narrow.lift(features), dtype="float32"), features,
                               atol=1e-4)


def test_contract_round_trip_and_tamper() -> None:
    projection = FeatureProjection.create(seed=5, hidden_size=64, feature_dim=32)
    contract = projection.contract("float16")
    assert contract["projection_digest"] == projection.digest
    assert contract["feature_dtype"] == "float16" and contract["source"]
    assert check_contract(contract).digest == projection.digest
    with pytest.raises(ConfigError, match="digest"):
        check_contract({**contract, "projection_digest": "0" * 64})
    with pytest.raises(ConfigError, match="feature_dim"):
        check_contract({k: v for k, v in contract.items() if k != "feature_dim"})


def test_invalid_arguments_raise() -> None:
    with pytest.raises(ConfigError, match="projection_seed"):
        projection_matrix(-1, 4, 4)
    with pytest.raises(ConfigError, match="hidden_size"):
        projection_matrix(0, 0, 4)
    with pytest.raises(ConfigError, match="feature_dim"):
        projection_matrix(0, 4, True)
    projection = FeatureProjection.create(seed=0, hidden_size=8, feature_dim=4)
    with pytest.raises(ConfigError, match="width"):
        projection.reduce(np.zeros((2, 9)))
    with pytest.raises(ConfigError, match="width"):
        projection.lift(np.zeros((2, 5)))
    with pytest.raises(ConfigError, match="dtype"):
        projection.reduce(np.zeros((2, 8)), dtype="int8")
