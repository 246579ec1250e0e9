"""Crash-only agents and timers: an unhandled error ends the process non-zero, with
one log line naming the error and the record."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from hebrus_flywheel.streams.processors.crash import CRASH_EXIT_STATUS

SCRIPT = textwrap.dedent("""
    import asyncio, logging
    from types import SimpleNamespace
    from hebrus_flywheel.streams.processors.crash import crash_only_agent, crash_only_timer
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    async def body(stream):
        stream.current_event = SimpleNamespace(
            message=SimpleNamespace(topic="cap", partition=2, offset=41))
        raise {error}

    async def tick():
        raise {error}

    async def main():
        if "{kind}" == "agent":
            await crash_only_agent("capture", body)(SimpleNamespace())
        else:
            await crash_only_timer("send_ticks", tick)()
        print("NOT REACHED")

    asyncio.run(main())
""")


def run(kind: str, error: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(kind=kind, error=error)],
                          capture_output=True, text=True, timeout=60, check=False)


def test_agent_error_exits_non_zero_naming_error_and_record() -> None:
    done = run("agent", "RuntimeError('MessageSizeTooLarge')")
    assert done.returncode == CRASH_EXIT_STATUS, done.stderr
    assert "NOT REACHED" not in done.stdout
    lines = [x for x in done.stderr.splitlines() if "streams worker crashed" in x]
    assert len(lines) == 1
    assert "agent capture failed on cap[2]@41: RuntimeError: MessageSizeTooLarge" in lines[0]


def test_timer_error_exits_non_zero() -> None:
    done = run("timer", "KeyError('tp')")
    assert done.returncode == CRASH_EXIT_STATUS, done.stderr
    assert "timer send_ticks failed: KeyError" in done.stderr
