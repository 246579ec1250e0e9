"""Kafka consumers that drive replay, the Parquet shard writer, seal, verify and rebuild.

Data path::

    flywheel.windows.<split>.v1 ──▶ replay worker ──▶ ROOT/epoch=N/split=S/*.parquet
      (Window.v1, key owner/thread)  │ classify → dedup → block → replay → shard → commit
                                     └─▶ flywheel.quarantine.records.v1 (identity_mismatch, ...)
    flywheel seal --epoch N  ──▶ control topic boundary ──▶ wait for commits ──▶ manifest.json
    flywheel verify SNAPSHOT  /  flywheel rebuild --snapshot SNAPSHOT --out DIR

Determinism (invariants 4-6), in one place:

* A shard is a *block*: consecutive source offsets ``[b*S, (b+1)*S)`` of one
  (topic, partition), clipped to the epoch's offset range (:mod:`consumers.epochs`). Its
  name carries (topic, partition, first offset, last offset). Blocks depend only on
  offsets, ``S`` and the boundaries recorded on the control topic, never on poll timing.
* Epoch boundaries are recorded by ``seal`` with a two-step intent/boundary protocol
  (:mod:`consumers.control`) so that no already written shard can span one.
* A block is replayed in fixed batches of its own windows, rows are sorted, every Parquet
  writer option is pinned and no timestamps are written (:mod:`consumers.shards`), with a
  recorded torch thread count: the same offsets give the same bytes.
* Offsets are committed only after the shard is fsynced and renamed and the quarantine
  producer is flushed; a restart resumes at a block start and rebuilds the repeat filter
  from the shards already on disk (:mod:`consumers.worker`).
* The manifest's canonical digest is the snapshot id (:mod:`consumers.manifest`); a
  rebuild from the window topics reproduces every shard and the id
  (:mod:`consumers.rebuild`, which also says why it does not re-run the stream processors).
"""
