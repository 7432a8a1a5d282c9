"""Tiny decoders (export --tiny-decoder, export/tiny_decoder.py): TAEHV-layout files of random weights in the real
files' layouts (fp16 taew, fp32 lighttae, the 48-channel super decoder), decoded chunk by chunk by the bundle's
programs, against a PyTorch reference of TAEHV's whole-clip decode written from the architecture
(tests/taehv_reference.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import runtime
from export import tiny_decoder

from . import taehv_reference as ref
from .conftest import OnDemand, run_cli, run_module

TOL = 1e-4  # fp32 frames in [0, 1]
WIDTHS = (16, 8, 8, 8)  # the real ones are (256, 128, 64, 64) and (512, 256, 128, 64): the tensors say which
COMMON = ["--resolution", "64x32", "--frames", "9", "--max-sequence-length", "16", "--dtype", "fp32", "-q"]
# name: (file name, latent channels, patch, super, stored dtype, the model it goes with)
FILES = {"taew": ("taew2_1.safetensors", 16, 1, False, torch.float16, "tiny"),
         "lighttae": ("lighttaew2_1.safetensors", 16, 1, False, torch.float32, "tiny"),
         "super": ("taew2_2_super.safetensors", 48, 2, True, torch.float16, "tiny-ti2v-48"),
         "taew48": ("taew2_2.safetensors", 48, 2, False, torch.float16, "tiny-ti2v-48")}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Sequential]]:
    root = tmp_path_factory.mktemp("tiny-decoders")
    return {name: (root / file, ref.make_file(root / file, z, p, WIDTHS, sup, dtype, seed=i))
            for i, (name, (file, z, p, sup, dtype, _)) in enumerate(FILES.items())}


@pytest.fixture(scope="module")
def bundles(files, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A bundle per decoder file but taew48 (its network is tested on the programs' function below), the 16-channel
    ones at once."""
    root = tmp_path_factory.mktemp("tiny-decoder-bundles")

    def export(name: str) -> Path:
        run_module("export", "--model", FILES[name][5], "--tiny-decoder", str(files[name][0]), *COMMON,
                   "--out", str(root / name))
        return root / name

    # the 48-channel super decoder's bundle is the slow tier's: its network is checked below in the default run
    return OnDemand.start({n: functools.partial(export, n) for n in ("taew", "lighttae", "super")},
                          now=["taew", "lighttae"])


def _reference(dec: torch.nn.Sequential, latents: np.ndarray, patch: int) -> np.ndarray:
    """TAEHV's whole-clip decode of (B, Z, T, h, w) latents -> (B, F, H, W, 3)."""
    return ref.decode(dec, torch.from_numpy(latents).permute(0, 2, 1, 3, 4), patch).permute(0, 1, 3, 4, 2).numpy()


@pytest.mark.parametrize("name", ["taew", "lighttae", pytest.param("super", marks=pytest.mark.slow)])
def test_the_bundles_tiny_decoder_matches_taehv(bundles, files, name: str) -> None:
    """The bundle's chunk programs (first, then next with the memory carried) decode as TAEHV decodes the whole clip:
    taew's normalised latents as they are, lighttae's raw ones (z * std + mean with this bundle's VAE statistics)."""
    pipe = runtime.load(bundles[name])
    info = pipe.manifest.tiny_decoder
    _, z, p, sup, _, _ = FILES[name]
    assert (info.latents, info.variant, info.latent_channels, info.file) == \
        ("raw" if name == "lighttae" else "normalized", "super" if sup else "base", z, FILES[name][0])
    assert set(pipe.manifest.weights["tiny_decoder"].tensors) == {k for k in ref_keys(files[name][1])}
    latents = np.random.default_rng(1).standard_normal(pipe.geometry.latent_shape).astype(np.float32)
    ours = pipe.decode(latents, "tiny")
    taehv_in = latents
    if name == "lighttae":
        vae = pipe.manifest.source["config"]["vae"]
        taehv_in = latents * np.asarray(vae["latents_std"], np.float32)[:, None, None, None] + \
            np.asarray(vae["latents_mean"], np.float32)[:, None, None, None]
    want = _reference(files[name][1], taehv_in, p)
    assert ours.shape == want.shape == (1, 9, 32, 64, 3)
    assert np.abs(ours - want).max() <= TOL
    assert want.std() > 0.02 and ((want > 0) & (want < 1)).mean() > 0.5  # not clamped flat
    if name == "taew":  # the other convention on the same file gives other frames: the flag matters
        assert np.abs(ours - _reference(files[name][1], latents * 0.5 + 0.1, p)).max() > 0.05


