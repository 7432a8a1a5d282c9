"""GGUF DiT files (issue 62): city96's layout (original Wan names, 1-D tensors in F32 or F16), written here with the
`gguf` package (Q8_0, Q4_0) and tools/gguf_quants.py (Q4_K, which the package cannot quantize), read by export with
the package's dequantizers, against diffusers' own GGUF loader."""

from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import runtime

from .conftest import CASES, run_cli

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

PROMPT, NEGATIVE = "a lighthouse in a storm", "blurry"


def _types(name: str) -> str:
    """The tiny model's tensors as a city96 file stores them, with every kind of block the test reads: the K-quant on
    the one 256-wide weight (time_embedding.0, [24, 256]), Q8_0 and Q4_0 on the 32-wide ones, the norms in F16, the
    rest (24 wide: no block type fits) in F32."""
    return {"time_embedding.0.weight": "Q4_K", "blocks.0.ffn.2.weight": "Q8_0", "text_embedding.0.weight": "Q8_0",
            "blocks.1.ffn.2.weight": "Q4_0"}.get(name, "F16" if "norm" in name else "F32")


def _original(checkpoint: Path, tmp_path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    from .test_quantize import lightx2v_file

    return load_file(str(lightx2v_file(checkpoint, "transformer", tmp_path / "plain.safetensors", None)))


def _gguf(original: dict[str, np.ndarray], path: Path, types=_types) -> Path:
    from tools import gguf_quants

    return gguf_quants.write(path, {k: (v, types(k)) for k, v in original.items()})


def test_a_gguf_dit_gives_the_frames_of_diffusers_gguf_loader(checkpoints, fp32_bundles, tmp_path: Path) -> None:
    """A GGUF file as --dit-weights of an fp32 bundle (attached in this process to a copy of the session's bundle, so
    its programs are compiled already; a full export's --dit-weights takes the same path, test_dcp): the DiT's tensors
    are the gguf package's dequantized values exactly, and the frames within 1e-4 of diffusers' WanPipeline with the
    same file loaded by
    `from_single_file(..., GGUFQuantizationConfig(compute_dtype=float32))`, its block dequantizers run in float32 (on
    CPU diffusers 0.42 dequantizes in fp16, 1-6e-4 off what llama.cpp and the gguf package compute)."""
    import diffusers.quantizers.gguf.utils as gguf_utils
    from diffusers import GGUFQuantizationConfig, WanPipeline, WanTransformer3DModel
    from safetensors.numpy import load_file

    from export.prequantized import diffusers_names
    from tools import gguf_quants

    variant, _, frames, max_len = CASES["tiny-64x32-f9"]
    ckpt = checkpoints[variant]
    original = _original(ckpt, tmp_path)
    file = _gguf(original, tmp_path / "wan-tiny-Q4_K_M.gguf")
    out = tmp_path / "bundle"
    shutil.copytree(fp32_bundles["tiny-64x32-f9"], out)
    run_cli("export", "attach", str(out), "--weights", str(ckpt), "--dit-weights", str(file), "--force",
            "-q")
    got = load_file(str(out / "weights" / "transformer.safetensors"))
    for old, new in diffusers_names(list(original)).items():
        want = gguf_quants.dequantize(gguf_quants.quantize(original[old], _types(old)), _types(old),
                                      original[old].shape)
        assert got[new].dtype == np.float32 and np.array_equal(got[new], want), new
    assert not np.array_equal(got["condition_embedder.time_embedder.linear_1.weight"],
                              original["time_embedding.0.weight"])  # Q4_K moved it

    pipe = runtime.load(out)
    assert pipe.manifest.source["dit_weights"] == [{"file": file.name, "expert": "transformer"}]
    steps, guidance, seed = 3, 5.0, 3
    frames_out = pipe.generate(PROMPT, NEGATIVE, seed=seed, steps=steps, guidance=guidance, progress=False)
    fp32 = {k: functools.partial(f, dtype=torch.float32) for k, f in gguf_utils.dequantize_functions.items()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_utils, "dequantize_functions", fp32)
        dit = WanTransformer3DModel.from_single_file(
            str(file), config=str(ckpt), subfolder="transformer", torch_dtype=torch.float32,
            quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32))
        assert any(type(p).__name__ == "GGUFParameter" for p in dit.parameters())  # blocks kept quantized
        ref = WanPipeline.from_pretrained(str(ckpt), transformer=dit, dtype=torch.float32)
        g = pipe.geometry
        with torch.no_grad():
            want = ref(prompt=PROMPT, negative_prompt=NEGATIVE, height=g.height, width=g.width, num_frames=frames,
                       num_inference_steps=steps, guidance_scale=guidance, max_sequence_length=max_len,
                       latents=torch.from_numpy(pipe.initial_latents(seed).copy()), output_type="np").frames
    assert np.abs(frames_out - want).max() <= 1e-4 and frames_out.std() > 1e-3


