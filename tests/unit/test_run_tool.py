"""core.processes.run_tool: one way to run an external tool, its failure the caller's error."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hebrus_flywheel.core.processes import run_tool


class ToolError(Exception):
    pass


def test_returns_standard_output_in_the_given_directory_and_environment(tmp_path: Path) -> None:
    code = "import os; print(os.getcwd(), os.environ['PROBE'])"
    out = run_tool([sys.executable, "-c", code], what="probing", hint="-", timeout_s=30,
                   error=ToolError, cwd=tmp_path, env={"PROBE": "yes"})
    assert out.split() == [str(tmp_path), "yes"]


def test_a_failure_is_the_callers_error_with_the_output_tail_and_the_hint() -> None:
    code = "import sys; [print(f'line {i}') for i in range(30)]; sys.exit(3)"
    with pytest.raises(ToolError) as caught:
        run_tool([sys.executable, "-c", code], what="building the thing",
                 hint="install the thing and retry", timeout_s=30, error=ToolError)
    text = str(caught.value)
    assert text.startswith("building the thing failed (exit 3):")
    assert "line 29" in text and "line 9\n" not in text  # the last 20 lines only
    assert text.endswith("install the thing and retry")


def test_a_tool_past_its_time_is_stopped_and_named() -> None:
    with pytest.raises(ToolError, match=r"sleeping did not finish within 1 s; wait less"):
        run_tool([sys.executable, "-c", "import time; time.sleep(30)"], what="sleeping",
                 hint="wait less", timeout_s=1, error=ToolError)


def test_sigterm_runs_finally_blocks(tmp_path: Path) -> None:
    marker = tmp_path / "stopped"
    script = ("import sys, time\n"
              "from hebrus_flywheel.core.processes import exit_on_sigterm\n"
              "exit_on_sigterm()\n"
              "try:\n"
              "    print('ready', flush=True)\n"
              "    time.sleep(60)\n"
              "finally:\n"
              f"    open({str(marker)!r}, 'w').write('workers stopped')\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert marker.read_text() == "workers stopped"
