"""The exact routing rule: ranked top-k expert ids and their weights from router logits.

Pure functions over tensors; no model, no state. These define the labels the flywheel
records, so they are part of the runtime identity (``tie_break_rule``, ``weight_rule``).

Rank order: experts are ranked by router score descending; equal scores are ordered by
the LOWER expert id first (:data:`TIE_BREAK_SCORE_DESC_ID_ASC`). ``torch.topk`` makes no
promise about ties, so the ranking uses a stable descending sort over the logits, which
keeps equal scores in their original (ascending id) order. Ranking the logits is the same
as ranking the softmax probabilities except where two distinct logits round to the same
probability; the logits are the finer, authoritative score.

Weight rules (what the model multiplies the selected experts' outputs by):

- ``softmax_topk_renormalized``: softmax over ALL experts in float32, keep the top-k
  probabilities, divide by their sum. Qwen3-Next, Qwen3-MoE and OLMoE with
  ``norm_topk_prob=True``; always Mixtral (its softmax-then-renormalise equals a softmax
  over the k selected logits).
- ``softmax_topk``: softmax over all experts in float32, keep the top-k probabilities
  as they are (Qwen3-MoE / OLMoE with ``norm_topk_prob=False``).
- ``sparsemixer_eps<E>_topk`` (PhiMoE, inference): rank by logit; the weight of the
  rank-r expert (logit m) is its softmax probability among the experts not ranked
  before it whose logit s is within the relative gap ``(m - s) / max(|s|, m) <= 2E``
  (``E`` is the router's ``router_jitter_noise``), all others masked to -inf.

A rule named with the suffix ``_pes`` (Gemma 4) multiplies each selected weight by its
expert's learned scale, a vector the checkpoint holds (passed like a correction bias).
A rule named with ``_sink<S>`` (Inkling) reads S shared experts' logits after the routed
ones: never ranked, but normalised together with the selected weights.
A rule named with the suffix ``_skiplast`` (ZAYA) has a skip class: the router's last
class runs no expert and weighs 0; it is ranked and recorded like any other.

Tensor legend: T tokens, E experts (router classes), K top-k.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from hebrus_flywheel.core.geometry import (
    SKIP_LAST_SUFFIX,
    WEIGHT_RULES,
    WEIGHT_SOFTMAX_TOPK,
    WEIGHT_SOFTMAX_TOPK_RENORMALIZED,
)
from hebrus_flywheel.core.identity import TIE_BREAK_SCORE_DESC_ID_ASC
from hebrus_flywheel.replay.exceptions import RoutingError

TIE_BREAK_RULE = TIE_BREAK_SCORE_DESC_ID_ASC

__all__ = [
    "MASKED_SCORE",
    "TIE_BREAK_RULE",
    "WEIGHT_RULES",
    "WEIGHT_SOFTMAX_TOPK",
    "WEIGHT_SOFTMAX_TOPK_RENORMALIZED",
    "RouterRule",
    "all_finite",
    "margin_beside",
    "parse_rule",
    "rank_experts",
    "router_logit_width",
    "router_margin",
    "selection_scores",
    "sink_softmax",
    "topk_weights",
    "topk_with_tie_break",
]


SIGMOID_NORM_EPS = 1e-20
"""What DeepSeek-style sigmoid routers add to the sum of the top-k weights they divide by."""
MASKED_SCORE = float(torch.finfo(torch.float32).min)
"""Selection score of an expert whose group was not selected (finite, below any score)."""
SCORINGS: tuple[str, ...] = ("softmax", "sigmoid", "sparsemixer", "sqrtsoftplus")
GROUP_SCORES: tuple[str, ...] = ("top2sum", "max")
_GATED = ("sigmoid", "sqrtsoftplus")  # elementwise scores, renormalised with norm_eps
_RULE_RE = re.compile(
    r"^(?P<scoring>softmax|sigmoid|sqrtsoftplus)(?P<bias>\+bias)?"
    r"(?:_group(?P<topk_groups>\d+)of(?P<groups>\d+)_(?P<group_score>top2sum|max)"
    r"(?P<fill0>_fill0)?)?"
    r"_topk(?P<normalize>_renormalized)?(?:_sink(?P<sinks>\d+))?"
    r"(?:_eps(?P<norm_eps>[0-9.e+-]+))?"
    r"(?:_x(?P<scale>[0-9.e+-]+))?(?P<expert_scale>_pes)?(?P<skip_last>_skiplast)?$"
)
_SPARSEMIXER_RE = re.compile(r"^sparsemixer_eps(?P<eps>[0-9.e+-]+)_topk$")


@dataclass(frozen=True, kw_only=True)
class RouterRule:
    """How a family's router turns logits into a ranked selection and weights.

    Fields:
        scoring: ``softmax``, ``sigmoid`` or ``sqrtsoftplus`` (DeepSeek-V4:
            ``sqrt(softplus(logit))``, scored like sigmoid) (how weights derive from logits).
        normalize: divide the selected weights by their sum.
        scale: multiply the (normalised) weights by this (``routed_scaling_factor``).
        bias: selection adds a per-expert correction bias to the sigmoid score, or to
            the float32 softmax probability (ERNIE-4.5-MoE).
        groups: expert groups G (1: no grouping).
        topk_groups: groups kept per token g (experts of the others are masked).
        group_score: how a group is scored: sum of its two best scores, or its best.
        group_fill_zero: experts of the dropped groups score 0.0 instead of
            :data:`MASKED_SCORE` (A.X-K2's gate), so one can outrank a kept expert whose
            biased score is negative; named ``_fill0``.
        jitter_eps: the sparsemixer's relative gap ``eps`` (``sparsemixer`` scoring only).
        norm_eps: what a sigmoid renormalisation adds to the sum it divides by (1e-20 in
            DeepSeek-V3, 1e-6 in LFM2-MoE); named in the rule only when not 1e-20.
        shared_sinks: the router's logits end with this many shared experts' logits
            (Inkling): never selected, but the selected weights are normalised together
            with them, ``exp(logsigmoid(l) - logsumexp(logsigmoid(top-k and shared)))``
            (sigmoid scoring, renormalised only); named ``_sink<S>``.
        expert_scale: each selected weight is then multiplied by its expert's learned
            scale, a per-expert vector of the checkpoint (Gemma 4's ``per_expert_scale``,
            read from the loaded model like a correction bias); named ``_pes``.
        skip_last: the router's last class is a skip class that runs no expert (ZAYA):
            it is ranked and selected like the others, and its weight is 0 (named
            ``_skiplast``; :attr:`core.geometry.RouteGeometry.skip_expert`).
    """

    scoring: str = "softmax"
    normalize: bool = True
    scale: float = 1.0
    bias: bool = False
    groups: int = 1
    topk_groups: int = 1
    group_score: str = "top2sum"
    group_fill_zero: bool = False
    jitter_eps: float = 0.0
    norm_eps: float = SIGMOID_NORM_EPS
    shared_sinks: int = 0
    expert_scale: bool = False
    skip_last: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise RoutingError(
                f"RouterRule.scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if self.group_score not in GROUP_SCORES:
            raise RoutingError(f"RouterRule.group_score must be one of {GROUP_SCORES}, "
                               f"got {self.group_score!r}")
        if not (self.scale > 0 and self.scale < float("inf")):
            raise RoutingError(
                f"RouterRule.scale must be a positive finite number, got {self.scale!r}")
        if not 1 <= self.topk_groups <= self.groups:
            raise RoutingError(f"RouterRule.topk_groups must be in [1, groups={self.groups}], "
                               f"got {self.topk_groups}")
        if self.bias and self.scoring == "sparsemixer":
            raise RoutingError("RouterRule.bias is not defined for sparsemixer scoring")
        if self.scoring == "sparsemixer" and (
                self.normalize or self.scale != 1.0 or self.groups != 1
                or not 0.0 <= self.jitter_eps < float("inf")):
            raise RoutingError("a sparsemixer RouterRule has only jitter_eps >= 0 (no "
                               "renormalisation, scale or groups)")
        if self.norm_eps != SIGMOID_NORM_EPS and not (
                self.scoring in _GATED and self.normalize and 0.0 <= self.norm_eps < 1.0):
            raise RoutingError("RouterRule.norm_eps is only defined for renormalised sigmoid "
                               "rules, in [0, 1)")
        if self.group_fill_zero and not (self.groups > 1 and self.scoring in _GATED):
            raise RoutingError("RouterRule.group_fill_zero is only defined for grouped "
                               "sigmoid-type rules")
        if self.scoring != "sparsemixer" and self.jitter_eps != 0.0:
            raise RoutingError("RouterRule.jitter_eps is only defined for sparsemixer scoring")
        if self.shared_sinks < 0 or (self.shared_sinks and not (
                self.scoring == "sigmoid" and self.normalize
                and self.norm_eps == SIGMOID_NORM_EPS)):
            raise RoutingError("RouterRule.shared_sinks is only defined (>= 0) for "
                               "renormalised sigmoid rules without norm_eps")
        if self.skip_last and (self.normalize or self.scoring == "sparsemixer"):
            # a renormalised skip weight would change the others' weights; no router does it
            raise RoutingError("RouterRule.skip_last is only defined for rules with raw "
                               "(not renormalised) weights")

    @property
    def name(self) -> str:
        """The ``weight_rule`` string of this rule (the two softmax rules keep their names)."""
        if self.scoring == "sparsemixer":
            return f"sparsemixer_eps{self.jitter_eps!r}_topk"
        out = self.scoring + ("+bias" if self.bias else "")
        if self.groups > 1:
            out += f"_group{self.topk_groups}of{self.groups}_{self.group_score}"
            out += "_fill0" if self.group_fill_zero else ""
        out += "_topk" + ("_renormalized" if self.normalize else "")
        out += f"_sink{self.shared_sinks}" if self.shared_sinks else ""
        out += f"_eps{self.norm_eps!r}" if self.norm_eps != SIGMOID_NORM_EPS else ""
        out += f"_x{self.scale!r}" if self.scale != 1.0 else ""
        out += "_pes" if self.expert_scale else ""
        return out + (SKIP_LAST_SUFFIX if self.skip_last else "")


def parse_rule(weight_rule: str) -> RouterRule:
    """The :class:`RouterRule` a ``weight_rule`` string names; RoutingError if none."""
    mixer = _SPARSEMIXER_RE.match(weight_rule) if isinstance(weight_rule, str) else None
    if mixer is not None:
        try:
            return RouterRule(scoring="sparsemixer", normalize=False,
                              jitter_eps=float(mixer["eps"]))
        except ValueError as exc:
            raise RoutingError(f"weight_rule {weight_rule!r} has a malformed number") from exc
    match = _RULE_RE.match(weight_rule) if isinstance(weight_rule, str) else None
    if match is None:
        raise RoutingError(
            f"unknown weight_rule {weight_rule!r}; expected one of {WEIGHT_RULES} or a rule "
            "named like 'sigmoid+bias_group4of8_top2sum_topk_renormalized_x2.5'"
        )
    parts = match.groupdict()
    try:
        return RouterRule(
            scoring=parts["scoring"], bias=bool(parts["bias"]),
            normalize=bool(parts["normalize"]), scale=float(parts["scale"] or 1.0),
            groups=int(parts["groups"] or 1), topk_groups=int(parts["topk_groups"] or 1),
            group_score=parts["group_score"] or "top2sum", group_fill_zero=bool(parts["fill0"]),
            norm_eps=float(parts["norm_eps"] or SIGMOID_NORM_EPS),
            shared_sinks=int(parts["sinks"] or 0), expert_scale=bool(parts["expert_scale"]),
            skip_last=bool(parts["skip_last"]),
        )
    except ValueError as exc:
        raise RoutingError(f"weight_rule {weight_rule!r} has a malformed number") from exc


def _gate_scores(logits_XE: torch.Tensor, scoring: str) -> torch.Tensor:
    """Per-expert scores of an elementwise router: ``sigmoid`` or DeepSeek-V4's
    ``sqrtsoftplus`` (``sqrt(softplus(logit))``, transformers' own op order)."""
    if scoring == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits_XE).sqrt()
    return logits_XE.sigmoid()


def _group_mask(scores_XE: torch.Tensor, rule: RouterRule) -> torch.Tensor:
    """True for experts inside the ``topk_groups`` best groups (ties: lower group id)."""
    experts = scores_XE.shape[-1]
    if experts % rule.groups:
        raise RoutingError(f"{experts} experts do not split into {rule.groups} groups")
    grouped = scores_XE.reshape(*scores_XE.shape[:-1], rule.groups, experts // rule.groups)
    if rule.group_score == "top2sum":
        group_XG = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    else:
        group_XG = grouped.amax(dim=-1)
    order = torch.sort(group_XG, dim=-1, descending=True, stable=True).indices
    keep_XG = torch.zeros_like(group_XG, dtype=torch.bool)
    keep_XG.scatter_(-1, order[..., : rule.topk_groups], True)
    return keep_XG.repeat_interleave(experts // rule.groups, dim=-1)


def selection_scores(
    router_logits_XE: torch.Tensor, weight_rule: str, bias_XE: torch.Tensor | None = None
) -> torch.Tensor:
    """The scores experts are ranked by under ``weight_rule`` (any leading shape).

    Softmax routers, and sigmoid routers without bias or groups (Llama 4, which ranks
    its raw logits), rank by the logits themselves (a softmax router's groups scored by
    their two best probabilities are chosen on the probabilities) (returned unchanged: sigmoid is
    monotonic, and unlike it the logits do not saturate). Other sigmoid routers rank by
    ``sigmoid(logit) + bias`` in float32 (``sqrtsoftplus`` likewise), bias-corrected
    softmax routers by
    ``softmax(logits) + bias`` in float32; with groups, experts outside the selected
    groups get :data:`MASKED_SCORE` (0.0 under ``_fill0``). ``bias_XE`` broadcasts against
    the logits.
    """
    rule = parse_rule(weight_rule)
    if rule.shared_sinks:  # the shared experts' logits are never ranked
        router_logits_XE = router_logits_XE[..., :-rule.shared_sinks]
    if rule.groups == 1 and not rule.bias:
        return router_logits_XE
    group_scores = None
    if rule.scoring == "softmax" and not rule.bias:
        scores = router_logits_XE
        if rule.group_score == "top2sum":  # a sum of probabilities, not of logits (Mistral 4
            group_scores = scores.softmax(-1)  # sums its softmax, in the logits' dtype)
    else:
        logits_XE = router_logits_XE.to(torch.float32)
        scores = logits_XE.softmax(-1) if rule.scoring == "softmax" else _gate_scores(
            logits_XE, rule.scoring)
        if rule.bias:
            if bias_XE is None:
                raise RoutingError(f"weight_rule {weight_rule!r} needs the routers' correction "
                                   "bias; load the teacher that recorded it")
            scores = scores + bias_XE.to(torch.float32)
    if rule.groups > 1:
        fill = 0.0 if rule.group_fill_zero else MASKED_SCORE
        keep = _group_mask(scores if group_scores is None else group_scores, rule)
        scores = scores.masked_fill(~keep, fill)
    return scores


def _check_logits(router_logits_TE: torch.Tensor, k: int) -> None:
    if router_logits_TE.dim() < 1:
        raise RoutingError("router logits must have an expert dimension; got a 0-d tensor")
    if not router_logits_TE.is_floating_point():
        raise RoutingError(
            f"router logits must be floating point, got {router_logits_TE.dtype}; pass the "
            "gate's raw output"
        )
    expert_count = router_logits_TE.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= expert_count:
        raise RoutingError(f"k must be an int in [1, {expert_count}] (the expert count), got {k!r}")
    if not all_finite(router_logits_TE):
        raise RoutingError(
            "router logits contain NaN or infinity; the teacher's forward is broken (check "
            "dtype overflow) and no route can be recorded"
        )


def all_finite(values: torch.Tensor) -> bool:
    """No NaN or infinity in ``values``: min and max propagate NaN, so one fused pass
    without the boolean copy that ``isfinite(...).all()`` makes (30x faster on CPU)."""
    if values.numel() == 0:
        return True
    low, high = torch.aminmax(values)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def rank_experts(router_logits_TE: torch.Tensor) -> torch.Tensor:
    """Every expert id in rank order (score desc, ties by lower id): int64 ``[..., E]``."""
    _check_logits(router_logits_TE, 1)
    return torch.sort(router_logits_TE, dim=-1, descending=True, stable=True).indices


def topk_weights(
    router_logits_TE: torch.Tensor, expert_ids_TK: torch.Tensor, weight_rule: str,
    expert_scale_TE: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 weights of the given ranked experts under ``weight_rule``: ``[..., K]``;
    ``expert_scale_TE`` (``_pes`` rules) broadcasts against the logits."""
    rule = parse_rule(weight_rule)
    logits_TE = router_logits_TE.to(torch.float32)
    if rule.scoring == "sparsemixer":
        return _sparsemixer_weights(logits_TE, expert_ids_TK, rule.jitter_eps)
    if rule.scoring == "softmax":
        weights_TK = torch.gather(torch.softmax(logits_TE, dim=-1), -1, expert_ids_TK)
        if rule.normalize:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    elif rule.shared_sinks:
        weights_TK = sink_softmax(logits_TE, expert_ids_TK, rule.shared_sinks)[
            ..., : expert_ids_TK.shape[-1]]
    else:
        weights_TK = torch.gather(_gate_scores(logits_TE, rule.scoring), -1, expert_ids_TK)
        if rule.normalize:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + rule.norm_eps)
    if rule.scale != 1.0:
        weights_TK = weights_TK * rule.scale
    if rule.expert_scale:
        if expert_scale_TE is None:
            raise RoutingError(f"weight_rule {weight_rule!r} needs the routers' per-expert "
                               "scales; load the teacher that recorded it")
        scale_TE = expert_scale_TE.to(torch.float32).expand(
            *logits_TE.shape[:-1], expert_scale_TE.shape[-1])  # experts only, never sinks
        weights_TK = weights_TK * torch.gather(scale_TE, -1, expert_ids_TK)
    if rule.skip_last:  # the skip class runs nothing: the model zeroes its weight
        weights_TK = weights_TK.masked_fill(expert_ids_TK == logits_TE.shape[-1] - 1, 0.0)
    return weights_TK


def sink_softmax(logits_TE: torch.Tensor, expert_ids_TK: torch.Tensor, sinks: int
                 ) -> torch.Tensor:
    """Inkling's normalisation: the selected and the ``sinks`` shared experts'
    log-sigmoids softmaxed together (its own op order), ``[..., K + sinks]``: the selected
    experts' weights, then the shared experts' (its gammas)."""
    chosen_TK = torch.gather(logits_TE, -1, expert_ids_TK)
    log_TX = torch.nn.functional.logsigmoid(torch.cat([chosen_TK, logits_TE[..., -sinks:]], -1))
    return torch.exp(log_TX - torch.logsumexp(log_TX, dim=-1, keepdim=True))


def router_logit_width(expert_count: int, weight_rule: str) -> int:
    """Columns of the router logits a route is read from: the experts, and the shared
    experts' sink logits after them where the rule has them (:attr:`RouterRule.shared_sinks`)."""
    return expert_count + parse_rule(weight_rule).shared_sinks


def _sparsemixer_weights(
    logits_TE: torch.Tensor, expert_ids_TK: torch.Tensor, eps: float
) -> torch.Tensor:
    """PhiMoE's inference multipliers, rank by rank, with its own arithmetic: experts
    ranked before r and those beyond the relative gap of r's logit are masked to -inf,
    and r's weight is its softmax probability over the rest."""
    columns = []
    for rank in range(expert_ids_TK.shape[-1]):
        chosen_T1 = expert_ids_TK[..., rank:rank + 1]
        top_T1 = torch.gather(logits_TE, -1, chosen_T1)
        factor_TE = logits_TE.abs().clamp(min=top_T1)
        drop_TE = ((top_T1 - logits_TE) / factor_TE) > (2 * eps)
        masked_TE = logits_TE.masked_fill(drop_TE, float("-inf"))
        masked_TE = masked_TE.scatter(-1, expert_ids_TK[..., :rank], float("-inf"))
        columns.append(torch.gather(torch.softmax(masked_TE, dim=-1), -1, chosen_T1))
    return torch.cat(columns, dim=-1)


def topk_with_tie_break(
    router_logits_TE: torch.Tensor,
    k: int,
    *,
    weight_rule: str = WEIGHT_SOFTMAX_TOPK_RENORMALIZED,
    bias_TE: torch.Tensor | None = None,
    expert_scale_TE: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``k`` experts in rank order and their weights.

    Returns ``(expert_ids_TK int64, weights_TK float32)``; rank 0 is the highest selection
    score (:func:`selection_scores`) and equal scores are ordered by the lower expert id.
    Any leading shape is allowed; ``bias_TE`` (bias-corrected rules) and
    ``expert_scale_TE`` (``_pes`` rules) broadcast.
    """
    _check_logits(router_logits_TE, k)
    scores_TE = selection_scores(router_logits_TE, weight_rule, bias_TE)
    expert_ids_TK = _ranked_topk(scores_TE, k)
    return expert_ids_TK, topk_weights(router_logits_TE, expert_ids_TK, weight_rule,
                                       expert_scale_TE)


def _ranked_topk(router_logits_TE: torch.Tensor, k: int) -> torch.Tensor:
    """``torch.topk`` where the top k+1 scores of a row are distinct, else a stable sort.

    With distinct top k+1 scores the selected set and its order are unique, so topk's
    answer IS the rule's; only rows with an equal adjacent pair among them are re-ranked.
    """
    expert_count = router_logits_TE.shape[-1]
    if k == expert_count:
        return rank_experts(router_logits_TE)
    flat_TE = router_logits_TE.reshape(-1, expert_count)
    values_TK, ids_TK = torch.topk(flat_TE, k + 1, dim=-1)
    tied_T = (values_TK[:, 1:] == values_TK[:, :-1]).any(-1)
    ids_TK = ids_TK[:, :k].clone()
    if bool(tied_T.any()):
        ids_TK[tied_T] = rank_experts(flat_TE[tied_T])[:, :k]
    return ids_TK.reshape(*router_logits_TE.shape[:-1], k)


def router_margin(router_logits_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Score gap between rank ``k-1`` (last selected) and rank ``k`` (first rejected).

    A small margin marks a near-tie at the top-k boundary, where rounding differences
    between two runtimes can flip the selected set. Float32 ``[...]``; ``+inf`` when
    ``k`` equals the expert count (nothing is rejected).
    """
    _check_logits(router_logits_TE, k)
    if k == router_logits_TE.shape[-1]:
        return torch.full(router_logits_TE.shape[:-1], float("inf"), dtype=torch.float32,
                          device=router_logits_TE.device)
    top_TK = torch.topk(router_logits_TE.to(torch.float32), k + 1, dim=-1).values
    return top_TK[..., k - 1] - top_TK[..., k]


def margin_beside(router_logits_TE: torch.Tensor, expert_ids_TK: torch.Tensor) -> torch.Tensor:
    """:func:`router_margin` given the ranked top-k ids already: the last selected score
    minus the best unselected one, without a second top-k (the same float32 values)."""
    k = expert_ids_TK.shape[-1]
    _check_logits(router_logits_TE, k)
    if k == router_logits_TE.shape[-1]:
        return torch.full(router_logits_TE.shape[:-1], float("inf"), dtype=torch.float32,
                          device=router_logits_TE.device)
    logits_TE = router_logits_TE.to(torch.float32)
    last_T = torch.gather(logits_TE, -1, expert_ids_TK[..., k - 1:]).squeeze(-1)
    rest_T = logits_TE.scatter(-1, expert_ids_TK, float("-inf")).amax(dim=-1)
    return last_T - rest_T
