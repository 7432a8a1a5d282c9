"""Tenants (`runtime serve --api-keys FILE`): each sees only its own videos (another's id is a 404), the queue takes
turns between them on SQLite and PostgreSQL alike, /metrics counts jobs per tenant name, and a key taken out of the
file stops working on SIGHUP; then all of it across two replicas on one PostgreSQL queue.

In-process tests run the HTTP app on a job store with no worker (jobs stay queued) and a stand-in for the pipeline;
the replica test starts real servers on the tiny bundle. PostgreSQL is test_replicas.py's (its own server on a
loopback port). Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime.errors import UserError

from .test_replicas import _replica, postgres, queue_url  # noqa: F401  (fixtures)
from .test_serve import _mp4_frames, _wait

openai = pytest.importorskip("openai")
psycopg = pytest.importorskip("psycopg")
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

KEYS = {"sk-alice-1f0e9d8c7b6a": "alice", "sk-bob-5a4b3c2d1e0f": "bob", "sk-bob-new-77aa88bb99cc": "bob",
        "sk-carol-0123456789ab": "carol"}
ALICE, BOB, BOB_NEW, CAROL = KEYS


def _keys_file(path: Path, keys: dict[str, str]) -> Path:
    path.write_text("# the server's tenants\n\n" + "".join(f"{k} {name}\n" for k, name in keys.items()))
    return path


def test_the_keys_file(tmp_path: Path) -> None:
    """`KEY NAME` lines (comments, blank lines, a tenant with two keys); bad lines are one error naming the line,
    never quoting a key; a reload that fails keeps the keys the server had; --api-key is the `default` tenant."""
    from runtime.serve.tenants import Keys

    keys = Keys.load(_keys_file(tmp_path / "keys", KEYS), "sk-single \n")
    assert [keys.tenant(k) for k in (ALICE, BOB, BOB_NEW, CAROL, "sk-single")] == ["alice", "bob", "bob", "carol",
                                                                                   "default"]
    assert keys.tenant("sk-alice") is None and keys.tenant(ALICE + "x") is None and keys.tenant("") is None
    for text, message in ((f"{ALICE}\n", "line 1: expected `KEY NAME` (two words), found 1"),
                          (f"{ALICE} alice\n{ALICE} again\n", "line 2: the same key as line 1"),
                          (f"{ALICE} al/ice\n", "line 1: tenant name 'al/ice' must be"),
                          ("# nothing\n", "has no `KEY NAME` line")):
        (tmp_path / "bad").write_text(text)
        with pytest.raises(UserError) as e:
            Keys.load(tmp_path / "bad", None)
        assert message in str(e.value) and ALICE not in str(e.value), str(e.value)
    (tmp_path / "keys").write_text("not a key file at all\n")
    with pytest.raises(UserError):
        keys.reload()
    assert keys.tenant(ALICE) == "alice"  # kept
    with pytest.raises(UserError, match="cannot read it"):
        Keys.load(tmp_path / "missing", None)
    assert Keys.load(None, None) is None


def test_a_bad_keys_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    from .conftest import run_cli

    (tmp_path / "keys").write_text(f"{ALICE}\n")
    proc = run_cli("runtime", "serve", str(tmp_path / "nowhere"), "--api-keys", str(tmp_path / "keys"), check=False)
    assert proc.returncode == 2 and proc.stderr == f"error: --api-keys {tmp_path / 'keys'} line 1: expected `KEY " \
                                                   "NAME` (two words), found 1\n", proc.stderr


def app_client(tmp_path: Path, kind: str = "t2v", **settings) -> tuple[object, object]:
    """(TestClient, State): the HTTP app on a SQLite store under tmp_path, no worker (jobs stay queued), the
    pipeline a stand-in (the schedule check passes); `settings` go to Settings."""
    from fastapi.testclient import TestClient

    from runtime import kinds
    from runtime.manifest import Defaults
    from runtime.serve.jobs import open_store
    from runtime.serve.metrics import make_metrics
    from runtime.serve.routes import create_app
    from runtime.serve.schema import Offer
    from runtime.serve.state import Settings, State

    offer = Offer(models=("tiny",), shapes=(("64x32", 9),), kind=kinds.get(kind),
                  defaults=Defaults(steps=4, guidance=5.0, flow_shift=3.0))
    state = State(settings=Settings(bundle=tmp_path / "tiny", jobs_dir=tmp_path / "jobs", **settings),
                  store=open_store(tmp_path / "jobs"), offer=offer)
    state.pipe = SimpleNamespace(settings=lambda seed, steps, *rest: SimpleNamespace(steps=steps or 4))
    state.metrics = make_metrics(state.store)
    state.ready.set()
    return TestClient(create_app(state), base_url="http://127.0.0.1"), state


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_tenant_sees_only_its_own_videos(tmp_path: Path) -> None:
    """Retrieve, content, list (and `after`) and delete of another tenant's video answer as for an unknown id (404),
    on any page; its own are there; /metrics counts per tenant name, never naming a key."""
    from runtime.serve.tenants import Keys

    client, state = app_client(tmp_path, keys=Keys.load(_keys_file(tmp_path / "keys", KEYS), None))
    store = state.store
    made = {}
    for key, prompt in ((ALICE, "alice's fox"), (BOB, "bob's cat"), (ALICE, "alice's owl")):
        r = client.post("/v1/videos", json={"prompt": prompt}, headers=_bearer(key))
        assert r.status_code == 200, r.text
        made[prompt] = r.json()["id"]
    job = store.claim()  # alice's fox, completed with a video
    with store.storage.writer(store.video_key(job)) as tmp:
        tmp.write_bytes(b"an mp4")
    store.complete(job, store.video_key(job))
    fox, cat = made["alice's fox"], made["bob's cat"]
    for key in (BOB, BOB_NEW, CAROL):
        for method, path in (("GET", f"/v1/videos/{fox}"), ("GET", f"/v1/videos/{fox}/content"),
                             ("DELETE", f"/v1/videos/{fox}"), ("GET", f"/v1/videos?after={fox}")):
            r = client.request(method, path, headers=_bearer(key))
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (key, path, r.text)
    assert client.get(f"/v1/videos/{fox}/content", headers=_bearer(ALICE)).content == b"an mp4"
    listed = {key: [v["prompt"] for v in client.get("/v1/videos", headers=_bearer(key)).json()["data"]]
              for key in (ALICE, BOB, BOB_NEW, CAROL)}
    assert listed == {ALICE: ["alice's owl", "alice's fox"], BOB: ["bob's cat"], BOB_NEW: ["bob's cat"], CAROL: []}
    owl = made["alice's owl"]
    assert [v["id"] for v in client.get(f"/v1/videos?after={owl}", headers=_bearer(ALICE)).json()["data"]] == [fox]
    assert client.get(f"/v1/videos/{cat}", headers=_bearer(BOB_NEW)).json()["prompt"] == "bob's cat"  # bob's 2nd key
    assert client.delete(f"/v1/videos/{fox}", headers=_bearer(ALICE)).json()["deleted"]
    assert store.get(cat) is not None and store.get(fox) is None
    metrics = client.get("/metrics").text
    assert 'wan_aot_tenant_jobs{status="queued",tenant="alice"} 1.0' in metrics
    assert 'wan_aot_tenant_jobs{status="queued",tenant="bob"} 1.0' in metrics
    assert not any(key in metrics for key in KEYS)


def test_without_keys_every_job_is_the_default_tenants(tmp_path: Path) -> None:
    client, state = app_client(tmp_path)
    video = client.post("/v1/videos", json={"prompt": "a"}).json()
    assert state.store.get(video["id"]).tenant == "default"
    assert client.get(f"/v1/videos/{video['id']}").status_code == 200


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    return None if request.param == "sqlite" else request.getfixturevalue("queue_url")


def test_the_queue_takes_turns_between_tenants(store_url: str | None, tmp_path: Path) -> None:
    """Round robin between the tenants with queued jobs, oldest first within each: tenant A queues 10, then B one,
    then C one: B's starts second and C's third, not eleventh and twelfth. A tenant's turn is kept where it was
    served, not in its jobs, so deleting its finished videos does not move it up the queue."""
    from runtime.serve.jobs import open_store

    store = open_store(tmp_path / "jobs", store_url, None, lease=60)
    names = {}
    for tenant, n in (("a", 10), ("b", 1), ("c", 1)):
        for i in range(n):
            job = store.add(model="m", size="64x32", seconds="1", prompt=f"{tenant}{i}", params={}, images=[],
                            queue_size=100, tenant=tenant)
            names[job.id] = job.prompt
    order = []
    while (job := store.claim()) is not None:
        order.append(names[job.id])
        store.complete(job, store.video_key(job))
        store.delete(job.id, job.tenant)  # as a client that downloads, then deletes
        if order == ["a0", "b0", "c0", "a1"]:  # b and c queue one more each, a while has been served
            for tenant in "bc":
                job = store.add(model="m", size="64x32", seconds="1", prompt=f"{tenant}1", params={}, images=[],
                                queue_size=100, tenant=tenant)
                names[job.id] = job.prompt
    assert order == ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "a3", "a4", "a5", "a6", "a7", "a8", "a9"], order
    store.close()


def test_a_replica_prefers_jobs_of_the_lora_set_it_holds(store_url: str | None, tmp_path: Path) -> None:
    """LoRA affinity (`--lora-affinity-max N`): a replica takes the first queued job, in the order the tenants' turns
    give, whose set is the one its weights hold, unless a job ahead of it was passed over N times already; on SQLite
    and PostgreSQL alike. A, B, A, B, A, B from no adapter: 2 switches with N = 4 (6 in strict turns); N = 1 lets no
    job be passed twice. Between tenants the turns still order the jobs: bob's first job waits two of alice's, not
    three."""
    from runtime.serve.jobs import open_store
    from runtime.serve.loras import set_key

    store = open_store(tmp_path / "jobs", store_url, None, lease=60)

    def queue(jobs: str, tenants: str = "") -> None:  # "ABAB": one job of each set; tenants: one letter a job
        for i, name in enumerate(jobs):
            tenant = tenants[i] if tenants else "t"
            n = sum(1 for j in range(i) if jobs[j] == name and (not tenants or tenants[j] == tenant))
            store.add(model="m", size="64x32", seconds="1", prompt=f"{tenant if tenants else ''}{name}{n + 1}",
                      params={"lora": [{"name": name, "scale": 1.0, "expert": None}]}, images=[], queue_size=100,
                      tenant=tenant)

    def run(passes: int) -> tuple[list[str], int, int]:
        held, order, switches = "[]", [], 0
        while (job := store.claim(held, passes)) is not None:
            key = set_key(job.params["lora"])
            switches, held = switches + (key != held), key
            order.append(job.prompt)
            store.complete(job, store.video_key(job))
        with store.db.transaction(exclusive=False) as tx:
            most = tx.one("SELECT MAX(lora_passed) FROM jobs")[0]
            tx.execute("DELETE FROM jobs")
        return order, switches, int(most)

    queue("ABABAB")
    assert run(4) == (["A1", "A2", "A3", "B1", "B2", "B3"], 2, 2)
    queue("ABABAB")
    assert run(0) == (["A1", "B1", "A2", "B2", "A3", "B3"], 6, 0)
    queue("ABABAB")
    assert run(1) == (["A1", "A2", "B1", "B2", "B3", "A3"], 3, 1)
    queue("ABABAB", tenants="ababab")  # alice's jobs are A, bob's B
    assert run(4) == (["aA1", "aA2", "aA3", "bB1", "bB2", "bB3"], 2, 2)
    store.close()


def test_a_tenant_may_have_only_so_many_jobs_waiting(tmp_path: Path) -> None:
    """--tenant-queue-size: one tenant's burst cannot fill the whole queue for the others."""
    from runtime.serve.tenants import Keys

    client, state = app_client(tmp_path, keys=Keys.load(_keys_file(tmp_path / "keys", KEYS), None), queue_size=4,
                               tenant_queue_size=2)
    assert [client.post("/v1/videos", json={"prompt": "a"}, headers=_bearer(ALICE)).status_code
            for _ in range(3)] == [200, 200, 429]
    r = client.post("/v1/videos", json={"prompt": "a"}, headers=_bearer(ALICE))
    assert r.json()["error"]["code"] == "queue_full" and "as many as one tenant may" in r.json()["error"]["message"]
    assert [client.post("/v1/videos", json={"prompt": "b"}, headers=_bearer(BOB)).status_code
            for _ in range(3)] == [200, 200, 429]
    r = client.post("/v1/videos", json={"prompt": "c"}, headers=_bearer(CAROL))
    assert r.status_code == 429 and "the queue is full (4 jobs waiting)" in r.json()["error"]["message"]


