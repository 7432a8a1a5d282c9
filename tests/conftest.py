"""Shared fixtures: tiny diffusers checkpoints and bundles exported from them (built once per session)."""

from __future__ import annotations

import atexit
import concurrent.futures
import fcntl
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[1]
# XLA's CPU backend with its cheapest optimisation, for every test process (this one, its xdist peers and what they
# start): a tiny model's first generate compiles in half the time (18.4 -> 8.0 s) and its frames move by at most
# 1.2e-7, far inside every tolerance here; both sides of an exact comparison run with the same flags. Never for what
# measures compiled code: `PLAIN_XLA` is the environment's own flags, for test_fit's TPU compiles.
FAST_XLA = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
PLAIN_XLA = os.environ.get("XLA_FLAGS", "")
if FAST_XLA not in PLAIN_XLA:
    os.environ["XLA_FLAGS"] = f"{PLAIN_XLA} {FAST_XLA}".strip()
# jax reads JAX_PLATFORMS when imported: the export fork server (tests/export_fork.py) imports it once for all its
# exports, which run on the CPU whatever their target
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def devices_env(n: int) -> dict[str, str]:
    """The environment of a process with `n` fake CPU devices (and the test processes' XLA flags)."""
    return {"XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count={n}"}

# What the test processes of one run share (pytest-xdist's workers, and the processes they start): the session's
# checkpoints and bundles (`shared`) and the CLI's persistent compilation cache, never the user's. Each worker would
# otherwise export and compile the same things again. The directory goes when the run ends (pytest_sessionfinish of
# the process that started it).
RUN = os.environ.setdefault("WAN_AOT_TEST_RUN", os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"{os.getpid()}")
SHARED = Path(tempfile.gettempdir()) / f"wan-aot-tests-{RUN}"
SHARED.mkdir(mode=0o700, exist_ok=True)
os.environ["WAN_AOT_CACHE_DIR"] = str(SHARED / "jax-cache")
os.environ["WAN_AOT_STAMP_DIR"] = tempfile.mkdtemp(prefix="wan-aot-test-stamps-")  # stamps: per process
atexit.register(shutil.rmtree, os.environ["WAN_AOT_STAMP_DIR"], True)


