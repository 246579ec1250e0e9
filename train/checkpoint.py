"""Route-model checkpoints that carry their lineage.

A checkpoint directory holds::

    checkpoint.pt    torch.save of {format, model_kind, model_config, state_dict, lineage}
    lineage.json     the same lineage, readable without torch
    history.jsonl    one line per validation (written by the trainer)

The lineage records the snapshot (id, epoch, identity, geometry, split counts), the
feature contract the model was trained on (projection seed, widths, digest: a model is
only valid for features made the same way), the full training config and seed, the code
version (package version, git commit and whether the tree was dirty, torch version), the
world size and the training outcome. ``checkpoint_id`` is the SHA-256 of the canonical
lineage and the parameter bytes, so the same seed, data and code give the same id.
``model_kind`` is ``route_sidecar`` (:class:`train.models.RouteSidecar`; the default of
checkpoints written before it existed) or ``route_predictor``
(:class:`train.predictor_model.RoutePredictor`, whose state holds the teacher's routers
it leans on and its validation-fitted calibration). Files are written through a
fsynced temporary name and renamed (:mod:`hebrus_flywheel.core.files`), so a crash
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.files import atomic_write, atomic_write_json, make_dirs
from hebrus_flywheel.core.jsonio import canonical_json
from hebrus_flywheel.train.exceptions import CheckpointError
from hebrus_flywheel.train.models import RouteSidecar, SidecarConfig, membership_probability
from hebrus_flywheel.train.predictor_model import MODEL_KIND, PredictorConfig, RoutePredictor

CHECKPOINT_FORMAT = "hebrus-flywheel-sidecar/v1"
SIDECAR_KIND = "route_sidecar"
CHECKPOINT_FILE = "checkpoint.pt"
LINEAGE_FILE = "lineage.json"
HISTORY_FILE = "history.jsonl"
_REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(_REPO), *args], capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_version() -> dict[str, Any]:
    """Package version, git commit (None outside a checkout), dirty flag, torch version."""
    try:
        package = version("hebrus-flywheel")
    except PackageNotFoundError:
        package = None
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"package": "hebrus-flywheel", "version": package, "git_commit": commit,
            "git_dirty": None if status is None else bool(status),
            "torch": torch.__version__.split("+")[0]}


def checkpoint_id(state_dict: Mapping[str, torch.Tensor], lineage: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical lineage (without its id) and every tensor's bytes."""
    digest = hashlib.sha256(canonical_json({k: v for k, v in lineage.items()
                                            if k != "checkpoint_id"}))
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        digest.update(f"|{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def save_checkpoint(directory: Path, config: SidecarConfig | PredictorConfig,
                    state_dict: Mapping[str, torch.Tensor],
                    lineage: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``checkpoint.pt`` and ``lineage.json``; returns the lineage with its id."""
    make_dirs(directory)
    state = {k: v.detach().cpu() for k, v in state_dict.items()}
    plain = json.loads(json.dumps(dict(lineage)))
    plain["checkpoint_id"] = checkpoint_id(state, plain)
    kind = MODEL_KIND if isinstance(config, PredictorConfig) else SIDECAR_KIND
    payload = {"format": CHECKPOINT_FORMAT, "model_kind": kind,
               "model_config": _config_dict(config),
               "state_dict": state, "lineage": plain}
    atomic_write(directory / CHECKPOINT_FILE, lambda handle: torch.save(payload, handle))
    atomic_write_json(directory / LINEAGE_FILE, plain)
    return plain


def _config_dict(config: SidecarConfig | PredictorConfig) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(config)))


@dataclass(eq=False)
class LoadedCheckpoint:
    """A model restored from a checkpoint, in eval mode, and its lineage."""

    model: RouteSidecar | RoutePredictor
    lineage: dict[str, Any]
    path: Path

    @property
    def method(self) -> str:
        return str(self.lineage.get("method", "sidecar"))

    def probabilities(self, scores_BE: torch.Tensor, head: int = 0) -> torch.Tensor:
        """Membership probabilities of one head's scores: the predictor's fitted
        calibration, the sidecar's plain sigmoid (its loss calibrates it)."""
        if isinstance(self.model, RoutePredictor):
            return self.model.probabilities(scores_BE, head)
        return membership_probability(scores_BE)


def resolve(path: Path) -> Path:
    """``path/checkpoint.pt`` for a directory, else ``path``."""
    path = Path(path)
    return path / CHECKPOINT_FILE if path.is_dir() else path


def load_checkpoint(path: Path, *, device: str | torch.device = "cpu") -> LoadedCheckpoint:
    """Restore a checkpoint; CheckpointError if it is missing, foreign or damaged."""
    file = resolve(path)
    if not file.is_file():
        raise CheckpointError(f"{file} does not exist; pass a checkpoint directory written by "
                              "`flywheel train --out DIR` or its checkpoint.pt")
    try:
        payload = torch.load(file, map_location=device, weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError) as exc:
        raise CheckpointError(f"cannot read checkpoint {file}: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{file} is not a {CHECKPOINT_FORMAT} checkpoint")
    lineage = payload["lineage"]
    if checkpoint_id(payload["state_dict"], lineage) != lineage.get("checkpoint_id"):
        raise CheckpointError(f"{file}: parameters or lineage do not match checkpoint id "
                              f"{lineage.get('checkpoint_id')}; the file was altered")
    try:
        model = _build(payload).to(device)
        model.load_state_dict(payload["state_dict"])
    except (TypeError, ConfigError, RuntimeError) as exc:
        raise CheckpointError(f"{file}: model config or parameters do not fit: {exc}") from exc
    return LoadedCheckpoint(model=model.eval(), lineage=lineage, path=file)


def _build(payload: dict[str, Any]) -> RouteSidecar | RoutePredictor:
    """An empty model of the payload's kind and config (its state is loaded next)."""
    kind = payload.get("model_kind", SIDECAR_KIND)
    fields = {**payload["model_config"], "offsets": tuple(
        tuple(o) for o in payload["model_config"]["offsets"])}
    if kind == SIDECAR_KIND:
        return RouteSidecar(SidecarConfig(**fields))
    if kind == MODEL_KIND:
        config = PredictorConfig(**fields)
        return RoutePredictor(config, RoutePredictor.empty_gate(config))
    raise ConfigError(f"unknown model kind {kind!r}")
