"""Verified stamps: an unchanged bundle is not hashed again on the next start; a changed file is,
and is refused if its content differs; stamps of other bundles or not the runtime's own are
ignored; `runtime verify` never trusts a stamp."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import runtime
from runtime import integrity
from runtime import manifest as mf
from runtime.errors import BundleError
from runtime.verify import FAIL, verify

WEIGHTS = "weights/transformer.safetensors"


@pytest.fixture()
def stamps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "stamps"
    monkeypatch.setenv(integrity.STAMP_ENV, str(d))
    return d


@pytest.fixture()
def bundle(fp32_bundles, tmp_path: Path, stamps: Path) -> Path:
    dst = tmp_path / "bundle"
    shutil.copytree(fp32_bundles["tiny-64x32-f9"], dst)
    return dst


def start(bundle: Path) -> runtime.Pipeline:
    """What a start does before its first job: open the bundle, place every weight, compile every program."""
    pipe = runtime.load(bundle)
    for name in pipe.manifest.programs:
        pipe.bundle.call(name)
    return pipe


def all_files(bundle: Path) -> set[str]:
    return {ref.file for ref in mf.read(bundle).files()}


def flip_byte(path: Path, keep_times: bool = False) -> None:
    """Change one byte of tensor data in place (same size)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size - 5)
        b = f.read(1)
        f.seek(st.st_size - 5)
        f.write(bytes([b[0] ^ 0xFF]))
    if keep_times:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_unchanged_bundle_is_not_hashed_again(bundle: Path, stamps: Path) -> None:
    first = start(bundle)
    assert set(first.bundle.checker.hashed) == all_files(bundle)
    a = first.generate("a cat", steps=2, progress=False)
    assert len(list(stamps.glob("*.json"))) == 1
    second = start(bundle)
    assert second.bundle.checker.hashed == []
    np.testing.assert_array_equal(second.generate("a cat", steps=2, progress=False), a)


@pytest.mark.parametrize("change", ["same-size", "same-size-mtime-restored", "truncated"])
def test_changed_file_is_hashed_again_and_refused(bundle: Path, change: str) -> None:
    start(bundle)
    path = bundle / WEIGHTS
    if change == "truncated":
        path.write_bytes(path.read_bytes()[:-8])
    else:
        flip_byte(path, keep_times=change.endswith("restored"))
    pipe = runtime.load(bundle)  # programs and tokenizer are unchanged, and trusted
    assert pipe.bundle.checker.hashed == []
    with pytest.raises(BundleError, match=f"{WEIGHTS} does not match its sha256"):
        pipe.generate("a cat", steps=2, progress=False)
    assert pipe.bundle.checker.hashed == [WEIGHTS]


def test_touched_file_is_hashed_again_and_accepted(bundle: Path) -> None:
    start(bundle)
    st = (bundle / WEIGHTS).stat()
    os.utime(bundle / WEIGHTS, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    pipe = start(bundle)
    assert pipe.bundle.checker.hashed == [WEIGHTS]
    assert start(bundle).bundle.checker.hashed == []  # stamped again


def test_stamp_of_another_bundle_is_ignored(bundle: Path, tmp_path: Path, stamps: Path) -> None:
    start(bundle)
    (stamp,) = stamps.glob("*.json")
    other = tmp_path / "other"
    shutil.copytree(bundle, other)
    # Its own stamp file is another one; a copy of the first bundle's stamp in its place is not taken.
    shutil.copy(stamp, integrity.load_stamp(other, mf.read(other).bundle_id).path)
    assert set(start(other).bundle.checker.hashed) == all_files(other)

    # A bundle re-exported in place (another bundle id) does not take the old stamp either.
    data = json.loads((bundle / "manifest.json").read_text())
    data["defaults"]["steps"] = 3
    data["bundle_id"] = mf.content_id(data)
    (bundle / "manifest.json").write_text(mf.canonical_json(data))
    assert set(start(bundle).bundle.checker.hashed) == all_files(bundle)


def test_stamp_not_the_runtimes_own_is_ignored(bundle: Path, stamps: Path) -> None:
    start(bundle)
    (stamp,) = stamps.glob("*.json")
    flip_byte(bundle / WEIGHTS)
    # An edited stamp that vouches for the changed file: its MAC no longer matches.
    data = json.loads(stamp.read_text())
    data["files"][WEIGHTS].update(integrity.identity((bundle / WEIGHTS).stat()))
    stamp.write_text(json.dumps(data))
    with pytest.raises(BundleError, match="does not match its sha256"):
        runtime.load(bundle).generate("a cat", steps=2, progress=False)

    # A stamp made under another key (another user's, another machine's): ignored.
    flip_byte(bundle / WEIGHTS)  # back to the original bytes
    start(bundle)
    (stamps / "key").unlink()
    assert set(start(bundle).bundle.checker.hashed) == all_files(bundle)


def test_verify_ignores_stamps(bundle: Path) -> None:
    start(bundle)
    flip_byte(bundle / WEIGHTS)
    # A valid stamp of ours that (wrongly) vouches for the changed file, as if the change had kept its identity.
    m = mf.read(bundle)
    checker = integrity.Checker(bundle, m)
    ref = next(r for r in m.files() if r.file == WEIGHTS)
    checker.record({WEIGHTS: {"sha256": ref.sha256, **integrity.identity((bundle / WEIGHTS).stat())}})
    assert runtime.load(bundle).bundle.checker.trusted(ref)
    failed = [c.message for c in verify(bundle) if c.status == FAIL]
    assert failed == [f"bundle file {WEIGHTS} does not match its sha256 in the manifest (tampered or truncated): "
                      "re-copy or re-export the bundle"]


def test_unusable_stamp_directory_still_checks_everything(bundle: Path, stamps: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = stamps.parent / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(integrity.STAMP_ENV, str(blocker / "stamps"))
    assert set(start(bundle).bundle.checker.hashed) == all_files(bundle)
    assert set(start(bundle).bundle.checker.hashed) == all_files(bundle)
