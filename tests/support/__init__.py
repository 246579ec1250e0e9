"""Test scaffolding shared by tests and benches: planted snapshots, synthetic windows and
records, worker drivers.

Not part of the installed package; import as ``tests.support.<name>`` from the repository root.
"""
