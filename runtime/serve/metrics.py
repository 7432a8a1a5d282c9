"""The Prometheus metrics `GET /metrics` serves: the shared queue, jobs by status and by tenant, step, job and request
times.

Every label's values are bounded by the server, never made of what a client sends: methods are HTTP's (anything else
is `other`), routes the app's templates (`other` for a path no route has), tenants the names in the key file (a
name, never a key)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .db import DatabaseUnavailable
from .jobs import JobStore

# Request metrics are labelled with these methods and the route templates only: a label made of what a client sent
# would grow a series per made-up method.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})


def method_label(method: str) -> str:
    return method if method in METHODS else "other"


@dataclass
class Metrics:
    registry: Any
    queue_depth: Any
    jobs: Any
    step_seconds: Any
    job_seconds: Any
    request_seconds: Any
    replica_jobs: Any
    lora_switches: Any = None  # wan_aot_lora_switches_total: LoRA set changes between jobs on this replica
    lora_switch_seconds: Any = None  # one change: the tensors it touches merged again from their unmodified weights
    storage_errors: Any = None  # wan_aot_storage_errors_total{kind}: writes the video storage refused, by kind


def make_metrics(store: JobStore) -> Metrics:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry()
    counts: dict[str, Any] = {"at": 0.0, "value": {}}

    def count(status: str) -> float:  # one query per scrape, shared by the gauges; NaN while the database is away
        if time.monotonic() - counts["at"] > 0.5:
            try:
                counts["value"] = store.counts()
            except DatabaseUnavailable:
                counts["value"] = {}
            counts["at"] = time.monotonic()
        return counts["value"].get(status, float("nan"))

    class Tenants:
        """wan_aot_tenant_jobs{tenant, status}: the tenants are those with jobs in the store, so a collector."""

        def collect(self) -> Any:
            from prometheus_client.core import GaugeMetricFamily

            family = GaugeMetricFamily("wan_aot_tenant_jobs", "jobs in the shared store, by tenant name and status",
                                       labels=["tenant", "status"])
            try:
                tenants = store.tenant_counts()
            except DatabaseUnavailable:  # a scrape while the database is away: the tenants' series pause
                tenants = {}
            for tenant, statuses in sorted(tenants.items()):
                for status, n in statuses.items():
                    family.add_metric([tenant, status], n)
            yield family

    queue = Gauge("wan_aot_queue_depth", "jobs waiting to run, in the queue every replica shares", registry=reg)
    queue.set_function(lambda: count("queued"))
    jobs = Gauge("wan_aot_jobs", "jobs in the shared store, by status", ["status"], registry=reg)
    for status in ("queued", "in_progress", "completed", "failed"):
        jobs.labels(status).set_function(lambda s=status: count(s))
    reg.register(Tenants())

    class Database:
        """wan_aot_queue_db_errors_total and wan_aot_queue_db_up: what the database layer counts (runtime/serve/db.py),
        read at each scrape."""

        def collect(self) -> Any:
            from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

            yield CounterMetricFamily("wan_aot_queue_db_errors", "statements that found the job database unreachable",
                                      value=store.db.errors)
            yield GaugeMetricFamily("wan_aot_queue_db_up", "1 while the job database answers (its last statement "
                                    "reached it), else 0", value=1 if store.db.up else 0)

    reg.register(Database())
    replica = Counter("wan_aot_replica_jobs", "jobs this replica ran, by outcome (lost: taken over by another; "
                      "cancelled: a client cancelled or deleted it while it ran, and it stopped)",
                      ["outcome"], registry=reg)
    for outcome in ("completed", "failed", "lost", "cancelled"):
        replica.labels(outcome)
    storage_errors = Counter("wan_aot_storage_errors", "the video storage's (or the jobs directory's) failures, by "
                             "kind (full: no space left; unavailable: the store failed past its retries)", ["kind"],
                             registry=reg)
    for kind in ("full", "unavailable"):
        storage_errors.labels(kind)
    buckets = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
    return Metrics(
        registry=reg, queue_depth=queue, jobs=jobs,
        step_seconds=Histogram("wan_aot_step_seconds", "one denoising step", registry=reg, buckets=buckets),
        job_seconds=Histogram("wan_aot_job_seconds", "one job, encode to mp4", registry=reg,
                              buckets=(*buckets, 600, 1800)),
        request_seconds=Histogram("wan_aot_request_seconds", "HTTP request latency", ["method", "route", "status"],
                                  registry=reg, buckets=buckets), replica_jobs=replica,
        lora_switches=Counter("wan_aot_lora_switches", "changes of the LoRA set between this replica's jobs",
                              registry=reg),
        lora_switch_seconds=Histogram("wan_aot_lora_switch_seconds", "one change of the LoRA set: the tensors it "
                                      "touches merged again from their unmodified weights", registry=reg,
                                      buckets=(0.001, 0.005, *buckets)),
        storage_errors=storage_errors)

