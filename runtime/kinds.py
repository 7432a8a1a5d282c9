"""The Wan model kinds as data: which stages a kind has, what it takes, how its loop conditions.

Every other module asks this table instead of testing model names, so adding a kind
is a row here (plus its detection rule in export/source.py). The six diffusers
configurations map onto these rows:

    kind        diffusers pipeline                                  checkpoints
    t2v         WanPipeline (WanVideoToVideoPipeline: + video in)   Wan2.1-T2V-1.3B / -14B
    t2v-moe     WanPipeline + transformer_2 + boundary_ratio        Wan2.2-T2V-A14B
    ti2v        WanPipeline / WanImageToVideoPipeline,              Wan2.2-TI2V-5B (text, or text + image)
                expand_timesteps
    i2v         WanImageToVideoPipeline + CLIP image encoder        Wan2.1-I2V-14B-480P / -720P
    flf2v       i2v with pos_embed_seq_len (first + last frame)     Wan2.1-FLF2V-14B-720P
    i2v-moe     WanImageToVideoPipeline + transformer_2, no CLIP    Wan2.2-I2V-A14B
    vace        WanVACEPipeline (WanVACETransformer3DModel)         Wan2.1-VACE-1.3B / -14B
    vace-moe    WanVACEPipeline + transformer_2 + boundary_ratio    Wan2.2-VACE-Fun-A14B
    animate     WanAnimatePipeline (WanAnimateTransformer3DModel)   Wan2.2-Animate-14B (segments: runtime/animate.py)
    lucy-edit   LucyEditPipeline (TI2V-5B's DiT on 2 x 48 channels)  decart-ai/Lucy-Edit-Dev (edits a source video)
    chronoedit  ChronoEditPipeline (I2V-14B, its RoPE puts 2 latent  nvidia/ChronoEdit-14B-Diffusers (edits an image:
                frames at 0 and 7; runtime/chronoedit.py)            the 5-frame video's last frame)

SkyReels-V2 (Skywork; SkyReelsV2Transformer3DModel: Wan 2.1's DiT, its timestep sinusoid in float64, an fps embedding):

    skyreels-t2v    SkyReelsV2Pipeline                              SkyReels-V2-T2V-14B-540P / -720P
    skyreels-i2v    SkyReelsV2ImageToVideoPipeline (CLIP)           SkyReels-V2-I2V-1.3B-540P / -14B-540P / -720P
    skyreels-flf2v  skyreels-i2v with pos_embed_seq_len             SkyReels-V2-FLF2V-1.3B-540P
    skyreels-df     SkyReelsV2DiffusionForcing{,ImageToVideo,       SkyReels-V2-DF-1.3B-540P / -14B-540P / -720P
                    VideoToVideo}Pipeline: one bundle, any length   (segments: runtime/forcing.py)

Helios (HeliosTransformer3DModel: Wan's blocks, with the clean history patchified at three scales):

    helios          HeliosPipeline (text, image or video in;        BestWishYsh/Helios-Base
                    chunks of any count: runtime/helios.py)
    helios-pyramid  HeliosPyramidPipeline (three stages per chunk)  BestWishYsh/Helios-Mid
    helios-distilled HeliosPyramidPipeline, is_distilled (DMD)      BestWishYsh/Helios-Distilled

AnyFlow (NVIDIA; AnyFlowTransformer3DModel: Wan 2.1's DiT with a second time input r, the flow map's target):

    anyflow     AnyFlowPipeline (text, or text + the video's first  nvidia/AnyFlow-Wan2.1-T2V-14B-Diffusers
                frames to continue; any step count, 1 to 16)
    anyflow-far AnyFlowFARPipeline (causal chunks, each attending   nvidia/AnyFlow-FAR-Wan2.1-1.3B-Diffusers
                to a KV cache of the chunks before; runtime/far.py)

Wan-Animate 2 (WanAnimate2Transformer3DModel; diffusers 0.42.1 ships it as modular pipelines only, a directory with a
modular_model_index.json):

    animate-2            WanAnimate2ModularPipeline (a character image moved by a driving video, any length, in
                         segments; runtime/animate2.py)
    animate-2-distilled  WanAnimate2DistilledModularPipeline (the same, few steps, no CFG)

Video-to-video (a `t2v` or `t2v-moe` bundle exported with the VAE encoder, `Manifest.video_to_video`) is a
capability of those kinds, not a kind: the same DiT programs run from the video's noised latents.

Conditioning modes (how the image enters the denoising loop):

- "none": the DiT sees the noisy latents only.
- "concat": the DiT input is [latents (z), mask (4), VAE latents of the conditioning video (z)] on the
  channel axis; the conditioning video is the image, zeros, and the last image (FLF2V) or zeros.
- "first_frame": the image's VAE latent replaces latent frame 0 in the DiT input and after the
  loop, and that frame's tokens get timestep 0 (per-token timesteps). Without an image, every token
  gets the step's timestep and nothing is replaced: the same program does text-to-video.
- "vace": the DiT's VACE branch takes `control` (the VAE latents of the video's inactive and reactive
  parts, and of the reference images before them, with the mask folded 8x8 onto the latent grid) and
  `control_scale` (one per VACE layer); the noisy latents have one leading frame per reference image,
  dropped before the decode (runtime/conditioning.py builds `control` as diffusers' WanVACEPipeline does).
- "animate": a segment of Wan-Animate: the DiT input is [latents (z), mask (4), condition (z)] as "concat", over one
  more latent frame first (the reference image's, dropped before the decode), plus the segment's `pose` latents and
  the face video's `motion` vectors (from the `face_motion` program, for the prompt and, with guidance, for an
  all-black face); the segment loop around it is runtime/animate.py.
- "forcing": diffusion forcing (SkyReels-V2 DF): every latent frame has its own timestep (`timestep` and `row` are
  one per frame) and its own sampler state, stepped only where `update` is 1; an image or the frames carried over
  from the segment before are pinned latent frames, fed to the DiT as they are or lightly re-noised (`noise` times
  `blend`, addnoise_condition); `causal_block` > 1 makes self-attention block-causal over frames (the asynchronous
  mode); `fps` is the frame rate the DiT is told. The segment loop around it is runtime/forcing.py.
- "video_concat": the DiT input is [latents (z), VAE latents of the source video (z)] on the channel axis at every
  step (Lucy Edit): no mask, every token at the step's timestep; the video's frame count is the shape's.
- "helios": a chunk of Helios: the DiT sees the chunk's noisy latents and `history`, the clean latents before it
  ([prefix, long, mid, short] frames: the first frame kept, then history_sizes' 16, 2 and 1 latest, zeros where the
  video has none yet), which it patchifies at three scales and attends to at timestep 0; the frame positions are
  fixed, so every chunk runs the same program. `cfg_mode` picks the guidance: 0 diffusers' CFG, 1 CFG-Zero* (the
  unconditional prediction scaled by its projection on the conditional one, HeliosPyramidPipeline's
  is_cfg_zero_star), 2 a zero prediction (its zero-init steps). The chunk loop around it is runtime/helios.py.
- "flowmap": AnyFlow's flow map. The DiT sees [latents, with `condition`'s frames where `mask` is 0] (the given
  video's first latent frames, pinned as AnyFlowPipeline pins them: their timestep 0), and each frame's target
  timestep `r_timestep` beside its timestep (the next sigma x 1000 for the mean velocity, the timestep itself for
  plain Euler); the sampler is FlowMapEulerDiscreteScheduler's z_r = z_t - (sigma_t - sigma_r) u (runtime/samplers.py
  "flowmap"). Without a video, `condition` is zeros and `mask` ones: the same program does text-to-video.
- "far": a chunk of AnyFlow-FAR (AnyFlowFARPipeline), its flow-map step as "flowmap"'s (`r_timestep` the chunk's
  target timestep) attending to itself and to the KV cache of the chunks before it: `full_cache` (the last chunks at
  patch_size) and `compressed_cache` (older ones at compressed_patch_size), each (layers, 2, B', heads, tokens,
  head_dim), B' = 2B with CFG (both halves cached), and `frame_pos`, each cache slot's and the chunk's frames' position
  (-1: empty). After a chunk, the `cache_step` program runs the DiT on the clean video so far (AnyFlowFARPipeline's
  encode_kv_cache, mode "cache", timestep 0) and writes the cache, which it takes and returns (donated).
  The count of cached chunks is data, not one program per chunk position: every chunk runs one step program and one
  cache program. The chunk is padded to the partition's largest chunk (the `state` of max(chunk_partition) frames),
  the cache to the most tokens any chunk reads, and which slot holds which frame is `frame_pos` (the cache step's
  `frame_chunk`: its block-causal mask), so the shapes do not depend on the chunk: one compile, and a bundle's size
  independent of the video's chunk count. What the padding costs is masked work: a chunk of 1 frame (the first) runs
  the step of max(chunk_partition); the cache step the tokens of its largest prefix (diffusers re-encodes the whole
  prefix each chunk too). The query padding of diffusers' flex attention (unmasked zero keys up to a multiple of 128
  of the chunk's tokens) is reproduced exactly, as that many zero scores in the softmax. The loop is runtime/far.py.
- "animate-2": a segment of Wan-Animate 2. The DiT input is [latents (z), mask (4), condition (z)] as "concat", over
  one more latent frame first (the character image's slot, dropped before the decode); self-attention attends to the
  segment's own tokens and, frame f >= 1, to the reference tokens of driving frame f - 1, whose keys (after RoPE) and
  values `ref_cache` holds, (layers, 2, B, heads, tokens, head_dim), written once per segment by the `reference_step`
  program (the driving segment under the reference prompt, kv_cache_mode "extract"), which takes it and returns it
  (donated). The loop is runtime/animate2.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import programs
from .errors import UserError
from .programs import (  # noqa: F401  (kinds.DENOISE_VARIANTS, kinds.SHAPE_SEPARATOR, ... as before)
    DENOISE_VARIANTS,
    DIT_GROUPS,
    SHAPE_SEPARATOR,
    STAGE_SUFFIX,
    TEXT_ENCODER,
    DenoiseVariant,
    Program,
)

# The decoders a run can pick (`decoder=`), by the prefix of their chunk programs ("<prefix>_first", "<prefix>_next"):
# the VAE's, and a tiny decoder's where the bundle has one (Manifest.tiny_decoder, export/tiny_decoder.py).
DECODERS = {"full": programs.VAE_DECODE, "tiny": programs.TINY_DECODE}


@dataclass(frozen=True)
class Kind:
    name: str
    title: str
    experts: int  # 1, or 2: "transformer" above the boundary timestep, "transformer_2" below
    image: str  # "none" | "optional" | "required"
    last_image: bool  # takes (and needs) a last frame too (FLF2V)
    image_encoder: bool  # CLIP vision stage feeding the DiT's image cross-attention
    conditioning: str  # "none" | "concat" | "first_frame" | "vace" | "animate" | "video_concat" (module docstring)
    fps: int = 16  # the family's native frame rate (the mp4 default)
    steps: int = 50  # the run defaults of diffusers' pipeline (__call__'s num_inference_steps, guidance_scale)
    guidance: float = 5.0
    video: str = "none"  # "none" | "optional": a control video (with a mask and reference images) | "required" |
    #                      "extend": a video to continue (diffusion forcing) | "prefix": the video's first frames,
    #                      4k + 1 of them, kept as they are (AnyFlow) | "context": the video's first frames as the
    #                      first chunks' context, 4k + 1 of them (AnyFlow-FAR)
    dit: str = "wan"  # "wan" | "skyreels" | "helios" | "anyflow" | "chronoedit": the DiT's diffusers class family
    #                   (export/source.py transformer_class)
    frames: int = 81  # the export's default --frames (Helios: one chunk, 9 latent frames)

    @property
    def vae_encode(self) -> str:
        """What the VAE encodes: "" (nothing), "image" (one frame) or "video" (the whole conditioning video)."""
        return {"none": "", "first_frame": "image", "concat": "video", "vace": "video",
                "animate": "video", "video_concat": "video", "forcing": "video", "helios": "video",
                "flowmap": "video", "far": "video", "animate-2": "video"}[self.conditioning]

    @property
    def vace(self) -> bool:
        """The DiT is a WanVACETransformer3DModel: VACE blocks beside the main ones, their hints added after the main
        blocks their `vace_layers` name."""
        return self.conditioning == "vace"

    @property
    def reference_images(self) -> bool:
        """Takes reference images (VACE): each one more latent frame before the video's, so the DiT's programs
        are traced per count of them (Geometry.reference_images)."""
        return self.vace

    @property
    def expert_groups(self) -> tuple[str, ...]:
        return DIT_GROUPS[: self.experts]

    @property
    def conditioning_inputs(self) -> tuple[str, ...]:
        """The image conditioning the denoise programs take after (state, kv, timestep, guidance, row), in order."""
        return {"none": (), "concat": ("condition",), "first_frame": ("condition", "mask"),
                "vace": ("control", "control_scale"), "animate": ("condition", "pose", "motion"),
                "video_concat": ("condition",), "forcing": FORCING_INPUTS,
                "helios": ("history", "cfg_mode"), "flowmap": ("condition", "mask", "r_timestep"),
                "far": FAR_INPUTS, "animate-2": ("condition", "ref_cache")}[self.conditioning]

    @property
    def channel_condition(self) -> str:
        """What `condition` puts after the noisy latents on the DiT input's channel axis, over every latent frame:
        "" (nothing: the DiT sees the latents alone, or "first_frame"'s blend), "mask+latents" (the frame mask, then
        the conditioning video's latents: "concat", "animate") or "latents" (the source video's latents alone:
        "video_concat")."""
        return {"concat": "mask+latents", "animate": "mask+latents", "animate-2": "mask+latents",
                "video_concat": "latents"}.get(self.conditioning, "")

    @property
    def animate(self) -> bool:
        """Wan-Animate: segments of a pose-driven video (runtime/animate.py), each one bundle shape."""
        return self.conditioning == "animate"

    @property
    def animate2(self) -> bool:
        """Wan-Animate 2: segments of a driving video, each a reference pass into a cache, then steps attending to it
        (runtime/animate2.py)."""
        return self.conditioning == "animate-2"

    @property
    def forcing(self) -> bool:
        """Diffusion forcing (SkyReels-V2 DF): per-frame timesteps and sampler states, segments of any count
        (runtime/forcing.py)."""
        return self.conditioning == "forcing"

    @property
    def helios(self) -> bool:
        """Helios: a video of any length in chunks, each conditioned on the clean latents before it at three scales
        (runtime/helios.py)."""
        return self.conditioning == "helios"

    @property
    def chronoedit(self) -> bool:
        """ChronoEdit: an image edit made as a short video whose last frame is the edit (runtime/chronoedit.py), by
        a DiT whose RoPE puts exactly 2 latent frames at temporal positions 0 and 7 (rope_temporal_skip_len - 1): its
        loop runs temporal reasoning (the first steps over more frames, then the last ones on those 2), and
        `edit_image` returns the last frame."""
        return self.dit == "chronoedit"

    @property
    def flow_map(self) -> bool:
        """AnyFlow: the DiT takes the step's target timestep r too, and predicts the mean velocity from t to r
        (the "flowmap" sampler; "euler" is the same update with r = t, diffusers' use_mean_velocity=False)."""
        return self.conditioning in ("flowmap", "far")

    @property
    def far(self) -> bool:
        """AnyFlow-FAR: a video in causal chunks, each attending to a KV cache of the chunks before it
        (runtime/far.py)."""
        return self.conditioning == "far"

    @property
    def any_length(self) -> bool:
        """One bundle shape makes a video of any length, in segments or chunks of it (diffusion forcing, Helios): a
        run's frame count (a job's seconds) is the video's, not a shape's."""
        return self.forcing or self.helios

    @property
    def takes_last_image(self) -> bool:
        """Takes a last image: FLF2V kinds need one; diffusion forcing pins one as the video's last latent frame."""
        return self.last_image or self.forcing

    @property
    def loop(self) -> str:
        """The loop `generate` runs (runtime/pipeline.py LOOPS): "segment" (one bundle shape, runtime/segment.py),
        "animate" (runtime/animate.py), "forcing" (runtime/forcing.py), "helios" (runtime/helios.py) or "chronoedit"
        (runtime/chronoedit.py: one shape, or temporal reasoning over two)."""
        if self.chronoedit:
            return "chronoedit"
        if self.far:
            return "far"
        if self.animate2:
            return "animate-2"
        return "animate" if self.animate else "forcing" if self.forcing else "helios" if self.helios else "segment"

    @property
    def variants(self) -> tuple[str, ...]:
        """The denoise variants (DENOISE_VARIANTS) a bundle of this kind holds: all, but diffusion forcing's steps have
        no MagCache ones (its per-frame timesteps give MagCache's per-step schedule nothing to go by)."""
        return ("cfg", "cond") if self.forcing or self.helios or self.flow_map or self.animate2 else \
            tuple(DENOISE_VARIANTS)

    @property
    def block_loop(self) -> bool:
        """The DiT's steps run as a block loop (export/denoise_blocks.py). Not Animate's: its face adapters run
        between the blocks (after every 5th), not in them, so each of its steps is one program; nor Helios' (its
        history tokens and their timestep-0 modulation are its own), one program per step too; nor AnyFlow's (its
        blocks are AnyFlowTransformer3DModel's, its time embedding two)."""
        return not self.animate and not self.helios and not self.flow_map and not self.animate2

    @property
    def kv_inputs(self) -> tuple[str, ...]:
        """Inputs of the cross_kv programs, in order (the CLIP image embeddings go to cross-attention)."""
        return ("context",) + (("image_embeds",) if self.image_encoder else ())

    @property
    def denoise_extras(self) -> tuple[str, ...]:
        """Inputs after (state, context, timestep, guidance, row) of the denoise programs of bundles exported
        before the cross_kv programs existed, whose steps took the text (and CLIP image) embeddings."""
        return self.conditioning_inputs + (("image_embeds",) if self.image_encoder else ())

    def short_prompts(self, platform: str) -> bool:
        """Whether a bundle for `platform` holds the short prompts' programs (cross_kv_t<T> and short block programs,
        export/cross_kv.py): CPU targets, where cross-attention over 512 rows is a tenth of a small video's step;
        elsewhere not (the TPU kernel takes no bias). Not for VACE (its head runs the VACE blocks' cross-attention,
        on the whole text's keys and values), nor where the steps are one program each (no block loop)."""
        return platform == "cpu" and not self.vace and self.block_loop

    def programs(self, latent_frames: int, max_sequence_length: int, short_prompts: bool = False,
                 video_to_video: bool = False, tiny_decoder: bool = False) -> tuple[Program, ...]:
        """The programs a bundle of this kind holds for a shape of `latent_frames`, in the order they run (bundles
        exported before the denoise variants other than "cfg" existed hold only that one, and the runtime falls back
        to it; those exported before the cross_kv programs existed have none, and their steps take the embeddings;
        those exported before the shorter text encoder programs existed have only the full one). `short_prompts`:
        the bundle has the cross_kv_t<T> programs too (`Kind.short_prompts`). The one list of them: the export
        builds these (export/build.py), and the runtime checks a bundle against them."""
        L = max_sequence_length
        out = [Program(TEXT_ENCODER, text_rows=None if n == L else n) for n in text_lengths(L)]
        if self.image_encoder:
            out.append(Program(programs.IMAGE_ENCODER))
        if self.animate:
            out.append(Program(programs.FACE_MOTION))
        encode = "video" if video_to_video else self.vae_encode
        if encode:
            out += [Program(programs.VAE_ENCODE, chunk=c)
                    for c in programs.CHUNKS[: 2 if encode == "video" and latent_frames > 1 else 1]]
        rows = [None, *(short_text_lengths(L) if short_prompts else ())]
        out += [Program.cross_kv(e, t) for e in range(self.experts) for t in rows]
        if self.animate2:  # the reference pass, once per segment, before its steps
            out.append(Program(programs.REFERENCE_STEP))
        out += [Program.denoise(e, v) for e in range(self.experts) for v in self.variants]
        if self.far:  # the KV cache's write after each chunk, with CFG (both halves) and without
            out += [Program(programs.CACHE_STEP, variant=v) for v in self.variants]
        for decoder in DECODERS.values() if tiny_decoder else (DECODERS["full"],):
            out += [Program(decoder, chunk=c) for c in programs.CHUNKS[: 2 if latent_frames > 1 else 1]]
        return tuple(out)

    def stages(self, latent_frames: int, max_sequence_length: int, short_prompts: bool = False,
               video_to_video: bool = False, tiny_decoder: bool = False) -> tuple[str, ...]:
        """The names of `programs`."""
        return tuple(p.name for p in self.programs(latent_frames, max_sequence_length, short_prompts,
                                                   video_to_video, tiny_decoder))


# Denoise inputs that change every step, which the loop computes (not the run's conditioning): a flow-map model's
# per-frame target timestep.
STEP_INPUTS = ("r_timestep",)

# Diffusion forcing's step inputs after (state, kv, timestep, guidance, row), kind.conditioning_inputs: the Gaussian
# noise of re-noised prefix frames (B, z, T, h, w) and each frame's share of it (T,), each frame's update flag (T,),
# the causal block size (int32; <= 1: full attention) and the frame rate (int32; the DiT's fps embedding).
FORCING_INPUTS = ("noise", "blend", "update", "causal_block", "fps")

# AnyFlow-FAR's step inputs after (state, kv, timestep, guidance, row) (module docstring, "far"): the KV cache, each
# cache slot's and chunk frame's position, the chunk's target timestep. Its cache_step's inputs and outputs:
# programs.CACHE_STEP_INPUTS / CACHE_STEP_OUTPUTS.
FAR_INPUTS = ("full_cache", "compressed_cache", "frame_pos", "r_timestep")

KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("t2v", "Wan 2.1 text-to-video", experts=1, image="none", last_image=False, image_encoder=False,
         conditioning="none"),
    Kind("t2v-moe", "Wan 2.2 text-to-video, two experts", experts=2, image="none", last_image=False,
         image_encoder=False, conditioning="none"),
    Kind("ti2v", "Wan 2.2 text/image-to-video (TI2V)", experts=1, image="optional", last_image=False,
         image_encoder=False, conditioning="first_frame", fps=24),
    Kind("i2v", "Wan 2.1 image-to-video (CLIP)", experts=1, image="required", last_image=False,
         image_encoder=True, conditioning="concat"),
    Kind("flf2v", "Wan 2.1 first-last-frame-to-video", experts=1, image="required", last_image=True,
         image_encoder=True, conditioning="concat"),
    Kind("i2v-moe", "Wan 2.2 image-to-video, two experts", experts=2, image="required", last_image=False,
         image_encoder=False, conditioning="concat"),
    Kind("vace", "Wan VACE (control video, mask, reference images)", experts=1, image="none", last_image=False,
         image_encoder=False, conditioning="vace", video="optional"),
    Kind("vace-moe", "Wan 2.2 VACE, two experts", experts=2, image="none", last_image=False, image_encoder=False,
         conditioning="vace", video="optional"),
    Kind("animate", "Wan 2.2 Animate (a character from an image, moved by pose and face videos)", experts=1,
         image="required", last_image=False, image_encoder=True, conditioning="animate", fps=30, steps=20,
         guidance=1.0),
    # Lucy Edit (Decart): an instruction edits a source video; its latents beside the noise at every step.
    Kind("lucy-edit", "Lucy Edit (video editing from an instruction)", experts=1, image="none", last_image=False,
         image_encoder=False, conditioning="video_concat", fps=24, video="required"),
    # ChronoEdit (NVIDIA; diffusers' ChronoEditPipeline): Wan2.1-I2V-14B with ChronoEditTransformer3DModel's RoPE; an
    # image edit as a 5-frame video (2 latent frames) whose last frame is the edit, optionally after temporal
    # reasoning over more frames (runtime/chronoedit.py). Run defaults: ChronoEditPipeline.__call__'s.
    Kind("chronoedit", "ChronoEdit (image editing: a short video whose last frame is the edit)", experts=1,
         image="required", last_image=False, image_encoder=True, conditioning="concat", dit="chronoedit", frames=5),
    # SkyReels-V2 (Skywork): Wan 2.1's DiT fine-tuned; diffusers' SkyReelsV2 pipelines and their run defaults.
    Kind("skyreels-t2v", "SkyReels-V2 text-to-video", experts=1, image="none", last_image=False, image_encoder=False,
         conditioning="none", fps=24, guidance=6.0, dit="skyreels"),
    Kind("skyreels-i2v", "SkyReels-V2 image-to-video (CLIP)", experts=1, image="required", last_image=False,
         image_encoder=True, conditioning="concat", fps=24, dit="skyreels"),
    Kind("skyreels-flf2v", "SkyReels-V2 first-last-frame-to-video", experts=1, image="required", last_image=True,
         image_encoder=True, conditioning="concat", fps=24, dit="skyreels"),
    Kind("skyreels-df", "SkyReels-V2 diffusion forcing (text, image or video to a video of any length)", experts=1,
         image="optional", last_image=False, image_encoder=False, conditioning="forcing", fps=24, guidance=6.0,
         video="extend", dit="skyreels"),
    # Helios (PKU-YuanGroup; diffusers' HeliosPipeline): chunks of a video of any length, each conditioned on the clean
    # latents before it (runtime/helios.py); text, image or video in.
    Kind("helios", "Helios (text, image or video to a video of any length, in chunks)", experts=1, image="optional",
         last_image=False, image_encoder=False, conditioning="helios", fps=24, video="extend", dit="helios",
         frames=33),
    # HeliosPyramidPipeline: each chunk in three stages, from a quarter of the resolution up (Helios-Mid: CFG-Zero*);
    # `steps` is per stage (pyramid_num_inference_steps_list sets each).
    Kind("helios-pyramid", "Helios pyramid (chunks in three stages, low to full resolution)", experts=1,
         image="optional", last_image=False, image_encoder=False, conditioning="helios", fps=24, steps=10,
         video="extend", dit="helios", frames=33),
    # Helios-Distilled: the pyramid with HeliosDMDScheduler, a few steps per stage, no guidance.
    Kind("helios-distilled", "Helios distilled (pyramid stages of a few DMD steps)", experts=1, image="optional",
         last_image=False, image_encoder=False, conditioning="helios", fps=24, steps=2, guidance=1.0,
         video="extend", dit="helios", frames=33),
    # AnyFlow (NVIDIA; diffusers' AnyFlowPipeline): a flow-map distilled Wan 2.1 T2V, any step count from one checkpoint;
    # its run defaults: 4 steps (1 to 16 sample well), no guidance (CFG is distilled into the weights).
    Kind("anyflow", "AnyFlow text-to-video (any step count; continues a video's first frames)", experts=1,
         image="none", last_image=False, image_encoder=False, conditioning="flowmap", steps=4, guidance=1.0,
         video="prefix", dit="anyflow"),
    # AnyFlow-FAR (NVIDIA; diffusers' AnyFlowFARPipeline): AnyFlow's flow map made causal, the video in chunks
    # (chunk_partition), each attending to a KV cache of those before (runtime/far.py); text, an image (the first
    # chunk's context) or a video's frames as context. Run defaults as AnyFlow's: 4 steps, no guidance.
    Kind("anyflow-far", "AnyFlow-FAR (causal chunks with a KV cache; text, image or video context)", experts=1,
         image="optional", last_image=False, image_encoder=False, conditioning="far", steps=4, guidance=1.0,
         video="context", dit="anyflow-far"),
    # Wan-Animate 2 (diffusers' WanAnimate2ModularPipeline): a character image moved by a driving video of any length,
    # in segments of the bundle shape's frames (segment_frame_length); run defaults: the modular blocks' (40 steps,
    # ClassifierFreeGuidance 3.0, 24 fps).
    Kind("animate-2", "Wan-Animate 2 (a character from an image, moved by a driving video)", experts=1,
         image="required", last_image=False, image_encoder=True, conditioning="animate-2", fps=24, steps=40,
         guidance=3.0, dit="animate-2"),
    # WanAnimate2DistilledModularPipeline: the same model distilled, 10 steps, no guidance.
    Kind("animate-2-distilled", "Wan-Animate 2 distilled (few steps, no CFG)", experts=1, image="required",
         last_image=False, image_encoder=True, conditioning="animate-2", fps=24, steps=10, guidance=1.0,
         dit="animate-2"),
)}


