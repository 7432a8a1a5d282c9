"""The server process: the HTTP app on uvicorn, the loader and the worker threads, and the drain on SIGTERM.

Jobs live in a database (runtime/serve/jobs.py: SQLite under the jobs directory by default, or PostgreSQL with
--queue, shared by every replica), videos and images in shared storage (runtime/serve/storage.py), so any replica
answers for any job and a restart loses none. A replica claims a job under a lease that it heartbeats while the job
makes progress (runtime/serve/lease.py); a replica that dies or stalls stops heartbeating and another takes the job
over. SIGTERM drains: new jobs get 503, the running job finishes, then the server exits (queued jobs stay queued for
the other replicas or the next start). With several processes (TPU slices), process 0 serves, claims and
heartbeats, and every job's settings and images are broadcast to the others, which run the same programs
(runtime/serve/follower.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .jobs import open_store
from .metrics import make_metrics
from .routes import create_app
from .state import Settings, State
from .worker import load_and_compile, worker

log = logging.getLogger("runtime")


def serve(settings: Settings, host: str, port: int, loader: Callable[[], Any],
          broadcast: Callable[[dict[str, Any] | None], None] | None = None,
          on_exit: Callable[[], None] | None = None) -> int:
    """Serve until SIGTERM/SIGINT: the first one drains (503 for new jobs, the running job finishes), a
    second one stops at once."""
    import uvicorn

    store = open_store(settings.jobs_dir, settings.queue, settings.videos_url, settings.lease)
    for job in store.expire_dead_local_owners():
        log.warning("job %s was running when the server stopped: %s", job.id,
                    "queued again" if job.attempts < store.max_attempts else "failed, out of attempts")
    state = State(settings=settings, store=store, broadcast=broadcast)
    state.metrics = make_metrics(store)
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

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=10))
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
    server.run()
    state.draining.set()
    state.wake.set()
    if state.ready.is_set():
        worker_thread.join(timeout=5)
    if on_exit is not None:
        on_exit()
    store.close()
    return 0

