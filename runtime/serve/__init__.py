"""`python -m runtime serve`: a bundle behind the OpenAI videos API, on one server or many replicas.

    server.py      the process: binds the port, starts the loader and the worker, runs the app, drains on SIGTERM
    routes.py      the HTTP app: the routes, the checks before them, the body limit, error answers
    intake.py      a job's way in, for every route that queues one: ready, room, the body read, queued
    access.py      who may ask: the Host and Origin checks, the API key to its tenant
    tenants.py     the keys file (KEY NAME), constant-time lookups, read again on SIGHUP
    limits.py      what one client may hold: timeouts, connections, uploads and decodes at once, sizes
    protocol.py    uvicorn's h11 protocol with head and body deadlines, its answers in the OpenAI shape
    schema.py      the create request: its fields (types, limits, enums), read from JSON or multipart, checked
    errors.py      ApiError, answered in the OpenAI error shape
    state.py       the settings, and what the routes and the worker share
    worker.py      loads the bundle, then runs claimed jobs one at a time under a lease
    run.py         one job's run (every process of a slice runs it): its params to the pipeline's call
    metrics.py     the Prometheus metrics at /metrics
    playground.py  the playground page at GET / (static files in ui/: HTML, CSS and a script; the public API only)
    jobs.py        the job queue: claims under a lease, writes fenced by (job, owner, attempt)
    db.py          its database: SQLite under the jobs directory, or PostgreSQL shared by replicas
    storage.py     videos and uploaded images: a (shared) directory or an object store
    lease.py       a running job's heartbeat, and giving up when it stalls
    follower.py    processes 1..N-1 of a multi-host slice, running process 0's jobs
"""
