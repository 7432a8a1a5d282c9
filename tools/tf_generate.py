"""Generate a video from a wan-aot SavedModel with TensorFlow alone: what a TF Serving client does.

    python -m export savedmodel artifacts/tiny --out artifacts/tiny-savedmodel
    python tools/tf_generate.py artifacts/tiny-savedmodel --prompt "a cat playing piano" --out cat.mp4

The flags mean what they mean for `python -m runtime generate` (and `denoise --latents`,
`--frames-out`; the same safetensors formats, tied to the same bundle id). This client imports
tensorflow, numpy, tokenizers, Pillow and the project's numpy-only modules (the UniPC coefficient rows
of runtime/scheduler.py, the settings checks, the prompt tokenizer, the image conditioning, the video
writer), never jax. Against
TF Serving, replace `signature(**inputs)` with a Predict request naming the same signature and inputs.

What a client does (the signatures and their inputs are listed in DIR/wan-aot.json):
  1. tokenize prompt and negative prompt (DIR/tokenizer.json) -> `text_encoder(ids, mask)` -> embeds
  2. with --image: `image_encoder(pixels)` (CLIP kinds) and `vae_encode_first` / `vae_encode_next`
     -> the denoise step's `condition` (+ `image_embeds`, `mask`), as runtime/conditioning.py builds them
  3. `initial_latents(seed)` -> noise (or --latents)
  4. once per prompt: `cross_kv(context[, image_embeds])` -> kv, the cross-attention keys and values
     (two-expert models: `cross_kv_2` too, for the second expert)
  5. per step i: `denoise_step(state, kv, timestep, guidance, row)` with the scheduler's row i
     (two-expert models: `denoise_step_2` and its kv below the boundary timestep)
  6. `vae_decode_first(latents[:, :, :1])`, then `vae_decode_next(latents[:, :, t:t+1], caches...)`
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime import conditioning, images, kinds, samplers, scheduler  # noqa: E402  (numpy-only; jax loads lazily)
from runtime import intermediates as im  # noqa: E402
from runtime import settings as st  # noqa: E402
from runtime.errors import UserError  # noqa: E402
from runtime.files import check_writable  # noqa: E402
from runtime.manifest import Defaults, Geometry  # noqa: E402
from runtime.text import PromptTokenizer, check_prompt  # noqa: E402
from runtime.video import check_fps, check_video_path, write_videos  # noqa: E402

log = logging.getLogger("tf_generate")
INFO_FILE = "wan-aot.json"  # as export/savedmodel.py writes it
FORMAT = "wan-aot-savedmodel"
PIP = "pip install 'wan-aot[savedmodel]'"


class SavedModelPipeline:
    """The bundle's stages as SavedModel signatures, driven from the host like runtime/pipeline.py."""

    def __init__(self, directory: Path) -> None:
        info_path = directory / INFO_FILE
        if not info_path.is_file():
            raise UserError(f"{directory} has no {INFO_FILE}: pass the directory `python -m export savedmodel` "
                            "wrote")
        try:
            self.info = json.loads(info_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{info_path} is not valid JSON ({e}): convert the bundle again") from None
        if self.info.get("format") != FORMAT:
            raise UserError(f"{info_path} is not a wan-aot SavedModel description: convert the bundle again")
        self.directory = directory
        self.kind = kinds.get(self.info["kind"])
        self.geometry = Geometry(**self.info["geometry"])
        self.config = scheduler.UniPCConfig.from_json(self.info["scheduler"])
        self.defaults = Defaults(**self.info["defaults"])
        self.bundle_id = self.info["bundle_id"]
        self._model: Any = None

    def load(self) -> None:
        try:
            import tensorflow as tf
        except ImportError:
            raise UserError(f"tools/tf_generate.py needs TensorFlow: {PIP} (or pip install tensorflow-cpu)") from None
        version = self.directory / self.info["version"]
        log.info("loading %s", version)
        self._model = tf.saved_model.load(str(version))
        self._tf = tf

    def run(self, name: str, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        """Run signature `name` on host arrays (cast to the signature's dtypes); host arrays back."""
        spec = self.info["signatures"][name]
        args = {i["name"]: self._tf.constant(np.asarray(inputs[i["name"]], dtype=i["dtype"])) for i in spec["inputs"]}
        out = self._model.signatures[name](**args)
        return {o["name"]: out[o["name"]].numpy() for o in spec["outputs"]}

    def call(self, name: str) -> Any:
        """Signature `name` as a positional function (inputs and outputs in call order), the runtime's way."""
        spec = self.info["signatures"][name]

        def fn(*args: np.ndarray) -> tuple[np.ndarray, ...]:
            out = self.run(name, **{i["name"]: a for i, a in zip(spec["inputs"], args, strict=True)})
            return tuple(out[o["name"]] for o in spec["outputs"])

        return fn

    def shapes(self, name: str) -> dict[str, tuple[int, ...]]:
        return {i["name"]: tuple(i["shape"]) for i in self.info["signatures"][name]["inputs"]}

    def encode_images(self, first: Any, last: Any | None) -> dict[str, np.ndarray]:
        """The denoise inputs of an image (runtime/conditioning.py, as the runtime builds them)."""
        chunk = self.shapes("vae_encode_next")["pixels"][2] if "vae_encode_next" in self.info["signatures"] else 0
        return conditioning.encode_images(self.kind, self.geometry, self.info.get("image_processor"), first, last,
                                          self.call, np.asarray, chunk)

    def encode(self, prompt: str, negative_prompt: str) -> np.ndarray:
        """(2B, L, D) float32: the prompt's embeddings, then the negative prompt's."""
        b = self.geometry.batch
        tokenizer = PromptTokenizer.from_file(self.directory / self.info["tokenizer"],
                                              self.geometry.max_sequence_length)
        check_prompt(prompt)  # as the runtime and the server refuse an empty one
        ids, mask = tokenizer([prompt] * b + [negative_prompt] * b, names=["prompt"] * b + ["negative prompt"] * b)
        return self.run("text_encoder", ids=ids, mask=mask)["embeds"].astype(np.float32)

    def denoise(self, context: np.ndarray, latents: np.ndarray, extras: dict[str, np.ndarray], s: st.DenoiseSettings,
                progress: bool) -> np.ndarray:
        from tqdm.auto import tqdm

        plan = s.plan(self.config)
        state = np.zeros((scheduler.state_rows(self.config.solver_order), *latents.shape), np.float32)
        state[0] = latents
        kv: dict[int, np.ndarray] = {}  # per expert, computed once (SavedModels of older bundles take context)
        for i in tqdm(range(s.steps), desc="denoising", unit="step", disable=not progress):
            t = plan.timesteps[i]  # cast by `run` to the signature's dtype (int32 in SavedModels of older bundles)
            e = st.expert_of(float(t), self.kind, self.info["boundary_ratio"], self.config)
            if self.defaults.timestep_scale != scheduler.TIMESTEP_SCALE:  # the DiT's convention (export --defaults)
                t = scheduler.scaled_timesteps(t, self.defaults.timestep_scale)
            if e not in kv and kinds.cross_kv_program(e) in self.info["signatures"]:
                kv[e] = self.run(kinds.cross_kv_program(e), context=context, **extras)["kv"]
            out = self.run(kinds.denoise_program(e), state=state, context=context, kv=kv.get(e), timestep=t,
                           guidance=s.guidance_of(e), row=plan.coeffs[i], **extras)
            if not bool(out["finite"]):
                raise UserError(f"non-finite values (NaN/inf) appeared in the latents at denoising step {i + 1} of "
                                f"{s.steps}: check the weights, guidance and dtype")
            state = out["state"]
        return conditioning.after_loop(self.kind, extras, state[0].astype(np.float32), self.geometry)

    def decode(self, latents: np.ndarray) -> np.ndarray:
        """(B, F, H, W, 3) float32 in [0, 1], chunk by chunk with the VAE's caches carried on the host."""
        names = [o["name"] for o in self.info["signatures"]["vae_decode_first"]["outputs"]]
        caches = [n for n in names if n.startswith("cache_")]
        out = self.run("vae_decode_first", latents=latents[:, :, 0:1])
        chunks = [out["frames"]]
        for t in range(1, latents.shape[2]):
            out = self.run("vae_decode_next", latents=latents[:, :, t:t + 1], **{c: out[c] for c in caches})
            chunks.append(out["frames"])
        return np.concatenate(chunks, axis=1).astype(np.float32)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/tf_generate.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("savedmodel", type=Path, metavar="DIR", help="what `python -m export savedmodel` wrote")
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative-prompt", default="")
    p.add_argument("--image", type=Path, default=None, help="first frame (image-to-video and TI2V SavedModels)")
    p.add_argument("--last-image", type=Path, default=None, help="last frame (first-last-frame SavedModels)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the bundle's)")
    p.add_argument("--guidance", type=float, default=None, help="classifier-free guidance scale")
    p.add_argument("--guidance-2", type=float, default=None,
                   help="guidance of the second (low-noise) expert of a two-expert model (default: --guidance)")
    p.add_argument("--flow-shift", type=float, default=None, help="flow shift (default: the bundle's)")
    p.add_argument("--sampler", default=None, help="unipc, euler or dpm++ (default: the bundle's)")
    p.add_argument("--sigmas", default=None, help="custom sigmas, one per step (e.g. 1,0.75,0.5,0.25)")
    p.add_argument("--latents", type=Path, default=None, help="initial latents (key `latents`) instead of noise")
    p.add_argument("--fps", type=int, default=None, help="frames per second of the video (default: the bundle's)")
    p.add_argument("--out", type=Path, required=True, help="video path: .mp4, .mkv, .mov or .gif")
    p.add_argument("--frames-out", type=Path, default=None, help="also save the float frames (safetensors)")
    p.add_argument("-q", "--quiet", action="store_true")
    return p


def generate(args: argparse.Namespace) -> list[Path]:
    for out in (args.out, args.frames_out):
        if out is not None:
            check_writable(out)
    check_video_path(args.out)
    if args.fps is not None:
        check_fps(args.fps)
    pipe = SavedModelPipeline(args.savedmodel)
    first = None if args.image is None else images.load_image(args.image, "--image")
    last = None if args.last_image is None else images.load_image(args.last_image, "--last-image")
    kinds.check_images(pipe.kind, first, last)
    check_prompt(args.prompt)  # before the SavedModel loads
    s = st.resolve(pipe.defaults, pipe.kind, pipe.config, args.seed, args.steps, args.guidance, args.flow_shift,
                   args.guidance_2, args.sampler, samplers.parse_sigmas(args.sigmas))
    init = None
    if args.latents is not None:
        init = im.load(args.latents, im.LATENTS, pipe.bundle_id, {"latents": pipe.geometry.latent_shape})[0]["latents"]
    pipe.load()
    context = pipe.encode(args.prompt, args.negative_prompt)
    if first is not None:
        extras = pipe.encode_images(first, last)
    else:
        extras = conditioning.text_mode(pipe.kind, pipe.shapes(kinds.denoise_program(0)))
    latents = pipe.run("initial_latents", seed=np.uint32(s.seed))["latents"] if init is None else init
    latents = pipe.denoise(context, np.asarray(latents, np.float32), extras, s, progress=not args.quiet)
    frames = pipe.decode(latents)
    if args.frames_out is not None:
        im.save(args.frames_out, im.FRAMES, {"frames": frames}, pipe.bundle_id, {})
        log.info("wrote %s", args.frames_out)
    return write_videos(frames, args.out, pipe.defaults.fps if args.fps is None else args.fps)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(name)s: %(message)s")
    try:
        for path in generate(args):
            log.info("wrote %s", path)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
