"""Load against running servers (`python -m runtime serve`, loopback only): N concurrent clients submit M jobs
and poll each to its end; throughput, latencies, and whether any job was lost or completed twice.

    python tools/bench.py load --url http://127.0.0.1:8000 --clients 4 --requests 12 --steps 2
    python tools/bench.py load --url http://127.0.0.1:8000 --url http://127.0.0.1:8001 --clients 4 --requests 40 \\
        --steps 20 [--kill-pid PID --kill-after 10]          # replicas on one queue, one killed part way

With several --url (replicas sharing one queue, `runtime serve --queue postgresql://...`), client i starts on
URL i mod n and moves to the next URL when one stops answering: a job accepted by one replica is polled on
another. --kill-pid PID --kill-after S sends SIGKILL to that process (a replica on this machine) S seconds
into the run. At the end every completed job is retrieved once more: one whose status or completed_at
changed since (completed twice) is counted as duplicated.

Each client (a thread with its own keep-alive connection) takes the next of the M jobs, POSTs it to
/v1/videos (JSON: a prompt, and num_inference_steps=S with --steps), then polls GET /v1/videos/{id}
until the job is completed or failed (every openai-poll-after-ms the server suggests, or
--poll-interval), then takes the next: at most N jobs are in flight. A 429 (queue full) is counted as
rejected and a 503 (loading, draining) as unavailable; both are retried after the server's
Retry-After (1 s without one), at most --max-retries times per job. Connection errors while polling
are retried until the deadline (jobs survive a server restart). Any other 4xx (wrong API key, a
setting the bundle refuses) stops the run: every job would get the same answer.

Everything is bounded: M <= 10000, N <= 64, and a wall-clock --timeout (default 600 s) after which the
run stops; accepted jobs not completed or failed by then, or that vanished (404), are counted as
lost. Jobs still queued on the server are left there. Only loopback servers (127.0.0.0/8, ::1,
localhost) are accepted: any other host is refused before a single request is sent.

Latencies (p50, p95, max): submit -> completed, from the job's first POST attempt (so 429/503 waits count)
to the poll that saw it completed, what a client waits; accepted -> completed, from the accepted POST's
answer (queue wait + generation, to within one poll interval). --repeats runs the whole load again (one row
each). Exit code 0 when no job was lost or duplicated, 1 otherwise, 2 for a bad command line, a
non-loopback URL, an unreachable server or a refused request. Standard library only.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import math
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from .common import Report, Table, Usage, add_common, log

MAX_REQUESTS = 10_000
MAX_CLIENTS = 64
MAX_WAIT_S = 60.0  # the longest Retry-After honoured (a server could ask for hours)
REQUEST_TIMEOUT_S = 30.0  # one HTTP request
IDLE_RECONNECT_S = 2.0  # uvicorn closes idle keep-alive connections after 5 s
PROGRESS_EVERY_S = 10.0
TERMINAL = ("completed", "failed")


class Fatal(Exception):
    """Stops the whole run (exit 2)."""


# -- the target ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    address: str  # the loopback IP connected to (never re-resolved)
    port: int
    host_header: str
    prefix: str  # path before /v1/...


def loopback_target(base_url: str) -> Target:
    """The server to test, or ValueError when the URL is not plain http to a loopback host."""
    try:
        parts = urlsplit(base_url)
        port = parts.port or 80
        host = (parts.hostname or "").lower()
    except ValueError as e:
        raise ValueError(f"--url {base_url!r} is not a valid URL ({e})") from None
    if parts.scheme != "http":
        raise ValueError(f"--url {base_url!r}: only http:// URLs are supported")
    if parts.query or parts.fragment:
        raise ValueError(f"--url {base_url!r} must not have a query or fragment")
    if host == "localhost":
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise ValueError(f"--url {base_url!r}: cannot resolve localhost ({e})") from None
        addresses = [info[4][0] for info in infos]
        if not addresses or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
            raise ValueError(f"--url {base_url!r}: localhost resolves to {addresses}, not only loopback "
                             "addresses; refusing")
        address = addresses[0]
    else:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if ip is None or not ip.is_loopback:
            raise ValueError(f"--url {base_url!r}: host {host or '(none)'!r} is not loopback (127.0.0.0/8, "
                             "::1, localhost); this tool only tests a local server")
        address = str(ip)
    prefix = parts.path.rstrip("/")
    if prefix.endswith("/v1"):  # the openai SDK's base_url form
        prefix = prefix[:-3]
    netloc_host = f"[{host}]" if ":" in host else host
    return Target(address, port, f"{netloc_host}:{port}", prefix)


class Connection:
    """One client's keep-alive HTTP connection to the target (reopened after errors and idle spells)."""

    def __init__(self, target: Target, api_key: str | None, others: list[Target] | None = None) -> None:
        self.target = target
        self.targets = others or [target]  # failover order (several replicas of one queue)
        self.headers = {"Host": target.host_header, "Accept": "application/json", "User-Agent": "wan-aot-load-test"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.conn: http.client.HTTPConnection | None = None
        self.last_used = 0.0

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def request(self, method: str, path: str, body: dict[str, Any] | None, timeout: float
                ) -> tuple[int, http.client.HTTPMessage, Any]:
        """(status, headers, parsed JSON or None); raises OSError / http.client.HTTPException."""
        if self.conn is not None and time.monotonic() - self.last_used > IDLE_RECONNECT_S:
            self.close()
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.target.address, self.target.port, timeout=timeout)
        self.conn.timeout = timeout
        if self.conn.sock is not None:
            self.conn.sock.settimeout(timeout)
        headers = dict(self.headers)
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            self.conn.request(method, self.target.prefix + path, body=data, headers=headers)
            response = self.conn.getresponse()
            raw = response.read()
        except BaseException as e:
            self.close()
            if isinstance(e, OSError | http.client.HTTPException) and len(self.targets) > 1:  # next replica
                self.target = self.targets[(self.targets.index(self.target) + 1) % len(self.targets)]
                self.headers["Host"] = self.target.host_header
            raise
        finally:
            self.last_used = time.monotonic()
        if response.will_close:
            self.close()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        return response.status, response.headers, parsed


