"""`python -m runtime serve`: a bundle behind the OpenAI videos API, on one server or many replicas.

    app.py       the HTTP app, request parsing, the worker that runs claimed jobs
    jobs.py      the job queue: claims under a lease, writes fenced by (job, owner, attempt)
    db.py        its database: SQLite under the jobs directory, or PostgreSQL shared by replicas
    storage.py   videos and uploaded images: a (shared) directory or an object store
    lease.py     a running job's heartbeat, and giving up when it stalls
    follower.py  processes 1..N-1 of a multi-host slice, running process 0's jobs
    ui/          the playground page served at GET / (HTML, CSS and a script; the public API only)
"""
