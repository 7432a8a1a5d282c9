"""A training run's checkpoint as --dit-weights (issue 62): a torch.distributed.checkpoint folder, as TorchTitan's Wan
experiment writes it (step-N/ with .metadata and .distcp files; the model in the original Wan layout beside the
optimizer's state and the run's), written here by `torch.distributed.checkpoint.save` from one process."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest

from .conftest import CASES, run_cli, run_module

torch = pytest.importorskip("torch")


def _dcp(original: dict, out: Path, scale: float = 1.0) -> Path:
    """`original` (original Wan names -> tensors) saved as a training run would: under `model.` with torch.compile's
    and activation checkpointing's wrappers in the names, with an optimizer whose flattened keys hold the same block
    names, a scheduler and the run's state."""
    import torch.distributed.checkpoint as dcp

    def wrapped(name: str) -> str:
        parts = name.split(".")
        if parts[0] == "blocks":  # per-block activation checkpointing wraps each block
            parts.insert(2, "_checkpoint_wrapped_module")
        return "_orig_mod." + ".".join(parts)

    model = {wrapped(k): (v * scale).clone() for k, v in original.items()}
    state = {"model": model,
             "optimizer": {"state": {k: {"exp_avg": torch.ones_like(v), "step": torch.tensor(10.0)}
                                     for k, v in original.items()}, "param_groups": [{"lr": 1e-4}]},
             "lr_scheduler": {"last_epoch": 10}, "train_state": {"step": 10}}
    # two writer threads: with one, DCP's writer takes torchax (imported by other tests in this process) for an
    # accelerator and asks it for CUDA streams
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out), thread_count=2))
    return out


def test_a_dcp_folder_attaches_as_the_diffusers_directory(checkpoints, fp32_bundles, tmp_path: Path) -> None:
    """The run's folder (two steps: the highest is read) attached to a --no-weights fp32 bundle gives the DiT weights
    of the direct export from the diffusers directory the run's weights came from, bit for bit; the bundle runs."""
    from safetensors.numpy import load_file
    from safetensors.torch import load_file as load_torch

    import runtime

    from .test_quantize import lightx2v_file

    variant, res, frames, max_len = CASES["tiny-64x32-f9"]
    ckpt = checkpoints[variant]
    original = load_torch(str(lightx2v_file(ckpt, "transformer", tmp_path / "plain.safetensors", None)))
    run = tmp_path / "run"
    _dcp(original, run / "step-10")
    _dcp(original, run / "step-9", scale=0.5)  # an older step: not the one read
    bundle = tmp_path / "bundle"
    run_module("export", "--model", str(ckpt), "--no-weights", "--resolution", res, "--frames", str(frames),
               "--dtype", "fp32", "--max-sequence-length", str(max_len), "--out", str(bundle), "-q")
    proc = run_module("export", "attach", str(bundle), "--weights", str(ckpt), "--dit-weights", str(run))
    assert "reading step-10, the highest of 2 step(s)" in proc.stderr, proc.stderr
    got = load_file(str(bundle / "weights" / "transformer.safetensors"))
    want = load_file(str(fp32_bundles["tiny-64x32-f9"] / "weights" / "transformer.safetensors"))
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
    assert "ready to run" in run_cli("runtime", "verify", str(bundle)).stdout
    assert runtime.load(bundle).generate("a kite", steps=2, progress=False).std() > 1e-3


def test_a_full_export_takes_the_dit_from_a_dcp_folder(checkpoints, fp32_bundles, tmp_path: Path) -> None:
    """`--model CHECKPOINT --dit-weights RUN` in one export: the programs are the direct export's files, every weight
    file its weights bit for bit but the DiT's tensors the run holds (the checkpoint's halved), the RoPE tables
    computed as the model computes them."""
    from safetensors.numpy import load_file
    from safetensors.torch import load_file as load_torch

    from runtime import manifest as mf

    from .test_quantize import lightx2v_file

    variant, res, frames, max_len = CASES["tiny-64x32-f9"]
    ckpt = checkpoints[variant]
    original = load_torch(str(lightx2v_file(ckpt, "transformer", tmp_path / "plain.safetensors", None)))
    run = _dcp(original, tmp_path / "run" / "step-3", scale=0.5)  # halved: exact in fp32, and not the checkpoint's
    out = tmp_path / "bundle"
    run_module("export", "--model", str(ckpt), "--dit-weights", str(run), "--resolution", res, "--frames",
               str(frames), "--dtype", "fp32", "--max-sequence-length", str(max_len), "--out", str(out), "-q")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "plain.safetensors", "run"]  # no staging left
    ours, theirs = mf.read(out), mf.read(fp32_bundles["tiny-64x32-f9"])
    assert ours.source["dit_weights"] == [{"file": "step-3", "expert": "transformer"}]
    assert {k: p.sha256 for k, p in ours.programs.items()} == {k: p.sha256 for k, p in theirs.programs.items()}
    assert ours.weights.keys() == theirs.weights.keys()
    from export.prequantized import diffusers_names

    halved = set(diffusers_names(list(original)).values())
    for group in theirs.weights:
        got = load_file(str(out / "weights" / f"{group}.safetensors"))
        want = load_file(str(fp32_bundles["tiny-64x32-f9"] / "weights" / f"{group}.safetensors"))
        assert got.keys() == want.keys(), group
        for k in want:
            w = want[k] * np.float32(0.5) if group == "transformer" and k in halved else want[k]
            assert got[k].dtype == want[k].dtype and np.array_equal(got[k], w), (group, k)
    assert len(halved) > 10 and halved <= set(theirs.weights["transformer"].tensors)


def test_a_dcp_folder_that_is_not_this_model_is_one_line(checkpoints, tmp_path: Path) -> None:
    """Exit 2, one line, the bundle left without weights: a run of another architecture (its keys renamed) names the
    first missing tensor and the closest key present; a .pt file is refused unread; a .metadata that would unpickle
    anything but DCP's metadata is refused unread."""
    from safetensors.torch import load_file as load_torch

    from .test_quantize import lightx2v_file

    variant, res, frames, max_len = CASES["tiny-64x32-f9"]
    ckpt = checkpoints[variant]
    original = load_torch(str(lightx2v_file(ckpt, "transformer", tmp_path / "plain.safetensors", None)))
    other = _dcp({k.replace("self_attn", "attention"): v for k, v in original.items()}, tmp_path / "other")
    pt = tmp_path / "model.pt"
    pt.write_bytes(b"not read")
    evil = _dcp(original, tmp_path / "evil")

    class Payload:
        def __reduce__(self):  # what a hostile .metadata does: call anything on load
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (evil / ".metadata").write_bytes(pickle.dumps(Payload()))
    bundle = tmp_path / "bundle"
    run_module("export", "--model", str(ckpt), "--no-weights", "--resolution", res, "--frames", str(frames),
               "--dtype", "fp32", "--max-sequence-length", str(max_len), "--out", str(bundle), "-q")
    cases = [(other, r"holds no model tensor for blocks\.0\.attn1\.\S+ of this bundle's transformer \(the closest "
                     r"key it has: blocks\.0\.attention\."),
             (pt, r"is a pickle \(\.pt\), which export never unpickles"),
             (evil, r"names posix\.system, which DCP's metadata never holds")]
    for path, message in cases:
        proc = run_cli("export", "attach", str(bundle), "--weights", str(ckpt), "--dit-weights", str(path),
                       "-q", check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert re.search(message, lines[0]), lines[0]
        assert not (bundle / "weights").exists() or not any((bundle / "weights").iterdir())
    assert not (tmp_path / "pwned").exists()
