"""``flywheel seal --epoch N``: record the epoch boundary, wait for workers, write the manifest.

Steps (each is safe to repeat; re-running a seal resumes where it stopped):

1. Epochs are sealed in order. If epoch N's boundary is already on the control topic it
   is reused; otherwise a ``seal_intent`` is published, the end offsets of every window
   topic partition are read, then those of the capture topics, and an
   ``epoch_boundary`` with ``start`` (= epoch N-1's end, 0 for epoch 0), ``end`` and
   ``capture_end`` is published. The first boundary of an epoch wins.
2. Wait until the replay workers' group has committed every partition up to ``end``:
   workers commit only after a shard is durable, so then every shard of the epoch is on
   disk. Times out with the lagging partitions named.
3. Check that no shard of any epoch lies across the boundary, describe the epoch's
   shards, take the parity result (``--parity FILE``, else computed on the epoch's
   ``runtime_holdout`` shards) and refuse a non-authoritative identity unless
   ``--override-parity REASON`` is given (the reason goes into the manifest).
4. Write ``epoch=N/manifest.json`` atomically, make the epoch read-only, and publish an
   ``epoch_sealed`` record with the snapshot id. The manifest's ``source.capture`` holds
   ``capture_end`` and every streams run recorded so far (:mod:`streams.processors.runs`:
   each worker start's full configuration and capture start offsets), which is what
   ``flywheel rebuild --from-capture`` needs to run the stream processors again.
5. With ``--snapshot-root s3://bucket/prefix`` (or ``$FLYWHEEL_SNAPSHOT_ROOT``), publish
   the sealed epoch there (:mod:`.publish`: claim, shards, manifest last); a re-run of a
   seal whose publication crashed completes it.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hebrus_flywheel.consumers import consent_seal, throughput
from hebrus_flywheel.consumers.control import (
    ControlChannel,
    ControlState,
    boundary_record,
    intent_record,
    sealed_record,
)
from hebrus_flywheel.consumers.dataset import read_dataset
from hebrus_flywheel.consumers.epochs import EpochBoundary, freeze_offsets, offsets_json
from hebrus_flywheel.consumers.exceptions import ManifestError, SealError
from hebrus_flywheel.consumers.holdout import HOLDOUT_SPLIT, holdout_parity
from hebrus_flywheel.consumers.kafka_io import committed_offsets, end_offsets
from hebrus_flywheel.consumers.manifest import (
    build_manifest,
    check_ranges,
    describe_shards,
    make_read_only,
    write_manifest,
)
from hebrus_flywheel.consumers.publish import PublishResult, publish_epoch
from hebrus_flywheel.consumers.shards import epoch_dir
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.snapshot import MANIFEST_FILE, PRODUCT_CLEAN, load_manifest
from hebrus_flywheel.core.storage import is_object_url
from hebrus_flywheel.streams.consent import CONSENT_TOPIC, now_ms
from hebrus_flywheel.streams.consent_book import ConsentBook
from hebrus_flywheel.streams.processors.pipeline import capture_topics
from hebrus_flywheel.streams.processors.runs import StreamsRunError, read_runs
from hebrus_flywheel.streams.topics import CONTROL_TOPIC, SPLITS, STREAMS_RUNS_TOPIC, window_topic

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SealConfig:
    """One seal.

    Fields:
        dataset: dataset root the workers write to.
        epoch: epoch number to seal (0, 1, ... in order).
        bootstrap: Kafka bootstrap servers.
        parity_file: JSON parity result (``flywheel parity``); must hold ``authoritative``.
        override_parity: reason to seal although the identity is not authoritative.
        timeout_s: how long to wait for the workers to reach the boundary.
        poll_interval_s: how often the group's committed offsets are checked.
        intent_ttl_s: how long workers honour the seal intent if no boundary follows.
        snapshot_root: ``s3://bucket/prefix`` to publish the sealed epoch to
            (:mod:`.publish`: shards first, manifest last); None keeps it local only.
    """

    dataset: Path
    epoch: int
    bootstrap: str
    parity_file: Path | None = None
    override_parity: str | None = None
    timeout_s: float = 600.0
    poll_interval_s: float = 1.0
    intent_ttl_s: float = 120.0
    snapshot_root: str | None = None

    def __post_init__(self) -> None:
        if self.snapshot_root is not None and not is_object_url(self.snapshot_root):
            raise ConfigError(f"SealConfig.snapshot_root must be s3://bucket/prefix, got "
                              f"{self.snapshot_root!r}")
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise ConfigError(f"SealConfig.epoch must be an integer >= 0, got {self.epoch!r}")
        for name in ("timeout_s", "poll_interval_s", "intent_ttl_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"SealConfig.{name} must be > 0")
        if self.override_parity is not None and not self.override_parity.strip():
            raise ConfigError("SealConfig.override_parity must give a reason, not be empty")


@dataclass(frozen=True, kw_only=True)
class SealResult:
    """What a seal produced."""

    snapshot_id: str
    manifest_path: Path
    manifest: dict[str, Any]
    already_sealed: bool
    published: PublishResult | None = None


def _topics(prefix: str) -> dict[str, str]:
    return {prefix + window_topic(s): s for s in SPLITS}


def record_boundary(channel: ControlChannel, config: SealConfig, prefix: str) -> EpochBoundary:
    """Epoch N's boundary: the recorded one, or a new one recorded now (intent first)."""
    state = channel.sync()
    if config.epoch in state.boundaries:
        return state.boundaries[config.epoch]
    if config.epoch != state.next_epoch:
        raise SealError(
            f"epoch {config.epoch} cannot be sealed yet: epochs are sealed in order and the "
            f"next one is {state.next_epoch}; run `flywheel seal --epoch {state.next_epoch}`"
        )
    intent = intent_record(config.epoch, config.intent_ttl_s)
    channel.publish(intent)
    ends = end_offsets(config.bootstrap, _topics(prefix), error=SealError)
    # After the window ends: every window below them came from capture records below these.
    capture_ends = end_offsets(config.bootstrap, capture_topics(prefix).values(), error=SealError)
    previous = state.ordered()[-1] if state.ordered() else None
    start = {t: {p: previous.end_of(t, p) if previous else 0 for p in parts}
             for t, parts in ends.items()}
    for t, parts in ends.items():
        for p, end in parts.items():
            if end < start[t][p]:
                raise SealError(f"{t}[{p}] ends at {end}, before epoch start {start[t][p]}; "
                                "the topic was truncated or recreated")
    boundary = EpochBoundary(epoch=config.epoch, start=freeze_offsets(start),
                             end=freeze_offsets(ends), capture_end=freeze_offsets(capture_ends))
    channel.publish(boundary_record(boundary, intent["intent_id"]))
    return _settled(channel.sync(), config.epoch)


