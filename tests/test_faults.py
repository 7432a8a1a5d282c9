"""Faults of what a server depends on (issue 61): a full disk under the video storage and under the jobs directory.

The disk is a small tmpfs mounted for the test (root only: the test is skipped, saying so, where mounting is not
allowed), filled by a file until nothing is left. The app and its worker run in this process on the tiny bundle.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
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


def _app(tmp_path: Path, bundle: Path, db_dir: Path, videos: Path):
    from fastapi.testclient import TestClient

    from runtime.serve.db import open_database
    from runtime.serve.jobs import JobStore
    from runtime.serve.metrics import make_metrics
    from runtime.serve.routes import create_app
    from runtime.serve.schema import Offer
    from runtime.serve.state import Settings, State
    from runtime.serve.storage import Directory

    pipe = runtime.load(bundle)
    store = JobStore(open_database(None, db_dir), Directory(videos))
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