def get(name: str) -> Kind:
    if name not in KINDS:
        raise UserError(f"unknown model kind {name!r} (this runtime knows {', '.join(KINDS)}): upgrade wan-aot")
    return KINDS[name]


def denoise_program(expert: int, variant: str = "cfg") -> str:
    """Expert 0 runs `denoise_step[suffix]`, expert 1 `denoise_step_2[suffix]` (the same program file, other
    weights); the suffix names the variant (DENOISE_VARIANTS), none for the CFG step every bundle has."""
    return Program.denoise(expert, variant).name


def cross_kv_program(expert: int, text_rows: int | None = None) -> str:
    """The program computing expert `expert`'s cross-attention keys and values of a prompt (export/cross_kv.py):
    `cross_kv`, `cross_kv_2` (the same program file, the second expert's weights); with `text_rows` T, the one
    over a short prompt's first T rows (`short_text_lengths`): `cross_kv_t<T>`, `cross_kv_2_t<T>`."""
    return Program.cross_kv(expert, text_rows).name


def is_cross_kv(program: str) -> bool:
    p = Program.parse(program)
    return p is not None and p.base == programs.CROSS_KV and not p.shape


def short_text_lengths(max_sequence_length: int) -> tuple[int, ...]:
    """The text lengths T below the whole that CPU bundles have cross_kv_t<T> and short block programs for
    (export/cross_kv.py): text_lengths', the lengths of the text encoder programs."""
    return tuple(n for n in text_lengths(max_sequence_length) if n < max_sequence_length)


