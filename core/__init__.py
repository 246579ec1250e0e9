"""The base of hebrus-flywheel: what every stage shares and nothing above it.

Errors, settings, identity digests, geometry, canonical JSON, atomic files, counters,
the snapshot contract and Kafka I/O live here. Modules in this package import only the
standard library, third-party libraries and each other; every stage imports them, never
the other way round (``make lint`` checks it with import-linter).
"""

from __future__ import annotations

__version__ = "0.1.0"
