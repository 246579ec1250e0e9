"""Avro schemas (every published version) and the single-object codec."""
