"""Many replicas, one queue: `runtime serve --queue postgresql://...` against a real PostgreSQL server, videos in a
shared directory or an S3-protocol object store.

PostgreSQL is Debian's (`.ci/run` installs it where missing): a fresh cluster made with initdb in a temporary
directory and started with pg_ctl on a loopback port, as the `postgres` user when the tests run as root (the
server refuses root), stopped at the end. Object storage is moto's S3 server on loopback. Servers listen on
127.0.0.1 only; every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from . import pg_bin
from .pg_bin import PROGRAMS as PG_PROGRAMS
from .pg_cluster import Cluster
from .test_serve import Server, _free_port, _mp4_frames, _wait
from .test_stream import assert_same_video, stream_frames

openai = pytest.importorskip("openai")
psycopg = pytest.importorskip("psycopg")
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

LEASE = "2"  # seconds: short, so that a takeover happens within the test


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A PostgreSQL server of its own on a loopback port (tests/pg_cluster.py); yields its admin URL."""
    cluster = Cluster()
    cluster.start()
    try:
        yield cluster.url
    finally:
        cluster.remove()


def test_the_newest_installed_server_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only 15: the newest major version with a server (initdb and pg_ctl) under Debian's layout, numerically."""
    for version, programs in (("9.6", PG_PROGRAMS), ("15", PG_PROGRAMS), ("16", PG_PROGRAMS), ("17", ("pg_ctl",))):
        (tmp_path / version / "bin").mkdir(parents=True)
        for name in programs:
            (tmp_path / version / "bin" / name).touch()
    monkeypatch.setattr(pg_bin.shutil, "which", lambda name: None)  # no pg_config, no initdb on PATH
    assert pg_bin.find(tmp_path) == tmp_path / "16" / "bin"
    assert pg_bin.find(tmp_path / "none") is None


_databases = iter(range(1, 10_000))


