"""`--vae FILE`: a Wan 2.1 VAE in the original Wan layout (lightx2v's LightVAE: every width x0.25) replaces the
checkpoint's. Its widths come from its tensors, its names are renamed to diffusers' (export/vae_file.py), and the
bundle decodes as diffusers does with the same weights loaded through diffusers' own converter."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import runtime
import runtime.manifest as mf

from .conftest import run_cli, run_module

# LightVAE's structure (Wan 2.1's dim_mult, res blocks and temporal downsampling) at base_dim 4 instead of 24; the
# tiny checkpoint's own VAE is base_dim 3, dim_mult [1, 1, 1, 1], one res block per stage.
LIGHT = dict(base_dim=4, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
RES, FRAMES, MAX_LEN = "64x32", 9, 16

_RESNET = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3",
           "conv2": "residual.6", "conv_shortcut": "shortcut"}


def to_original(name: str, num_res_blocks: int) -> str:
    """diffusers' AutoencoderKLWan name -> the original Wan 2.1 layout's (this test's own inverse of the rename)."""
    top = {"quant_conv": "conv1", "post_quant_conv": "conv2"}
    head, _, rest = name.partition(".")
    if head in top:
        return f"{top[head]}.{rest}"

    def resnet(local: str) -> str:
        for new, old in _RESNET.items():
            if local.startswith(new + "."):
                return old + local[len(new):]
        raise AssertionError(f"not a resnet tensor: {local}")

    for pattern, build in (
        (r"(encoder|decoder)\.conv_in\.(.+)", lambda m: f"{m[1]}.conv1.{m[2]}"),
        (r"(encoder|decoder)\.norm_out\.gamma", lambda m: f"{m[1]}.head.0.gamma"),
        (r"(encoder|decoder)\.conv_out\.(.+)", lambda m: f"{m[1]}.head.2.{m[2]}"),
        (r"(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.+)",
         lambda m: f"{m[1]}.middle.{2 * int(m[2])}.{resnet(m[3])}"),
        (r"(encoder|decoder)\.mid_block\.attentions\.0\.(.+)", lambda m: f"{m[1]}.middle.1.{m[2]}"),
        (r"encoder\.down_blocks\.(\d+)\.((?:resample|time_conv).+)", lambda m: f"encoder.downsamples.{m[1]}.{m[2]}"),
        (r"encoder\.down_blocks\.(\d+)\.(.+)", lambda m: f"encoder.downsamples.{m[1]}.{resnet(m[2])}"),
        (r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)",
         lambda m: f"decoder.upsamples.{int(m[1]) * (num_res_blocks + 2) + int(m[2])}.{resnet(m[3])}"),
        (r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)",
         lambda m: f"decoder.upsamples.{int(m[1]) * (num_res_blocks + 2) + num_res_blocks + 1}.{m[2]}"),
    ):
        m = re.fullmatch(pattern, name)
        if m:
            return build(m)
    raise AssertionError(f"no original name for {name}")


def random_vae(seed: int = 0, **config):
    """AutoencoderKLWan with every weight moved away from its init (ones, zeros), so each one matters."""
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(**config).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return vae


def write_original(vae, path: Path) -> dict:
    """Save `vae` in the original Wan layout; returns what was written (original names, torch tensors)."""
    from safetensors.torch import save_file

    tensors = {to_original(k, vae.config.num_res_blocks): v.detach().contiguous()
               for k, v in vae.state_dict().items()}
    save_file(tensors, str(path))
    return tensors


