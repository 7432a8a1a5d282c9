"""The one step runner: every denoising loop's steps run here.

A loop (one segment: runtime/segment.py; diffusion forcing's rows: runtime/forcing.py; each Helios chunk and pyramid
stage: runtime/helios.py; ChronoEdit's temporal reasoning; AnyFlow; Wan-Animate's segments) supplies only what differs
from loop to loop: the programs its steps run, its schedule's timesteps, the inputs that change per step (the sampler's
coefficient row, the prompt's keys and values, a per-frame timestep, ...) and those placed once (the conditioning).
What is the same everywhere is here, once:

- choosing the step program: the expert, the CFG variant (the cond-only step where guidance <= 1), MagCache's;
- the timestep as the program takes it: cast, and scaled to the DiT's convention (manifest.Defaults.timestep_scale);
- placing the state and the fixed inputs on the devices as the first program wants them;
- MagCache's residual, carried from step to step, and its calibration;
- the finite check after each step, progress, cancel (an `on_step` that raises), and previews: through the bundle's
  tiny decoder where it has one (a real frame at the video's size), else the fixed latent-to-RGB map.

Nothing here imports a loop or the Pipeline front."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from . import kinds, previews, signatures
from . import magcache as magcache_rule
from . import manifest as mf
from .distributed import fetch, is_primary, put
from .errors import UserError
from .magcache import MagCache
from .scheduler import TIMESTEP_SCALE, scaled_timesteps

if TYPE_CHECKING:
    from .bundle import Bundle

Cast = Callable[[Any], Any]


def timestep_cast(manifest: mf.Manifest, program: str, timesteps: Sequence[float] | np.ndarray,
                  sampler: str = "") -> Cast:
    """The timestep as program `program` takes it: the schedule's (sigma x 1000, a scalar or one per frame) times the
    bundle's timestep_scale / 1000, as float32 (bundles of schema 9 on), or int32 in older bundles, whose programs
    cannot take fractional `timesteps` (UserError, before any work). `sampler` names the schedule's in that message."""
    scale = manifest.defaults.timestep_scale
    if manifest.programs[program].inputs["timestep"].dtype == "float32":
        return np.float32 if scale == TIMESTEP_SCALE else (lambda t: scaled_timesteps(t, scale))
    if scale != TIMESTEP_SCALE:  # only an edited manifest gets here: its migration sets 1000
        raise UserError(f"this bundle's programs take whole-number timesteps (it was exported by an older "
                        f"wan-aot), which cannot carry timestep_scale {scale:g}: re-export the bundle")
    ts = np.asarray(timesteps)
    if not np.array_equal(ts, np.round(ts)):
        raise UserError(f"this bundle's programs take whole-number timesteps (it was exported by an older "
                        f"wan-aot), and the {sampler} sampler's are fractional: re-export the bundle, or use "
                        "sampler unipc or dpm++")
    return np.int32


def step_program(manifest: mf.Manifest, g: mf.Geometry, expert: int, guidance: float, stage: int | None = None,
                 stages: int = 1) -> str:
    """The denoise program of expert `expert` (of pyramid stage `stage` of `stages`) for shape `g`: the cond-only
    step where `guidance` <= 1 and the bundle has it (the uncond half would be computed for nothing), else the CFG
    step (bundles exported before the variants existed have only that one)."""
    def name(variant: str) -> str:
        base = kinds.denoise_program(expert, variant)
        return manifest.program_for(base if stage is None else kinds.stage_program(base, stage, stages), g)

    cond = name("cond")
    return cond if guidance <= 1.0 and cond in manifest.programs else name("cfg")


def step_programs(manifest: mf.Manifest, kind: kinds.Kind, g: mf.Geometry, experts: Sequence[int],
                  guidance_of: Callable[[int], float], magcache: MagCache | None = None) -> list[str]:
    """The denoise program of each step, whose expert is `experts[i]`: with `magcache`, its full ("_residual") or
    cached ("_cached") step as MagCache's schedule says; else `step_program`."""
    if magcache is None:
        return [step_program(manifest, g, e, guidance_of(e)) for e in experts]
    if "residual" not in kind.variants:
        raise UserError(f"this bundle is {kind.title}: MagCache is not for its steps (diffusion forcing's "
                        "per-frame timesteps give its per-step schedule nothing to go by)")
    if kinds.denoise_program(0, "residual") not in manifest.programs:
        raise UserError("this bundle has no MagCache programs (it was exported by an older wan-aot): "
                        "re-export it to use MagCache")
    compute = magcache.schedule(list(experts))
    return [manifest.program_for(kinds.denoise_program(e, "residual" if c else "cached"), g)
            for e, c in zip(experts, compute)]


def previewer(bundle: Bundle, g: mf.Geometry) -> Callable[[Any], np.ndarray] | None:
    """What turns the step programs' state of shape `g` into the live preview's uint8 RGB: the tiny decoder's
    first-chunk program on the middle latent frame of x0 (a real frame, at the video's size) where the bundle has one,
    else the fixed latent-to-RGB map (runtime/previews.py), else None (latents it has no map for)."""
    manifest = bundle.manifest
    if manifest.tiny_decoder is not None:
        return previews.TinyPreviewer(g, bundle.call(manifest.program_for("tiny_decode_first", g)))
    return previews.Previewer(g) if previews.family(g.latent_channels) else None


