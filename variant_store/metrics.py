"""The variant store's Prometheus metrics, in a registry of its own (served at its ``/metrics``).

    tiermesh_store_requests_total{route,status}     requests answered, by route and HTTP status
    tiermesh_store_blob_bytes_total                  blob bytes sent
    tiermesh_store_corrupt_blobs_total               verifications that found a blob no longer matching its digest
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

__all__ = ["CONTENT_TYPE", "ROUTES", "StoreMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ROUTES = ("blobs", "catalog", "healthz", "metrics", "other")


class StoreMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._requests = Counter("tiermesh_store_requests", "Requests the variant store answered",
                                 ["route", "status"], registry=self.registry)
        self.blob_bytes = Counter("tiermesh_store_blob_bytes", "Blob bytes sent", registry=self.registry)
        self.corrupt = Counter("tiermesh_store_corrupt_blobs", "Blobs found not matching their digest",
                               registry=self.registry)

    def answered(self, path: str, status: int) -> None:
        route = path.strip("/").split("/", 1)[0] or "other"
        # bounded labels: known routes, statuses as the three-digit numbers HTTP has
        code = str(status) if 100 <= status < 600 else "other"
        self._requests.labels(route if route in ROUTES else "other", code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
