"""Data sources, encoders, shards and the `prepare` stage."""
