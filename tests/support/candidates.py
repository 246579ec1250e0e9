"""A tiny deterministic candidate-path table (test fixture, never library code).

One row per (proposal, path, candidate position) in the column contract of the
``candidate_path`` product. Routes have learnable structure: each layer's native top-k
is the top-k of ``features[l] @ M_l`` plus a per-position bias, so a model reading the
features beats the frequency control; acceptance drops with the candidate position and
the drafter log-probability is higher on accepted positions. ``path_correlation``
shares part of the features along a path, so its positions' routes overlap (a smaller
route union U_B); ``feature_signal=0`` makes routes independent of the features.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa


def _nested(inner: pa.DataType, *dims: int) -> pa.DataType:
    out = inner
    for dim in reversed(dims):
        out = pa.list_(pa.field("element", out, nullable=False), dim)
    return out


def _column(values: np.ndarray, inner: pa.DataType) -> pa.Array:
    array: pa.Array = pa.array(values.reshape(-1), type=inner)
    for dim in reversed(values.shape[1:]):
        array = pa.FixedSizeListArray.from_arrays(array, dim)
    return array


def acceptance_lengths(proposals: int, width: int, block: int, survive: tuple[float, ...],
                       rng: np.random.Generator) -> np.ndarray:
    """Accepted-prefix length per (proposal, path): position p survives with
    ``survive[p - 1]`` given that p - 1 survived."""
    draws = rng.random((proposals, width, block)) < np.asarray(survive)[None, None, :block]
    return np.cumprod(draws, axis=2).sum(axis=2).astype(np.int32)


def candidate_table(*, proposals: int = 60, width: int = 2, block: int = 4, layers: int = 2,
                    experts: int = 16, top_k: int = 2, feature_dim: int = 8, seed: int = 0,
                    survive: tuple[float, ...] = (0.9, 0.75, 0.6, 0.45, 0.3, 0.2, 0.1, 0.1),
                    validation_share: float = 0.3, noise: float = 0.3,
                    path_correlation: float = 0.0, feature_signal: float = 1.0) -> pa.Table:
    """The table; proposals are split by a hash of their id (train / validation)."""
    rng = np.random.default_rng(seed)
    mix_LDE = rng.normal(size=(layers, feature_dim, experts)) * feature_signal
    bias_PLE = rng.normal(size=(block, layers, experts)) * 0.5
    n = proposals * width * block
    prop_n = np.repeat(np.arange(proposals), width * block)
    path_n = np.tile(np.repeat(np.arange(width), block), proposals)
    pos_n = np.tile(np.arange(1, block + 1), proposals * width)
    shared_nLD = rng.normal(size=(proposals * width, layers, feature_dim))[prop_n * width + path_n]
    feat_nLD = (np.sqrt(path_correlation) * shared_nLD + np.sqrt(1 - path_correlation)
                * rng.normal(size=(n, layers, feature_dim))).astype(np.float32)
    logits_nLE = np.einsum("nld,lde->nle", feat_nLD, mix_LDE) + bias_PLE[pos_n - 1]
    logits_nLE += rng.normal(size=logits_nLE.shape) * noise
    ids_nLK = np.argsort(-logits_nLE, axis=2, kind="stable")[:, :, :top_k]
    weights_nLK = np.sort(rng.random((n, layers, top_k)), axis=2)[:, :, ::-1]
    accepted_len = acceptance_lengths(proposals, width, block, survive, rng)[prop_n, path_n]
    accepted = pos_n <= accepted_len
    logprob = np.where(accepted, -0.3, -1.5) + rng.normal(size=n) * 0.3
    ids = [f"proposal-{p:04d}" for p in range(proposals)]
    split = ["validation" if int(hashlib.sha256(i.encode()).hexdigest(), 16) % 1000
             < validation_share * 1000 else "train" for i in ids]
    columns = {
        "window_id": pa.array([f"w-{p:04d}" for p in prop_n]),
        "split": pa.array([split[p] for p in prop_n]),
        "owner": pa.array(["owner-a" if p % 2 else "owner-b" for p in prop_n]),
        "thread": pa.array([f"thread-{p % 7}" for p in prop_n]),
        "generation": pa.array(np.zeros(n, np.int64)),
        "identity_id": pa.array(["identity-0"] * n),
        "domain_tags": pa.array([["code" if p % 3 else "chat"] for p in prop_n],
                                type=pa.list_(pa.string())),
        "proposal_id": pa.array([ids[p] for p in prop_n]),
        "anchor_ordinal": pa.array((prop_n * 5).astype(np.int64)),
        "drafter_id": pa.array(["ngram"] * n),
        "path_id": pa.array(path_n.astype(np.int32)),
        "candidate_position": pa.array(pos_n.astype(np.int32)),
        "candidate_token_id": pa.array(rng.integers(0, 50, n).astype(np.int32)),
        "drafter_logprob": pa.array(logprob.astype(np.float32)),
        "expert_ids": _column(ids_nLK.astype(np.uint16), pa.uint16()),
        "weights_f16": _column(weights_nLK.astype(np.float16), pa.float16()),
        "features": _column(feat_nLD, pa.float32()),
        "accepted_prefix_length": pa.array(accepted_len.astype(np.int32)),
        "accepted_prefix_digest": pa.array([f"digest-{p}-{q}" for p, q in zip(
            prop_n, path_n, strict=True)]),
        "accepted": pa.array(accepted),
    }
    return pa.table(columns)