# -- the run -------------------------------------------------------------------------------------------
@dataclass
class JobRecord:
    index: int
    client: int
    id: str | None = None
    outcome: str = "not_submitted"  # completed | failed | lost | not_accepted | not_submitted
    detail: str | None = None  # why failed / lost / not accepted
    posts: int = 0
    polls: int = 0
    t_first_post: float | None = None  # seconds since the run started
    t_accepted: float | None = None
    t_completed: float | None = None  # the first poll that saw it completed (or failed)
    server_seconds: int | None = None  # completed_at - created_at (the server keeps whole seconds)
    completed_at: int | None = None  # as the first poll that saw it completed reported it
    duplicated: bool = False  # retrieved again at the end: its status or completed_at had changed


class Run:
    def __init__(self, args: argparse.Namespace, targets: list[Target]) -> None:
        self.args, self.targets = args, targets
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.timeout
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.next_index = 0
        self.records: list[JobRecord] = []
        self.counts = dict(posts=0, accepted=0, rejected_429=0, unavailable_503=0, post_errors=0, polls=0,
                           poll_errors=0)
        self.fatal: str | None = None

    # shared state
    def now(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def count(self, name: str) -> None:
        with self.lock:
            self.counts[name] = self.counts.get(name, 0) + 1

    def recheck(self) -> None:
        """Retrieve every completed job once more: a job completed a second time (run again by another replica
        after it was reported completed) shows another completed_at, or is no longer completed."""
        conn = Connection(self.targets[0], self.args.api_key, self.targets)
        try:
            for r in [r for r in self.records if r.outcome == "completed"]:
                for _ in range(len(self.targets)):
                    try:
                        status, _, data = conn.request("GET", "/v1/videos/" + quote(r.id or "", safe=""), None, 10.0)
                        break
                    except (OSError, http.client.HTTPException):
                        continue
                else:
                    continue
                if status != 200 or not isinstance(data, dict) or data.get("status") != "completed" \
                        or data.get("completed_at") != r.completed_at:
                    r.duplicated = True
        finally:
            conn.close()

    def take(self, client: int) -> JobRecord | None:
        with self.lock:
            if self.next_index >= self.args.requests or self.stop.is_set() or self.remaining() <= 0:
                return None
            record = JobRecord(self.next_index, client)
            self.next_index += 1
            self.records.append(record)
            return record

    def give_up(self, message: str) -> None:
        with self.lock:
            if self.fatal is None:
                self.fatal = message
        self.stop.set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds` (never past the deadline); False when the run is over."""
        seconds = min(seconds, self.remaining())
        if seconds > 0:
            self.stop.wait(seconds)
        return not self.stop.is_set() and self.remaining() > 0

    def timeout(self) -> float:
        return max(1.0, min(REQUEST_TIMEOUT_S, self.remaining() + 1.0))

    # one client
    def client(self, client: int) -> None:
        n = len(self.targets)
        conn = Connection(self.targets[client % n], self.args.api_key,
                          [self.targets[(client + i) % n] for i in range(n)])
        try:
            while (record := self.take(client)) is not None:
                if self.submit(conn, record):
                    self.poll(conn, record)
        except Fatal as e:
            self.give_up(str(e))
        except Exception as e:  # noqa: BLE001  (a bug here must not hang the run)
            self.give_up(f"client {client} crashed: {type(e).__name__}: {e}")
        finally:
            conn.close()

    def submit(self, conn: Connection, record: JobRecord) -> bool:
        body: dict[str, Any] = {"prompt": f"{self.args.prompt} (load test job {record.index})"}
        if self.args.steps is not None:
            body["num_inference_steps"] = self.args.steps
        retries = 0
        while True:
            if self.stop.is_set() or self.remaining() <= 0:
                record.outcome, record.detail = ("not_accepted", "run ended before it was accepted") if \
                    record.posts else ("not_submitted", "run ended before it was sent")
                return False
            if record.t_first_post is None:
                record.t_first_post = self.now()
            record.posts += 1
            self.count("posts")
            try:
                status, headers, data = conn.request("POST", "/v1/videos", body, self.timeout())
            except (OSError, http.client.HTTPException) as e:
                status, headers, data, error = 0, None, None, f"{type(e).__name__}: {e}"
            else:
                error = _error_message(data)
            if status == 200 and isinstance(data, dict) and isinstance(data.get("id"), str):
                self.count("accepted")
                self.count(f"accepted by {conn.target.host_header}")
                record.id, record.t_accepted = data["id"], self.now()
                return True
            if status in (429, 503):
                self.count("rejected_429" if status == 429 else "unavailable_503")
                wait = _retry_after(headers)
            elif status == 0 or status >= 500 or status == 200:
                self.count("post_errors")
                wait = 1.0
            else:  # 400, 401, 404, 413...: every other job would get the same answer
                self.count("post_errors")
                record.outcome, record.detail = "not_accepted", f"HTTP {status}: {error}"
                raise Fatal(f"POST /v1/videos answered {status}: {error}")
            retries += 1
            if retries > self.args.max_retries:
                record.outcome = "not_accepted"
                record.detail = f"gave up after {record.posts} POSTs; last: HTTP {status or '-'} {error}"
                return False
            if not self.wait(wait):
                record.outcome, record.detail = "not_accepted", "run ended while waiting to retry"
                return False

    def poll(self, conn: Connection, record: JobRecord) -> None:
        path = "/v1/videos/" + quote(record.id or "", safe="")
        interval = self.args.poll_interval
        while True:
            if not self.wait(0 if record.polls == 0 else interval):
                record.outcome, record.detail = "lost", "not completed or failed by the end of the run"
                return
            record.polls += 1
            self.count("polls")
            try:
                status, headers, data = conn.request("GET", path, None, self.timeout())
            except (OSError, http.client.HTTPException):
                self.count("poll_errors")
                interval = 1.0  # the server may be restarting; its jobs survive that
                continue
            if status == 404:
                record.outcome, record.detail = "lost", "vanished: GET answered 404"
                return
            if status != 200 or not isinstance(data, dict):
                self.count("poll_errors")
                interval = 1.0
                continue
            interval = self.args.poll_interval or _poll_after(headers)
            if data.get("status") in TERMINAL:
                record.t_completed, record.outcome = self.now(), data["status"]
                record.completed_at = data.get("completed_at")
                if isinstance(data.get("completed_at"), int) and isinstance(data.get("created_at"), int):
                    record.server_seconds = data["completed_at"] - data["created_at"]
                if data["status"] == "failed":
                    err = data.get("error") or {}
                    record.detail = f"{err.get('code')}: {err.get('message')}" if isinstance(err, dict) else str(err)
                return

    def progress(self) -> str:
        with self.lock:
            outcomes = [r.outcome for r in self.records]
            c = dict(self.counts)
        return (f"[{self.now():6.1f} s] accepted {c['accepted']}, completed {outcomes.count('completed')}, "
                f"failed {outcomes.count('failed')}, 429 {c['rejected_429']}, 503 {c['unavailable_503']}")


def _error_message(data: Any) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message"))
    return "(no OpenAI error body)"


def _retry_after(headers: http.client.HTTPMessage | None) -> float:
    value = headers.get("retry-after") if headers is not None else None
    try:
        seconds = float(value) if value is not None else 1.0
    except ValueError:  # an HTTP date: not worth parsing here
        seconds = 1.0
    return min(max(seconds, 0.0), MAX_WAIT_S) if math.isfinite(seconds) else 1.0


def _poll_after(headers: http.client.HTTPMessage | None) -> float:
    try:
        ms = float(headers.get("openai-poll-after-ms", "250")) if headers is not None else 250.0
    except ValueError:
        ms = 250.0
    return min(max(ms, 10.0), 10_000.0) / 1000 if math.isfinite(ms) else 0.25


def _stats(values: list[float]) -> dict[str, float | None]:
    """p50, p95 (linear interpolation between order statistics) and max."""
    if not values:
        return {"n": 0, "p50": None, "p95": None, "max": None}
    v = sorted(values)

    def q(p: float) -> float:
        k = (len(v) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return v[lo] + (v[hi] - v[lo]) * (k - lo)

    return {"n": len(v), "p50": q(0.5), "p95": q(0.95), "max": v[-1]}


def summarize(run: Run, wall: float, interrupted: bool) -> dict[str, Any]:
    records = sorted(run.records, key=lambda r: r.index)
    for r in records:  # anything a client left mid-way (deadline, fatal error, interrupt)
        if r.id is not None and r.outcome not in TERMINAL:
            r.outcome, r.detail = "lost", r.detail or "not completed or failed by the end of the run"
    outcome = [r.outcome for r in records]
    completed = [r for r in records if r.outcome == "completed"]
    failed_codes: dict[str, int] = {}
    for r in records:
        if r.outcome == "failed":
            code = (r.detail or "?").split(":", 1)[0]
            failed_codes[code] = failed_codes.get(code, 0) + 1
    return {
        "base_url": ", ".join(run.args.urls), "clients": run.args.clients, "requests": run.args.requests,
        "steps": run.args.steps, "timeout_s": run.args.timeout, "interrupted": interrupted, "fatal": run.fatal,
        "posts": run.counts["posts"], "accepted": run.counts["accepted"],
        "rejected_429": run.counts["rejected_429"], "unavailable_503": run.counts["unavailable_503"],
        "post_errors": run.counts["post_errors"], "polls": run.counts["polls"],
        "poll_errors": run.counts["poll_errors"],
        "completed": outcome.count("completed"), "failed": outcome.count("failed"), "lost": outcome.count("lost"),
        "duplicated": sum(r.duplicated for r in records),
        "accepted_by": {k.removeprefix("accepted by "): v for k, v in run.counts.items()
                        if k.startswith("accepted by ")},
        "not_accepted": outcome.count("not_accepted"), "not_submitted": run.args.requests - len(records)
        + outcome.count("not_submitted"),
        "failed_by_code": failed_codes,
        "wall_s": wall, "throughput_jobs_per_s": len(completed) / wall if wall > 0 else 0.0,
        "latency_submit_to_completed_s": _stats([r.t_completed - r.t_first_post for r in completed]),
        "latency_accepted_to_completed_s": _stats([r.t_completed - r.t_accepted for r in completed]),
        "first_completed_s": min((r.t_completed for r in completed), default=None),
        "server_seconds": _stats([float(r.server_seconds) for r in completed if r.server_seconds is not None]),
        "jobs": [asdict(r) for r in records],
    }


def _latency(st: dict[str, Any]) -> str:
    return "-" if not st["n"] else f"{st['p50']:.2f} / {st['p95']:.2f} / {st['max']:.2f}"


def table(title: str, summaries: list[tuple[str, dict[str, Any]]]) -> Table:
    """One row per load run (the figures `summarize` returns)."""
    t = Table(title, ["run", "accepted / 429 / 503", "completed / failed / lost / duplicated", "throughput jobs/s",
                      "submit→completed p50 / p95 / max s", "accepted→completed p50 / p95 / max s", "accepted by"])
    for name, s in summaries:
        t.add(name, f"{s['accepted']} / {s['rejected_429']} / {s['unavailable_503']}",
              f"{s['completed']} / {s['failed']} / {s['lost']} / {s['duplicated']}",
              f"{s['throughput_jobs_per_s']:.2f}", _latency(s["latency_submit_to_completed_s"]),
              _latency(s["latency_accepted_to_completed_s"]),
              ", ".join(f"{v}" for _, v in sorted(s["accepted_by"].items())) or "-")
    return t


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", "--base-url", dest="urls", action="append", default=None,
                   help="the server, loopback only (default http://127.0.0.1:8000; a trailing /v1 is fine); "
                        "repeat for replicas of one queue")
    p.add_argument("--kill-pid", type=int, default=None, help="SIGKILL this process (a replica) --kill-after s in")
    p.add_argument("--kill-after", type=float, default=None, help="seconds into the run to send --kill-pid SIGKILL")
    p.add_argument("--api-key", default=os.environ.get("WAN_AOT_API_KEY"),
                   help="sent as Authorization: Bearer KEY (default: $WAN_AOT_API_KEY)")
    p.add_argument("--clients", type=int, default=4, help=f"concurrent clients, 1..{MAX_CLIENTS} (default 4)")
    p.add_argument("--requests", type=int, default=16, help=f"jobs to submit in all, 1..{MAX_REQUESTS} (default 16)")
    p.add_argument("--steps", type=int, default=None, help="num_inference_steps of every job (default: the bundle's)")
    p.add_argument("--prompt", default="a red fox running through fresh snow", help="prompt (the job number is added)")
    p.add_argument("--timeout", type=float, default=600.0, help="wall-clock limit of the whole run, s (default 600)")
    p.add_argument("--max-retries", type=int, default=30,
                   help="retries of one job's POST after 429 / 503 / errors (default 30)")
    p.add_argument("--poll-interval", type=float, default=None,
                   help="seconds between polls of a job (default: the server's openai-poll-after-ms, 0.25 s)")
    add_common(p, repeats=1, devices=("cpu",))


def check(args: argparse.Namespace) -> list[Target]:
    """The loopback targets of a valid command line; Usage (exit 2, one line) otherwise."""
    args.urls = args.urls or ["http://127.0.0.1:8000"]
    problems = []
    if (args.kill_pid is None) != (args.kill_after is None):
        problems.append("--kill-pid and --kill-after go together")
    if not 1 <= args.clients <= MAX_CLIENTS:
        problems.append(f"--clients must be in 1..{MAX_CLIENTS}, got {args.clients}")
    if not 1 <= args.requests <= MAX_REQUESTS:
        problems.append(f"--requests must be in 1..{MAX_REQUESTS}, got {args.requests}")
    if args.steps is not None and args.steps < 1:
        problems.append(f"--steps must be >= 1, got {args.steps}")
    if not (math.isfinite(args.timeout) and 0 < args.timeout <= 86_400):
        problems.append(f"--timeout must be in (0, 86400] seconds, got {args.timeout}")
    if not 0 <= args.max_retries <= 1000:
        problems.append(f"--max-retries must be in 0..1000, got {args.max_retries}")
    if args.poll_interval is not None and not (math.isfinite(args.poll_interval) and 0.01 <= args.poll_interval
                                               <= 60):
        problems.append(f"--poll-interval must be in 0.01..60 seconds, got {args.poll_interval}")
    if not 1 <= args.repeats <= 100:
        problems.append(f"--repeats must be in 1..100, got {args.repeats}")
    if problems:
        raise Usage("; ".join(problems))
    try:
        targets = [loopback_target(url) for url in args.urls]
    except ValueError as e:
        raise Usage(str(e)) from None
    probe = Connection(targets[0], None)
    try:
        status, _, data = probe.request("GET", "/ready", None, 10.0)
    except (OSError, http.client.HTTPException) as e:
        raise Usage(f"cannot reach {args.urls[0]} ({type(e).__name__}: {e})") from None
    finally:
        probe.close()
    ready = data.get("status") if isinstance(data, dict) else None
    log(f"server /ready: {status} {ready or ''}".rstrip())
    return targets


def load(args: argparse.Namespace, targets: list[Target]) -> dict[str, Any]:
    """One load run against `targets` (check's result); its summary (`summarize`)."""
    run = Run(args, targets)
    if args.kill_pid is not None:
        import signal

        def kill() -> None:
            if not run.stop.wait(args.kill_after):
                os.kill(args.kill_pid, signal.SIGKILL)
                log(f"{run.now():6.1f} s: killed process {args.kill_pid}")

        threading.Thread(target=kill, daemon=True).start()
    threads = [threading.Thread(target=run.client, args=(i,), name=f"client-{i}", daemon=True)
               for i in range(args.clients)]
    for t in threads:
        t.start()
    interrupted = False
    next_progress = PROGRESS_EVERY_S
    try:
        while any(t.is_alive() for t in threads):
            if run.remaining() <= 0:
                run.stop.set()
                break
            threads[0].join(timeout=min(0.2, max(run.remaining(), 0.01)))
            if run.now() >= next_progress:
                log(run.progress())
                next_progress += PROGRESS_EVERY_S
    except KeyboardInterrupt:
        interrupted = True
    run.stop.set()
    grace = time.monotonic() + 3.0  # requests in flight end within their socket timeout
    for t in threads:
        t.join(timeout=max(0.0, grace - time.monotonic()))
    wall = run.now()
    if not interrupted:
        run.recheck()
    with run.lock:
        summary = summarize(run, wall, interrupted)
    if run.fatal:
        raise Usage(run.fatal)
    return summary


def run(a: argparse.Namespace) -> Report:
    targets = check(a)
    summaries = []
    for i in range(a.repeats):
        summaries.append((f"{i + 1}" if a.repeats > 1 else "1", load(a, targets)))
    title = (f"{a.clients} clients, {a.requests} jobs" + (f" of {a.steps} steps" if a.steps else "")
             + f" against {', '.join(a.urls)}")
    t = table(title, summaries)
    t.notes.append("Throughput: completed jobs per second of wall time. Accepted by: jobs accepted by each URL.")
    bad = sum(s["lost"] + s["duplicated"] for _, s in summaries)
    return Report([t], [s for _, s in summaries], exit_code=1 if bad else 0)
