"""Object storage: URLs, the publication protocol and the checked remote read, on a
:class:`LocalStore` (the same operations as S3; tests/integration/test_snapshot_s3.py
runs them against the real SeaweedFS)."""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path

import pytest

from hebrus_flywheel.consumers.exceptions import PublishError
from hebrus_flywheel.consumers.publish import CLAIMS, claim_epoch, publish_epoch
from hebrus_flywheel.core.jsonio import canonical_json
from hebrus_flywheel.core.snapshot import (
    ManifestError,
    VerifyError,
    content_digest,
    manifest_digest,
    verify_snapshot,
)
from hebrus_flywheel.core.snapshot.remote import epoch_url, fetch_snapshot, remote_manifest
from hebrus_flywheel.core.storage import LocalStore, S3Target, S3Url, StorageError
from tests.support.planted import PlantedConfig, write_planted_snapshot

CONFIG = PlantedConfig(threads={"train": 1, "validation": 1}, tokens_per_thread=16, layers=2,
                       experts=8, top_k=2, hidden_dim=8, feature_dim=8)


@pytest.fixture(scope="module")
def sealed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sealed")
    write_planted_snapshot(root, CONFIG, read_only=False)
    return root / "epoch=0"


def _other_snapshot(sealed: Path, tmp_path: Path) -> Path:
    """A second valid snapshot of the same epoch: same shards, another manifest."""
    other = tmp_path / "other" / "epoch=0"
    other.mkdir(parents=True)
    for path in sealed.rglob("*.parquet"):
        target = other / path.relative_to(sealed)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    manifest = json.loads((sealed / "manifest.json").read_text())
    manifest["parity_override"] = {"reason": "another sealer"}
    manifest["content_id"] = content_digest(manifest)
    manifest["snapshot_id"] = manifest_digest(manifest)
    (other / "manifest.json").write_bytes(canonical_json(manifest))
    return other


def test_s3_urls_parse_and_refuse_bad_buckets_and_escapes() -> None:
    url = S3Url.parse("s3://flywheel-snapshots/team/a/")
    assert (url.bucket, url.prefix) == ("flywheel-snapshots", "team/a")
    assert url.child("epoch=3") == "s3://flywheel-snapshots/team/a/epoch=3"
    for bad in ("s3://B/x", "s3://ab", "s3://bucket/a/../b", "/local/path"):
        with pytest.raises(StorageError):
            S3Url.parse(bad)
    assert epoch_url("s3://b-1/p/epoch=2/manifest.json") == "s3://b-1/p/epoch=2"
    with pytest.raises(ManifestError, match="epoch=N"):
        epoch_url("s3://b-1/p")


def test_targets_are_tls_only_and_never_print_the_secret() -> None:
    with pytest.raises(StorageError, match="https"):
        S3Target(endpoint="http://127.0.0.1:1", access_key="a", secret_key="s", ca_bundle=None)
    target = S3Target(endpoint="https://h:1", access_key="a", secret_key="hunter2",
                      ca_bundle=None)
    assert "hunter2" not in repr(target)


