"""Sidecar models: configs, shapes, head offsets, parameter counts, and the learning path."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.baselines import BaselineConfig, FrequencyTable, frequency_scores
from hebrus_flywheel.train.exceptions import BatchError
from hebrus_flywheel.train.losses import LossConfig, SidecarLoss
from hebrus_flywheel.train.metrics import MetricsAccumulator, MetricsConfig, ranking, row_metrics
from hebrus_flywheel.train.models import (
    P1_OFFSETS,
    RouteSidecar,
    SidecarConfig,
    candidate_path_config,
    p1_config,
    parameter_counts,
    rank_candidates,
    select_valid,
)

torch.set_num_threads(1)
TINY: dict[str, Any] = {"feature_dim": 8, "rank": 6, "hidden": 12, "layer_count": 3,
                        "expert_count": 16}


@pytest.mark.parametrize(
    ("field", "value"),
    [("feature_dim", 0), ("rank", -1), ("expert_count", 1.5), ("dropout", 1.0),
     ("offsets", ()), ("offsets", ((0, -1),)), ("offsets", ((-1, 0),)),
     ("offsets", ((0, 0), (0, 0))), ("offsets", ((0, 3),))],
)
def test_config_rejects_bad_fields_naming_them(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"SidecarConfig.{field}"):
        SidecarConfig(**{**TINY, field: value})


def test_config_is_keyword_only_and_frozen() -> None:
    config = SidecarConfig(**TINY)
    with pytest.raises(TypeError):
        SidecarConfig(8)  # type: ignore[call-arg]
    with pytest.raises(AttributeError):
        config.rank = 3  # type: ignore[misc]


def test_variant_configs() -> None:
    assert p1_config(**TINY).offsets == P1_OFFSETS == ((0, 0), (0, 1))
    config = candidate_path_config(position_offsets=(1, 2), layer_offsets=(0, 1), **TINY)
    assert config.offsets == ((1, 0), (1, 1), (2, 0), (2, 1))
    # A later position may look back to an earlier layer (layer 2 of p -> layer 0 of p+1).
    assert SidecarConfig(**{**TINY, "offsets": ((1, -2),)}).offsets == ((1, -2),)


def test_forward_shapes_and_p1_target_layers() -> None:
    torch.manual_seed(0)
    model = RouteSidecar(p1_config(**TINY))
    feature_BD = torch.randn(5, 8)
    layer_B = torch.tensor([0, 1, 2, 2, 0])
    scores_BOE = model(feature_BD, layer_B)
    assert scores_BOE.shape == (5, 2, 16)
    target_BO, valid_BO = model.target_layers(layer_B)
    assert target_BO.tolist() == [[0, 1], [1, 2], [2, 2], [2, 2], [0, 1]]
    assert valid_BO.tolist() == [[True, True], [True, True], [True, False], [True, False],
                                 [True, True]]
    scores_NE, target_N = select_valid(valid_BO, scores_BOE, target_BO)
    assert scores_NE.shape == (8, 16) and target_N.tolist() == [0, 1, 1, 2, 2, 2, 0, 1]


def test_candidate_path_head_target_positions_and_layers() -> None:
    model = RouteSidecar(SidecarConfig(**{**TINY, "offsets": ((1, 0), (2, -2), (0, 1))}))
    target_BO, valid_BO = model.target_layers(torch.tensor([2, 0]))
    assert target_BO.tolist() == [[2, 0, 2], [0, 0, 1]]  # (0 - 2) is clamped, marked invalid
    assert valid_BO.tolist() == [[True, True, False], [True, False, True]]
    assert model.target_positions(torch.tensor([0, 3])).tolist() == [[1, 2, 0], [4, 5, 3]]
    assert model(torch.randn(2, 8), torch.tensor([2, 0])).shape == (2, 3, 16)


def test_layer_conditioning_changes_scores_after_training_starts() -> None:
    torch.manual_seed(0)
    model = RouteSidecar(SidecarConfig(**TINY))
    assert model.expert_bias is not None
    with torch.no_grad():
        model.layer_film.weight.normal_()
        model.expert_bias.weight.normal_()
    feature_BD = torch.randn(1, 8).repeat(2, 1)
    scores_BOE = model(feature_BD, torch.tensor([0, 1]))
    assert not torch.allclose(scores_BOE[0], scores_BOE[1])


def test_forward_rejects_bad_inputs() -> None:
    model = RouteSidecar(SidecarConfig(**TINY))
    with pytest.raises(BatchError, match="feature_dim"):
        model(torch.randn(2, 7), torch.tensor([0, 1]))
    with pytest.raises(BatchError, match="int64"):
        model(torch.randn(2, 8), torch.tensor([0.0, 1.0]))
    with pytest.raises(BatchError, match="layer_count"):
        model(torch.randn(2, 8), torch.tensor([0, 3]))


def test_parameter_counts_match_the_architecture() -> None:
    D, R, H, L, E = 8, 6, 12, 3, 16
    offsets = 2
    counts = parameter_counts(RouteSidecar(p1_config(**TINY)))
    expected = {
        "trunk": 2 * D + D * R + R,
        "layer_film": L * 2 * R,
        "offset_film": offsets * 2 * R,
        "mlp": 2 * R + R * H + H + H * R + R,
        "head_norm": 2 * R,
        "expert_embedding": E * R,
        "expert_bias": L * E,
    }
    assert counts == {**expected, "total": sum(expected.values())}
    no_bias = parameter_counts(RouteSidecar(SidecarConfig(**TINY, layer_expert_bias=False)))
    assert "expert_bias" not in no_bias


def test_default_geometry_is_compact() -> None:
    counts = parameter_counts(RouteSidecar(SidecarConfig()))
    assert counts["total"] < 150_000  # 48 layers x 512 experts share one small model


def test_rank_candidates_breaks_ties_by_lower_expert_id() -> None:
    scores_BE = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0]])
    assert rank_candidates(scores_BE, 4).tolist() == [[1, 2, 4, 3]]
    with pytest.raises(BatchError):
        rank_candidates(scores_BE, 6)


def _teacher_dataset(rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Features and the top-3 of a random per-layer linear 'router' over them."""
    generator = torch.Generator().manual_seed(seed)
    feature_BD = torch.randn(rows, 8, generator=generator)
    layer_B = torch.randint(0, 3, (rows,), generator=generator)
    router_LDE = torch.randn(3, 8, 16, generator=generator)
    logits_BE = torch.einsum("bd,bde->be", feature_BD, router_LDE[layer_B])
    target_ids_BK = torch.sort(logits_BE, dim=1, descending=True, stable=True).indices[:, :3]
    return feature_BD, layer_B, target_ids_BK