def ref_keys(dec: torch.nn.Sequential) -> list[str]:
    return [f"decoder.{k}" for k in dec.state_dict()]


@pytest.mark.parametrize("name", ["taew48", "super", "taew"])
def test_the_network_streams_as_taehv_decodes_the_clip(files, name: str) -> None:
    """export/tiny_decoder.py's chunk functions, one latent frame at a time, against the whole-clip reference: the
    variant, channels and pixel shuffle read from the tensors."""
    path, dec = files[name]
    _, z, p, sup, _, _ = FILES[name]
    spec = tiny_decoder.read(path)
    assert (spec.variant, spec.latent_channels, spec.patch, spec.time_scale) == ("super" if sup else "base", z, p, 4)
    assert not [k for k in spec.tensors if k.startswith("encoder.")]  # the encoder half stays out
    latents = np.random.default_rng(2).standard_normal((1, z, 4, 3, 5)).astype(np.float32)
    weights = {k: np.asarray(v) for k, v in spec.tensors.items()}
    first = tiny_decoder.build(spec, "normalized", np.zeros(z), np.ones(z), first=True)
    nxt = tiny_decoder.build(spec, "normalized", np.zeros(z), np.ones(z), first=False)
    frames, memory = first(weights, latents[:, :, :1])
    chunks = [np.asarray(frames)]
    for t in range(1, latents.shape[2]):
        frames, memory = nxt(weights, latents[:, :, t:t + 1], *memory)
        chunks.append(np.asarray(frames))
    assert [c.shape[1] for c in chunks] == [1, 4, 4, 4]
    assert np.abs(np.concatenate(chunks, 1) - _reference(dec, latents, p)).max() <= TOL


def test_generate_and_decode_with_the_tiny_decoder(bundles, tmp_path: Path) -> None:
    """`runtime generate --decoder tiny` is `generate(..., decoder="tiny")`, other frames than the VAE's; `runtime
    decode --decoder tiny` decodes denoise's latents the same way; inspect names the decoder; previews are the tiny
    decoder's frames at the video's size."""
    from runtime import intermediates as im

    bundle = bundles["taew"]
    pipe = runtime.load(bundle)
    args = ["--prompt", "a fox", "--steps", "2", "--seed", "3"]
    run_cli("runtime", "generate", str(bundle), *args, "--decoder", "tiny", "--out", str(tmp_path / "t.mp4"),
            "--frames-out", str(tmp_path / "t.safetensors"), "-q")
    cli = im.load(tmp_path / "t.safetensors", im.FRAMES, pipe.bundle_id, {"frames": (1, 9, 32, 64, 3)})[0]["frames"]
    previews = []
    tiny = pipe.generate("a fox", steps=2, seed=3, decoder="tiny", progress=False, on_preview=previews.append)
    full = pipe.generate("a fox", steps=2, seed=3, progress=False)
    assert np.abs(cli - tiny).max() <= 1e-6 and np.abs(tiny - full).max() > 1e-2
    assert len(previews) == 2 and previews[-1].shape == (32, 64, 3) and previews[-1].dtype == np.uint8
    latents = pipe.denoise(pipe.encode("a fox"), seed=3, steps=2, progress=False)
    assert np.abs(pipe.decode(latents, "tiny") - tiny).max() <= 1e-6
    im.save(tmp_path / "l.safetensors", im.LATENTS, {"latents": latents}, pipe.bundle_id, {})
    run_cli("runtime", "decode", str(bundle), "--latents", str(tmp_path / "l.safetensors"), "--decoder", "tiny",
            "--out", str(tmp_path / "d.mp4"), "--frames-out", str(tmp_path / "d.safetensors"), "-q")
    decoded = im.load(tmp_path / "d.safetensors", im.FRAMES, pipe.bundle_id, {"frames": (1, 9, 32, 64, 3)})[0]
    assert np.abs(decoded["frames"] - tiny).max() <= 1e-6
    text = run_cli("runtime", "inspect", str(bundle)).stdout
    assert "tiny: taew2_1.safetensors (base TAEHV decoder, 16 channels, takes normalized latents)" in text
    assert json.loads(run_cli("runtime", "inspect", str(bundle), "--json").stdout)["decoders"]["tiny"]["latents"] == \
        "normalized"


