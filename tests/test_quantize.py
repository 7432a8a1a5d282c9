"""int8 / fp8 / int8-dynamic weights (export --quantize): what is stored, how close the videos stay to the same bundle
unquantized (same latents), sharding, LoRA and the speed-ups on them, and lightx2v-layout checkpoints attached as they
are (tiny fp32 models: a one-expert Wan 2.1 and a two-expert Wan 2.2)."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import runtime
from export.prequantized import diffusers_names
from runtime import manifest as mf
from runtime.magcache import MagCache

from .conftest import (
    CASES,
    KIND_CASES,
    ROOT,
    OnDemand,
    devices_env,
    in_parallel,
    run_cli,
    run_module,
    run_modules,
    run_processes,
)

sys.path.insert(0, str(ROOT / "tools"))
import quality  # noqa: E402  (tools/quality.py: the fidelity measure the bounds are stated in)

MODES = ("int8", "fp8", "int8-dynamic")
STORAGE = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn), "int8-dynamic": np.dtype(np.int8)}
# Fidelity against the same bundle unquantized (fp32, the same latents), as tools/quality.py measures it over its
# prompts x SEEDS, 4 steps, guidance 4. The first step's velocity error is what the weights' rounding sets, and it is
# stable across models (int8 1.1e-3..6.6e-3, int8-dynamic 6.4e-3..1.1e-2, fp8 9.8e-3..2.5e-2); the frames' PSNR (the
# worst prompt x seed) adds how much a random tiny model amplifies that over the steps, which depends on the model,
# shape and seed (int8 37.2..68.3 dB, fp8 32.2..54.5, int8-dynamic 32.5..65.2). Measured over tiny, tiny-wide and
# tiny-t2v-moe at 64x32 and 96x64 (BENCHMARKS.md section 5); the bounds sit below the least of each. In bf16 such a
# model's frames are as far from fp32's (32-36 dB) as a quantized bf16 bundle's from bf16's: bounds are for fp32.
SEEDS = (0, 1, 2)
VELOCITY_BOUND = {"int8": 1e-2, "int8-dynamic": 2e-2, "fp8": 4e-2}
PSNR_BOUND = {"int8": 35.0, "fp8": 30.0, "int8-dynamic": 30.0}
LORA_PSNR_BOUND = 38.0  # int8 with an adapter merged and quantized again, against fp32 with the same adapter
KINDS = {"t2v": ("checkpoints", "tiny", CASES["tiny-64x32-f9"]), "t2v-moe": ("kind", "t2v-moe", KIND_CASES["t2v-moe"])}
PROMPT = "a lighthouse in a storm"
STEPS = 4


def _case(kind: str) -> tuple[str, int, int]:
    """(resolution, frames, max sequence length) of a kind's reference bundle in conftest."""
    spec = KINDS[kind][2]
    return spec[-3], spec[-2], spec[-1]


def _checkpoint(kind: str, checkpoints: dict[str, Path], kind_checkpoints: dict[str, Path]) -> Path:
    where, key, _ = KINDS[kind]
    return checkpoints[key] if where == "checkpoints" else kind_checkpoints[key]


def _reference(kind: str, fp32_bundles: dict[str, Path], kind_bundles: dict[str, Path]) -> Path:
    return fp32_bundles["tiny-64x32-f9"] if kind == "t2v" else kind_bundles["t2v-moe"]


@pytest.fixture(scope="module")
def quant_bundles(checkpoints, kind_checkpoints, tmp_path_factory) -> OnDemand:
    """Each kind x mode, exported as conftest exports the unquantized reference of the kind: the t2v ones (what the
    default run uses) at once, two at a time, a two-expert one when a test first asks for it (the slow tier)."""
    root = tmp_path_factory.mktemp("quantized")

    def command(kind: str, mode: str) -> list[str]:
        res, frames, max_len = _case(kind)
        return ["export", "--model", str(_checkpoint(kind, checkpoints, kind_checkpoints)), "--resolution", res,
                "--frames", str(frames), "--dtype", "fp32", "--max-sequence-length", str(max_len), "--quantize", mode,
                "--out", str(root / f"{kind}-{mode}"), "-q"]

    def export(kind: str, mode: str) -> Path:
        run_module(*command(kind, mode))
        return root / f"{kind}-{mode}"

    return OnDemand.start({(k, m): functools.partial(export, k, m) for k in KINDS for m in MODES},
                          now=[("t2v", m) for m in MODES])