def test_gguf_blocks_into_an_int8_bundle_are_quantized_per_row(checkpoints, fp32_bundles, tmp_path: Path) -> None:
    """With --quantize int8, a GGUF's block weights (Q8_0 and Q4_0 here) are stored as int8 with a per-row scale,
    quantized from the dequantized values as export quantizes a checkpoint; the rest cast to the bundle's dtype."""
    import dataclasses

    from export import gguf_file
    from export.quantize import quantize_tensor
    from runtime import manifest as mf
    from tools import gguf_quants

    variant = CASES["tiny-64x32-f9"][0]
    original = _original(checkpoints[variant], tmp_path)
    file = _gguf(original, tmp_path / "dit.gguf")
    wf = mf.read(fp32_bundles["tiny-64x32-f9"]).weights["transformer"]
    quantized = {"blocks.0.ffn.net.2.weight": "int8", "blocks.1.ffn.net.2.weight": "int8",
                 "blocks.0.attn1.to_q.weight": "int8"}
    tensors = dict(wf.tensors)
    for name in quantized:
        tensors[name] = mf.TensorSpec(wf.tensors[name].shape, "int8")
        tensors[name + "_scale"] = mf.TensorSpec((wf.tensors[name].shape[0], 1), "float32")
    int8 = dataclasses.replace(wf, tensors=tensors, quantized=quantized)
    rope = {n: torch.zeros(spec.shape) for n, spec in wf.tensors.items() if n.startswith("rope.")}  # computed
    got = gguf_file.read(file, int8, "transformer", rope)
    for name, old in (("blocks.0.ffn.net.2.weight", "blocks.0.ffn.2.weight"),
                      ("blocks.1.ffn.net.2.weight", "blocks.1.ffn.2.weight"),
                      ("blocks.0.attn1.to_q.weight", "blocks.0.self_attn.q.weight")):
        dequantized = gguf_quants.dequantize(gguf_quants.quantize(original[old], _types(old)), _types(old),
                                             original[old].shape)
        q, scale = quantize_tensor(torch.from_numpy(dequantized), "int8")
        assert got[name].dtype == torch.int8 and torch.equal(got[name], q), name
        assert got[name + "_scale"].shape == (q.shape[0], 1) and torch.equal(got[name + "_scale"], scale), name
        back = (got[name].float() * got[name + "_scale"]).numpy()
        assert np.abs(back - dequantized).max() <= scale.max().item() / 2 + 1e-7, name
    assert got["blocks.0.norm2.weight"].dtype == torch.float32  # F16 in the file, the bundle's dtype in the bundle
    assert set(got) == set(tensors)


def test_bad_gguf_files_are_one_line_and_write_nothing(checkpoints, fp32_bundles, tmp_path: Path) -> None:
    """Exit 2, one line, the bundle untouched: a tensor type export does not read (named with its type), a tensor of
    another shape, a missing tensor (named, with the closest present), a file that is not GGUF, a GGUF as --model
    without --weights."""
    import gguf

    from tools import gguf_quants

    variant = CASES["tiny-64x32-f9"][0]
    ckpt = checkpoints[variant]
    original = _original(ckpt, tmp_path)
    iq4 = tmp_path / "iq4.gguf"  # an IQ4_NL block (18 bytes per 32 values) gguf can store but export does not read
    w = gguf.GGUFWriter(str(iq4), "wan")
    for k, v in original.items():
        if k == "blocks.0.ffn.2.weight":
            w.add_tensor(k, np.zeros((v.shape[0], 18), np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        else:
            w.add_tensor(k, v)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    wrong = dict(original, **{"text_embedding.2.weight": original["text_embedding.2.weight"][:, :16]})
    short = {k: v for k, v in original.items() if k != "blocks.1.self_attn.q.weight"}
    not_gguf = tmp_path / "torn.gguf"
    not_gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 5)
    bundle = tmp_path / "bundle"
    shutil.copytree(fp32_bundles["tiny-64x32-f9"], bundle)
    before = {p.name: p.read_bytes() for p in (bundle / "weights").iterdir()}
    cases = [(iq4, r"tensor blocks\.0\.ffn\.2\.weight is IQ4_NL, a GGUF type export does not read"),
             (gguf_quants.write(tmp_path / "wrong.gguf", {k: (v, "F32") for k, v in wrong.items()}),
              r"tensor text_embedding\.2\.weight is \[24, 16\] but the bundle's transformer expects \[24, 24\]"),
             (gguf_quants.write(tmp_path / "short.gguf", {k: (v, "F32") for k, v in short.items()}),
              r"holds no tensor for blocks\.1\.attn1\.to_q\.weight of this bundle's transformer \(the closest it "
              r"has: blocks\.1\.self_attn\.\w\.weight\)"),
             (not_gguf, r"cannot read --dit-weights \S+torn\.gguf as GGUF")]
    for path, message in cases:
        proc = run_cli("export", "attach", str(bundle), "--weights", str(ckpt), "--dit-weights", str(path),
                       "--force", "-q", check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        assert re.search(message, lines[0]), lines[0]
    assert {p.name: p.read_bytes() for p in (bundle / "weights").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    proc = run_cli("export", "--model", str(iq4), "--resolution", "64x32", "--out", str(tmp_path / "x"), check=False)
    assert proc.returncode == 2 and "is a GGUF file, which holds the DiT only: give the checkpoint" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_a_gguf_model_is_the_first_experts_dit_weights() -> None:
    """`--model FILE.gguf --weights CHECKPOINT [--dit-weights LOW.gguf]` is an export of CHECKPOINT whose DiT experts
    come from the GGUF files, in that order (the rest of the export is test_dcp's full export with --dit-weights)."""
    from export.__main__ import _model_and_dit_weights, parser

    args = parser().parse_args(["--model", "high.gguf", "--weights", "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
                                "--dit-weights", "low.gguf", "--resolution", "480p", "--out", "x"])
    assert _model_and_dit_weights(args) == ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", [Path("high.gguf"), Path("low.gguf")])
