"""Faults of what a server depends on (issue 61): the queue's PostgreSQL restarting under two replicas, a full disk
under the video storage and under the jobs directory, an object store failing.

The database is a cluster of the test's own (tests/pg_cluster.py), stopped and started again on its data directory.
The disk is a small tmpfs mounted for the test (root only: the test is skipped, saying so, where mounting is not
allowed), filled by a file until nothing is left. The store is moto's S3 server behind a proxy the test turns off.
Apart from the replicas, the app and its worker run in this process on the tiny bundle.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import runtime

PROMPT = "a full disk"


@contextlib.contextmanager
def small_disk(path: Path, size: str = "512k") -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> Path:
    """A file that takes every free byte of `path`'s filesystem."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for block in (1 << 16, 4096, 512, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * block)
    finally:
        os.close(fd)
    return filler


def _app(tmp_path: Path, bundle: Path, db_dir: Path, videos: Path | object):
    from fastapi.testclient import TestClient

    from runtime.serve.db import open_database
    from runtime.serve.jobs import JobStore
    from runtime.serve.metrics import make_metrics
    from runtime.serve.routes import create_app
    from runtime.serve.schema import Offer
    from runtime.serve.state import Settings, State
    from runtime.serve.storage import Directory

    pipe = runtime.load(bundle)
    store = JobStore(open_database(None, db_dir), Directory(videos) if isinstance(videos, Path) else videos)
    state = State(settings=Settings(bundle=bundle, jobs_dir=db_dir), store=store,
                  offer=Offer.of(pipe.manifest, bundle.name))
    state.pipe = pipe
    state.metrics = make_metrics(store)
    state.ready.set()
    return TestClient(create_app(state), base_url="http://127.0.0.1"), state


def _metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}")


def test_a_full_video_storage_fails_the_job_and_the_next_one_completes(fp32_bundles, tmp_path: Path) -> None:
    """The video storage's disk full while a job runs: the job fails with `storage_full` and a message saying so,
    nothing is left in the storage (no partial file, no video), the server answers on (health, the list, the job),
    the worker takes the next job, and once space is freed that job completes and its video plays."""
    from runtime.serve import worker

    from .test_serve import _mp4_frames

    with small_disk(tmp_path / "videos") as videos:
        client, state = _app(tmp_path, fp32_bundles["tiny-64x32-f9"], tmp_path / "jobs", videos)
        before = set(os.listdir(videos))
        filler = fill(videos)
        first = client.post("/v1/videos", json={"prompt": PROMPT, "num_inference_steps": 1}).json()["id"]
        worker._run(state, state.store.claim())
        job = client.get(f"/v1/videos/{first}").json()
        assert job["status"] == "failed" and job["error"]["code"] == "storage_full", job
        assert "the video storage is full" in job["error"]["message"]
        left = {str(p.relative_to(videos)) for p in videos.rglob("*") if p.is_file()} - {"filler"}
        assert not left, left  # no partial file, no video, no thumbnail
        assert set(os.listdir(videos)) == before | {"filler"}
        assert client.get(f"/v1/videos/{first}/content").status_code == 409
        assert client.get("/health").status_code == 200 and client.get("/v1/videos").status_code == 200
        assert _metric(client, 'wan_aot_storage_errors_total{kind="full"}') == 1.0

        filler.unlink()
        second = client.post("/v1/videos", json={"prompt": PROMPT, "num_inference_steps": 1}).json()["id"]
        worker._run(state, state.store.claim())
        assert client.get(f"/v1/videos/{second}").json()["status"] == "completed"
        assert _mp4_frames(client.get(f"/v1/videos/{second}/content").content, tmp_path).shape == (9, 32, 64, 3)
        state.store.close()


