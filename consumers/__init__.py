"""Kafka consumers that drive replay, the Parquet shard writer, seal and rebuild."""