def test_a_version_1_postgresql_queue_is_upgraded(queue_url: str, tmp_path: Path) -> None:  # noqa: F811
    """A job database of the release before tenants: its jobs become the default tenant's, the version row 2."""
    from runtime.serve.db import SCHEMA_VERSION
    from runtime.serve.jobs import open_store

    with psycopg.connect(queue_url, autocommit=True) as conn:
        conn.execute("""CREATE TABLE jobs (id TEXT PRIMARY KEY, seq BIGINT NOT NULL, created_at BIGINT NOT NULL,
            completed_at BIGINT, status TEXT NOT NULL, progress INTEGER NOT NULL DEFAULT 0,
            attempts INTEGER NOT NULL DEFAULT 0, model TEXT NOT NULL, size TEXT NOT NULL, seconds TEXT NOT NULL,
            prompt TEXT NOT NULL, params TEXT NOT NULL, image TEXT, error_code TEXT, error_message TEXT, owner TEXT,
            heartbeat DOUBLE PRECISION NOT NULL DEFAULT 0, video TEXT)""")
        conn.execute("CREATE TABLE wan_aot_schema (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO wan_aot_schema VALUES (1)")
        conn.execute("INSERT INTO jobs (id, seq, created_at, status, model, size, seconds, prompt, params) VALUES "
                     "('video_old', 1, 1, 'queued', 'm', '64x32', '1', 'p', '{}')")
    store = open_store(tmp_path / "jobs", queue_url, None)
    assert store.get("video_old").tenant == "default" and store.get("video_old", "alice") is None
    assert store.claim().id == "video_old"
    store.close()
    with psycopg.connect(queue_url) as conn:
        assert conn.execute("SELECT version FROM wan_aot_schema").fetchall() == [(SCHEMA_VERSION,)]