def test_a_full_jobs_directory_refuses_creates_with_507_and_reads_go_on(fp32_bundles, tmp_path: Path) -> None:
    """SQLite under a full --jobs-dir: once its database cannot grow, a create is a 507 in the OpenAI shape (code
    `storage_full`, Retry-After) and queues nothing (the list counts the jobs that got a 200); the list and the jobs
    already there are still read. (SQLite may fit a few more rows in pages it has: the creates go on until one is
    refused, and every later one is.)"""
    with small_disk(tmp_path / "jobs", "1m") as jobs:
        client, state = _app(tmp_path, fp32_bundles["tiny-64x32-f9"], jobs, jobs)
        made = client.post("/v1/videos", json={"prompt": PROMPT, "num_inference_steps": 1})
        assert made.status_code == 200, made.text
        fill(jobs)
        answers = [client.post("/v1/videos", json={"prompt": PROMPT * 50}) for _ in range(60)]
        codes = [r.status_code for r in answers]
        assert 507 in codes and set(codes[codes.index(507):]) == {507}, codes
        full = answers[-1]
        error = full.json()["error"]
        assert error["code"] == "storage_full" and "storage is full" in error["message"], error
        assert full.headers["retry-after"] == "60"
        listed = client.get("/v1/videos?limit=100")
        assert listed.status_code == 200 and len(listed.json()["data"]) == 1 + codes.count(200)
        assert client.get(f"/v1/videos/{made.json()['id']}").status_code == 200
        assert client.get("/health").status_code == 200
        assert _metric(client, 'wan_aot_storage_errors_total{kind="full"}') == codes.count(507)
        state.store.close()


