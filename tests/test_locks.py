"""requirements/*.lock, the exact versions each install set is installed from (tools/lock.sh writes them): they agree
with pyproject.toml, pin every package with its sha256, and keep the pins the bundles depend on."""

from __future__ import annotations

import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from .conftest import ROOT

# the sets tools/lock.sh locks: `lock NAME EXTRA...`
SETS = {m.group(1): m.group(2).split() for m in re.finditer(r"^lock (\w+) ([\w ]+)$",
                                                              (ROOT / "tools" / "lock.sh").read_text(), re.M)}


def _pins(name: str) -> dict[str, tuple[Version, str]]:
    """package -> (version, its entry's text) of requirements/NAME.lock."""
    text = (ROOT / "requirements" / f"{name}.lock").read_text()
    out = {}
    for entry in re.split(r"\n(?=[A-Za-z0-9])", text):
        m = re.match(r"([A-Za-z0-9][\w.-]*)==(\S+)", entry)
        if m:
            out[canonicalize_name(m.group(1))] = (Version(m.group(2)), entry)
    return out


def test_the_sets() -> None:
    assert SETS == {"runtime": ["serve", "postgres", "objectstore"], "cuda": ["serve", "cuda"],
                    "tpu": ["serve", "postgres", "objectstore", "tpu"], "export": ["export"],
                    "test": ["export", "serve", "test", "savedmodel", "postgres", "objectstore", "tpu"]}


@pytest.mark.parametrize("name", ["runtime", "cuda", "tpu", "export", "test"])
def test_lock_agrees_with_pyproject(name: str) -> None:
    """Every requirement of the set (the runtime's and its extras') is pinned within pyproject.toml's range, with a
    sha256 per pinned package: a dependency changed in pyproject.toml without re-locking fails here."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for extra in SETS[name] for r in project["optional-dependencies"][extra]]
    pins = _pins(name)
    for req in wanted:
        version, _ = pins[canonicalize_name(req.name)]
        assert req.specifier.contains(version, prereleases=True), (name, str(req), str(version))
        for extra in req.extras:  # jax[cuda12] -> its plugin, at jax's version
            if extra.startswith("cuda"):
                assert pins["jax-cuda12-plugin"][0] == version == pins["jax-cuda12-pjrt"][0]
    assert all("--hash=sha256:" in entry for _, entry in pins.values()), name


def test_the_pins_bundles_depend_on() -> None:
    for name in SETS:
        pins = _pins(name)
        assert pins["jax"][0] == pins["jaxlib"][0] == Version("0.10.2"), name
        gpu = {p for p in pins if p.startswith(("nvidia-", "triton", "jax-cuda"))}
        assert bool(gpu) == (name == "cuda"), (name, sorted(gpu))  # no CUDA wheels outside the cuda set
        # libtpu where `runtime fit` must work (TPU hosts, CI): the release jax[tpu] 0.10.2 pins
        assert ("libtpu" in pins) == ("tpu" in SETS[name]), name
        if "libtpu" in pins:
            assert str(pins["libtpu"][0]).startswith("0.0.42."), name
        if "export" in SETS[name]:  # the CPU build torchax 0.0.13 is patched for (a CUDA torch is GBs)
            assert str(pins["torch"][0]) == "2.13.0+cpu" and str(pins["torchax"][0]) == "0.0.13"
        else:
            assert "torch" not in pins, name  # the runtime never installs torch
