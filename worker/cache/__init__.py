"""The worker's cache: per-form paged pools, tiers, the transition outbox, validation, and a
request's cache manager.

* a request's cache — :mod:`.manager` (``Session``: open, prefill plan, commits, close), with
  :mod:`.hits` (speculation, validation, restore) and :mod:`.leases` (prefix waits, acquire,
  renew, settle, release); :mod:`.ports` is everything it is given;
* the worker's replicas — :mod:`.replicas` (every transition emitted, the moves between tiers),
  :mod:`.outbox` (kept until the commit watermark covers it);
* the pure core — :mod:`.planner` (which blocks a resume reads, the four validation layers),
  :mod:`.cost` (what validation and restore cost, per form);
* where the bytes live — :mod:`.pools` and :mod:`.store` (the GPU tier), :mod:`.host_tier`,
  :mod:`.tiers`, :mod:`.segments`, :mod:`.segment_writer`, :mod:`.offload_key` (host memory and
  the offload directory), :mod:`.retention` (the disk tier's bound and age).
"""
