"""hebrus-flywheel: the data and qualification flywheel for MoE expert-prefetch predictors.

The repository keeps one folder per stage; installed, they are the subpackages of this
namespace (``hebrus_flywheel.streams`` is ``streams/``, ``hebrus_flywheel.core`` is
``core/``). This folder is the top: the ``flywheel`` CLI and the demo.
"""

from __future__ import annotations

from hebrus_flywheel.core import __version__

__all__ = ["__version__"]