def stage_program(program: str, stage: int, stages: int) -> str:
    """The DiT program `program` (a denoise program, before any shape suffix) of pyramid stage `stage` of `stages`:
    the full-resolution (last) stage's is the program itself, a lower stage's "<program>_stage<k>"."""
    if stage == stages - 1:
        return program
    p = Program.parse(program)
    if p is None or p.base != programs.DENOISE:
        raise ValueError(f"{program!r} is not a denoise program")
    return p.replace(stage=stage).name


def pyramid_programs(program: str, stages: int) -> tuple[str, ...]:
    """`program`, and its lower stages' where it is a denoise program of a pyramid of `stages` stages."""
    if stages <= 1 or denoise_variant(program) is None:
        return (program,)
    return tuple(stage_program(program, k, stages) for k in range(stages))


def denoise_variant(name: str) -> DenoiseVariant | None:
    """The variant of denoise program `name` (of any shape or pyramid stage), or None if `name` is not a denoise
    program."""
    p = Program.parse(name)
    return p.denoise_variant if p is not None else None


def shape_scope(program: str) -> str:
    """What program `program`'s tensor shapes depend on, so what a bundle of several shapes holds one of per
    shape: "" (nothing: the text and image encoders, the cross-attention keys and values), "size" (width x
    height: the VAE's one-frame chunks) or "video" (width x height x frames: the DiT's denoise programs)."""
    p = Program.parse(program)
    return p.scope if p is not None else ""