def test_bad_input_is_one_line_and_writes_nothing(files, bundles, checkpoints, fp32_bundles, tmp_path: Path) -> None:
    torch.save({"decoder.1.weight": torch.zeros(1)}, tmp_path / "taew2_1.pth")
    from safetensors.torch import save_file

    save_file({"decoder.conv_in.weight": torch.zeros(4, 16, 3, 3)}, str(tmp_path / "other.safetensors"))
    save_file({"decoder.1.weight": torch.zeros(4, 16, 3, 3)}, str(tmp_path / "cut.safetensors"))  # decoder.3.* missing
    cases = [
        (["--model", str(checkpoints["tiny"]), "--tiny-decoder", str(tmp_path / "taew2_1.pth")],
         "a .pth file can run code when read, so it is never read here: convert it to .safetensors"),
        (["--model", str(checkpoints["tiny"]), "--tiny-decoder", str(tmp_path / "other.safetensors")],
         "not a TAEHV-layout tiny decoder (no decoder.N.* tensors)"),
        (["--model", str(checkpoints["tiny"]), "--tiny-decoder", str(tmp_path / "cut.safetensors")],
         "not a TAEHV-layout tiny decoder (decoder.3.conv.0.weight is missing)"),
        (["--model", str(checkpoints["tiny"]), "--tiny-decoder", str(files["super"][0])],
         "a 48-channel decoder, but this model's VAE has 16 latent channels"),
    ]
    for args, message in cases:
        out = tmp_path / "b"
        proc = run_cli("export", *args, *COMMON, "--out", str(out), check=False)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()
        assert not list(tmp_path.glob(".b.*"))
    plain = fp32_bundles["tiny-64x32-f9"]
    proc = run_cli("runtime", "generate", str(plain), "--prompt", "x", "--decoder", "tiny",
                   "--out", str(tmp_path / "v.mp4"), check=False)
    assert proc.returncode == 2 and not (tmp_path / "v.mp4").exists()
    assert proc.stderr.strip() == ("error: this bundle has no tiny decoder: export it with --tiny-decoder FILE (e.g. "
                                   "taew2_1.safetensors), or decode with the full VAE (decoder full)")
    with pytest.raises(runtime.UserError, match="decoder 'small' is not one of full, tiny"):
        runtime.load(bundles["taew"]).generate("x", decoder="small", progress=False)