def _frames(pipe: runtime.Pipeline, seed: int = 3, **kw) -> np.ndarray:
    latents = pipe.initial_latents(seed)
    return pipe.decode(pipe.denoise(pipe.encode(PROMPT, "blurry"), seed=seed, steps=STEPS, guidance=4.0,
                                    latents=latents, progress=False, **kw))


@pytest.mark.parametrize("kind", ["t2v", pytest.param("t2v-moe", marks=pytest.mark.slow)])  # moe: a variant
@pytest.mark.parametrize("mode", MODES)
def test_mode_stores_8_bit_weights_and_stays_close(kind, mode, quant_bundles, fp32_bundles, kind_bundles) -> None:
    """The table's layers are stored in the mode's dtype with a float32 scale per output row, the rest as before;
    `verify` passes; the frames stay within the mode's PSNR bound of the unquantized bundle's (same latents)."""
    bundle = quant_bundles[kind, mode]
    m = mf.read(bundle)
    assert m.quantize == mode
    ref = mf.read(_reference(kind, fp32_bundles, kind_bundles))
    for group, wf in m.weights.items():
        plain = ref.weights[group].tensors
        for name, spec in wf.tensors.items():
            if name.endswith("_scale"):
                base = name.removesuffix("_scale")
                assert base in wf.quantized and spec == mf.TensorSpec((plain[base].shape[0], 1), "float32")
            elif name in wf.quantized:
                assert wf.quantized[name] == mode and np.dtype(spec.dtype) == STORAGE[mode]
                assert spec.shape == plain[name].shape
            else:
                assert spec == plain[name], name
        q = set(wf.quantized)
        if group.startswith("transformer"):
            block_linear = r"blocks\.\d+\.(attn[12]\.(to_[qkv]|to_out\.0)|ffn\.net\.(0\.proj|2))\.weight"
            layers = {n for n in plain if re.fullmatch(block_linear, n)}
            assert q == layers and "proj_out.weight" not in q and "condition_embedder.time_proj.weight" not in q
        elif group == "text_encoder":
            assert "shared.weight" in q and any(".DenseReluDense.wo.weight" in n for n in q)
            assert not any("layer_norm" in n or "relative_attention_bias" in n for n in q)
        else:
            assert not q, group
    proc = run_cli("runtime", "verify", str(bundle))
    assert "ready to run" in proc.stdout
    rows = quality.compare(runtime.load(_reference(kind, fp32_bundles, kind_bundles)), runtime.load(bundle),
                           list(quality.PROMPTS), list(SEEDS), STEPS, 4.0)
    print(f"{kind} {mode}:\n{quality.table(rows)}")
    s = quality.summary(rows)
    assert PSNR_BOUND[mode] <= s["psnr_db_min"] < math.inf, f"{kind} {mode}: {s}"
    assert 0 < s["velocity_rel_error_max"] <= VELOCITY_BOUND[mode], f"{kind} {mode}: {s}"