def test_tiny_model_overfits_tiny_dataset_to_near_perfect_recall() -> None:
    """The learning path works end to end: model -> loss -> optimiser -> metrics."""
    torch.manual_seed(0)
    feature_BD, layer_B, target_ids_BK = _teacher_dataset(128, seed=1)
    model = RouteSidecar(SidecarConfig(feature_dim=8, rank=32, hidden=64, layer_count=3,
                                       expert_count=16))
    loss_fn = SidecarLoss(LossConfig())
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(200):
        terms = loss_fn(model(feature_BD, layer_B)[:, 0], target_ids_BK, layer_B=layer_B)
        optimiser.zero_grad()
        terms["total"].backward()
        optimiser.step()
    with torch.no_grad():
        scores_BE = model(feature_BD, layer_B)[:, 0]
    # Training rows are scored with the pure per-row core: the accumulator refuses them.
    per_row = row_metrics(ranking(scores_BE.numpy()), target_ids_BK.numpy(), budgets=(3,))
    recall, exact = per_row["recall@3"].mean(), per_row["exact_match"].mean()
    assert recall >= 0.97 and exact >= 0.9, (recall, exact)


def _p1_tokens(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token and layer: a feature (a layer-specific mix of a token latent) and the
    top-3 route of a fixed per-layer linear router over the latent. Rows are
    (token, layer); targets are the routes of layers l and l+1 (P1 offsets)."""
    weights = torch.Generator().manual_seed(99)
    mix_LDD = torch.randn(3, 8, 8, generator=weights)
    router_LDE = torch.randn(3, 8, 16, generator=weights)
    latent_TD = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(seed))
    feature_TLD = torch.einsum("td,lde->tle", latent_TD, mix_LDD)
    logits_TLE = torch.einsum("td,lde->tle", latent_TD, router_LDE)
    route_TLK = torch.sort(logits_TLE, dim=2, descending=True, stable=True).indices[..., :3]
    next_TLK = torch.cat([route_TLK[:, 1:], route_TLK[:, :1]], dim=1)  # last layer: invalid
    targets_TL2K = torch.stack([route_TLK, next_TLK], dim=2)
    layer_TL = torch.arange(3).expand(tokens, 3)
    return feature_TLD.reshape(-1, 8), layer_TL.reshape(-1), targets_TL2K.reshape(-1, 2, 3)


def test_p1_sidecar_beats_frequency_control_on_held_out_rows() -> None:
    """Gate 3 in miniature: train on train rows, evaluate held-out rows, compare."""
    torch.manual_seed(0)
    feature_BD, layer_B, targets_BOK = _p1_tokens(200, seed=1)
    model = RouteSidecar(p1_config(feature_dim=8, rank=32, hidden=64, layer_count=3,
                                   expert_count=16))
    loss_fn = SidecarLoss(LossConfig())
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-3)
    target_BO, valid_BO = model.target_layers(layer_B)
    for _ in range(200):
        scores_NE, targets_NK, layer_N = select_valid(valid_BO, model(feature_BD, layer_B),
                                                      targets_BOK, target_BO)
        loss = loss_fn(scores_NE, targets_NK, layer_B=layer_N)["total"]
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    table = FrequencyTable(BaselineConfig(layer_count=3, expert_count=16))
    table.fit(layer_B=target_BO[valid_BO], target_ids_BK=targets_BOK[valid_BO], split_B="train")

    feature_BD, layer_B, targets_BOK = _p1_tokens(100, seed=2)  # held-out tokens
    target_BO, valid_BO = model.target_layers(layer_B)
    with torch.no_grad():
        scores_NE, targets_NK, layer_N = select_valid(valid_BO, model(feature_BD, layer_B),
                                                      targets_BOK, target_BO)
    config = MetricsConfig(expert_count=16, top_k=3, budgets=(3, 6))
    recall = {}
    for method, scores in (("sidecar", scores_NE), ("frequency", frequency_scores(table, layer_N))):
        accumulator = MetricsAccumulator(config, method=method)
        accumulator.update(target_ids_BK=targets_NK, layer_B=layer_N, split_B="validation",
                           scores_BE=scores)
        recall[method] = accumulator.result()["splits"]["validation"]["overall"]["recall"]["3"]
    assert recall["sidecar"] > recall["frequency"] + 0.2, recall
