"""LoRA adapters: converted with diffusers' own Wan loader, merged per device shard at load, against diffusers
with the same LoRA loaded through PEFT (tiny fp32 models)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import runtime
from runtime.errors import UserError

from .conftest import CASES, devices_env, run_module

PROMPT = "a lighthouse in a storm"
CASE = "tiny-64x32-f9"
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


def diffusers_lora(checkpoint: Path, out: Path, seed: int, rank: int = 4, alpha: int = 8,
                   subfolder: str = "transformer") -> Path:
    """A random LoRA in diffusers' own format (PEFT keys + adapter metadata, alpha != rank), saved by diffusers."""
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(seed)
    model = WanTransformer3DModel.from_pretrained(str(checkpoint), subfolder=subfolder, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS, init_lora_weights=False)
    model.add_adapter(config)
    with torch.no_grad():  # PEFT's non-default init still makes small B: make the change visible
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    WanPipeline.save_lora_weights(out, transformer_lora_layers=get_peft_model_state_dict(model),
                                  transformer_lora_adapter_metadata=config.to_dict())
    return out / "pytorch_lora_weights.safetensors"


def wan_format_lora(checkpoint: Path, out: Path, seed: int) -> Path:
    """A LoRA with the original Wan / ComfyUI keys (diffusion_model.*, lora_down/up, alpha, diff_b)."""
    import json

    import torch
    from safetensors.torch import save_file

    config = json.loads((checkpoint / "transformer" / "config.json").read_text())
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(config["num_layers"]):
        for o in ("q", "k", "v", "o"):
            key = f"diffusion_model.blocks.{i}.self_attn.{o}"
            sd[f"{key}.lora_down.weight"] = torch.randn(2, dim, generator=g) * 0.3
            sd[f"{key}.lora_up.weight"] = torch.randn(dim, 2, generator=g) * 0.3
            sd[f"{key}.alpha"] = torch.tensor(1.0)
            # diffusers' PEFT path needs a diff_b on every module once one has it (else meta biases)
            sd[f"{key}.diff_b"] = torch.randn(dim, generator=g) * 0.1
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "wan_lora.safetensors"))
    return out / "wan_lora.safetensors"


def _adapter(source: Path, bundle: Path, out: Path, *extra: str) -> Path:
    run_module("export", "lora", str(source), "--bundle", str(bundle), "--out", str(out), *extra)
    return out


def _reference(checkpoint: Path, pipe: runtime.Pipeline, loras: list[tuple[Path, float, bool]], steps: int,
               max_len: int, seed: int, guidance: float = 5.0, **call) -> np.ndarray:
    """diffusers' WanPipeline with each LoRA loaded by its Wan loader (PEFT) at its scale: the latents."""
    import torch
    from diffusers import WanPipeline

    ref = WanPipeline.from_pretrained(str(checkpoint), dtype=torch.float32)
    names = []
    for i, (path, scale, into_2) in enumerate(loras):
        ref.load_lora_weights(str(path), adapter_name=f"a{i}", load_into_transformer_2=into_2)
        names.append((f"a{i}", scale, into_2))
    for into_2 in (False, True):
        chosen = [(n, s) for n, s, i2 in names if i2 == into_2]
        model = ref.transformer_2 if into_2 else ref.transformer
        if chosen:
            model.set_adapters([n for n, _ in chosen], [s for _, s in chosen])
    g = pipe.geometry
    with torch.no_grad():
        return ref(prompt=PROMPT, height=g.height, width=g.width, num_frames=g.frames, num_inference_steps=steps,
                   guidance_scale=guidance, max_sequence_length=max_len, output_type="latent",
                   latents=torch.from_numpy(pipe.initial_latents(seed).copy()), **call).frames.numpy()


def test_diffusers_and_wan_format_loras_match_diffusers(fp32_bundles, checkpoints, tmp_path) -> None:
    variant, _, _, max_len = CASES[CASE]
    bundle, ckpt = fp32_bundles[CASE], checkpoints[variant]
    peft_lora = diffusers_lora(ckpt, tmp_path / "peft", seed=1)
    wan_lora = wan_format_lora(ckpt, tmp_path / "wan", seed=2)
    a = _adapter(peft_lora.parent, bundle, tmp_path / "a.safetensors")  # a directory holding the file works too
    b = _adapter(wan_lora, bundle, tmp_path / "b.safetensors")
    from safetensors import safe_open

    with safe_open(str(b), framework="numpy") as f:
        assert f.metadata()["bundle_id"] == runtime.load(bundle).bundle_id
        assert "transformer.blocks.0.attn1.to_q.bias.delta" in set(f.keys())  # the diff_b as a bias update

    plain = runtime.load(bundle)
    embeds = plain.encode(PROMPT)
    base = plain.denoise(embeds, seed=4, steps=3, progress=False)
    pipe = runtime.load(bundle, loras=[(a, 0.7), (b, 1.0)])
    ours = pipe.denoise(embeds, seed=4, steps=3, progress=False)
    ref = _reference(ckpt, pipe, [(peft_lora, 0.7, False), (wan_lora, 1.0, False)], 3, max_len, 4)
    assert np.abs(ours - base).max() > 1e-2  # the adapters change the result...
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)  # ...as diffusers' loader does