def test_quality_tool(quant_bundles, fp32_bundles, kind_bundles, capsys) -> None:
    """`tools/quality.py --json` reports a row per prompt x seed and their summary; bundles of two kinds are one
    line and exit 2."""
    ref, cand = fp32_bundles["tiny-64x32-f9"], quant_bundles["t2v", "fp8"]
    argv = ["--reference", str(ref), "--candidate", str(cand), "--seeds", "0", "4", "--steps", "2", "--json"]
    assert quality.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    rows = [quality.Row(**r) for r in out["rows"]]
    assert [(r.prompt, r.seed) for r in rows] == [(p, s) for p in quality.PROMPTS for s in (0, 4)]
    assert out["summary"] == quality.summary(rows)
    assert all(0 < r.velocity_rel_error <= VELOCITY_BOUND["fp8"] and r.psnr_db < math.inf for r in rows)
    assert quality.main(["--reference", str(ref), "--candidate", str(kind_bundles["t2v-moe"])]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the bundles are of different kinds") and len(err.splitlines()) == 1, err


def test_inspect_shows_bytes_per_device_by_dtype(quant_bundles) -> None:
    proc = run_cli("runtime", "inspect", str(quant_bundles["t2v", "fp8"]))
    assert "quantized: fp8" in proc.stdout
    line = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith("transformer"))
    assert "float8_e4m3fn" in line and "float32" in line
    data = json.loads(run_cli("runtime", "inspect", str(quant_bundles["t2v", "fp8"]), "--json").stdout)
    dit = data["weights"]["transformer"]
    assert sum(dit["bytes_per_device_by_dtype"].values()) == dit["bytes_per_device"]
    assert dit["quantized_tensors"] == len(mf.read(quant_bundles["t2v", "fp8"]).weights["transformer"].quantized)


_SCRIPT = """
import json, sys
import numpy as np
import runtime
pipe = runtime.load(sys.argv[1])
embeds = pipe.encode("a lighthouse in a storm", "blurry")
lat = pipe.denoise(embeds, seed=2, steps=3, guidance=4.0, progress=False)
w = pipe.bundle.weights("transformer", "denoise_step")
print(json.dumps({"lat": lat.tolist(), "spec": str(w["blocks.0.attn1.to_q.weight_scale"].sharding.spec)}))
"""


@pytest.mark.slow  # a variant on 8 devices and 2 processes: test_multidevice covers the mechanism
@pytest.mark.parametrize("mode", ["int8-dynamic"])  # the mode with reductions of its own (per-token scales)
def test_sharded_equals_single_device(mode, checkpoints, quant_bundles, tmp_path) -> None:
    """On 8 fake devices (dp=2, sp=2, tp=2) the scales split with their rows and the latents equal one device's."""
    from safetensors.numpy import load_file

    from .test_multidevice import GEN

    res, frames, max_len = _case("t2v")
    cpu8 = tmp_path / "cpu8"
    frames_out = {n: tmp_path / f"frames{n}.safetensors" for n in (1, 2)}

    def latents(n: int, bundle: Path) -> dict:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
               **devices_env(n)}
        proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(bundle)], cwd=ROOT, env=env, timeout=300,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def one_device() -> dict:  # beside the cpu-8 export: the single-device latents and frames
        run_module("runtime", "generate", str(quant_bundles["t2v", mode]), *GEN, "--out", str(tmp_path / "one.mp4"),
                   "--frames-out", str(frames_out[1]))
        return latents(1, quant_bundles["t2v", mode])

    _, one = in_parallel(
        lambda: run_module("export", "--model", str(checkpoints["tiny"]), "--resolution", res, "--frames",
                           str(frames), "--dtype", "fp32", "--max-sequence-length", str(max_len), "--quantize", mode,
                           "--target", "cpu-8", "--out", str(cpu8), "-q"),
        one_device)
    out = {1: one, 8: latents(8, cpu8)}
    assert "tp" in out[8]["spec"]
    np.testing.assert_allclose(out[8]["lat"], out[1]["lat"], rtol=0, atol=1e-5)
    # and on 2 processes x 4 devices (jax.distributed over loopback): each host places its own shards
    run_processes(["generate", str(cpu8), *GEN, "--out", str(tmp_path / "two.mp4"), "--frames-out",
                   str(frames_out[2])])
    a, b = (load_file(str(frames_out[n]))["frames"] for n in (1, 2))
    assert a.shape == b.shape and np.abs(a - b).max() <= 1e-5