@pytest.fixture(scope="module")
def light(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A LightVAE-like file in the original layout, and the tensors in it."""
    root = tmp_path_factory.mktemp("light-vae")
    path = root / "lightvae_test.safetensors"
    return {"path": path, "tensors": write_original(random_vae(**LIGHT), path)}


@pytest.fixture(scope="module")
def bundle(checkpoints, light, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("light-bundle") / "bundle"
    run_module("export", "--model", str(checkpoints["tiny"]), "--vae", str(light["path"]), "--resolution", RES,
               "--frames", str(FRAMES), "--dtype", "fp32", "--max-sequence-length", str(MAX_LEN), "--out", str(out),
               "-q")
    return out


def test_the_written_file_is_the_original_layout(light) -> None:
    """The test's own inverse of the rename agrees with diffusers' converter of the original layout (so the file is
    what Wan and lightx2v ship), and has LightVAE's tensor count (194)."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    original = light["tensors"]
    assert len(original) == 194 and "encoder.middle.1.to_qkv.weight" in original and "conv2.weight" in original
    converted = convert_wan_vae_to_diffusers(dict(original))
    want = random_vae(**LIGHT).state_dict()
    assert set(converted) == set(want)
    assert all(converted[k] is original[to_original(k, LIGHT["num_res_blocks"])] for k in want)


def test_decodes_as_diffusers_with_the_file(bundle, checkpoints, light) -> None:
    """The runtime's decode of latents equals diffusers' AutoencoderKLWan with the file's weights (loaded through
    diffusers' own converter) decoding them as the pipeline does: de-normalised, decoded, (x + 1) / 2, clamped."""
    import torch
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    model_vae = json.loads((checkpoints["tiny"] / "vae" / "config.json").read_text())
    mean, std = model_vae["latents_mean"], model_vae["latents_std"]
    ref = AutoencoderKLWan(**LIGHT, latents_mean=mean, latents_std=std).eval()
    ref.load_state_dict(convert_wan_vae_to_diffusers(dict(light["tensors"])), strict=True)

    w, h = (int(s) for s in RES.split("x"))
    latents = np.random.default_rng(0).standard_normal((1, 16, (FRAMES - 1) // 4 + 1, h // 8, w // 8)
                                                       ).astype(np.float32)
    got = runtime.load(bundle).decode(latents)
    with torch.no_grad():
        z = torch.from_numpy(latents) / (1.0 / torch.tensor(std).view(1, -1, 1, 1, 1)) + \
            torch.tensor(mean).view(1, -1, 1, 1, 1)
        video = ref.decode(z, return_dict=False)[0]
    want = ((video + 1.0) / 2.0).clamp(0.0, 1.0).permute(0, 2, 3, 4, 1).numpy()
    assert got.shape == want.shape == (1, FRAMES, h, w, 3)
    assert float(np.abs(want - 0.5).max()) > 0.05  # a real picture, not a constant the two could agree on
    assert float(np.abs(got - want).max()) < 1e-4


def test_bundle_has_the_files_widths_and_records_it(bundle, light) -> None:
    """The VAE weights are the file's architecture (every tensor's shape), the manifest's source names the file by
    name and sha256, and its config is the file's widths over the checkpoint's latent space."""
    m = mf.read(bundle)
    want = {k: tuple(v.shape) for k, v in random_vae(**LIGHT).state_dict().items()}
    vae = m.weights["vae"].tensors
    assert vae and all(tuple(spec.shape) == want[name] for name, spec in vae.items())
    assert tuple(vae["decoder.conv_in.weight"].shape) == (4 * 4, 16, 3, 3, 3)  # base_dim 4 x dim_mult[-1] 4
    assert m.source["vae_file"] == {"file": light["path"].name, "sha256": mf.sha256_file(light["path"])}
    config = m.source["config"]["vae"]
    assert (config["base_dim"], config["dim_mult"], config["num_res_blocks"]) == (4, [1, 2, 4, 4], 2)
    assert config["temperal_downsample"] == [False, True, True] and len(config["latents_mean"]) == 16


def test_no_weights_reads_only_the_header(checkpoints, light) -> None:
    """With --no-weights the VAE is built on `meta` from the shapes in the file's header, at the file's widths."""
    from export.source import load, with_vae_file

    src = with_vae_file(load(str(checkpoints["tiny"]), "fp32", weights=False), light["path"])
    vae = src.load_vae()
    want = {k: tuple(v.shape) for k, v in random_vae(**LIGHT).state_dict().items()}
    assert {k: tuple(v.shape) for k, v in vae.state_dict().items()} == want
    assert all(p.device.type == "meta" for p in vae.parameters())
    assert src.describe()["vae_file"]["file"] == light["path"].name


def test_attach_takes_the_same_vae_and_refuses_another(bundle, checkpoints, light, tmp_path: Path) -> None:
    """`python -m export attach ... --vae FILE` writes the same VAE weights as the export; without --vae the
    checkpoint's VAE (other widths) is refused in one line naming the file the bundle was exported with."""
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    proc = run_cli("export", "attach", str(copy), "--weights", str(checkpoints["tiny"]), "--force",
                   check=False)
    _fails_cleanly(proc, f"exported with --vae {light['path'].name}")
    assert mf.read(copy).weights == mf.read(bundle).weights
    run_module("export", "attach", str(copy), "--weights", str(checkpoints["tiny"]), "--vae",
               str(light["path"]), "--force", "-q")
    after = mf.read(copy)
    assert after.weights["vae"].sha256 == mf.read(bundle).weights["vae"].sha256
    assert after.source["vae_file"] == mf.read(bundle).source["vae_file"]


def _fails_cleanly(proc: subprocess.CompletedProcess, message: str) -> None:
    err = proc.stderr.strip()
    assert proc.returncode == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("error:") and message in err, err


def _bad_files(root: Path) -> dict[str, Path]:
    """One file per way --vae can be wrong."""
    import torch
    from safetensors.torch import save_file

    files = {}
    files["pth"] = root / "Wan2.1_VAE.pth"
    files["pth"].write_bytes(b"\x80\x04not unpickled")  # refused by name: never read
    small = random_vae(base_dim=2, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                       temperal_downsample=[False, True, True])
    files["diffusers"] = root / "diffusers_vae.safetensors"
    save_file({k: v.contiguous() for k, v in small.state_dict().items()}, str(files["diffusers"]))
    files["taehv"] = root / "taew2_1.safetensors"
    save_file({"encoder.0.weight": torch.zeros(8, 3, 3, 3), "decoder.1.weight": torch.zeros(8, 16, 3, 3)},
              str(files["taehv"]))
    files["z_dim"] = root / "z8.safetensors"
    write_original(random_vae(base_dim=2, z_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                              temperal_downsample=[False, True, True]), files["z_dim"])
    files["scale"] = root / "x4.safetensors"  # three stages: 4x in space where the model's latents are 8x
    write_original(random_vae(base_dim=2, z_dim=16, dim_mult=[1, 1, 1], num_res_blocks=1,
                              temperal_downsample=[True, True]), files["scale"])
    files["missing"] = root / "nothing_here.safetensors"
    return files


@pytest.mark.parametrize("case,message", [
    ("pth", "is a pickle checkpoint, which wan-aot never loads"),
    ("diffusers", "is a VAE in diffusers' layout"),
    ("taehv", "looks like a TAEHV tiny autoencoder"),
    ("z_dim", "has z_dim 8 but the model's latents have 16 channels"),
    ("scale", "scales 4x in space and 4x in time but the model's VAE 8x and 4x"),
    ("missing", "does not exist"),
])
def test_bad_vae_files_fail_in_one_line(checkpoints, tmp_path: Path, case: str, message: str) -> None:
    out = tmp_path / "out"
    path = _bad_files(tmp_path)[case]
    proc = run_cli("export", "--model", str(checkpoints["tiny"]), "--vae", str(path), "--resolution", RES,
                   "--frames", str(FRAMES), "--out", str(out), check=False)
    _fails_cleanly(proc, message)
    assert str(path) in proc.stderr
    assert not out.exists()
