"""What the server's parts share: its settings, and the state the HTTP handlers and the worker both read."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .access import Names
from .jobs import JobStore
from .lease import DEFAULT_STALL_S
from .limits import Limits, Slots
from .loras import AFFINITY_MAX, MAX_LORAS
from .schema import DEFAULT_MAX_SECONDS, MAX_STEPS, Offer
from .tenants import Keys
from .webhooks import Config as WebhookConfig

# `serve --max-sync-seconds`: how long an image edit's request waits for its job (images.py); the openai SDK's
# own default timeout is 600 s
DEFAULT_MAX_SYNC_SECONDS = 600.0


@dataclass
class Settings:
    bundle: Path
    keys: Keys | None = None  # the API keys and their tenants (--api-keys FILE, --api-key), or None: no key asked
    jobs_dir: Path = Path("jobs")
    queue_size: int = 16
    tenant_queue_size: int | None = None  # the most jobs one tenant may have waiting (None: queue_size)
    magcache: Any = None  # runtime.MagCache every job runs with (recorded in the job's params), or None
    queue: str | None = None  # the job database: None (SQLite under jobs_dir) or a postgresql:// URL
    videos_url: str | None = None  # videos and images in an object store instead of jobs_dir
    queue_wait: float = 120.0  # seconds a server waits for its --queue database at start-up (db.py)
    store_retry: float = 300.0  # seconds a job's writes to a failing --videos-url store are retried (storage.py)
    lease: float = 60.0  # seconds without a heartbeat after which another replica takes a job over
    stall: float = DEFAULT_STALL_S  # seconds without progress after which a replica gives its job up and exits
    ui: bool = True  # the playground page at GET / (runtime/serve/ui/)
    max_steps: int = MAX_STEPS  # the most denoising steps a job may ask for (MAX_STEPS at most)
    max_seconds: float = DEFAULT_MAX_SECONDS  # diffusion forcing bundles: the longest video a job may ask for
    max_sync_seconds: float = DEFAULT_MAX_SYNC_SECONDS  # the longest an image edit's request waits for its job
    names: Names = field(default_factory=Names)  # the Host names requests may use (access.py); default: any
    limits: Limits = field(default_factory=Limits)  # timeouts and sizes (limits.py)
    webhooks: WebhookConfig = field(default_factory=WebhookConfig)  # --webhook-url/-secret/-allow (webhooks.py)
    loras: tuple[Any, ...] = ()  # the LoRA adapters offered per request (--lora-dir: runtime.lora.Adapter each)
    max_loras: int = MAX_LORAS  # the most adapters one request may name
    lora_affinity_max: int = AFFINITY_MAX  # how many others a queued job may be passed over by for a LoRA set's sake


@dataclass
class State:
    """What the HTTP handlers and the worker share."""

    settings: Settings
    store: JobStore
    offer: Offer | None = None  # what a request may ask for (from the manifest, before the weights load)
    pipe: Any = None  # runtime.Pipeline, once loaded and compiled
    ready: threading.Event = field(default_factory=threading.Event)
    draining: threading.Event = field(default_factory=threading.Event)
    idle: threading.Event = field(default_factory=threading.Event)  # set while the worker runs no job
    wake: threading.Event = field(default_factory=threading.Event)
    load_error: str | None = None
    on_load_error: Callable[[], Any] = lambda: None  # the bundle failed to load: the process stops (server.py)
    metrics: Any = None
    job_seconds: list[float] = field(default_factory=list)  # the last few jobs' durations (for Retry-After)
    broadcast: Callable[[dict[str, Any] | None], None] | None = None  # multi-host: send a job to the others
    on_stall: Callable[[], Any] = lambda: os._exit(3)  # a stalled job: exit non-zero, the supervisor restarts us
    wake_webhooks: Callable[[], None] = lambda: None  # a job ended here: its webhook deliveries are due (webhooks.py)
    uploads: Slots = None  # type: ignore[assignment]  # create requests reading or checking a body at once
    decodes: threading.BoundedSemaphore = None  # type: ignore[assignment]  # requests decoding media at once
    lora_key: str = "[]"  # the per-request LoRA set this replica's weights hold (loras.set_key; "[]": none)
    # the replica's worker slot, its devices: the worker holds it to claim and run a job, a realtime session while it
    # runs (realtime.py), so the two never run at once
    slot: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.uploads = Slots(self.settings.limits.max_uploads, "reading as many uploads as it takes at once")
        self.decodes = threading.BoundedSemaphore(self.settings.limits.max_decodes)

    @property
    def model(self) -> str:
        return self.settings.bundle.resolve().name