# The default run's costliest files first (worker seconds, `pytest --durations=0` summed per file; CONTRIBUTING.md):
# xdist (--dist loadfile) hands each worker the next file in collection order, so the run ends on short files and
# both workers finish together instead of one waiting for the other's last long file. test_faults is mostly waiting
# (outages, leases): early, its idle seconds overlap the other worker's work instead of ending the run.
HEAVY_FIRST = ("test_serve.py", "test_faults.py", "test_tpu_export.py", "test_savedmodel.py", "test_quantize.py",
               "test_video_in.py", "test_animate.py", "test_fit.py", "test_animate_2.py", "test_precompile.py",
               "test_skyreels.py", "test_shapes.py", "test_tiny_decoder.py", "test_attach.py", "test_bad_input.py",
               "test_lora.py", "test_api_kinds.py", "test_cuda_export.py", "test_samplers.py", "test_lora_switch.py",
               "test_replicas.py", "test_kinds.py", "test_anyflow_far.py", "test_helios.py", "test_realtime.py",
               "test_chronoedit.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the process that started the run (xdist's controller)
        shutil.rmtree(SHARED, ignore_errors=True)


def shared(name: str, build: Callable[[Path], object]) -> Path:
    """SHARED/name, built once per run by whichever process asks first (`build(path)` makes it; the others wait for
    it, under a file lock). For the session's read-only inputs: a test that changes one works on a copy."""
    path = SHARED / name
    done = SHARED / f"{name}.done"
    with open(SHARED / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            build(path)
            done.touch()
    return path


@pytest.fixture(scope="session", autouse=True)
def compilation_cache() -> None:
    """In-process loads share that cache too, as a server's restarts would: tests that start the same
    bundle again (copies included) load its compiled programs instead of compiling them again."""
    from runtime import cache

    cache.enable(os.environ["WAN_AOT_CACHE_DIR"])


def run_module(*args: str, env: dict[str, str] | None = None, check: bool = True,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `python -m ...` from the repository root; returns the completed process. `python -m export` is forked
    from a process that has its imports loaded (the same process boundary, ten seconds less each)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **(env or {})}
    if args[0] == "export":  # forked from a process with export's imports loaded (tests/export_fork.py)
        from . import export_fork

        proc = export_fork.run(list(args[1:]), full_env, str(ROOT), timeout)
    else:
        proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                              timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"python -m {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def run_processes(args: list[str], processes: int = 2, devices: int = 4, timeout: float = 300) -> list[str]:
    """`python -m runtime ARGS --coordinator ... --num-processes N --process-id i` for i < N, each with `devices`
    fake CPU devices, joined over loopback by jax.distributed. All are awaited together (their output to files: one
    blocked on a full pipe would hold the others in a collective) and all are killed if one fails or the time runs
    out, so that no process outlives its test. Returns each process's stderr."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **devices_env(devices), "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory() as logs:
        errs = [Path(logs) / f"{i}.err" for i in range(processes)]
        procs = []
        for i, err in enumerate(errs):
            with err.open("w") as f:
                procs.append(subprocess.Popen([sys.executable, "-m", "runtime", *args, "--coordinator",
                                               f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id",
                                               str(i)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=f))
        try:
            deadline = time.monotonic() + timeout
            for i, p in enumerate(procs):
                try:
                    code = p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{processes} processes did not finish in {timeout:.0f} s; process {i}:\n"
                                         f"{errs[i].read_text()[-3000:]}") from None
                assert code == 0, f"process {i} failed ({code}):\n{errs[i].read_text()[-3000:]}"
            return [err.read_text() for err in errs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def run_cli(module: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m <module> ARGS` run in this process, through the module's `main` as `python -m` runs it: its exit
    code, stdout and stderr as a process's, without a new interpreter's imports. For commands that fail or finish
    fast (what bad input says and returns); a traceback escapes as the test's own error."""
    import contextlib
    import importlib
    import io

    main = importlib.import_module(f"{module}.__main__").main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 1
    proc = subprocess.CompletedProcess([module, *args], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"python -m {module} {' '.join(args)} failed ({code}):\n{proc.stderr[-4000:]}")
    return proc


def blocked_run(blocked: tuple[str, ...], code: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `code` (with sys.argv[1:] = args) where importing any of `blocked` raises ModuleNotFoundError, as if it were
    not installed, and any that got imported anyway makes the process exit 3."""
    script = textwrap.dedent(f"""
        import importlib.abc, sys
        BLOCKED = {blocked!r}

        class Blocker(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (blocked here)", name=name)
                return None

        sys.meta_path.insert(0, Blocker())
        code = 1
        try:
    """) + textwrap.indent(textwrap.dedent(code), "    ") + textwrap.dedent("""
        finally:
            leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
            if leaked:
                print("leaked imports:", leaked, file=sys.stderr)
                code = 3
        sys.exit(code)
    """)
    env = {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


T = TypeVar("T")
K = TypeVar("K")


class OnDemand(Mapping[K, T]):
    """A fixture's mapping whose entries are built on first use (`build[key]()`), once: what only the slow tier
    reads is never built in the default run. `done` holds the entries built already."""

    def __init__(self, build: dict[K, Callable[[], T]], done: dict[K, T] | None = None) -> None:
        self._build, self._done = build, dict(done or {})

    @classmethod
    def start(cls, build: dict[K, Callable[[], T]], now: list[K]) -> OnDemand[K, T]:
        """The entries `now` built at once, two at a time (`in_parallel`), the others on first use."""
        return cls(build, dict(zip(now, in_parallel(*[build[key] for key in now]))))

    def __getitem__(self, key: K) -> T:
        if key not in self._done:
            self._done[key] = self._build[key]()
        return self._done[key]

    def __iter__(self) -> Iterator[K]:
        return iter({**self._done, **self._build})

    def __len__(self) -> int:
        return len({**self._done, **self._build})


def in_parallel(*calls: Callable[[], T]) -> list[T]:
    """Each call's result, in order, running two at a time. For independent subprocesses: exports and tiny-model
    runs are mostly single-threaded Python (imports, tracing, lowering, compiling), so on CI's two cores two of
    them take about as long as one. The first failure is raised."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda call: call(), calls))


def run_modules(*commands: list[str], timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """`run_module` for each command (its arguments), two at a time (`in_parallel`)."""
    return in_parallel(*[functools.partial(run_module, *args, timeout=timeout) for args in commands])


@pytest.fixture(scope="session")
def checkpoints() -> dict[str, Path]:
    """The embedded tiny variants saved with diffusers' save_pretrained."""
    from export import tiny

    names = ("tiny", "tiny-wide")
    root = shared("checkpoints", lambda root: [tiny.save(name, root / name) for name in names])
    return {name: root / name for name in names}


# (variant, resolution, frames, max sequence length)
CASES = {
    "tiny-64x32-f9": ("tiny", "64x32", 9, 24),
    "wide-48x48-f5": ("tiny-wide", "48x48", 5, 16),
}


@pytest.fixture(scope="session")
def fp32_bundles(checkpoints: dict[str, Path]) -> dict[str, Path]:
    root = shared("bundles", lambda root: run_modules(*[
        ["export", "--model", str(checkpoints[variant]), "--resolution", res, "--frames", str(frames), "--dtype",
         "fp32", "--max-sequence-length", str(max_len), "--out", str(root / case), "-q"]
        for case, (variant, res, frames, max_len) in CASES.items()]))
    return {case: root / case for case in CASES}


@pytest.fixture(scope="session")
def bf16_bundle(checkpoints: dict[str, Path]) -> Path:
    """tiny-64x32-f9 exported in bf16."""
    variant, res, frames, max_len = CASES["tiny-64x32-f9"]
    return shared("bf16", lambda root: run_module(
        "export", "--model", str(checkpoints[variant]), "--resolution", res, "--frames", str(frames), "--dtype",
        "bf16", "--max-sequence-length", str(max_len), "--out", str(root / "tiny-64x32-f9"), "-q")) / "tiny-64x32-f9"


# A bundle of several shapes: two resolutions (the second portrait) x two frame counts; its default shape is
# tiny-64x32-f9's.
SHAPES_CASE = ("tiny", "64x32,32x64", "9,5", 24)


@pytest.fixture(scope="session")
def shapes_bundle(checkpoints: dict[str, Path]) -> Path:
    variant, res, frames, max_len = SHAPES_CASE
    return shared("shapes", lambda root: run_module(
        "export", "--model", str(checkpoints[variant]), "--resolution", res, "--frames", frames, "--dtype", "fp32",
        "--max-sequence-length", str(max_len), "--out", str(root / "tiny-shapes"), "-q")) / "tiny-shapes"


@pytest.fixture(scope="session")
def cpu8_bundle(checkpoints: dict[str, Path]) -> Path:
    """tiny-64x32-f9 exported for the cpu-8 target (dp=2, sp=2, tp=2; run with 8 fake CPU devices), with a portrait
    shape (32x64) beside its default one."""
    variant, res, frames, max_len = CASES["tiny-64x32-f9"]
    return shared("cpu8", lambda root: run_module(
        "export", "--model", str(checkpoints[variant]), "--resolution", f"{res},32x64", "--frames", str(frames),
        "--dtype", "fp32", "--max-sequence-length", str(max_len), "--target", "cpu-8", "--out", str(root / "bundle"),
        "-q")) / "bundle"


# Wan 2.2 and image-to-video: one tiny checkpoint per model kind (export/tiny.py), exported fp32 with the CLI.
# kind: (variant, resolution, frames, max sequence length); sizes are non-square in both orientations.
KIND_CASES = {
    "t2v-moe": ("tiny-t2v-moe", "64x32", 9, 16),
    "ti2v": ("tiny-ti2v", "96x64,64x96", 9, 16),  # and a portrait shape
    "i2v": ("tiny-i2v", "48x32", 9, 16),
    "flf2v": ("tiny-flf2v", "64x32,32x64", 9, 16),  # and a portrait shape
    "i2v-moe": ("tiny-i2v-moe", "32x48", 9, 16),
}
# Lucy Edit (issue 51): a source video's latents beside the noise; the video's frame count picks one of its shapes
# (9 frames, the default, or 5).
KIND_CASES["lucy-edit"] = ("tiny-lucy-edit", "64x32", "9,5", 16)


@pytest.fixture(scope="session")
def kind_checkpoints() -> dict[str, Path]:
    from export import tiny

    root = shared("kind-checkpoints", lambda root: [tiny.save(variant, root / kind)
                                                    for kind, (variant, *_) in KIND_CASES.items()])
    return {kind: root / kind for kind in KIND_CASES}


@pytest.fixture(scope="session")
def kind_bundles(kind_checkpoints: dict[str, Path]) -> dict[str, Path]:
    root = shared("kind-bundles", lambda root: run_modules(*[
        ["export", "--model", str(kind_checkpoints[kind]), "--resolution", res, "--frames", str(frames), "--dtype",
         "fp32", "--max-sequence-length", str(max_len), "--out", str(root / kind), "-q"]
        for kind, (_, res, frames, max_len) in KIND_CASES.items()]))
    return {kind: root / kind for kind in KIND_CASES}


def test_image(width: int, height: int, seed: int = 0, mode: str = "RGB"):
    """A deterministic, structured PIL image (gradients plus noise), so resizing has something to do."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(1, width - 1), y * 255 / max(1, height - 1), (x + y) % 64 * 4], axis=-1)
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels).convert(mode)


test_image.__test__ = False  # a helper, not a test


# SkyReels-V2 (runtime/kinds.py's skyreels-* rows): one tiny checkpoint per diffusers pipeline, exported fp32 once per
# session. The diffusion forcing bundle's shapes are a segment of 17 frames (5 latent frames) and one of 13 (4): the
# last of three overlapping segments, the asynchronous mode's segment (causal blocks of 2), and image-to-video with a
# last image (4 + 1 latent frames). (tests/test_skyreels.py's slow tier exports a cpu-8 copy of the DF bundle.)
SKYREELS_CASES = {
    "skyreels-t2v": ("tiny-skyreels-t2v", "64x32", "9", 16, "cpu"),
    "skyreels-i2v": ("tiny-skyreels-i2v", "48x32", "9", 16, "cpu"),
    "skyreels-df": ("tiny-skyreels-df", "64x32", "17,13", 16, "cpu"),
}


@pytest.fixture(scope="session")
def skyreels_checkpoints() -> dict[str, Path]:
    from export import tiny

    variants = list(dict.fromkeys(v for v, *_ in SKYREELS_CASES.values()))
    root = shared("skyreels-checkpoints", lambda root: [tiny.save(v, root / v) for v in variants])
    return {v: root / v for v in variants}


@pytest.fixture(scope="session")
def skyreels_bundles(skyreels_checkpoints: dict[str, Path]) -> dict[str, Path]:
    root = shared("skyreels-bundles", lambda root: run_modules(*[
        ["export", "--model", str(skyreels_checkpoints[variant]), "--resolution", res, "--frames", frames, "--dtype",
         "fp32", "--max-sequence-length", str(max_len), "--target", target, "--out", str(root / case), "-q"]
        for case, (variant, res, frames, max_len, target) in SKYREELS_CASES.items()]))
    return {case: root / case for case in SKYREELS_CASES}
