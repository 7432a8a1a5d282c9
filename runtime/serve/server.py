"""The server process: the HTTP app on uvicorn, the loader and the worker threads, and the drain on SIGTERM.

Jobs live in a database (runtime/serve/jobs.py: SQLite under the jobs directory by default, or PostgreSQL with
--queue, shared by every replica), videos and images in shared storage (runtime/serve/storage.py), so any replica
answers for any job and a restart loses none. A replica claims a job under a lease that it heartbeats while the job
makes progress (runtime/serve/lease.py); a replica that dies or stalls stops heartbeating and another takes the job
over. SIGTERM drains: new jobs get 503, the running job finishes, then the server exits (queued jobs stay queued for
the other replicas or the next start). SIGHUP reads the API keys file again (tenants.py). With several processes
(TPU slices), process 0 serves, claims and heartbeats, and every job's settings and images are broadcast to the
others, which run the same programs (runtime/serve/follower.py). uvicorn runs with this server's limits
(runtime/serve/limits.py, protocol.py).

Exit status: 0 after a drain; 2 for bad input found before serving (a missing or unreadable bundle, a port in use:
one line, `error: ...`); LOAD_FAILED (4) when the bundle fails to load after the server started (a corrupt weight
file, a program that does not compile here): no job could ever run, so the process stops rather than answer "still
loading" forever; 3 when a job stalls (lease.py), for the supervisor to restart it.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from .. import manifest as mf
from ..errors import UserError
from .jobs import open_store
from .metrics import make_metrics
from .protocol import protocol
from .routes import create_app
from .schema import MAX_STEPS, Offer
from .state import Settings, State
from .webhooks import Events, Sender
from .worker import load_and_compile, worker

log = logging.getLogger("runtime")


LOAD_FAILED = 4  # the bundle could not be loaded: restarting will not help (3, a stall, is "restart me")


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before anything loads: a port in use is one line and exit 2 at once,
    not a server that loads and then dies (uvicorn is handed this socket, so no one can take the port between)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart need not wait out TIME_WAIT
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is in use: {e.strerror} (stop what listens there, or pass another "
                            "--port)") from None
        raise UserError(f"cannot listen on {host} port {port}: {e.strerror or e}") from None
    return sock


def reload_keys(settings: Settings) -> None:
    """SIGHUP: the API keys file again; a key taken out of it stops working now. The names are logged, never a key;
    a file that does not read keeps the keys the server had."""
    try:
        tenants = settings.keys.reload()  # type: ignore[union-attr]
    except UserError as e:
        log.error("SIGHUP: kept the API keys the server had: %s", e)
        return
    log.info("SIGHUP: read %s again: %d keys of %d tenants (%s)", settings.keys.file,  # type: ignore[union-attr]
             sum(tenants.values()), len(tenants), ", ".join(sorted(tenants)))


def serve(settings: Settings, host: str, port: int, loader: Callable[[], Any],
          broadcast: Callable[[dict[str, Any] | None], None] | None = None,
          on_exit: Callable[[], None] | None = None) -> int:
    """Serve until SIGTERM/SIGINT: the first one drains (503 for new jobs, the running job finishes), a
    second one stops at once. Returns the exit status (0, or LOAD_FAILED); bad input raises UserError first."""
    import uvicorn

    sock = listen(host, port)
    try:
        offer = Offer.of(mf.read(settings.bundle), settings.bundle.resolve().name, min(settings.max_steps, MAX_STEPS),
                         settings.loras, settings.max_loras, settings.max_seconds)
        store = open_store(settings.jobs_dir, settings.queue, settings.videos_url, settings.lease,
                           settings.queue_wait, settings.store_retry)
    except BaseException:
        sock.close()
        raise
    for job in store.expire_dead_local_owners():
        log.warning("job %s was running when the server stopped: %s", job.id,
                    "queued again" if job.attempts < store.max_attempts else "failed, out of attempts")
    store.events = Events(settings.webhooks, store.db.now)  # a job's end is its tenant's webhooks' deliveries
    state = State(settings=settings, store=store, offer=offer, broadcast=broadcast)
    state.metrics = make_metrics(store)
    sender = Sender(store.db, settings.webhooks, state.metrics.registry).start()  # any replica sends them
    state.wake_webhooks = sender.wake
    app = create_app(state)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if state.draining.is_set():  # a second signal: stop now
                self.force_exit = True
                return super().handle_exit(sig, frame)
            log.info("draining: no new jobs; finishing the running one, then exiting")
            state.draining.set()
            state.wake.set()

            def finish() -> None:
                state.idle.wait()
                self.should_exit = True

            threading.Thread(target=finish, daemon=True).start()

    limits = settings.limits
    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=10, http=protocol(limits),
                                   timeout_keep_alive=limits.keep_alive,  # type: ignore[arg-type]  (float seconds)
                                   limit_concurrency=limits.max_connections,
                                   h11_max_incomplete_event_size=limits.max_header_bytes,
                                   ws_max_size=limits.realtime_max_message_bytes))  # more: closed with 1009
    if settings.keys is not None and settings.keys.file is not None:
        signal.signal(signal.SIGHUP, lambda sig, frame: threading.Thread(target=reload_keys, args=(settings,),
                                                                          daemon=True).start())

    def load_failed() -> None:  # no job could ever run: stop, rather than answer "still loading" forever
        server.should_exit = True

    state.on_load_error = load_failed
    loader_thread = threading.Thread(target=load_and_compile, args=(state, loader), daemon=True)
    loader_thread.start()

    def work() -> None:
        state.ready.wait()
        worker(state)

    state.idle.set()
    worker_thread = threading.Thread(target=work, daemon=True)
    worker_thread.start()
    log.info("serving %s on http://%s:%d (replica %s; jobs in %s)", settings.bundle, host, port, store.owner,
             settings.queue and "the PostgreSQL queue" or settings.jobs_dir)
    server.run(sockets=[sock])
    state.draining.set()
    state.wake.set()
    if state.ready.is_set():
        worker_thread.join(timeout=5)
    if on_exit is not None:
        on_exit()
    sender.stop()
    store.close()
    code = LOAD_FAILED if state.load_error else 0
    if loader_thread.is_alive():  # stopped while loading: leave at once, not with compiles running into shutdown
        log.info("stopped while loading %s", settings.bundle)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
