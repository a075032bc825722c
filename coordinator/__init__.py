"""The coordinator: the single authority on cache-block state, backed by an append-only log."""