def test_the_server_takes_decoder_where_the_bundle_has_one(bundles, fp32_bundles, tmp_path: Path) -> None:
    """`decoder` is in the create operation's document of a bundle with a tiny decoder (full, tiny), a job with
    decoder tiny makes the CLI's video, a bad value is a 400 naming it; a bundle without one neither documents nor
    takes it (400, as every field a bundle does not offer: runtime/serve/schema.py)."""
    import httpx
    import openai

    from runtime import manifest as mf
    from runtime.serve import schema

    from .test_serve import KEY, _mp4_frames, serving

    bundle = bundles["taew"]
    run_cli("runtime", "generate", str(bundle), "--prompt", "a kite", "--steps", "2", "--decoder", "tiny",
            "--out", str(tmp_path / "cli.mp4"), "-q")
    want = _mp4_frames((tmp_path / "cli.mp4").read_bytes(), tmp_path).astype(np.int16)
    with serving(bundle, tmp_path / "jobs", "--api-key", KEY) as server:
        doc = httpx.get(server.url + "/openapi.json").json()
        body = doc["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["properties"]["decoder"]["enum"] == ["full", "tiny"]
        client = server.client()
        video = client.videos.create_and_poll(prompt="a kite", poll_interval_ms=50,
                                              extra_body={"num_inference_steps": 2, "decoder": "tiny"})
        assert video.status == "completed", video.error
        got = _mp4_frames(client.videos.download_content(video.id).read(), tmp_path).astype(np.int16)
        assert np.abs(got - want).max() <= 1
        with pytest.raises(openai.BadRequestError, match="decoder 'small' is not one of full, tiny"):
            client.videos.create(prompt="a kite", extra_body={"decoder": "small"})
    field = next(f for f in schema.FIELDS if f.name == "decoder")
    plain = schema.Offer.of(mf.read(fp32_bundles["tiny-64x32-f9"]), "plain")
    assert not field.offered(plain) and field.refusal(plain).startswith("this bundle has no tiny decoder")


def test_attach_takes_the_tiny_decoder_file_too(checkpoints, files, bundles, tmp_path: Path) -> None:
    """A --no-weights export with --tiny-decoder has its programs and no weights; `attach` needs the file
    (one line without it) and then decodes as the direct export does."""
    from .conftest import run_module

    out = tmp_path / "bare"
    run_module("export", "--model", str(checkpoints["tiny"]), "--no-weights", "--tiny-decoder", str(files["taew"][0]),
               *COMMON, "--out", str(out))
    assert not (out / "weights" / "tiny_decoder.safetensors").exists()
    attach = ["attach", str(out), "--weights", str(checkpoints["tiny"])]
    proc = run_cli("export", *attach, check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: this bundle was exported with a tiny decoder (taew2_1.safetensors): give its weights with "
        "--tiny-decoder FILE")
    proc = run_cli("export", *attach, "--tiny-decoder", str(files["taew"][0]), "--tiny-decoder-latents", "raw",
                   check=False)
    assert proc.returncode == 2 and "takes raw latents, the bundle's tiny decoder normalized ones" in proc.stderr
    run_module("export", *attach, "--tiny-decoder", str(files["taew"][0]), "-q")
    latents = np.random.default_rng(5).standard_normal((1, 16, 3, 4, 8)).astype(np.float32)
    assert np.abs(runtime.load(out).decode(latents, "tiny") - runtime.load(bundles["taew"]).decode(latents, "tiny")
                  ).max() <= 1e-6


@pytest.fixture(scope="module")
def loop_bundles(files, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A bundle with the taew decoder for each loop of its own: diffusion forcing, Wan-Animate, Helios."""
    root = tmp_path_factory.mktemp("tiny-decoder-loops")
    frames = {"tiny-skyreels-df": "9", "tiny-animate": "9", "tiny-helios": "9"}
    for model, n in frames.items():
        run_module("export", "--model", model, "--tiny-decoder", str(files["taew"][0]), "--resolution", "64x32",
                   "--frames", n, "--dtype", "fp32", "--max-sequence-length", "16", "-q", "--out", str(root / model))
    return {model: root / model for model in frames}


def test_every_loop_previews_through_the_tiny_decoder(loop_bundles) -> None:
    """The step runner previews every loop's steps through the bundle's tiny decoder (runtime/steps.py): diffusion
    forcing's rows, Wan-Animate's segments' steps and Helios' chunks' steps give real frames at the video's size (the
    linear map's are at the latents' 8x4)."""
    from PIL import Image

    from .conftest import test_image

    def frames(n: int, w: int, h: int, seed: int) -> list[Image.Image]:
        return [test_image(w, h, seed=seed + i) for i in range(n)]

    runs = {"tiny-skyreels-df": dict(num_frames=9, steps=2),
            "tiny-animate": dict(image=test_image(40, 56, seed=3), pose_video=frames(9, 64, 32, 1),
                                 face_video=frames(9, 32, 32, 2), steps=2),
            "tiny-helios": dict(num_frames=9, steps=2)}
    for model, kw in runs.items():
        pipe = runtime.load(loop_bundles[model])
        shown: list[np.ndarray] = []
        out = pipe.generate("a fox", progress=False, on_preview=shown.append, **kw)
        assert shown and all(p.shape == (32, 64, 3) and p.dtype == np.uint8 for p in shown), (model, len(shown))
        assert out.shape[2:] == (32, 64, 3), model
