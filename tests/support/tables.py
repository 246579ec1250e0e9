"""A worker table on the sealed RocksDB store, without a broker, for store unit tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import faust

from hebrus_flywheel.streams.processors.state_codec import StateValue
from hebrus_flywheel.streams.processors.state_seal import StateSealer
from hebrus_flywheel.streams.processors.state_store import (
    ROCKSDB_OPTIONS,
    STORE_URL,
    SealedRocksDBStore,
)


def sealed_table(app_id: str, datadir: Path) -> Any:
    """Table ``t`` (one partition) of a fresh faust app on the worker's store; values
    of no owner (no owner key store here). The caller runs an event loop."""
    app = faust.App(app_id, store=STORE_URL, datadir=str(datadir), web_enabled=False)
    table = app.Table("t", partitions=1, key_type=str, value_type=StateValue,
                      options=dict(ROCKSDB_OPTIONS))
    store = table.data
    assert isinstance(store, SealedRocksDBStore)
    store.state_sealer = StateSealer(sealer=None, table="t")
    return table


def close_databases(table: Any) -> None:
    for db in table.data._dbs.values():
        db.close()