def test_two_expert_adapters_target_either_expert(kind_bundles, kind_checkpoints, tmp_path) -> None:
    from .conftest import KIND_CASES

    bundle, ckpt = kind_bundles["t2v-moe"], kind_checkpoints["t2v-moe"]
    high = diffusers_lora(ckpt, tmp_path / "high", seed=3)
    low = diffusers_lora(ckpt, tmp_path / "low", seed=4, subfolder="transformer_2")
    a = _adapter(high, bundle, tmp_path / "high.safetensors")
    b = _adapter(low, bundle, tmp_path / "low.safetensors", "--lora-into", "transformer_2")
    pipe = runtime.load(bundle, loras=[(a, 1.0), (b, 0.5)])
    assert set(pipe.bundle.loras) == {"transformer", "transformer_2"}
    ours = pipe.denoise(pipe.encode(PROMPT), seed=2, steps=6, guidance=4.0, progress=False)
    ref = _reference(ckpt, pipe, [(high, 1.0, False), (low, 0.5, True)], 6, KIND_CASES["t2v-moe"][3], 2, 4.0)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


def test_adapter_errors_are_one_line(fp32_bundles, checkpoints, kind_bundles, tmp_path) -> None:
    bundle = fp32_bundles[CASE]
    lora = diffusers_lora(checkpoints[CASES[CASE][0]], tmp_path / "src", seed=5)
    adapter = _adapter(lora, bundle, tmp_path / "a.safetensors")
    # made for another bundle
    with pytest.raises(UserError, match="was made for bundle .* not this one"):
        runtime.load(kind_bundles["t2v-moe"], loras=[(adapter, 1.0)])
    # a LoRA of another architecture: shapes differ (tiny-wide's LoRA on the tiny bundle)
    wide = diffusers_lora(checkpoints["tiny-wide"], tmp_path / "wide", seed=6)
    proc = run_module("export", "lora", str(wide), "--bundle", str(bundle), "--out", str(tmp_path / "w.safetensors"),
                      check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not (tmp_path / "w.safetensors").exists()
    assert "is [" in proc.stderr and "was the adapter made for another model?" in proc.stderr
    # a tensor the bundle does not have: transformer_2 on a one-expert bundle
    proc = run_module("export", "lora", str(lora), "--bundle", str(bundle), "--out", str(tmp_path / "x.safetensors"),
                      "--lora-into", "transformer_2", check=False)
    assert proc.returncode == 2 and "targets transformer_2, which bundle" in proc.stderr
    # the runtime's CLI: a missing adapter, a bad scale
    for spec, message in ((str(tmp_path / "none.safetensors"), "does not exist"),
                          (f"{adapter}:nan", "scale must be a finite number")):
        proc = run_module("runtime", "generate", str(bundle), "--prompt", PROMPT, "--lora", spec, "--out",
                          str(tmp_path / "v.mp4"), check=False)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not (tmp_path / "v.mp4").exists()


@pytest.mark.slow  # a variant on 8 devices: test_multidevice covers sharded runs, test_lora_switch the merges
def test_merge_keeps_each_weights_sharding_on_8_devices(fp32_bundles, cpu8_bundle, checkpoints, tmp_path) -> None:
    """On the cpu-8 mesh (tp=2 splits q/k/v rows and out-proj columns) the merged weights keep their sharding
    and the frames equal one device's with the same adapter."""
    import json
    import os
    import subprocess
    import sys

    from .conftest import ROOT

    variant = CASES[CASE][0]
    cpu8 = cpu8_bundle
    lora = diffusers_lora(checkpoints[variant], tmp_path / "src", seed=7)
    script = """
import json, sys
import numpy as np
import runtime
pipe = runtime.load(sys.argv[1], loras=[(sys.argv[2], 0.8)] if sys.argv[2] != "-" else None)
w = pipe.bundle.weights("transformer", "denoise_step")
names = ["blocks.0.attn1.to_q.weight", "blocks.0.attn1.to_out.0.weight", "blocks.0.attn1.to_q.bias"]
lat = pipe.denoise(pipe.encode("a lighthouse"), seed=1, steps=2, progress=False)
print(json.dumps({"specs": [str(w[n].sharding.spec) for n in names], "q": np.asarray(w[names[0]]).tolist(),
                  "lat": lat.tolist()}))
"""
    out = {}
    for n, bundle in ((1, fp32_bundles[CASE]), (8, cpu8)):
        adapter = _adapter(lora, bundle, tmp_path / f"a{n}.safetensors")
        for name, arg in (("lora", str(adapter)), ("plain", "-")):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
                   **devices_env(n)}
            proc = subprocess.run([sys.executable, "-c", script, str(bundle), arg], cwd=ROOT, env=env, timeout=300,
                                  capture_output=True, text=True)
            assert proc.returncode == 0, proc.stderr[-3000:]
            out[n, name] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out[8, "lora"]["specs"] == out[8, "plain"]["specs"]
    assert out[8, "lora"]["specs"][0] != "PartitionSpec()"  # really sharded
    np.testing.assert_allclose(out[8, "lora"]["q"], out[1, "lora"]["q"], rtol=0, atol=1e-6)
    assert np.abs(np.subtract(out[1, "lora"]["q"], out[1, "plain"]["q"])).max() > 1e-3
    np.testing.assert_allclose(out[8, "lora"]["lat"], out[1, "lora"]["lat"], rtol=0, atol=1e-5)