def test_lora_merges_into_quantized_weights(quant_bundles, fp32_bundles, checkpoints, tmp_path) -> None:
    """An adapter on an int8 bundle is merged into each dequantized weight and quantized again: the frames stay as
    close to the unquantized bundle with the same adapter as without adapters, and the adapter does change them."""
    from .test_lora import diffusers_lora

    lora = diffusers_lora(checkpoints["tiny"], tmp_path / "src", seed=7)
    bundles = {"int8": quant_bundles["t2v", "int8"], "plain": fp32_bundles["tiny-64x32-f9"]}
    adapters = {k: tmp_path / f"{k}.safetensors" for k in bundles}
    run_modules(*[["export", "lora", str(lora), "--bundle", str(b), "--out", str(adapters[k])]
                  for k, b in bundles.items()])
    frames = {(k, with_lora): _frames(runtime.load(b, loras=[(adapters[k], 0.8)] if with_lora else None))
              for k, b in bundles.items() for with_lora in (True, False)}
    close = quality.psnr(frames["int8", True], frames["plain", True])
    assert close >= LORA_PSNR_BOUND
    assert quality.psnr(frames["int8", True], frames["int8", False]) < close - 5  # the adapter changes more
    pipe = runtime.load(bundles["int8"], loras=[(adapters["int8"], 0.8)])
    w = pipe.bundle.weights("transformer", "denoise_step")
    assert w["blocks.0.attn1.to_q.weight"].dtype == np.int8


def test_magcache_and_cfg_free_steps_on_a_quantized_bundle(quant_bundles, fp32_bundles) -> None:
    """MagCache's cached steps and guidance-1 (cond-only) steps run on fp8 weights and stay close to fp32's."""
    cache = MagCache([1.0, 1.0, 1.01, 0.99, 1.02, 0.97, 1.0, 1.0], threshold=0.05, max_skip_steps=2,
                     retention_ratio=0.2)
    for kw in ({"magcache": cache}, {}):
        q, plain = (runtime.load(b) for b in (quant_bundles["t2v", "fp8"], fp32_bundles["tiny-64x32-f9"]))
        embeds = {p: p.encode(PROMPT) for p in (q, plain)}
        guidance = 4.0 if kw else 1.0
        lat = {p: p.denoise(embeds[p], seed=1, steps=6, guidance=guidance, progress=False, **kw) for p in (q, plain)}
        assert quality.psnr(q.decode(lat[q]), plain.decode(lat[plain])) >= PSNR_BOUND["fp8"]


# -- checkpoints in lightx2v's layout -----------------------------------------------------------------------------

_TO_WAN = [("attn1.", "self_attn."), ("attn2.", "cross_attn."), (".to_out.0.", ".o."), (".to_q.", ".q."),
           (".to_k.", ".k."), (".to_v.", ".v."), (".add_k_proj.", ".k_img."), (".add_v_proj.", ".v_img."),
           (".norm_added_k.", ".norm_k_img."), ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
           ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
           ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
           ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
           ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
           ("condition_embedder.time_proj", "time_projection.1"), ("proj_out", "head.head"),
           ("norm2", "norm_x"), ("norm3", "norm2"), ("norm_x", "norm3")]
_LIGHTX2V_QUANTIZED = re.compile(r"blocks\.\d+\.(self_attn\.[qkvo]|cross_attn\.([qkvo]|k_img|v_img)|ffn\.[02])\.weight")


def _wan_name(name: str) -> str:
    """A diffusers Wan DiT tensor name in the original Wan layout."""
    if name == "scale_shift_table":
        return "head.modulation"
    for a, b in _TO_WAN:
        name = name.replace(a, b)
    return name.replace("scale_shift_table", "modulation")


