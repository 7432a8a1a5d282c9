"""A command run without the optional extra it needs says, in one line and exit 2, which extra and the pip command
(instead of a ModuleNotFoundError traceback): export without torch, serve without fastapi, --queue without psycopg,
--videos-url without fsspec. The extras' modules are blocked from import as if they were not installed."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest

from runtime import extras

from .conftest import ROOT, blocked_run

GOLDEN = ROOT / "artifacts" / "golden" / "schema-8" / "bundle"  # a bundle that needs no export here
EXPORT = "from export.__main__ import main\ncode = main(sys.argv[1:])"
RUNTIME = "from runtime.__main__ import main\ncode = main(sys.argv[1:])"


def _one_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_export_without_the_export_extra(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    proc = blocked_run(("torch", "torchax", "diffusers", "transformers", "accelerate"), EXPORT,
                       "--model", "tiny", "--resolution", "64x32", "--frames", "5", "--out", str(out))
    line = _one_line(proc)
    assert re.fullmatch(r"error: python -m export needs the export extra \((torch|torchax|diffusers|transformers|"
                        r"accelerate)(\.\w+)* is not installed\): pip install 'wan-aot\[export\]'", line), line
    assert not out.exists() and not list(tmp_path.glob(".bundle*"))


@pytest.mark.parametrize("blocked, flags, extra", [
    (("fastapi", "starlette", "uvicorn"), [], "serve"),
    (("psycopg", "psycopg_pool"), ["--queue", "postgresql://postgres@127.0.0.1:1/jobs"], "postgres"),
    (("fsspec", "s3fs"), ["--videos-url", "s3://bucket/videos"], "objectstore"),
], ids=["serve", "queue", "videos-url"])
def test_serve_without_its_extras(tmp_path: Path, blocked: tuple[str, ...], flags: list[str], extra: str) -> None:
    jobs = tmp_path / "jobs"
    proc = blocked_run(blocked, RUNTIME, "serve", str(GOLDEN), "--jobs-dir", str(jobs), "--port", "1", *flags,
                       timeout=120)
    line = _one_line(proc)
    assert line.startswith("error: ") and line.endswith(f"pip install 'wan-aot[{extra}]'"), line
    if extra == "serve":  # whichever of its modules the server imports first
        assert line in {f"error: python -m runtime serve needs the serve extra ({name} is not installed): "
                        "pip install 'wan-aot[serve]'" for name in blocked}, line


def test_each_extras_module_comes_from_that_extra() -> None:
    """runtime/extras.py's table against pyproject.toml: each module is installed by a distribution the extra names,
    or by one of their requirements (starlette by fastapi). Needs every extra installed, as CI installs them."""
    wanted = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def name(requirement: str) -> str:
        return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")

    providers = importlib.metadata.packages_distributions()
    for extra, modules in extras.MODULES.items():
        named = {name(r) for r in wanted[extra]}
        closure = set(named)
        for dist in named:
            closure |= {name(r) for r in importlib.metadata.requires(dist) or [] if "extra ==" not in r}
        for module in modules:
            dists = {d.lower().replace("_", "-") for d in providers.get(module.split(".")[0], [])}
            assert dists & closure, (extra, module, dists)
        assert extras.extra_of(modules[0] + ".sub") == extra
    assert extras.extra_of("numpy") is None and extras.extra_of("torchvision") is None