def test_a_per_expert_pair_switched_in(kind_bundles, tmp_path) -> None:
    """Wan2.2-Lightning ships one LoRA per expert. On the two-expert bundle, two adapters both made for the first
    expert, run after a plain job as a pair with `expert` high and low (the second moved to transformer_2), make
    exactly the frames `runtime generate` makes in a fresh process with the pair converted for each expert (the low
    one into transformer_2, as --lora-into does); through the server's request check and worker too."""
    from runtime.serve.run import run_job
    from runtime.serve.schema import Body, Offer, parse_request

    from .test_lora_switch import make_adapter
    from .test_serve import _mp4_frames

    bundle = kind_bundles["t2v-moe"]
    high = make_adapter(bundle, tmp_path / "dir" / "high.safetensors", seed=3)
    make_adapter(bundle, tmp_path / "dir" / "low.safetensors", seed=4)
    low_2 = make_adapter(bundle, tmp_path / "low_2.safetensors", seed=4, group="transformer_2")
    run_module("runtime", "generate", str(bundle), "--prompt", PROMPT, "--seed", "2", "--steps", "6", "--guidance",
               "4", "--lora", f"{high}:1", "--lora", f"{low_2}:0.5", "--out", str(tmp_path / "cli.mp4"),
               "--frames-out", str(tmp_path / "cli.safetensors"), "-q")
    from safetensors.numpy import load_file

    cli = load_file(str(tmp_path / "cli.safetensors"))["frames"]
    pipe = runtime.load(bundle, lora_dir=tmp_path / "dir")
    assert pipe.loras["low"].groups == ("transformer",)
    assert pipe.loras["low"].targets == ("transformer", "transformer_2")
    run = {"seed": 2, "steps": 6, "guidance": 4.0, "progress": False}
    plain = pipe.generate(PROMPT, loras=[], **run)
    pair = pipe.generate(PROMPT, loras=[("high", 1.0, "high"), ("low", 0.5, "low")], **run)
    assert np.array_equal(pair, cli) and not np.array_equal(plain, cli)
    assert pipe.use_loras([(high, 1.0), (low_2, 0.5)]) is not None  # another file for the low one: another key...
    assert np.array_equal(pipe.generate(PROMPT, **run), cli)  # ...the same weights
    # a request's entries, checked by the server's field table, run by its worker (from no adapter again)
    pipe.use_loras([])
    offer = Offer.of(pipe.manifest, "moe", adapters=tuple(pipe.loras.values()))
    params = parse_request(Body({"prompt": PROMPT, "seed": 2, "num_inference_steps": 6, "guidance_scale": 4,
                                 "lora": [{"name": "high", "scale": 1}, {"name": "low", "scale": 0.5,
                                                                         "expert": "low"}]}, {}, form=False),
                           offer, pipe, None)
    taken = []
    run_job(pipe, params, [], tmp_path / "served.mp4", on_lora=taken.append)
    assert taken[0] is not None and taken[0]["tensors"] == 40  # 20 tensors of each expert
    served, expected = (_mp4_frames((tmp_path / f"{n}.mp4").read_bytes(), tmp_path) for n in ("served", "cli"))
    assert np.array_equal(served, expected)
