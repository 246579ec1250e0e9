"""``flywheel rebuild --snapshot S --out DIR``: regenerate a sealed epoch from the topics.

What it covers: the WINDOW topics, from offset 0 up to the epoch's recorded end offsets,
through a fresh replay run: the same classification (:func:`consumers.intake.classify`),
the same duplicate rule (window ids seen at offsets before the epoch are primed by
decoding those records, without replaying them), the same block arithmetic with the
manifest's start/end offsets, the same batches, engine options, torch thread count and
Parquet writer settings. The result must be *plaintext* byte-identical: every shard's
``plaintext_sha256`` (the SHA-256 of its deterministic unencrypted encoding) and the
manifest's ``content_id`` are compared, and any shard difference raises
:class:`RebuildError`. The ciphertext, hence each shard's ``sha256`` and the snapshot id,
differs by design: shards are encrypted with fresh random data keys and nonces
(:mod:`hebrus_flywheel.core.snapshot.crypto`). Without encryption the files themselves
are byte-identical as well.

With ``--from-capture`` (:mod:`consumers.capture_check`) the stream processing is
fresh too: the capture topics, up to the offsets the seal recorded, run through the
stream processors' in-memory chain with the configuration of every recorded streams
run; every window record of the snapshot must be regenerated with the same window id
and content digest, and the replay then uses those FRESH windows. Which window-topic
offset holds which window still comes from the window topics: windows are
deterministic (ids and content digests depend only on the thread and the
configuration) but at-least-once delivery may repeat a window on the topic, so offsets,
hence block boundaries and shard names, are not a function of the capture topics.

Rebuild works only within the retention window of the topics (``streams.retention``:
7 days by default): before reading, the low watermark of every window partition is
compared with the manifest's first source offset, and with ``--from-capture`` every
capture partition (and the streams group's threads topic) must still hold offset 0.
When retention (or ``delete_records``) removed records the snapshot was made from,
:class:`RebuildError` says so instead of producing a different snapshot.

Nothing is published to Kafka: records refused again are only counted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hebrus_flywheel.consumers import throughput
from hebrus_flywheel.consumers.blocks import BlockSettings, close_block
from hebrus_flywheel.consumers.content_policy import (
    ContentPolicy,
    policy_from_mapping,
    tokenizer_decoder,
)
from hebrus_flywheel.consumers.dataset import config_digest, writer_versions
from hebrus_flywheel.consumers.engine import load_engine, window_check
from hebrus_flywheel.consumers.epochs import Block, EpochBoundary, EpochPlan, freeze_offsets
from hebrus_flywheel.consumers.exceptions import RebuildError
from hebrus_flywheel.consumers.intake import Accepted, PartitionLog, classify
from hebrus_flywheel.consumers.kafka_io import low_offsets, read_ranges
from hebrus_flywheel.consumers.manifest import (
    build_manifest,
    describe_shards,
    make_read_only,
    write_manifest,
)
from hebrus_flywheel.consumers.shards import ShardConfig, epoch_dir
from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.execution import parse_kernel_path
from hebrus_flywheel.core.snapshot import load_manifest
from hebrus_flywheel.core.snapshot.remote import remote_manifest
from hebrus_flywheel.core.storage import is_object_url
from hebrus_flywheel.streams.consent import CONSENT_TOPIC, now_ms, scope_for_split
from hebrus_flywheel.streams.consent_book import ConsentBook

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RebuildConfig:
    """One rebuild.

    Fields:
        snapshot: sealed epoch directory (or its manifest.json), or
            ``s3://bucket/prefix/epoch=N`` (only its manifest is read: the rows come from
            the topics).
        out: output dataset root; ``out/epoch=N`` must not exist yet.
        teacher: teacher checkpoint directory; its identity must be the snapshot's.
        bootstrap: Kafka bootstrap servers holding the snapshot's window topics.
        tokenizer_dir: tokenizer directory (default: the teacher's).
        timeout_s: give up when no source record arrives for this long.
        from_capture: also regenerate the windows from the capture topics (up to the
            recorded capture offsets, with the recorded streams configurations), require
            them to match the snapshot's, and replay the regenerated ones.
    """

    snapshot: Path | str
    out: Path
    teacher: Path
    bootstrap: str
    tokenizer_dir: Path | None = None
    timeout_s: float = 120.0
    from_capture: bool = False

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError("RebuildConfig.timeout_s must be > 0")
        if not self.bootstrap:
            raise ConfigError("RebuildConfig.bootstrap must name at least one broker")


def manifest_boundary(manifest: dict[str, Any]) -> tuple[EpochBoundary, dict[str, str]]:
    topics = manifest["source"]["topics"]
    start = {t: {p: r["start"] for p, r in v["partitions"].items()} for t, v in topics.items()}
    end = {t: {p: r["end"] for p, r in v["partitions"].items()} for t, v in topics.items()}
    boundary = EpochBoundary(epoch=manifest["epoch"], start=freeze_offsets(start),
                             end=freeze_offsets(end))
    return boundary, {t: v["split"] for t, v in topics.items()}


def load_for_snapshot(manifest: Mapping[str, Any], teacher_dir: Path, *,
                      tokenizer_dir: Path | None = None, teacher: Any = None) -> Any:
    """The replay engine bundle a sealed epoch was made with (same dtype, kernel path,
    options and thread count); RebuildError when the teacher's identity or the engine's
    resolved config is not the snapshot's."""
    det = manifest["determinism"]
    path = parse_kernel_path(manifest["identity"].get("kernel_path") or "")
    bundle = load_engine(teacher_dir=teacher_dir, dtype=det["dtype"],
                         device=path.get("device", "cpu"), attention=path.get("attention", "sdpa"),
                         replay_options=det["replay_options"],
                         torch_threads=det["torch_threads"],
                         tokenizer_dir=tokenizer_dir, teacher=teacher)
    want = manifest["identity"]["identity_id"]
    if bundle.identity["identity_id"] != want:
        raise RebuildError(
            f"the teacher in {teacher_dir} has identity {bundle.identity['identity_id']}, "
            f"the snapshot was made with {want}; load the same checkpoint, tokenizer, dtype "
            "and kernel path"
        )
    if bundle.replay_config != det["replay_config"]:
        raise RebuildError(
            f"the replay engine now resolves its config to {bundle.replay_config}, the "
            f"snapshot used {det['replay_config']}; rebuild with the code version that sealed it"
        )
    return bundle


def _window_ranges(manifest: dict[str, Any]) -> dict[tuple[str, int], tuple[int, int]]:
    boundary, _ = manifest_boundary(manifest)
    return {(t, p): (0, boundary.end_of(t, p)) for t, parts in boundary.end.items()
            for p in parts}


def check_retained(bootstrap: str, needed: Mapping[tuple[str, int], int], *,
                   what: str, timeout_s: float = 15.0) -> None:
    """RebuildError when a partition's low watermark is past the offset a rebuild needs
    first (``needed``: (topic, partition) -> first offset that must still exist)."""
    if not needed:
        return
    lows = low_offsets(bootstrap, sorted({t for t, _ in needed}), timeout_s=timeout_s,
                       error=RebuildError)
    gone = [(tp, first, lows.get(tp, 0)) for tp, first in sorted(needed.items())
            if lows.get(tp, 0) > first]
    if gone:
        (topic, partition), first, low = gone[0]
        raise RebuildError(
            f"{topic}[{partition}] starts at offset {low} on the broker but the rebuild needs "
            f"{what} from offset {first}: retention (or delete_records) removed records this "
            f"snapshot was made from ({len(gone)} partition(s) affected). A snapshot can only "
            "be rebuilt within the topics' retention window (streams.retention); keep the "
            "sealed snapshot itself as the copy of record")
    primed = {tp: low for tp, low in lows.items() if low > 0 and tp in needed}
    if primed:
        log.warning("records before %s are gone; windows repeated from there cannot be "
                    "recognised as duplicates (the comparison will tell)", primed)


def _window_starts(manifest: dict[str, Any]) -> dict[tuple[str, int], int]:
    boundary, _ = manifest_boundary(manifest)
    return {(t, int(p)): boundary.start_of(t, p) for t, parts in boundary.end.items()
            for p in parts if boundary.start_of(t, p) < boundary.end_of(t, p)}


def _capture_starts(prefix: str, capture: Mapping[str, Any]) -> dict[tuple[str, int], int]:
    """Every capture partition the seal recorded, and the group's threads topic, from 0."""
    from hebrus_flywheel.consumers.capture_check import recorded_runs
    from hebrus_flywheel.streams.processors.topology import StreamTopics

    needed = {(str(t), int(p)): 0 for t, parts in (capture.get("end") or {}).items()
              for p, end in parts.items() if int(end) > 0}
    app_id = recorded_runs(capture)[0].app_id
    if app_id.startswith(prefix):
        needed[(StreamTopics.from_prefix(prefix, app_id[len(prefix):]).threads, 0)] = 0
    return needed


def _capture_check(config: RebuildConfig, manifest: dict[str, Any]) -> Any:
    from hebrus_flywheel.consumers.capture_check import check_windows, regenerate

    prefix, capture = manifest["source"].get("prefix"), manifest["source"].get("capture")
    if prefix is None or not capture or not capture.get("end"):
        raise RebuildError(
            "--from-capture needs the topic prefix and the capture offsets and streams runs "
            "recorded at seal time (manifest source.prefix and source.capture); this snapshot "
            "was sealed without them — rebuild it from the window topics (drop --from-capture)"
        )
    check_retained(config.bootstrap, _capture_starts(prefix, capture), what="the capture records",
                   timeout_s=config.timeout_s)
    fresh = regenerate(config.bootstrap, prefix, capture, timeout_s=config.timeout_s)
    check = check_windows(config.bootstrap, _window_ranges(manifest), fresh,
                          timeout_s=config.timeout_s)
    check.raise_on_failure(manifest["snapshot_id"])
    return check


def _classify(msg: Any, split: str, identity_id: str, bundle: Any, check: Any,
              fresh: Mapping[str, bytes] | None) -> Any:
    """Classify one window record; with ``fresh``, classify its regenerated copy instead."""
    def run(value: bytes | None) -> Any:
        return classify(value, msg.headers(), msg.key(), split=split,
                        identity_id=identity_id, vocab_size=bundle.vocab_size,
                        check=check)

    verdict = run(msg.value())
    if fresh is None or verdict.window is None:
        return verdict
    return run(fresh.get(verdict.window["window_id"], msg.value()))


def _policy(tokenizer_dir: Path | None, det: Mapping[str, Any],
            bundle: Any) -> ContentPolicy | None:
    """The content policy the snapshot was written under (None: sealed before it existed,
    every accepted window was replayed)."""
    recorded = det.get("content_policy")
    if recorded is None:
        return None
    return ContentPolicy(policy_from_mapping(recorded, "manifest determinism.content_policy"),
                         tokenizer_decoder(tokenizer_dir or bundle.teacher.path))


def _intake(plog: PartitionLog, offset: int, verdict: Any, policy: ContentPolicy | None,
            stats: Counters, consent: ConsentBook) -> None:
    """What the worker does with one record past the block base (see worker._handle).
    Consent is asked now: a rebuild matches while the ledger says what it said at replay
    time; an owner who revoked since is left out, and the rebuild reports the difference."""
    if not verdict.accepted:
        stats.inc("quarantine", str(verdict.reason))
        plog.skip(offset)
    elif not consent.allows(str((verdict.window or {}).get("owner")),
                            scope_for_split(plog.split), now_ms()):
        stats.inc("quarantine", "no_consent")
        plog.skip(offset)
    elif policy is not None and (found := policy.screen(verdict.window or {})) is not None:
        stats.inc("policy_dropped", found.reason)
        plog.skip(offset)
    elif not plog.admit(offset, verdict.window or {}):
        stats.inc("intake", "duplicate")


def _settings(manifest: Mapping[str, Any], bundle: Any, root: Path) -> BlockSettings:
    det = manifest["determinism"]
    return BlockSettings(
        root=root, shard=ShardConfig(**det["shard"]), batch_windows=det["batch_windows"],
        route=bundle.teacher.geometry, identity_id=bundle.identity["identity_id"],
        config_digest=config_digest(det),
        feature_contract=bundle.replay_config.get("feature_contract"))


def epoch_blocks(bootstrap: str, manifest: Mapping[str, Any], bundle: Any, stats: Counters, *,
                 timeout_s: float, tokenizer_dir: Path | None = None,
                 fresh: Mapping[str, bytes] | None = None,
                 ) -> Iterator[tuple[Block, str, list[Accepted]]]:
    """The sealed epoch's blocks as the replay worker closed them: ``(block, split,
    accepted windows)`` from the window topics (offset 0 up to the recorded end), with the
    worker's classification, duplicate rule, consent check and content policy."""
    det = manifest["determinism"]
    boundary, splits = manifest_boundary(dict(manifest))
    identity_id = bundle.identity["identity_id"]
    plan = EpochPlan(ShardConfig(**det["shard"]).offsets_per_shard, [boundary])
    logs = {(t, p): PartitionLog(topic=t, partition=p, split=splits[t],
                                 base=boundary.start_of(t, p))
            for t, parts in boundary.end.items() for p in parts}
    ranges = {tp: (0, boundary.end_of(*tp)) for tp in logs}
    check = window_check(bundle)
    policy = _policy(tokenizer_dir, det, bundle)
    consent = ConsentBook(bootstrap=bootstrap,
                          topic=str(manifest["source"].get("prefix") or "") + CONSENT_TOPIC)
    consent.load()
    for msg in read_ranges(bootstrap, ranges, timeout_s=timeout_s, error=RebuildError):
        plog = logs[(msg.topic(), msg.partition())]
        verdict = _classify(msg, plog.split, identity_id, bundle, check, fresh)
        if msg.offset() < plog.base:
            if verdict.accepted and verdict.window is not None:
                plog.written_ids.add(verdict.window["window_id"])
            stats.inc("prime", "records")
            continue
        _intake(plog, msg.offset(), verdict, policy, stats, consent)
        while (block := plog.next_block(plan)) is not None:
            yield block, plog.split, plog.take(block)


def _replay(config: RebuildConfig, manifest: dict[str, Any], bundle: Any, root: Path,
            stats: Counters, fresh: Mapping[str, bytes] | None = None) -> None:
    settings = _settings(manifest, bundle, root)
    for block, split, items in epoch_blocks(
            config.bootstrap, manifest, bundle, stats, timeout_s=config.timeout_s,
            tokenizer_dir=config.tokenizer_dir, fresh=fresh):
        close_block(bundle.engine, settings, block, split, items, stats)


def _differences(original: dict[str, Any], rebuilt: dict[str, Any]) -> list[str]:
    old = {s["path"]: s["plaintext_sha256"] for s in original["shards"]}
    new = {s["path"]: s["plaintext_sha256"] for s in rebuilt["shards"]}
    out = [f"{p}: missing from the rebuild" for p in sorted(set(old) - set(new))]
    out += [f"{p}: not in the snapshot" for p in sorted(set(new) - set(old))]
    out += [f"{p}: plaintext sha256 {old[p]} -> {new[p]}" for p in sorted(set(old) & set(new))
            if old[p] != new[p]]
    return out


def rebuild_snapshot(config: RebuildConfig, *, teacher: Any = None) -> dict[str, Any]:
    """Rebuild one sealed epoch into ``config.out`` and compare it; a report dict."""
    source = config.snapshot
    manifest = (remote_manifest(source)[0] if isinstance(source, str) and is_object_url(source)
                else load_manifest(Path(source))).to_dict()
    out = Path(config.out).resolve()
    target = epoch_dir(out, manifest["epoch"])
    if target.exists():
        raise RebuildError(f"{target} already exists; choose an empty --out directory")
    check_retained(config.bootstrap, _window_starts(manifest), what="the window records",
                   timeout_s=config.timeout_s)
    capture = _capture_check(config, manifest) if config.from_capture else None
    bundle = load_for_snapshot(manifest, config.teacher, tokenizer_dir=config.tokenizer_dir,
                               teacher=teacher)
    stats = Counters()
    _replay(config, manifest, bundle, out, stats,
            None if capture is None else capture.fresh.encoded)
    boundary, splits = manifest_boundary(manifest)
    dataset = {"identity": manifest["identity"], "determinism": manifest["determinism"],
               "writer": writer_versions()}
    dataset["source"] = {k: v for k, v in manifest["source"].items() if k != "topics"}
    shards = describe_shards(out, manifest["epoch"])
    rebuilt = build_manifest(
        epoch=manifest["epoch"], dataset=dataset, boundary=boundary, splits_by_topic=splits,
        shards=shards, parity=manifest["parity"],
        replay_throughput=throughput.summarize(out, manifest["epoch"], shards),
        parity_override=(manifest["parity_override"] or {}).get("reason"),
        previous_snapshot=manifest["previous_snapshot"], product=manifest.get("product"))
    write_manifest(out, target, rebuilt)
    make_read_only(target)
    diffs = _differences(manifest, rebuilt)
    report = {"snapshot_id": manifest["snapshot_id"], "rebuilt_snapshot_id": rebuilt["snapshot_id"],
              "shards": len(rebuilt["shards"]), "rows": rebuilt["totals"]["rows"],
              "identical": not diffs, "differences": diffs, "out": str(target),
              "content_id": manifest["content_id"], "rebuilt_content_id": rebuilt["content_id"],
              "content_id_match": manifest["content_id"] == rebuilt["content_id"],
              "snapshot_id_match": manifest["snapshot_id"] == rebuilt["snapshot_id"],
              "stats": stats.report(), **({} if capture is None else capture.report())}
    if diffs:
        drift = {k: (v, writer_versions().get(k)) for k, v in manifest["writer"].items()
                 if writer_versions().get(k) != v}
        raise RebuildError(
            f"rebuild of {manifest['snapshot_id']} differs: " + "; ".join(diffs[:10])
            + (f". Library versions changed since sealing: {drift}" if drift else "")
            + f". The rebuilt files are in {target} for inspection"
        )
    return report