def base_program(name: str) -> str:
    """Program `name` without its shape suffix (kinds.SHAPE_SEPARATOR): the stage it is, whatever its shape."""
    return name.partition(SHAPE_SEPARATOR)[0]


PIPELINE_STAGES = ("encode", "denoise", "decode")  # the order a generation runs its programs' stages in


def text_lengths(max_sequence_length: int) -> tuple[int, ...]:
    """The prompt lengths (tokens) a bundle has text encoder programs for, shortest first: L/8, L/4, L/2 and L.
    A batch of prompts runs the shortest that holds its longest prompt. diffusers encodes all L positions, but
    with the padding masked out of attention the real tokens' embeddings do not depend on it (the padded rows
    are zeroed after), and UMT5-XXL over 512 positions costs ~8x what it does over the 64 a prompt fills."""
    L = max_sequence_length
    return tuple(sorted({L >> k for k in (3, 2, 1) if L >> k >= 1} | {L}))


def text_encoder_program(length: int, max_sequence_length: int) -> str:
    return Program(TEXT_ENCODER, text_rows=None if length == max_sequence_length else length).name


def is_text_encoder(program: str) -> bool:
    p = Program.parse(program)
    return p is not None and p.base == TEXT_ENCODER and not p.shape


def pipeline_stage(program: str) -> str:
    """Which of PIPELINE_STAGES program `program` belongs to: the DiT's programs (its steps and cross-attention
    keys and values) denoise, the VAE decoder's decode, the rest (text, CLIP, VAE encoder) encode."""
    p = Program.parse(program)
    return p.pipeline_stage if p is not None else "encode"