def test_a_video_left_short_is_never_renamed_into_place(tmp_path: Path) -> None:
    """An mp4 cut short (as ffmpeg can leave one, exiting 0, on a full disk) or empty fails the container check that
    write_video runs before its rename; a whole one passes."""
    import numpy as np

    from runtime.video import check_complete, write_video

    path = write_video(np.random.default_rng(0).random((9, 32, 64, 3), dtype=np.float32), tmp_path / "v.mp4")
    check_complete(path)
    data = path.read_bytes()
    for cut in (0, 1, len(data) // 2, len(data) - 1):
        (tmp_path / "short.mp4").write_bytes(data[:cut])
        with pytest.raises(OSError, match="incomplete"):
            check_complete(tmp_path / "short.mp4")


def _until(what: Callable[[], object], timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.1)


def test_a_database_restart_loses_no_job(fp32_bundles, tmp_path: Path) -> None:
    """Two replicas started before their PostgreSQL (each waits, saying so), then one job running on each and two
    queued when the database is stopped (`pg_ctl stop -m fast`) for OUTAGE_S, longer than the lease. While it is down
    each replica answers a retrieve and a create with a 503 in the OpenAI shape (code database_unavailable, Retry-After)
    within seconds, /ready with 503, and wan_aot_queue_db_up 0. Once it is back: no replica exited, every job
    completed exactly once (one "completed" line across both logs; a replica whose job was taken over meanwhile drops
    its result), every job's video.completed webhook was delivered, and each replica said once that the database went
    away and once that it came back."""
    import httpx

    from .pg_cluster import Cluster
    from .test_serve import Server, _wait
    from .test_webhooks import SERVER_SECRET, Receiver

    outage_s = 8.0
    cluster, receiver = Cluster(), Receiver()
    bundle, jobs = fp32_bundles["tiny-64x32-f9"], tmp_path / "jobs"
    args = ("--queue", cluster.url, "--lease", "3", "--webhook-allow", "127.0.0.1", "--webhook-url",
            receiver.url("/hook"), "--webhook-secret", SERVER_SECRET)
    replicas = [Server(bundle, jobs, *args) for _ in range(2)]
    try:
        _until(lambda: all("waiting for the job database" in r.output() for r in replicas), 60,
               "the replicas did not say they wait for their database")
        assert all(r.proc.poll() is None for r in replicas)
        cluster.start()
        for r in replicas:
            r.wait_ready()
        client = replicas[0].client(key="unused")
        videos = [client.videos.create(prompt=f"job {i}", extra_body={"num_inference_steps": n, "seed": i})
                  for i, n in enumerate((400, 400, 3, 3))]  # the first two overlap: one on each replica

        def running() -> set[str]:
            import psycopg

            with psycopg.connect(cluster.url) as conn:
                return {o for o, in conn.execute("SELECT owner FROM jobs WHERE status = 'in_progress'").fetchall()}

        _until(lambda: len(running()) == 2, 120, "not one job running on each replica")
        cluster.stop("fast")
        down = time.monotonic()
        for r in replicas:
            t0 = time.monotonic()
            got = httpx.get(f"{r.url}/v1/videos/{videos[0].id}", timeout=30)
            made = httpx.post(f"{r.url}/v1/videos", json={"prompt": "while it is down"}, timeout=30)
            for answer in (got, made):
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "database_unavailable", answer.text
                assert int(answer.headers["retry-after"]) > 0
            ready = httpx.get(f"{r.url}/ready", timeout=30)
            assert ready.status_code == 503 and ready.json()["status"] == "database_unavailable"
            assert re.search(r"^wan_aot_queue_db_up 0", httpx.get(f"{r.url}/metrics", timeout=30).text, re.M)
            assert time.monotonic() - t0 < 15, "the answers while the database is down took too long"
        time.sleep(max(0.0, outage_s - (time.monotonic() - down)))
        cluster.start()
        back = time.monotonic()
        for r in replicas:  # by itself: nothing but time
            _until(lambda r=r: httpx.get(f"{r.url}/ready", timeout=30).status_code == 200, 30, "not ready again")
        reconnected = time.monotonic() - back
        for video in videos:
            done = _wait(client, video.id, ("completed", "failed"), timeout=240)
            assert done.status == "completed", (done.error, replicas[0].output(), replicas[1].output())
        assert all(r.proc.poll() is None for r in replicas), "a replica exited"
        logs = [r.output() for r in replicas]
        for video in videos:
            assert sum(log.count(f"job {video.id}: completed") for log in logs) == 1, video.id
        delivered = receiver.wait("/hook", len(videos), timeout=60)
        assert {json.loads(body)["data"]["id"] for _, body in delivered} == {v.id for v in videos}
        for log in logs:
            assert log.count("is unreachable (") == 1 and log.count("is back after") == 1, log
            assert "Traceback" not in log, log
        assert reconnected < 20, reconnected
        for r in replicas:
            text = httpx.get(f"{r.url}/metrics", timeout=30).text
            assert re.search(r"^wan_aot_queue_db_up 1", text, re.M)
            assert float(re.search(r"^wan_aot_queue_db_errors_total (\S+)", text, re.M).group(1)) > 0
    finally:
        for r in replicas:
            r.stop(signal.SIGKILL)
        receiver.stop()
        cluster.remove()


class FailingS3:
    """moto's S3 server (a bucket `videos`) behind a loopback relay that passes requests on, or, while `down`, answers
    each with a 500 InternalError, counting them (`failed`); `close()` stops it listening (the store cannot be
    reached: connections refused) and `reopen()` listens again on the same port (moto itself stays up: a restarted
    moto forgets its buckets)."""

    def __init__(self) -> None:
        import http.client
        import http.server
        import threading

        import boto3
        from moto.server import ThreadedMotoServer

        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        boto3.client("s3", endpoint_url=f"http://{host}:{port}", aws_access_key_id="test",
                     aws_secret_access_key="test", region_name="us-east-1").create_bucket(Bucket="videos")
        self.down, self.failed = False, 0
        self.connections: set = set()  # the clients' open (kept-alive) connections: cut by close()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                proxy.connections.add(self.connection)

            def finish(self) -> None:
                proxy.connections.discard(self.connection)
                with contextlib.suppress(OSError):
                    super().finish()

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                head = self.command == "HEAD"
                if proxy.down:
                    proxy.failed += 1
                    status, headers = 500, []
                    data = b"<Error><Code>InternalError</Code><Message>the test's outage</Message></Error>"
                else:
                    upstream = http.client.HTTPConnection(host, port, timeout=30)
                    upstream.request(self.command, self.path, body, dict(self.headers.items()))
                    answer = upstream.getresponse()
                    status, headers, data = answer.status, answer.getheaders(), answer.read()
                    upstream.close()
                self.send_response(status)
                for k, v in headers:  # a HEAD's content-length is the object's
                    if k.lower() not in ("transfer-encoding", "connection", "server", "date") and (
                            head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("content-length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

            def log_message(self, *args: object) -> None:
                pass

        self._serve = lambda port: http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.http = self._serve(0)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.port = self.http.server_address[1]
        self.env = {"FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{self.port}",
                    "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_MAX_ATTEMPTS": "1"}  # one request per try: the retries timed here are the server's own

    def close(self) -> None:
        import socket

        self.http.shutdown()
        self.http.server_close()
        self.http = None
        for conn in list(self.connections):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def reopen(self) -> None:
        import threading

        self.http = self._serve(self.port)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.http is not None:
            self.close()
        self.moto.stop()


def test_a_failing_object_store_is_retried_then_fails_the_job(fp32_bundles, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Videos in an S3 store. While it answers 500 to everything, a client's download of a stored video is a 503 in
    the OpenAI shape (code storage_unavailable, Retry-After), not a 500. A job whose store cannot be reached (the relay
    closed) for OUTAGE_S as it ends retries its upload with backoff and completes once the store is back, its video
    whole; with the outage past --store-retry-seconds a job fails with storage_unavailable, nothing of it stored, and
    the server goes on. wan_aot_storage_errors_total{kind="unavailable"} counts the reads and the failed job."""
    import threading

    from runtime.serve import worker
    from runtime.serve.storage import ObjectStore

    from .test_serve import _mp4_frames

    outage_s = 10.0
    s3 = FailingS3()
    try:
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        storage = ObjectStore("s3://videos/faults", retry=60)
        client, state = _app(tmp_path, fp32_bundles["tiny-64x32-f9"], tmp_path / "jobs", storage)

        def job() -> str:
            made = client.post("/v1/videos", json={"prompt": PROMPT, "num_inference_steps": 1})
            assert made.status_code == 200, made.text
            return made.json()["id"]

        first = job()
        worker._run(state, state.store.claim())
        assert client.get(f"/v1/videos/{first}").json()["status"] == "completed"

        s3.down = True
        for variant in ("", "?variant=thumbnail"):
            read = client.get(f"/v1/videos/{first}/content{variant}")
            assert read.status_code == 503 and read.json()["error"]["code"] == "storage_unavailable", read.text
            assert read.headers["retry-after"] == "5"
        s3.down = False

        second = job()  # no file of its own: queued, then the store goes away as it runs
        s3.close()
        closed = time.monotonic()
        run = threading.Thread(target=worker._run, args=(state, state.store.claim()))
        run.start()
        time.sleep(max(0.0, outage_s - (time.monotonic() - closed)))
        assert run.is_alive(), "the job did not wait for its store"
        s3.reopen()
        run.join(90)
        assert not run.is_alive()
        done = client.get(f"/v1/videos/{second}").json()
        assert done["status"] == "completed", done
        assert _mp4_frames(client.get(f"/v1/videos/{second}/content").content, tmp_path).shape == (9, 32, 64, 3)

        storage.retry = 2.0  # --store-retry-seconds 2
        third = job()
        s3.close()
        worker._run(state, state.store.claim())
        failed = client.get(f"/v1/videos/{third}").json()
        assert failed["status"] == "failed" and failed["error"]["code"] == "storage_unavailable", failed
        assert "submit the job again" in failed["error"]["message"]
        assert client.get("/health").status_code == 200 and client.get("/v1/videos").status_code == 200
        s3.reopen()
        assert not [k for k in storage.fs.ls("videos/faults/videos", refresh=True) if third in k]
        assert _metric(client, 'wan_aot_storage_errors_total{kind="unavailable"}') == 3.0  # two reads, one job
        state.store.close()
    finally:
        s3.stop()
