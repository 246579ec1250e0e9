"""Errors raised by the ``replay`` package.

Every class derives from :class:`ReplayError`, itself a
:class:`flywheel.errors.FlywheelError`, so callers can catch the package or the project
as a whole. Messages say what was wrong and what to do about it.

This module is shared: new error families (tokenizer, conversations, rendering, teacher
loading, ...) are appended below, never renamed or removed.
"""

from __future__ import annotations

from pathlib import Path

from hebrus_flywheel.core.errors import FlywheelError


class ReplayError(FlywheelError):
    """Base class for every error raised deliberately by the ``replay`` package."""


# --- tokenizer, conversations, rendering -------------------------------------------


class TokenizerError(ReplayError):
    """A tokenizer directory is missing, incomplete, or inconsistent with the flywheel's."""


class ConversationFormatError(ReplayError, ValueError):
    """A conversation (thread) record is malformed.

    ``path`` and ``line`` locate the offending record when it came from a file; both
    are ``None`` for threads built in memory.
    """

    def __init__(
        self, message: str, *, path: str | Path | None = None, line: int | None = None
    ) -> None:
        self.path = None if path is None else str(path)
        self.line = line
        self.reason = message
        super().__init__(_locate(message, self.path, line))


def _locate(message: str, path: str | None, line: int | None) -> str:
    """Prefix ``message`` with ``path:line: `` when a location is known."""
    if path is None and line is None:
        return message
    where = path if path is not None else "<input>"
    if line is not None:
        where = f"{where}:{line}"
    return f"{where}: {message}"


class RenderError(ReplayError):
    """A thread cannot be rendered to canonical tokens, or a turn lookup is invalid."""


class NotPrefixStableError(RenderError):
    """The chat template rewrites earlier text when a message is added (e.g. it drops the
    reasoning of earlier assistant turns or merges consecutive tool results), so one
    token stream per thread does not exist; :func:`replay.render.render_episodes`
    renders such a thread as the runtime saw it at each assistant turn."""


# --- teacher, adapters, routing, decode, identity -------------------------------------


class TeacherError(ReplayError):
    """A teacher checkpoint cannot be created, read or loaded as a frozen teacher."""


class UnsupportedModelError(TeacherError):
    """The checkpoint's model family (``config.model_type``) has no route adapter."""


class RoutingError(ReplayError, ValueError):
    """Router logits or a routing request are malformed (shape, k, non-finite scores)."""


class DecodeError(ReplayError):
    """A decode request is invalid (empty prefix, out-of-vocabulary ids, bad arguments)."""


class IdentityMismatchError(ReplayError):
    """A record's runtime identity differs from the loaded teacher's; the message lists fields."""


# --- prefill replay, parity gate -------------------------------------------------------


class WindowError(ReplayError):
    """One window cannot be replayed.

    ``window_id`` names the window (``None`` when the record has none) and ``reason`` is
    a stable quarantine reason code, so a worker can quarantine the window and go on.
    """

    reason_code = "invalid_window"

    def __init__(self, message: str, *, window_id: str | None) -> None:
        self.window_id = window_id
        self.reason = self.reason_code
        super().__init__(f"window {window_id}: {message}")


class WindowFormatError(WindowError, ValueError):
    """A window record is malformed (missing fields, bad token ids, bad anchor positions)."""

    reason_code = "invalid_window"


class WindowIdentityError(WindowError, IdentityMismatchError):
    """A window's ``identity_id`` differs from the loaded teacher's runtime identity."""

    reason_code = "identity_mismatch"


class ReplayNumericsError(ReplayError):
    """A replay forward produced non-finite router logits, hidden states or features."""


class ParityError(ReplayError):
    """Captured routes cannot be compared with replayed labels (shape, geometry, bytes)."""


class WindowSourceError(ReplayError):
    """A file or Kafka topic of encoded windows cannot be read."""


# --- candidate-path replay ----------------------------------------------------------


class CandidateError(ReplayError):
    """A drafter proposal or a candidate-path replay request is malformed."""