@pytest.fixture
def queue_url(postgres: str) -> str:
    """A new, empty database on the module's server."""
    name = f"jobs_{next(_databases)}_{os.getpid()}"
    with psycopg.connect(postgres, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return postgres.rsplit("/", 1)[0] + "/" + name


def _replica(bundle: Path, jobs: Path, queue: str, *extra: str, env: dict[str, str] | None = None) -> Server:
    return Server(bundle, jobs, "--queue", queue, "--lease", LEASE, *extra, env=env)


@contextmanager
def _ready_replicas(bundle: Path, jobs: Path, queue: str, n: int = 2) -> Iterator[list[Server]]:
    """n replicas of one queue and one jobs directory, started at once, ready; SIGKILLed at the end."""
    replicas = [_replica(bundle, jobs, queue) for _ in range(n)]
    try:
        for r in replicas:
            r.wait_ready()
        yield replicas
    finally:
        for r in replicas:
            r.stop(signal.SIGKILL)


def _running_and_other(replicas: list[Server], queue: str, job_id: str) -> tuple[str, Server, Server]:
    """(owner name, the replica running the job, the other one)."""
    owner, pid = _owner_pid(queue, job_id)
    running = next(r for r in replicas if r.proc.pid == pid)
    return owner, running, next(r for r in replicas if r is not running)


def _owner_pid(queue: str, job_id: str) -> tuple[str, int]:
    with psycopg.connect(queue) as conn:
        owner, = conn.execute("SELECT owner FROM jobs WHERE id = %s", (job_id,)).fetchone()
    return owner, int(owner.rsplit(":", 2)[1])


def _rows(queue: str) -> dict[str, tuple]:
    with psycopg.connect(queue) as conn:
        return {r[0]: r[1:] for r in conn.execute("SELECT id, status, attempts, owner, video FROM jobs").fetchall()}


def test_two_replicas_serve_one_queue(fp32_bundles, queue_url: str, tmp_path: Path) -> None:
    """Started at once on an empty database; a job created on one is retrieved, listed, downloaded and deleted
    on the other; 429 comes from the shared queue depth, which both report in /metrics. Then cancels, each sent to
    the replica that is not running the job: a running job stops within one step, its replica takes the next job,
    and it is never taken over when its lease would have run out; a queued job cancelled never runs; a running job
    deleted stops too."""
    import httpx

    from runtime.serve.jobs import open_store

    from .test_serve import _log_until, _running, _stopped_after

    bundle, jobs = fp32_bundles["tiny-64x32-f9"], tmp_path / "shared-jobs"
    a = _replica(bundle, jobs, queue_url, "--queue-size", "1")
    b = _replica(bundle, jobs, queue_url, "--queue-size", "1")
    try:
        a.wait_ready()
        b.wait_ready()
        ca, cb = a.client(key="unused"), b.client(key="unused")
        made = ca.videos.create(prompt="made on a", extra_body={"num_inference_steps": 2, "seed": 1})
        done = _wait(cb, made.id, ("completed", "failed"))
        assert done.status == "completed", (done.error, a.output(), b.output())
        assert made.id in [v.id for v in cb.videos.list().data]
        assert _mp4_frames(cb.videos.download_content(made.id).read(), tmp_path).shape == (9, 32, 64, 3)
        assert _mp4_frames(ca.videos.download_content(made.id).read(), tmp_path).shape == (9, 32, 64, 3)
        assert cb.videos.delete(made.id).deleted
        with pytest.raises(openai.NotFoundError):
            ca.videos.retrieve(made.id)
        assert not list(jobs.glob(f"videos/{made.id}*"))
        # two slow jobs run (one per replica), a third waits: the shared depth is 1, so a fourth is refused. Each is
        # created once the one before has been claimed (a replica claims within a second, not at once: created at
        # once, the second found the first still waiting, and the depth full).
        slow = {"num_inference_steps": 1000}  # the replicas are killed at the end
        running = []
        for i in range(2):
            running.append(ca.videos.create(prompt=f"slow {i}", extra_body=slow))
            _running(ca, running[-1].id)
        waiting = cb.videos.create(prompt="waits", extra_body=slow)
        for client in (ca, cb):
            with pytest.raises(openai.RateLimitError) as e:
                client.videos.create(prompt="refused", extra_body=slow)
            assert e.value.body["code"] == "queue_full"
        for server in (a, b):
            metrics = httpx.get(server.url + "/metrics").text
            assert "wan_aot_queue_depth 1.0" in metrics and 'wan_aot_jobs{status="in_progress"} 2.0' in metrics
        owners = {_owner_pid(queue_url, v.id)[1] for v in running}
        assert owners == {a.proc.pid, b.proc.pid}  # one job each

        # cancel the first through the replica not running it: it stops, and its replica takes the waiting job
        first = running[0]
        _, runs_first, other = _running_and_other([a, b], queue_url, first.id)
        at_cancel = other.client(key="unused").post(f"/videos/{first.id}/cancel", cast_to=openai.types.Video)
        assert (at_cancel.status, at_cancel.error.code) == ("failed", "cancelled")
        log = _log_until(runs_first, f"job {first.id}: cancelled by a client")
        assert _stopped_after(log, first.id) <= 10 * at_cancel.progress + 10  # the step in flight, and no other
        _running(ca, waiting.id)
        assert _owner_pid(queue_url, waiting.id)[1] == runs_first.proc.pid  # the next job, on the freed replica
        # a queued job cancelled never runs: the second is deleted through the replica not running it, which frees
        # the other replica; the cancelled one stays unclaimed
        queued = ca.videos.create(prompt="cancelled while it waits", extra_body=slow)
        cb.post(f"/videos/{queued.id}/cancel", cast_to=openai.types.Video)
        second = running[1]
        _, runs_second, other = _running_and_other([a, b], queue_url, second.id)
        assert other.client(key="unused").videos.delete(second.id).deleted
        _log_until(runs_second, f"job {second.id}: cancelled by a client")
        # a cancelled job whose lease has run out is not taken over: its heartbeat set long past, a claim (as any
        # replica's) finds nothing to take, and the two replicas' own claims found nothing either
        store = open_store(tmp_path / "probe", queue_url, None, lease=float(LEASE))
        try:
            with psycopg.connect(queue_url, autocommit=True) as conn:
                conn.execute("UPDATE jobs SET heartbeat = 0 WHERE id = ANY(%s)", ([first.id, queued.id],))
            assert store.claim() is None
        finally:
            store.close()
        rows = _rows(queue_url)
        assert rows[first.id][:2] == ("failed", 1) and rows[queued.id][:2] == ("failed", 0) and second.id not in rows
        assert not list(jobs.glob(f"videos/{first.id}*")) and not list(jobs.glob(f"videos/{second.id}*"))
        for server in (runs_first, runs_second):
            assert 'wan_aot_replica_jobs_total{outcome="cancelled"} 1.0' in httpx.get(server.url + "/metrics").text
            assert "webhooks: cannot" not in server.output()  # their senders poll this database too
    finally:
        a.stop(signal.SIGKILL)
        b.stop(signal.SIGKILL)


def test_sigkill_of_the_running_replica_loses_nothing(fp32_bundles, queue_url: str, tmp_path: Path) -> None:
    """The replica running a job is killed: after the lease the other one takes the job over; every accepted job
    completes exactly once (one video each), none is lost or left in progress."""
    jobs = tmp_path / "shared-jobs"
    with _ready_replicas(fp32_bundles["tiny-64x32-f9"], jobs, queue_url) as replicas:
        client = replicas[0].client(key="unused")
        long = client.videos.create(prompt="killed while running", extra_body={"num_inference_steps": 400})
        others = [client.videos.create(prompt=f"job {i}", extra_body={"num_inference_steps": 3}) for i in range(4)]
        _wait(client, long.id, "in_progress")
        _, victim, survivor = _running_and_other(replicas, queue_url, long.id)
        victim.stop(signal.SIGKILL)
        client = survivor.client(key="unused")
        for video in (long, *others):
            done = _wait(client, video.id, ("completed", "failed"), timeout=240)
            assert done.status == "completed", (done.error, survivor.output())
        rows = _rows(queue_url)
        assert {status for status, *_ in rows.values()} == {"completed"} and len(rows) == 5
        assert rows[long.id][1] == 2 and rows[long.id][2] == _owner_pid(queue_url, long.id)[0]  # attempt 2
        videos = sorted(p.name for p in (jobs / "videos").glob("*.mp4"))
        assert videos == sorted(Path(video).name for *_, video in rows.values())  # exactly one each
        assert "taken over" not in survivor.output()


def test_a_replica_stopped_past_its_lease_cannot_overwrite_the_new_owner(fp32_bundles, queue_url: str,
                                                                          tmp_path: Path) -> None:
    """SIGSTOP the replica running a job until its lease runs out; the other takes it over and completes it.
    When the stopped one continues, its writes are refused: the job keeps its new owner, attempt and video."""
    jobs = tmp_path / "shared-jobs"
    with _ready_replicas(fp32_bundles["tiny-64x32-f9"], jobs, queue_url) as replicas:
        client = replicas[0].client(key="unused")
        job = client.videos.create(prompt="stopped while running", extra_body={"num_inference_steps": 300})
        _wait(client, job.id, "in_progress")
        first_owner, stopped, other = _running_and_other(replicas, queue_url, job.id)
        pid = stopped.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            client = other.client(key="unused")
            done = _wait(client, job.id, ("completed", "failed"), timeout=240)
            assert done.status == "completed", (done.error, other.output())
            after = _rows(queue_url)[job.id]
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.time() + 120  # the stopped replica finishes its (lost) run and drops it
        while "its result is dropped" not in stopped.output() and time.time() < deadline:
            time.sleep(0.2)
        assert "its result is dropped" in stopped.output(), stopped.output()
        status, attempts, owner, video = _rows(queue_url)[job.id]
        assert (status, attempts, owner, video) == after and owner != first_owner and attempts == 2
        from runtime.serve.jobs import derived_keys

        # the new owner's video, thumbnail and spritesheet; none of the stopped one's
        assert sorted(p.name for p in (jobs / "videos").glob(f"{job.id}*")) == sorted(
            Path(key).name for key in (video, *derived_keys(video)))


def test_replicas_starting_at_once_on_an_empty_database(queue_url: str, tmp_path: Path) -> None:
    """Eight stores opened at once on a fresh database: the schema is created once, each works."""
    from runtime.serve.jobs import open_store

    stores, errors = [], []

    def start(i: int) -> None:
        try:
            stores.append(open_store(tmp_path / f"jobs-{i}", queue_url, None, lease=5))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(stores) == 8
    from runtime.serve.db import SCHEMA_VERSION

    with psycopg.connect(queue_url) as conn:
        assert conn.execute("SELECT version FROM wan_aot_schema").fetchall() == [(SCHEMA_VERSION,)]
    added = stores[0].add(model="m", size="64x32", seconds="1", prompt="p", params={}, images=[], queue_size=4)
    claimed = [s.claim() for s in stores]  # claims race for one job: exactly one store gets it
    assert [c.id for c in claimed if c is not None] == [added.id]
    for s in stores:
        s.close()


def test_claims_are_fenced_and_attempts_are_limited(queue_url: str, tmp_path: Path) -> None:
    """In process, two stores on one database: a lease that ran out is taken over; the first owner's writes are
    refused; a job claimed MAX_ATTEMPTS times fails with a code that says why."""
    from runtime.serve.jobs import Lost, open_store

    a = open_store(tmp_path / "a", queue_url, None, lease=0.3)
    b = open_store(tmp_path / "b", queue_url, None, lease=0.3)
    job = a.add(model="m", size="64x32", seconds="1", prompt="p", params={}, images=[b"\x89PNG"], queue_size=4)
    mine = a.claim()
    assert mine.id == job.id and b.claim() is None  # a's lease is fresh
    assert a.heartbeat(mine)
    time.sleep(0.5)
    theirs = b.claim()  # a stopped heartbeating: b takes it over
    assert theirs.id == job.id and theirs.attempts == 2
    assert not a.heartbeat(mine)
    with pytest.raises(Lost):
        a.set_progress(mine, 50)
    with pytest.raises(Lost):
        a.complete(mine, a.video_key(mine))
    time.sleep(0.5)  # b stops heartbeating too: out of attempts
    assert a.claim() is None
    failed = a.get(job.id)
    assert (failed.status, failed.error_code) == ("failed", "attempts_exhausted")
    assert "stopped (it died, hung or lost the database) 2 times" in failed.error_message
    assert not a.storage.exists(job.images[0])  # its input images are dropped with it
    with pytest.raises(Lost):
        b.complete(theirs, b.video_key(theirs))


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_a_cancelled_job_is_never_claimed_again(database: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """In process, two stores on one database (one SQLite file, or PostgreSQL): a job one runs, cancelled through the
    other, refuses its owner's next write and reads as cancelled (not taken over), and no claim takes it, its lease
    run out or not; a queued job cancelled is never claimed; a running one deleted reads as cancelled too."""
    from runtime.serve.jobs import Lost, open_store

    queue = request.getfixturevalue("queue_url") if database == "postgresql" else f"sqlite://{tmp_path / 'q.db'}"
    a = open_store(tmp_path / "a", queue, None, lease=0.3)
    b = open_store(tmp_path / "b", queue, None, lease=0.3)
    try:
        running = a.add(model="m", size="64x32", seconds="1", prompt="p", params={}, images=[], queue_size=9)
        queued = a.add(model="m", size="64x32", seconds="1", prompt="q", params={}, images=[], queue_size=9)
        mine = a.claim()
        assert mine.id == running.id
        cancelled = b.cancel(running.id)
        assert (cancelled.status, cancelled.error_code) == ("failed", "cancelled")
        with pytest.raises(Lost):
            a.set_progress(mine, 10)
        assert not a.heartbeat(mine) and a.cancelled(mine)
        b.cancel(queued.id)
        with a.db.transaction(exclusive=False) as tx:  # their leases long run out: a running job would be claimed
            tx.execute("UPDATE jobs SET heartbeat = 0")
        assert a.claim() is None and b.claim() is None
        again = a.add(model="m", size="64x32", seconds="1", prompt="r", params={}, images=[], queue_size=9)
        theirs = b.claim()
        assert theirs.id == again.id and a.delete(again.id) is not None and b.cancelled(theirs)
        assert a.get(running.id).attempts == 1 and a.get(queued.id).attempts == 0
    finally:
        a.close()
        b.close()


def test_lease_stops_heartbeating_a_stalled_job() -> None:
    from runtime.serve.lease import Lease

    beats: list[float] = []
    stalled = threading.Event()
    with Lease(lambda: beats.append(time.monotonic()) or True, lease=0.8, stall=0.6, on_stall=stalled.set) as lease:
        for _ in range(4):  # progress every 0.2 s: heartbeats go on
            time.sleep(0.2)
            lease.progress()
        assert beats and not stalled.is_set()
        n = len(beats)
        assert stalled.wait(3)  # then no progress: it stalls, and stops
        assert lease.stalled and len(beats) <= n + 3
    lost = Lease(lambda: False, lease=0.4, stall=10, on_stall=lambda: None)
    with lost:
        time.sleep(0.5)
    assert lost.lost


def test_a_heartbeat_in_flight_as_a_job_ends_is_not_a_takeover(tmp_path: Path, monkeypatch, caplog) -> None:
    """The worker records a job's outcome after its lease has ended: a heartbeat still in flight when the job's
    run returns renews a job in progress, rather than landing after `complete` and reading as a takeover."""
    from types import SimpleNamespace

    from runtime.serve import state as st
    from runtime.serve import worker
    from runtime.serve.storage import Directory

    in_flight, completed = threading.Event(), threading.Event()

    class Store:  # what _run calls, fenced like JobStore: a heartbeat or write on a job not in progress fails
        lease = 0.8  # a heartbeat every 0.2 s
        storage = Directory(tmp_path)

        def heartbeat(self, job) -> bool:
            in_flight.set()
            time.sleep(0.3)  # a slow database write: the job's run returns meanwhile
            return not completed.is_set()

        def video_key(self, job) -> str:
            return "videos/j-1.mp4"

        def preview_key(self, job) -> str:
            return "previews/j-1.png"

        def stream_key(self, job, name: str) -> str:
            return "streams/j-1.m3u8" if name == "stream.m3u8" else f"streams/j-1-{name[7:-3]}.ts"

        def cancelled(self, job) -> bool:
            return False

        def complete(self, job, key: str, also: tuple[str, ...] = ()) -> None:
            assert not completed.is_set()
            completed.set()

    def run_job(pipe, params, images, video, **callbacks):
        assert in_flight.wait(5)  # return while a heartbeat is in flight
        video.write_bytes(b"mp4")
        return np.zeros((1, 8, 8, 3), np.float32)  # the frames: the thumbnail and spritesheet are made of them

    from runtime.serve.limits import Limits

    monkeypatch.setattr(worker, "run_job", run_job)
    state = st.State(settings=SimpleNamespace(stall=10.0, limits=Limits()), store=Store())
    job = SimpleNamespace(id="j", attempts=1, images=[], params={"fps": 16})
    with caplog.at_level("INFO", logger="runtime"):
        worker._run(state, job)
    assert completed.is_set() and (tmp_path / "videos" / "j-1.mp4").read_bytes() == b"mp4"
    assert "job j: completed" in caplog.text and "taken over" not in caplog.text, caplog.text


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    """moto's S3 server on loopback, with a bucket; yields the environment that points s3fs at it."""
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    env = {"FSSPEC_S3_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    import boto3

    boto3.client("s3", endpoint_url=env["FSSPEC_S3_ENDPOINT_URL"], aws_access_key_id="test",
                 aws_secret_access_key="test", region_name="us-east-1").create_bucket(Bucket="videos")
    try:
        yield env
    finally:
        server.stop()


def test_videos_in_an_object_store(fp32_bundles, queue_url: str, s3: dict[str, str], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas with no shared directory: videos and images go to s3://videos/run, content streams from
    either; a write is one put (no partial object)."""
    for k, v in s3.items():
        monkeypatch.setenv(k, v)
    from runtime.serve.storage import ObjectStore

    store = ObjectStore("s3://videos/unit")
    store.put("images/x.img", b"abc")
    with store.writer("videos/y.mp4") as tmp:
        tmp.write_bytes(b"0123456789" * 300_000)
        assert not store.exists("videos/y.mp4")  # nothing there until the block ends
    assert store.read("images/x.img") == b"abc" and b"".join(store.chunks("videos/y.mp4")) == b"0123456789" * 300_000
    store.delete("images/x.img")
    assert not store.exists("images/x.img")

    bundle = fp32_bundles["tiny-64x32-f9"]
    a = _replica(bundle, tmp_path / "a", queue_url, "--videos-url", "s3://videos/run", env=s3)
    b = _replica(bundle, tmp_path / "b", queue_url, "--videos-url", "s3://videos/run", env=s3)
    try:
        a.wait_ready()
        b.wait_ready()
        video = a.client(key="unused").videos.create_and_poll(prompt="to the bucket", poll_interval_ms=50,
                                                              extra_body={"num_inference_steps": 2})
        assert video.status == "completed", (video.error, a.output(), b.output())
        import httpx

        for server in (a, b):  # one of them did not run the job: it serves the video, and its live stream, alike
            data = server.client(key="unused").videos.download_content(video.id).read()
            assert _mp4_frames(data, tmp_path).shape == (9, 32, 64, 3)
            base = f"{server.url}/v1/videos/{video.id}/"
            playlist, frames = stream_frames(httpx.get(base + "stream.m3u8").text,
                                             lambda name: httpx.get(base + name).content)
            assert playlist.ended and len(playlist.durations) == 1
            assert_same_video(frames, _mp4_frames(data, tmp_path))
        assert not list((tmp_path / "a" / "videos").glob("*.mp4")) and not list((tmp_path / "b").glob("videos/*.mp4"))
        assert not list((tmp_path / "a").glob("streams/*")) and not list((tmp_path / "b").glob("streams/*"))
        assert ObjectStore("s3://videos/run").exists(_rows(queue_url)[video.id][3])
    finally:
        a.stop(signal.SIGKILL)
        b.stop(signal.SIGKILL)


def test_a_bad_queue_url_is_one_line(fp32_bundles, postgres: str, tmp_path: Path) -> None:
    """Nothing listening: waited for --queue-wait seconds, then one line naming the flag; a server that refuses (no
    such database) is not waited for; not PostgreSQL at all."""
    from .conftest import run_module

    port = _free_port()
    with socket.socket() as s:  # nothing listens there
        s.bind(("127.0.0.1", port))
    missing = postgres.rsplit("/", 1)[0] + "/no_such_database"
    for url, message in ((f"postgresql://postgres@127.0.0.1:{port}/x", "after 1 s"),
                         (missing, 'database "no_such_database" does not exist'),
                         ("mysql://x", "is not a postgresql:// URL")):
        t0 = time.monotonic()
        proc = run_module("runtime", "serve", str(fp32_bundles["tiny-64x32-f9"]), "--queue", url, "--jobs-dir",
                          str(tmp_path / "jobs"), "--port", str(_free_port()), "--queue-wait", "1", check=False,
                          timeout=120)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert "cannot connect to the job database" in last or "mysql" in url, last
        assert ("--queue-wait SECONDS" in last) == (message == "after 1 s"), last  # only a silence is waited for
        assert time.monotonic() - t0 < 30


def test_a_jobs_directory_from_before_the_lease_columns_is_upgraded(tmp_path: Path) -> None:
    """A single server's SQLite queue written by the previous release (no owner, heartbeat or video columns; videos
    at videos/<id>.mp4, images by bare name) opens, keeps its jobs and runs the queued one."""
    import json
    import sqlite3

    from runtime.serve.jobs import open_store

    jobs = tmp_path / "jobs"
    (jobs / "videos").mkdir(parents=True)
    (jobs / "images").mkdir()
    db = sqlite3.connect(jobs / "jobs.sqlite3")
    db.executescript("""
        CREATE TABLE jobs (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, created_at INTEGER NOT NULL,
            completed_at INTEGER, status TEXT NOT NULL, progress INTEGER NOT NULL DEFAULT 0,
            attempts INTEGER NOT NULL DEFAULT 0, model TEXT NOT NULL, size TEXT NOT NULL, seconds TEXT NOT NULL,
            prompt TEXT NOT NULL, params TEXT NOT NULL, image TEXT, error_code TEXT, error_message TEXT);
        CREATE INDEX jobs_by_status ON jobs (status, seq);
    """)
    row = "INSERT INTO jobs (id, seq, created_at, status, model, size, seconds, prompt, params, image) VALUES " \
          "(?, ?, 1, ?, 'm', '64x32', '1', 'p', '{}', ?)"
    db.execute(row, ("video_old", 1, "completed", "[]"))
    db.execute(row, ("video_waiting", 2, "queued", json.dumps(["video_waiting-0.img"])))
    db.commit()
    db.close()
    (jobs / "videos" / "video_old.mp4").write_bytes(b"old video")
    (jobs / "images" / "video_waiting-0.img").write_bytes(b"image")
    store = open_store(jobs)
    old = store.get("video_old")
    assert old.video == "videos/video_old.mp4" and store.storage.read(old.video) == b"old video"
    assert old.tenant == "default" and [j.id for j in store.list(10, tenant="default")[0]] == ["video_waiting",
                                                                                             "video_old"]
    job = store.claim()
    assert job.id == "video_waiting" and store.storage.read(job.images[0]) == b"image"
    store.complete(job, store.video_key(job))
    assert store.get(job.id).status == "completed" and not store.storage.exists(job.images[0])
    store.close()
