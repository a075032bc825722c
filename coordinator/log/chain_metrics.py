"""The chain head, published at scrape time: an anchor for the log's hash chain kept outside PostgreSQL.

``kvl_log_chain_head_position`` and ``kvl_log_chain_head_info{hash_prefix=…}`` are the
position and the first 16 hex digits of the chain hash of the last event this coordinator
appended. Prometheus keeps them with their time: a rewrite of the whole tail (which the chain
alone cannot reveal: recomputing it needs no secret) shows as a stored ``chain_hash`` at a
scraped position that differs from the prefix scraped then (docs/operations.md, "The log's
hash chain"). Nothing is published until the coordinator has appended (a standby publishes none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

#: Hex digits of the head's hash published (64 bits: enough to tell a rewrite, short to read).
PREFIX_HEX = 16


class ChainHeadCollector(Collector):
    def __init__(self, head: Callable[[], tuple[int, bytes] | None]) -> None:
        self.head = head

    def collect(self) -> Iterator[Any]:
        head = self.head()
        pos = GaugeMetricFamily("kvl_log_chain_head_position",
                                "Position of the last event this coordinator appended (the log's hash chain head)")
        info = GaugeMetricFamily("kvl_log_chain_head_info", "The log's hash chain head: 1, with the first "
                                 f"{PREFIX_HEX} hex digits of its chain_hash", labels=["hash_prefix"])
        if head is not None:
            pos.add_metric([], head[0])
            info.add_metric([head[1].hex()[:PREFIX_HEX]], 1)
        yield pos
        yield info