def lightx2v_file(checkpoint: Path, subfolder: str, out: Path, mode: str | None) -> Path:
    """The checkpoint's DiT in lightx2v's layout: original Wan names; with `mode`, the block linears' weights in int8
    or float8_e4m3fn with a per-row fp32 `weight_scale` (symmetric absmax), written here independently of export."""
    import torch
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    sd = load_file(str(checkpoint / subfolder / "diffusion_pytorch_model.safetensors"))
    renamed = {_wan_name(k): v for k, v in sd.items()}
    assert {diffusers_names(list(renamed))[k]: k for k in renamed} == {k: _wan_name(k) for k in sd}  # round trip
    tensors = {}
    for name, w in renamed.items():
        if mode and _LIGHTX2V_QUANTIZED.fullmatch(name):
            w = w.astype(np.float32)
            qmax = 127.0 if mode != "fp8" else 448.0
            amax = np.abs(w).max(axis=1, keepdims=True)
            scale = np.where(amax > 0, amax / np.float32(qmax), np.float32(1)).astype(np.float32)
            x = np.clip(w / scale, -qmax, qmax)
            if mode == "fp8":
                q = torch.from_numpy(x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)).view(torch.float8_e4m3fn)
            else:
                q = torch.from_numpy(np.round(x).astype(np.int8))
            tensors[name], tensors[name + "_scale"] = q, torch.from_numpy(scale)
        else:
            tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    save_file(tensors, str(out))
    return out


def _int8_programs(checkpoint: Path, out: Path) -> Path:
    """The two-expert case's programs exported with --quantize int8 and --no-weights, for attaching."""
    res, frames, max_len = _case("t2v-moe")
    run_module("export", "--model", str(checkpoint), "--no-weights", "--resolution", res, "--frames", str(frames),
               "--dtype", "fp32", "--max-sequence-length", str(max_len), "--quantize", "int8", "--out", str(out), "-q")
    return out


def test_lightx2v_checkpoints_attach_as_export_quantizes(kind_checkpoints, quant_bundles, tmp_path) -> None:
    """Both experts of a two-expert model from int8 files in lightx2v's layout: the attached bundle's tensors are
    those `--quantize int8` writes from the bf16 checkpoint, bit for bit."""
    from safetensors.numpy import load_file

    ckpt = kind_checkpoints["t2v-moe"]
    bundle = _int8_programs(ckpt, tmp_path / "bundle")
    files = [lightx2v_file(ckpt, g, tmp_path / f"{g}.safetensors", "int8") for g in ("transformer", "transformer_2")]
    run_module("export", "attach", str(bundle), "--weights", str(ckpt), "--quantize", "int8",
               "--dit-weights", str(files[0]), "--dit-weights", str(files[1]), "-q")
    proc = run_cli("runtime", "verify", str(bundle))
    assert "ready to run" in proc.stdout
    exported = quant_bundles["t2v-moe", "int8"]
    for group in ("transformer", "transformer_2", "text_encoder"):
        got = load_file(str(bundle / "weights" / f"{group}.safetensors"))
        want = load_file(str(exported / "weights" / f"{group}.safetensors"))
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and np.array_equal(got[k].view(np.uint8), want[k].view(np.uint8)), k


def test_prequantized_file_that_does_not_match_is_one_line(kind_checkpoints, tmp_path, capsys) -> None:
    """A file of another mode, an unquantized one, a missing expert, a mismatched --quantize, or a LoRA to merge into
    files stored quantized: exit 2, one line naming the tensor or the flag, and the bundle still has no weights."""
    ckpt = kind_checkpoints["t2v-moe"]
    bundle = _int8_programs(ckpt, tmp_path / "bundle")
    fp8 = [lightx2v_file(ckpt, g, tmp_path / f"{g}-fp8.safetensors", "fp8") for g in ("transformer", "transformer_2")]
    plain = [lightx2v_file(ckpt, g, tmp_path / f"{g}.safetensors", None) for g in ("transformer", "transformer_2")]
    int8 = [lightx2v_file(ckpt, g, tmp_path / f"{g}-int8.safetensors", "int8") for g in ("transformer", "transformer_2")]
    layer = r"tensor blocks\.0\.(self|cross)_attn\.[qkvo]\.weight"
    cases = [
        ([*fp8], [], layer + " is float8_e4m3fn but this --quantize int8 bundle"),
        ([*plain], [], layer + " is float32 but this --quantize int8 bundle"),
        ([fp8[0]], [], r"has 2 DiT expert\(s\) .*give --dit-weights once per expert"),
        ([], ["--quantize", "fp8"], r"was exported with --quantize int8 .*attach with --quantize int8"),
        ([*int8], ["--merge-lora", str(int8[0])], r"--merge-lora cannot merge into this int8 bundle's DiT taken from "
                                                   r"--dit-weights .*merge the LoRA at load instead"),
    ]
    from export.__main__ import main

    capsys.readouterr()
    for files, extra, message in cases:  # in this process: the CLI's main, as `python -m export` runs it
        args = [a for f in files for a in ("--dit-weights", str(f))]
        code = main(["attach", str(bundle), "--weights", str(ckpt), *args, *extra, "-q"])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err[-2000:]
        lines = err.strip().splitlines()
        assert len(lines) == 1 and re.search(message, lines[0]), lines
        assert not mf.read(bundle).has_weights
    assert not list(tmp_path.glob(".bundle.*"))  # no partial copy left behind


