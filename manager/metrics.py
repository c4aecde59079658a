"""Prometheus metrics of the live manager (a private registry; served over HTTP by `residency serve`
when `server.metrics_listen` is set).

loads / evictions per model and tier, load durations per transition, cold-start wait per class,
resident bytes per device and tier, queue depth per model, thrash, elastic lease size, and requests
by outcome. (WorldPager stall figures join with world sessions.)
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

WAIT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.loads = Counter(
            "residency_loads", "Model loads by target tier", ["model", "tier", "source"], registry=r
        )
        self.evictions = Counter(
            "residency_evictions", "Evictions from the GPU tier", ["model", "to"], registry=r
        )
        self.load_seconds = Histogram(
            "residency_load_seconds", "Measured transition time", ["model", "transition"],
            buckets=WAIT_BUCKETS, registry=r,
        )  # fmt: skip
        self.wait = Histogram(
            "residency_request_wait_seconds", "Time a request waited before it ran (cold starts, room)",
            ["cls"], buckets=WAIT_BUCKETS, registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "residency_requests", "Requests by outcome", ["model", "cls", "outcome"], registry=r
        )
        self.resident = Gauge(
            "residency_resident_bytes", "Bytes held per device and tier", ["device", "tier"], registry=r
        )
        self.queue = Gauge("residency_queue_depth", "Requests waiting for their model", ["model"], registry=r)
        self.thrash = Counter("residency_thrash", "Reloads within thrash_window of an eviction", registry=r)
        self.lease = Gauge("residency_lease_bytes", "Elastic KV lease on the device", ["model"], registry=r)
        self.failures = Counter(
            "residency_load_failures", "Failed worker commands", ["model", "code"], registry=r
        )
        self.log_buffered = Gauge(
            "residency_request_log_buffered", "Served requests waiting to be written to the store", registry=r
        )
        self.log_dropped = Counter(
            "residency_request_log_dropped",
            "Request-log records dropped: the store was down too long",
            registry=r,
        )
        self._children: dict[tuple[str, ...], Any] = {}

    def child(self, metric: str, *labels: str) -> Any:
        """The labelled child of a per-request metric, cached (labels() is a lookup with a lock)."""
        key = (metric, *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = getattr(self, metric).labels(*labels)
        return c