def check_images(kind: Kind, image: object, last_image: object) -> None:
    """Refuse images a kind does not take, or a missing required one, in one line."""
    if kind.image == "none" and image is not None:
        raise UserError(f"this bundle is {kind.title}: it takes no image (export an image-to-video model for that)")
    if kind.image == "required" and image is None:
        raise UserError(f"this bundle is {kind.title}: it needs an image (--image FILE / image=...)")
    if last_image is not None and not kind.takes_last_image:
        raise UserError(f"this bundle is {kind.title}: it takes no last image (that needs a first-last-frame "
                        "model such as Wan2.1-FLF2V)")
    if last_image is not None and image is None:
        raise UserError("a last image needs a first image too (--image)")
    if kind.last_image and image is not None and last_image is None:
        raise UserError(f"this bundle is {kind.title}: it needs a last image too (--last-image FILE / last_image=...)")


def check_videos(kind: Kind, video_to_video: bool, video: object, mask: object, reference_images: object) -> None:
    """Refuse video inputs a bundle does not take, in one line (`video_to_video`: a text-to-video bundle exported
    with the VAE encoder, Manifest.video_to_video)."""
    takes_video = kind.video != "none" or video_to_video
    if video is None and kind.video == "required":
        raise UserError(f"this bundle is {kind.title}: it needs a source video (--video FILE / video=...)")
    if video is not None and not takes_video:
        also = " (export a text-to-video model with --video-to-video for video-to-video)" \
            if kind.conditioning == "none" else ""
        raise UserError(f"this bundle is {kind.title}: it takes no video{also}")
    if mask is not None and not kind.vace:
        raise UserError(f"this bundle is {kind.title}: it takes no mask (masks are for VACE models)")
    if reference_images and not kind.reference_images:
        raise UserError(f"this bundle is {kind.title}: it takes no reference images (they are for VACE models)")

