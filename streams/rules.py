"""What the record checks need from one published identity.

The routing shape is the base :class:`~hebrus_flywheel.core.geometry.RouteGeometry`
(derived from the identity record); :class:`IdentityRules` adds the identity digest
records must carry and the checking policy the geometry implies.
"""

from __future__ import annotations

from dataclasses import dataclass

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.geometry import RouteGeometry

INT32_MAX = 2**31 - 1
MONOTONE_WEIGHT_RULES = frozenset({"softmax_topk_renormalized", "softmax_topk", "softmax"})
"""Weight rules under which weights never increase along rank."""


@dataclass(frozen=True, kw_only=True)
class IdentityRules:
    """The checks' view of one runtime identity.

    Attributes:
        identity_id: the identity digest records must carry.
        geometry: the identity's routing geometry (L slots, E experts, top-K).
        vocab_size: token ids lie in ``[0, vocab_size)``; ``None`` checks int32 only.
    """

    identity_id: str
    geometry: RouteGeometry
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ConfigError(f"IdentityRules.vocab_size must be ≥ 1, got {self.vocab_size}")

    @property
    def routed_layer_count(self) -> int:
        return self.geometry.routed_layer_count

    @property
    def expert_count(self) -> int:
        return self.geometry.expert_count

    @property
    def top_k(self) -> int:
        return self.geometry.top_k

    @property
    def monotone_weights(self) -> bool:
        """Weights never increase along rank (checked when true)."""
        return self.geometry.weight_rule in MONOTONE_WEIGHT_RULES

    @property
    def token_id_limit(self) -> int:
        return self.vocab_size if self.vocab_size is not None else INT32_MAX + 1
