"""Benchmarks; each ``python -m bench.<name>`` prints one JSON object as its last line."""
