"""Snapshot readers, sidecar models, baselines, losses, metrics and qualification."""
