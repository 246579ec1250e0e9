"""hebrus-flywheel: the data and qualification flywheel for MoE expert-prefetch predictors."""

from __future__ import annotations

__version__ = "0.1.0"