def _settled(state: ControlState, epoch: int) -> EpochBoundary:
    boundary = state.boundaries.get(epoch)
    if boundary is None:
        raise SealError(f"the boundary of epoch {epoch} was published but cannot be read back")
    return boundary


def wait_for_workers(config: SealConfig, group_id: str, boundary: EpochBoundary) -> None:
    """Block until ``group_id`` has committed every partition up to the boundary."""
    wanted = {(t, p): end for t, parts in boundary.end.items() for p, end in parts.items()
              if end > boundary.start_of(t, p)}
    deadline = time.monotonic() + config.timeout_s
    while True:
        got = committed_offsets(config.bootstrap, group_id, wanted, error=SealError)
        behind = {tp: (got.get(tp, -1), end) for tp, end in wanted.items()
                  if got.get(tp, -1) < end}
        if not behind:
            return
        if time.monotonic() > deadline:
            lag = ", ".join(f"{t}[{p}] at {c} < {e}" for (t, p), (c, e) in sorted(behind.items()))
            raise SealError(
                f"timed out after {config.timeout_s:.0f} s waiting for replay workers (group "
                f"{group_id}) to write epoch {config.epoch}: {lag}. Is `flywheel replay worker "
                f"--dataset {config.dataset}` running? The boundary is recorded; re-run the "
                "same seal to keep waiting"
            )
        time.sleep(config.poll_interval_s)