def test_unknown_mode_is_refused(checkpoints, tmp_path) -> None:
    proc = run_cli("export", "--model", str(checkpoints["tiny"]), "--resolution", "32x32", "--frames", "5",
                      "--quantize", "int4", "--out", str(tmp_path / "b"), check=False)
    assert proc.returncode == 2 and "--quantize: invalid choice: 'int4'" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "b").exists()


def test_clip_kind_quantizes_the_image_encoder_too(kind_checkpoints, kind_bundles, tmp_path) -> None:
    """First-last-frame (CLIP image encoder, image cross-attention): the image encoder's and the added K/V projections'
    weights are int8 too, and the video from two images stays within int8's bound of the fp32 bundle's (at its default
    shape: the int8 bundle has that shape alone, whose programs are what a bundle of more shapes has for it)."""
    from .conftest import test_image

    _, shapes, frames, max_len = KIND_CASES["flf2v"]
    res = shapes.split(",")[0]  # the fp32 bundle's default shape
    bundle = tmp_path / "flf2v-int8"
    run_module("export", "--model", str(kind_checkpoints["flf2v"]), "--resolution", res, "--frames", str(frames),
               "--dtype", "fp32", "--max-sequence-length", str(max_len), "--quantize", "int8", "--out", str(bundle),
               "-q")
    m = mf.read(bundle)
    assert any(".mlp.fc1.weight" in n for n in m.weights["image_encoder"].quantized)
    assert any(".attn2.add_k_proj.weight" in n for n in m.weights["transformer"].quantized)
    images = {"image": test_image(64, 32, seed=1), "last_image": test_image(64, 32, seed=2)}
    out = []
    for path in (bundle, kind_bundles["flf2v"]):
        pipe = runtime.load(path)
        out.append(pipe.generate(PROMPT, **images, seed=2, steps=STEPS, latents=pipe.initial_latents(2),
                                 progress=False))
    assert quality.psnr(*out) >= PSNR_BOUND["int8"]


def test_lora_switches_on_int8_quantize_again_from_the_stored_weights(quant_bundles, tmp_path) -> None:
    """The jobs none -> A -> B -> A+B at (0.5, 1.0) -> none -> A in one pipeline on the int8 bundle: every switch merges
    each quantized tensor again from its stored int8 values and scale (dequantized, the set added, quantized again,
    never from the last merge), so each job's frames are exactly those `runtime generate --lora` makes in a fresh
    process with its set, and the weights and scales end bit for bit as a fresh load's (tests/test_lora_switch.py)."""
    from .test_lora_switch import SEQUENCE, check_sequence, cli_references, make_adapter

    bundle = quant_bundles["t2v", "int8"]
    make_adapter(bundle, tmp_path / "loras" / "A.safetensors", seed=1)
    make_adapter(bundle, tmp_path / "loras" / "B.safetensors", seed=2, rank=2)
    check_sequence(bundle, tmp_path / "loras",
                   cli_references(bundle, tmp_path / "loras", list(SEQUENCE), tmp_path / "cli"))
