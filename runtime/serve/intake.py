"""A job's way in, the same for every route that queues one (create, remix, edits, extensions, image edits): the
checks before its body is read (the server draining or still loading, the queue's room for the tenant), the body read
within the limits, and the job queued with its files (429 for a full queue, 507 for a full disk, nothing queued).
routes.py and images.py call these in this order."""

from __future__ import annotations

import math
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from ..files import disk_full
from . import loras
from .errors import ApiError
from .jobs import Job, QueueFull
from .schema import FILE_FIELDS, Body, read_body
from .state import State


def check_ready(state: State) -> None:
    """503 while the server drains (it takes no new job) or still loads the bundle (retry when /ready says so)."""
    if state.draining.is_set():
        raise ApiError(503, "the server is shutting down and takes no new jobs; retry on another instance",
                       code="draining")
    if not state.ready.is_set():
        raise ApiError(503, "the model is still loading; retry when GET /ready answers 200", code="loading",
                       headers={"Retry-After": "5"})


def check_room(state: State, tenant: str) -> None:
    """429 unless the queue has room for a job of `tenant`."""
    try:
        state.store.room(tenant, state.settings.queue_size, state.settings.tenant_queue_size)
    except QueueFull as e:
        raise queue_full(state, e) from None


def queue_full(state: State, e: QueueFull) -> ApiError:
    """The 429 of a full queue (or of a tenant's full share), with a Retry-After of about one job's time."""
    recent = state.job_seconds or [10.0]  # about one job's time frees a place in the queue
    retry = max(1, math.ceil(sum(recent) / len(recent)))
    if e.mine:
        message = f"you have {e.waiting} jobs waiting, as many as one tenant may: retry in about {retry} s"
    else:
        message = f"the queue is full ({e.waiting} jobs waiting): retry in about {retry} s"
    return ApiError(429, message, headers={"Retry-After": str(retry)})


async def read(state: State, request: Request, file_fields: tuple[str, ...] = FILE_FIELDS) -> Body:
    """The request's body (JSON or multipart), within --max-body-mb and the bundle's part limits; 408 when it did
    not arrive in time."""
    try:
        return await read_body(request, state.settings.limits.max_body_bytes or state.offer.max_body_bytes,
                               state.offer.max_part_bytes, file_fields, state.offer)
    except ClientDisconnect:  # the body timeout closed the connection (protocol.py), or the client left
        raise ApiError(408, "the request's body did not arrive in time (--body-timeout), or the client went "
                            "away") from None


def add_job(state: State, params: dict[str, Any], files: list[bytes], tenant: str) -> Job:
    """Queue a checked request's job (every way in: create, remix, edits, image edits), its files stored with it;
    429 for a full queue, 507 for a full disk, nothing queued."""
    loras.check_tenant(params.get("lora"), allowed_loras(state, tenant))
    try:
        job = state.store.add(model=state.model, size=params["size"], seconds=params["seconds"],
                              prompt=params["prompt"], params=params, images=files,
                              queue_size=state.settings.queue_size, tenant=tenant,
                              tenant_queue_size=state.settings.tenant_queue_size)
    except QueueFull as e:
        raise queue_full(state, e) from None
    except Exception as e:
        if not disk_full(e):
            raise
        if state.metrics is not None:
            state.metrics.storage_errors.labels("full").inc()
        raise ApiError(507, "the server's storage is full (no space left for the job's files or its record): "
                            "nothing was queued; retry once an operator has freed space",
                       headers={"Retry-After": "60"}) from None
    state.wake.set()
    return job


def allowed_loras(state: State, tenant: str | None) -> frozenset[str] | None:
    """The adapters `tenant` may use (its `loras=` in the keys file), None: any."""
    keys = state.settings.keys
    return keys.loras(tenant) if keys is not None and tenant is not None else None