def resolve_parity(config: SealConfig, root: Path, boundary: EpochBoundary,
                   dataset: dict[str, Any]) -> dict[str, Any]:
    """The parity JSON (file, else computed) checked against the dataset's identity."""
    identity_id = dataset["identity"]["identity_id"]
    if config.parity_file is None:
        topic = dataset["source"]["prefix"] + window_topic(HOLDOUT_SPLIT)
        return holdout_parity(config.bootstrap, topic, root, boundary, dataset["identity"])
    try:
        parity = json.loads(Path(config.parity_file).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise SealError(f"cannot read the parity file {config.parity_file}: {exc}") from exc
    if not isinstance(parity, dict) or not isinstance(parity.get("authoritative"), bool):
        raise SealError(f"{config.parity_file} has no boolean 'authoritative'; pass the JSON "
                        "that `flywheel parity` writes")
    claimed = parity.get("identity_id")
    if claimed is not None and claimed != identity_id:
        raise SealError(f"the parity result is for identity {claimed}, the dataset's is "
                        f"{identity_id}; run the parity gate for this identity")
    return parity


def check_policy(parity: dict[str, Any], override: str | None, identity_id: str) -> None:
    """Refuse a non-authoritative identity unless an override reason is given.

    The refusal names the first mismatches with their router-score margins (a flip at a
    margin of a few float32 roundings is a kernel difference; one at a large margin is a
    replay bug), and the whole parity result is logged, so a refusal can be diagnosed
    from the seal's log alone.
    """
    if parity.get("authoritative") is True or override is not None:
        return
    keys = ("windows_compared", "windows_skipped", "pairs", "mismatched_pairs",
            "primary_mismatches", "set_mismatches", "rank_only_mismatches",
            "weight_violations", "max_weight_abs_diff", "token_id_mismatches",
            "position_mismatches", "teacher_dtype", "kernel_path", "source")
    summary = {k: parity.get(k) for k in keys if k in parity}
    if not parity.get("pairs") and not parity.get("windows_compared"):
        why = ("no runtime_holdout window with captured routes could be compared, so parity "
               "is unproven. Pass the result of `flywheel parity` with --parity FILE")
    else:
        why = (f"replayed routes do not exactly match decode{_first_mismatches(parity)}. "
               "Fix the replay path and re-run the parity gate (a first flip at a near tie, "
               "a small boundary or label margin, is float32 kernel rounding: capture and "
               "replay with --dtype float64, its own identity, as make demo does)")
    log.error("parity refused for identity %s: %s", identity_id,
              json.dumps(parity, sort_keys=True, default=str))
    raise SealError(
        f"identity {identity_id} is not authoritative (parity {summary or parity}): {why}, "
        "or seal anyway with --override-parity \"<reason>\" (recorded in the manifest)"
    )


_EXAMPLE_KEYS = ("window_id", "anchor_ordinal", "layer_slot", "kind", "primary",
                 "boundary_margin", "label_margin", "decode_ids", "replay_ids")


def _first_mismatches(parity: dict[str, Any], shown: int = 3) -> str:
    """`` (first mismatches: [...])`` from the parity result's examples, or ``""``."""
    examples = [e for e in parity.get("examples") or [] if isinstance(e, dict)]
    if not examples:
        return ""
    listed = [{k: e[k] for k in _EXAMPLE_KEYS if k in e} for e in examples[:shown]]
    more = f" and {len(examples) - shown} more" if len(examples) > shown else ""
    return f" (first mismatches: {listed}{more})"


def capture_source(config: SealConfig, prefix: str, boundary: EpochBoundary) -> dict[str, Any]:
    """``source.capture`` of the manifest: capture end offsets and the streams runs."""
    try:
        runs = read_runs(config.bootstrap, prefix + STREAMS_RUNS_TOPIC)
    except StreamsRunError as exc:
        raise SealError(f"cannot read the streams runs: {exc}") from exc
    return {"end": offsets_json(boundary.capture_end),
            "streams_runs": [run.to_json() for run in runs]}


def _previous_snapshot(root: Path, epoch: int) -> str | None:
    if epoch == 0:
        return None
    try:
        return str(load_manifest(epoch_dir(root, epoch - 1))["snapshot_id"])
    except ManifestError:
        return None


def check_consent(config: SealConfig, root: Path, prefix: str) -> dict[str, Any]:
    """Every row of the epoch against the consent ledger now (:mod:`.consent_seal`)."""
    ledger = prefix + CONSENT_TOPIC
    book = ConsentBook(bootstrap=config.bootstrap, topic=ledger)
    book.load()
    block = consent_seal.measure(consent_seal.owner_rows(root, config.epoch), book,
                                 at_ms=now_ms(), ledger=ledger)
    if block["rows_refused"]:
        log.warning("epoch %d: %d of %d rows (%d owners) have no live grant of their split's "
                    "scope now; refused (readers exclude them, Gate 2 fails until a "
                    "superseding snapshot drops them)", config.epoch, block["rows_refused"],
                    block["rows"], block["owners_refused"])
    return block


def seal_epoch(config: SealConfig) -> SealResult:
    """Seal one epoch (see the module doc); idempotent."""
    root = Path(config.dataset).resolve()
    dataset = read_dataset(root)
    edir = epoch_dir(root, config.epoch)
    if (edir / MANIFEST_FILE).exists():
        manifest = load_manifest(edir).to_dict()
        return SealResult(snapshot_id=manifest["snapshot_id"], manifest_path=edir / MANIFEST_FILE,
                          manifest=manifest, already_sealed=True, published=_publish(config, edir))
    prefix, group_id = dataset["source"]["prefix"], dataset["source"]["group_id"]
    channel = ControlChannel(config.bootstrap, prefix + CONTROL_TOPIC)
    try:
        boundary = record_boundary(channel, config, prefix)
        log.info("epoch %d boundary: %s", config.epoch, dict(boundary.end))
        wait_for_workers(config, group_id, boundary)
        check_ranges(root, boundary)
        parity = resolve_parity(config, root, boundary, dataset)
        check_policy(parity, config.override_parity, dataset["identity"]["identity_id"])
        source = {**dataset["source"], "capture": capture_source(config, prefix, boundary)}
        consent = check_consent(config, root, prefix)
        shards = describe_shards(root, config.epoch)
        manifest = build_manifest(
            consent=consent, replay_throughput=throughput.summarize(root, config.epoch, shards),
            epoch=config.epoch, dataset={**dataset, "source": source}, boundary=boundary,
            splits_by_topic=_topics(prefix), shards=shards, parity=parity,
            parity_override=config.override_parity, product=PRODUCT_CLEAN,
            previous_snapshot=_previous_snapshot(root, config.epoch))
        path = write_manifest(root, edir, manifest)
        make_read_only(edir)
        channel.publish(sealed_record(config.epoch, manifest["snapshot_id"], str(path)))
    finally:
        channel.close()
    return SealResult(snapshot_id=manifest["snapshot_id"], manifest_path=path, manifest=manifest,
                      already_sealed=False, published=_publish(config, edir))


def _publish(config: SealConfig, edir: Path) -> PublishResult | None:
    """Publish the sealed ``edir`` to the configured object store root (resumes a crashed
    publication; idempotent)."""
    if config.snapshot_root is None:
        return None
    return publish_epoch(edir, config.snapshot_root)
