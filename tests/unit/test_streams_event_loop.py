"""The streams worker's event loop choice (``--event-loop``)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.processors.event_loop import DEFAULT_EVENT_LOOP, use_event_loop


@pytest.fixture(autouse=True)
def _restore_policy() -> Iterator[None]:
    yield
    asyncio.set_event_loop_policy(None)


def _loop_module(name: str) -> str:
    use_event_loop(name)
    loop = asyncio.new_event_loop()
    try:
        return type(loop).__module__
    finally:
        loop.close()


def test_uvloop_is_the_default_and_every_new_loop_is_one() -> None:
    assert DEFAULT_EVENT_LOOP == "uvloop"
    assert _loop_module("uvloop").startswith("uvloop")


def test_asyncio_gives_the_standard_librarys_loop_back() -> None:
    _loop_module("uvloop")
    assert _loop_module("asyncio").startswith("asyncio")


def test_an_unknown_loop_is_refused_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match="'tokio' is not one of uvloop, asyncio"):
        use_event_loop("tokio")


def test_uvloop_missing_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import raises ImportError
    with pytest.raises(ConfigError, match=r"pip install uvloop.*--event-loop asyncio"):
        use_event_loop("uvloop")