def progress_bar(total: int, progress: bool, desc: str = "denoising", initial: int = 0) -> Any:
    """The loop's tqdm bar (on the primary process only)."""
    return tqdm(total=total, initial=initial, desc=desc, unit="step", disable=not progress or not is_primary())


def run(bundle: Bundle, g: mf.Geometry, programs: Sequence[str], state: np.ndarray, timesteps: Sequence[Any],
        per_step: Callable[[int], dict[str, Any]], *, fixed: dict[str, np.ndarray] | None = None,
        where: Callable[[int], str], cast: Cast | None = None, begin: int = 0,
        on_step: Callable[[int], None] | None = None, on_preview: Callable[[np.ndarray], None] | None = None,
        bar: Any = None, experts: Sequence[int] | None = None, calibration: list[float] | None = None,
        stop_after: int | None = None) -> Any:
    """Run steps `begin`.. of `programs` (step i runs `programs[i]`) on the scheduler state `state` (its rows: the
    latents first; runtime/scheduler.py) of shape `g`; returns the state after the last step, on the devices.

    The loop supplies `timesteps[i]` (the schedule's, sigma x 1000: a scalar or one per frame; cast here as the
    program takes it, `cast` or `timestep_cast`), `per_step(i)` (the inputs that change per step, by name: the
    sampler's `row`, `guidance`, the prompt's `kv` or `context`, ...) and `fixed` (placed once, as the first program
    wants them; the variants share their layout). `where(i)` names step i in the error raised when it makes
    non-finite latents. `on_step(i)` after step i is done and checked (it may raise to stop the run: a server's
    cancel); `on_preview(rgb)` before it, with the step's estimate of the video's middle frame (`previewer`).
    `experts` (each step's) with `calibration`: MagCache's calibration ratios are appended to it. `stop_after` n:
    stop after step n."""
    orders = {name: signature_of(bundle, name) for name in dict.fromkeys(programs[begin:])}  # once per program
    placed = dict(zip(signature_of(bundle, programs[0]), bundle.call_shardings(programs[0]), strict=True))
    state_dev = put(np.ascontiguousarray(state, np.float32), placed["state"])
    fixed_dev = {n: put(np.ascontiguousarray(v), placed[n]) for n, v in (fixed or {}).items()}
    cast = cast or timestep_cast(bundle.manifest, programs[0], _flat(timesteps))
    preview = previewer(bundle, g) if on_preview is not None else None
    residual = norms = None
    expert_before = -1
    for i in range(begin, len(programs)):
        name = programs[i]
        variant = kinds.denoise_variant(name)
        values = {"state": state_dev, "timestep": cast(timesteps[i]), "residual": residual, **fixed_dev,
                  **per_step(i)}
        outs = bundle.call(name)(*[values[n] for n in orders[name]])
        state_dev, finite = outs[0], outs[1]
        if variant is not None and variant.residual == "out":
            residual = outs[2]
        if not bool(fetch(finite)):
            raise UserError(f"non-finite values (NaN/inf) appeared in the latents at {where(i)}: check the weights, "
                            f"guidance ({values.get('guidance')}) and dtype")
        if calibration is not None and experts is not None:
            now = fetch(jnp.linalg.norm(residual[: g.batch].astype(jnp.float32), axis=-1))
            e = experts[i]
            calibration.append(magcache_rule.calibration_ratio(now, norms if e == expert_before else None))
            norms, expert_before = now, e
        if preview is not None:
            on_preview(preview(state_dev))  # type: ignore[misc]
        if bar is not None:
            bar.update(1)
        if on_step is not None:
            on_step(i)
        if stop_after is not None and i + 1 == stop_after:
            break
    return state_dev


def _flat(timesteps: Sequence[Any]) -> np.ndarray:
    """Every timestep of a schedule as one float64 array (scalars or one per frame)."""
    return np.concatenate([np.ravel(np.asarray(t, np.float64)) for t in timesteps]) if len(timesteps) else \
        np.zeros(0)


def signature_of(bundle: Bundle, program: str) -> tuple[str, ...]:
    """The names of program `program`'s inputs, in the order it takes them (runtime/signatures.py)."""
    return signatures.call_order(program, kinds.get(bundle.manifest.kind), bundle.manifest.programs[program]).inputs


def initial_state(x0: np.ndarray, rows: int, start: np.ndarray | None = None) -> np.ndarray:
    """A fresh scheduler state of `rows` rows (scheduler.state_rows): the latents `x0` in row 0 (and a DMD run's
    `start` in row 1, where its rows keep it), the sampler's history empty."""
    state = np.zeros((rows, *np.shape(x0)), np.float32)
    state[0] = x0
    if start is not None:
        state[1] = start
    return state