def test_a_conditional_put_creates_only_once(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    assert store.put_bytes("k", b"one", if_absent=True)
    assert not store.put_bytes("k", b"two", if_absent=True)
    assert store.get_bytes("k") == b"one"


def test_publish_puts_shards_then_the_manifest_and_fetch_reads_it_back(
        sealed: Path, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "bucket")
    result = publish_epoch(sealed, "s3://bucket/p", store=store)
    assert not result.already_published
    local = {p.relative_to(sealed).as_posix(): p.read_bytes()
             for p in sealed.rglob("*") if p.is_file()}
    assert {k[len("epoch=0/"):]: v for k, v in
            ((k, store.get_bytes(k)) for k in store.objects("epoch=0/"))} == local
    assert store.objects(CLAIMS) == {}  # the claim is released
    again = publish_epoch(sealed, "s3://bucket/p", store=store)
    assert again.already_published and again.snapshot_id == result.snapshot_id
    epoch = LocalStore(tmp_path / "bucket" / "epoch=0")
    copy = fetch_snapshot("s3://bucket/p/epoch=0", store=epoch, cache=tmp_path / "cache")
    assert verify_snapshot(copy)["snapshot_id"] == result.snapshot_id
    assert all((copy / k).read_bytes() == v for k, v in local.items())


def test_an_epoch_without_its_manifest_is_not_sealed(sealed: Path, tmp_path: Path) -> None:
    """What a crash between the shard uploads and the manifest leaves behind."""
    store = LocalStore(tmp_path / "bucket")
    publish_epoch(sealed, "s3://bucket/p", store=store)
    store.delete(["epoch=0/manifest.json"])
    epoch = LocalStore(tmp_path / "bucket" / "epoch=0")
    with pytest.raises(ManifestError, match="not sealed"):
        remote_manifest("s3://bucket/p/epoch=0", store=epoch)
    assert not publish_epoch(sealed, "s3://bucket/p", store=store).already_published
    assert remote_manifest("s3://bucket/p/epoch=0", store=epoch)[0].epoch == 0


def test_a_second_snapshot_of_a_sealed_epoch_is_refused(sealed: Path, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "bucket")
    first = publish_epoch(sealed, "s3://bucket/p", store=store)
    with pytest.raises(PublishError, match=f"already sealed as snapshot {first.snapshot_id}"):
        publish_epoch(_other_snapshot(sealed, tmp_path), "s3://bucket/p", store=store)


class IgnoresConditions(LocalStore):
    """A store that accepts ``If-None-Match: *`` and overwrites anyway (S3Proxy 2.6.0);
    both sealers meet right before their manifest writes, so without a claim both would
    write one (a sealer that never arrives releases the other after 1 s)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.meet = threading.Barrier(2, timeout=1.0)

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        if key.endswith("manifest.json"):
            with contextlib.suppress(threading.BrokenBarrierError):
                self.meet.wait()
        return super().put_bytes(key, data)


@pytest.mark.parametrize("kind", [LocalStore, IgnoresConditions])
def test_racing_sealers_never_both_win(sealed: Path, tmp_path: Path,
                                       kind: type[LocalStore]) -> None:
    """Whether or not the store enforces the conditional put, the claim lets at most one
    of two different snapshots seal the epoch."""
    other = _other_snapshot(sealed, tmp_path)
    for round_ in range(4):
        store = kind(tmp_path / f"race{round_}")
        outcome: dict[str, object] = {}

        def seal(name: str, directory: Path, store: LocalStore = store,
                 outcome: dict[str, object] = outcome) -> None:
            try:
                outcome[name] = publish_epoch(directory, "s3://bucket/p", store=store)
            except PublishError as exc:
                outcome[name] = exc

        threads = [threading.Thread(target=seal, args=(n, d))
                   for n, d in (("a", sealed), ("b", other))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert set(outcome) == {"a", "b"}, outcome  # each sealer won or refused: none crashed
        winners = [v for v in outcome.values() if not isinstance(v, Exception)]
        assert len(winners) <= 1, outcome
        published = store.get_bytes("epoch=0/manifest.json")
        if winners:
            assert json.loads(published or b"{}")["snapshot_id"] == winners[0].snapshot_id


def test_a_live_claim_of_another_snapshot_blocks_and_our_own_is_reused(
        sealed: Path, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "bucket")
    claim_epoch(store, 0, "f" * 64)  # a sealer still publishing (or dead)
    with pytest.raises(PublishError, match="another sealer is publishing"):
        publish_epoch(sealed, "s3://bucket/p", store=store)
    assert list(store.objects(CLAIMS)) == [f"{CLAIMS}/epoch=0/{'f' * 64}"]
    store.delete(list(store.objects(CLAIMS)))
    manifest = json.loads((sealed / "manifest.json").read_text())
    claim_epoch(store, 0, manifest["snapshot_id"])  # our own crashed run
    assert publish_epoch(sealed, "s3://bucket/p", store=store).snapshot_id


def test_stray_objects_in_an_unsealed_epoch_are_refused(sealed: Path, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "bucket")
    store.put_bytes("epoch=0/split=train/stray.parquet", b"PAR1")
    with pytest.raises(PublishError, match="does not list"):
        publish_epoch(sealed, "s3://bucket/p", store=store)


def test_fetch_refuses_a_damaged_or_extra_object(sealed: Path, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "bucket")
    publish_epoch(sealed, "s3://bucket/p", store=store)
    epoch = LocalStore(tmp_path / "bucket" / "epoch=0")
    shard = next(k for k in epoch.objects("") if k.endswith(".parquet"))
    data = bytearray(epoch.get_bytes(shard) or b"")
    data[50] ^= 0x01
    epoch.put_bytes(shard, bytes(data))
    with pytest.raises(VerifyError, match="SHA-256"):
        fetch_snapshot("s3://bucket/p/epoch=0", store=epoch, cache=tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("*/manifest.json"))  # nothing half-cached


def _superseding(sealed: Path, tmp_path: Path) -> Path:
    """A snapshot that supersedes ``sealed`` (what an erasure writes): one shard dropped."""
    new = tmp_path / "new" / "epoch=0"
    manifest = json.loads((sealed / "manifest.json").read_text())
    manifest["shards"].pop()
    for entry in manifest["shards"]:
        (new / entry["path"]).parent.mkdir(parents=True, exist_ok=True)
        (new / entry["path"]).write_bytes((sealed / entry["path"]).read_bytes())
    manifest["supersedes"] = manifest["snapshot_id"]
    manifest["content_id"] = content_digest(manifest)
    manifest["snapshot_id"] = manifest_digest(manifest)
    (new / "manifest.json").write_bytes(canonical_json(manifest))
    return new


def test_a_superseding_snapshot_replaces_the_published_one(sealed: Path, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "bucket")
    old = publish_epoch(sealed, "s3://bucket/p", store=store)
    new_dir = _superseding(sealed, tmp_path)
    new = publish_epoch(new_dir, "s3://bucket/p", store=store)
    assert new.snapshot_id != old.snapshot_id and not new.already_published
    epoch = LocalStore(tmp_path / "bucket" / "epoch=0")
    manifest, _ = remote_manifest("s3://bucket/p/epoch=0", store=epoch)
    assert manifest.snapshot_id == new.snapshot_id and manifest["supersedes"] == old.snapshot_id
    assert set(epoch.objects("")) == {p.relative_to(new_dir).as_posix()
                                   for p in new_dir.rglob("*") if p.is_file()}
    copy = fetch_snapshot("s3://bucket/p/epoch=0", store=epoch, cache=tmp_path / "cache")
    assert verify_snapshot(copy)["snapshot_id"] == new.snapshot_id
    with pytest.raises(PublishError, match="already sealed"):
        publish_epoch(sealed, "s3://bucket/p", store=store)  # the old one never comes back


def test_expire_on_a_store_unseals_first_keeps_the_newest_and_resumes(
        sealed: Path, tmp_path: Path) -> None:
    from hebrus_flywheel.consumers.expire_remote import MARKERS, expire_published

    store = LocalStore(tmp_path / "bucket")
    for epoch in range(3):
        for rel, size in LocalStore(sealed).objects("").items():
            assert size >= 0
            store.put_bytes(f"epoch={epoch}/{rel}", (sealed / rel).read_bytes())
    store.delete(["epoch=2/manifest.json"])  # epoch 2 is still being published
    store.put_bytes(f"{MARKERS}/epoch=7", b"")  # a killed run's marker
    store.put_bytes("epoch=7/split=train/left.parquet", b"x")
    now = max(store.modified(k) or 0 for k in store.objects("")) + 10 * 86_400
    dry = expire_published("s3://bucket/p", older_than_ms=86_400_000, keep=1, dry_run=True,
                           now_s=now, store=store)
    assert {e.epoch: e.state for e in dry.epochs} == {7: "would resume", 1: "kept",
                                                      0: "would remove"}
    done = expire_published("s3://bucket/p", older_than_ms=86_400_000, keep=1, now_s=now,
                            store=store)
    assert {e.epoch: e.state for e in done.epochs} == {7: "resumed", 1: "kept", 0: "removed"}
    left = set(store.objects(""))
    assert not any(k.startswith(("epoch=0/", "epoch=7/", MARKERS)) for k in left)
    assert "epoch=1/manifest.json" in left and any(k.startswith("epoch=2/") for k in left)