def _poll_starts(queue: str, ids: list[str], timeout: float) -> list[str]:
    """The jobs in the order they left the queue (polled every 20 ms until all did)."""
    started: list[str] = []
    deadline = time.time() + timeout
    with psycopg.connect(queue, autocommit=True) as conn:
        while len(started) < len(ids) and time.time() < deadline:
            rows = conn.execute("SELECT id FROM jobs WHERE id = ANY(%s) AND status != 'queued' ORDER BY seq",
                                (ids,)).fetchall()
            started += [job_id for (job_id,) in rows if job_id not in started]
            time.sleep(0.02)
    return started


@pytest.fixture
def replicas(fp32_bundles, queue_url: str, tmp_path: Path) -> Iterator[tuple[list, Path]]:  # noqa: F811
    """Two replicas of one PostgreSQL queue with the tenants' keys file; SIGKILLed at the end."""
    keys = _keys_file(tmp_path / "keys", KEYS)
    servers = [_replica(fp32_bundles["tiny-64x32-f9"], tmp_path / "shared-jobs", queue_url, "--api-keys", str(keys))
               for _ in range(2)]
    try:
        for server in servers:
            server.wait_ready()
        yield servers, keys
    finally:
        for server in servers:
            server.stop(signal.SIGKILL)


def test_tenants_across_two_replicas(replicas, queue_url: str, tmp_path: Path) -> None:  # noqa: F811
    """The issue's acceptance test, on two replicas of one PostgreSQL queue. Fairness: while both replicas are busy
    (carol's two long jobs), tenant A queues 10 jobs, then tenant B one: B's starts before A's third. Isolation: on
    either replica, B's keys get 404 for A's video (retrieve, content, delete, `after`) and list only B's. /metrics
    counts per tenant name. Revocation: a key taken out of the file stops working on both replicas at SIGHUP, the
    tenant's other key goes on. No key ever reaches a log."""
    import httpx

    (a, b), keys = replicas
    carol = [a.client(key=CAROL), b.client(key=CAROL)]
    blockers = [carol[0].videos.create(prompt=f"carol {i}", extra_body={"num_inference_steps": 1000}) for i in range(2)]
    for video in blockers:
        _wait(carol[0], video.id, "in_progress")
    alice, bob = a.client(key=ALICE), b.client(key=BOB)
    mine = [alice.videos.create(prompt=f"alice {i}", extra_body={"num_inference_steps": 40, "seed": i}).id
            for i in range(10)]
    theirs = bob.videos.create(prompt="bob", extra_body={"num_inference_steps": 40}).id
    assert {carol[1].videos.retrieve(v.id).status for v in blockers} == {"in_progress"}  # all queued while both ran
    order = _poll_starts(queue_url, [*mine, theirs], timeout=240)
    assert len(order) == 11, (order, a.output(), b.output())
    assert order.index(theirs) < order.index(mine[2]), [("bob" if i == theirs else mine.index(i)) for i in order]
    for video_id in (*mine, theirs):
        client = bob if video_id == theirs else alice
        assert _wait(client, video_id, ("completed", "failed"), timeout=240).status == "completed"

    for server in (a, b):
        for key in (BOB, BOB_NEW):
            client = server.client(key=key)
            for call, kwargs in ((client.videos.retrieve, {}), (client.videos.download_content, {}),
                                 (client.videos.delete, {}), (client.videos.list, {"after": mine[0]})):
                with pytest.raises(openai.NotFoundError):
                    call(**kwargs) if kwargs else call(mine[0])
            assert [v.id for v in client.videos.list().data] == [theirs]
        assert len(server.client(key=ALICE).videos.list(limit=100).data) == 10
        shape = _mp4_frames(server.client(key=ALICE).videos.download_content(mine[0]).read(), tmp_path).shape
        assert shape == (9, 32, 64, 3)
        metrics = httpx.get(server.url + "/metrics").text
        assert 'wan_aot_tenant_jobs{status="completed",tenant="alice"} 10.0' in metrics
        assert 'wan_aot_tenant_jobs{status="completed",tenant="bob"} 1.0' in metrics
        assert not any(key in metrics for key in KEYS)

    _keys_file(keys, {k: v for k, v in KEYS.items() if k != BOB})  # bob's first key revoked
    for server in (a, b):
        os.kill(server.proc.pid, signal.SIGHUP)
    deadline = time.time() + 30
    while not all("SIGHUP: read" in s.output() for s in (a, b)) and time.time() < deadline:
        time.sleep(0.1)
    for server in (a, b):
        assert "SIGHUP: read" in server.output() and "3 keys of 3 tenants (alice, bob, carol)" in server.output()
        with pytest.raises(openai.AuthenticationError):
            server.client(key=BOB).videos.list()
        assert [v.id for v in server.client(key=BOB_NEW).videos.list().data] == [theirs]
        assert server.client(key=ALICE).videos.retrieve(mine[0]).status == "completed"
        assert server.proc.poll() is None  # SIGHUP does not stop the server
        log = Path(server.log.name).read_text()
        assert not any(key in log for key in KEYS), log
