"""LoRA sets switched between jobs (issue 50): what a switch costs, which design to switch with, and what affinity
saves a mixed queue.

switch: the 1.3b workload (the Wan2.1-1.3B DiT's real widths, random weights) in one fresh process, with adapters of
rank --rank on every linear layer of its 30 blocks (self- and cross-attention q, k, v, o, FFN up and down: 300
tensors), switched none -> A -> B -> A+B -> none -> A as a server switches between jobs (Pipeline.use_loras), every
switch timed (the first round, which compiles the merge programs, apart; medians of the others); beside it the DiT's
load with A merged in a fresh pipeline (what a restart costs for the weights); the bytes a switch touches (weights
placed again from the weight file, adapters read and placed); and the process's memory: private (anonymous) and
mapped from files. The unmodified copy a switch merges from is the weight file's mapping: page cache, shared, costing
no memory of the process's own.

widths: the merge of a switch at the 1.3B's widths alone (its 300 block linears, bf16) on --device: each tensor
placed from host memory and merged by the runtime's merge program, as a switch does (no bundle: runs on a GPU too).

designs: the two designs the issue names, at the 1.3B's linear widths and --tokens tokens, as jitted JAX programs on
--device: merging into the weights (chosen; a switch merges every tensor again from its unmodified copy, a step is the
plain matmuls) against unmerged low-rank inputs (a switch places only A and B, but every step adds x A^T B^T beside
each matmul): one block's ten linear layers, a step's time both ways and a switch's both ways, and after how many
steps the unmerged branch has cost more than the merge.

v6e: the 14B on tpu-v6e-8 (dp=2, tp=4), exported from its architecture name with --no-weights (its sharding rules):
per device, the bytes of the tensors a rank --rank adapter on every block linear changes, the adapter's A and B shards,
and so the host-to-device traffic of one switch per device and per host; then one device's share, tensors of the
per-device shapes, placed from host memory and merged on --device by the runtime's merge program (--blocks of the 40,
scaled to 40), timed.

queue: a mixed queue of --jobs jobs (A, B, none, A, B, none, ...; --steps steps each) sent at once to one server of the
1.3b workload with --lora-dir, run with --lora-affinity-max 0 (strictly in turn) and 4 (the default), interleaved over
--repeats: jobs per minute from the first request to the last video, switches and the seconds they took.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .common import (
    ROOT,
    WORKLOADS,
    Report,
    Table,
    add_common,
    bundle,
    child_env,
    export,
    log,
    median,
    num,
    ratio,
    spawn,
)

LAYERS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
          "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")
SEQUENCE = (("none", []), ("A", [("A", 1.0)]), ("B", [("B", 1.0)]), ("A+B", [("A", 0.5), ("B", 1.0)]), ("none", []),
            ("A", [("A", 1.0)]))
V6E = ("wan2.1-t2v-14b", "720p", 81, "tpu-v6e-8")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=3, workloads=("1.3b",), dtypes=("bf16",))
    p.add_argument("--what", nargs="+", default=["switch", "widths", "designs", "v6e", "queue"],
                   choices=["switch", "widths", "designs", "v6e", "queue"])
    p.add_argument("--rank", type=int, default=64, help="the adapters' rank (lightx2v's distill LoRAs: 64)")
    p.add_argument("--tokens", type=int, default=None,
                   help="designs: tokens per step (default 192 on cpu: the 1.3b workload's 128x128x9; 32760 on cuda: "
                        "480p x 81 frames)")
    p.add_argument("--blocks", type=int, default=None, help="v6e: blocks merged (default 2 on cpu, 40 on cuda)")
    p.add_argument("--jobs", type=int, default=9, help="queue: jobs in the mixed queue")
    p.add_argument("--steps", type=int, default=2, help="queue: denoising steps per job")


def block_linears(names: Any) -> list[str]:
    """The weights of the block linear layers an adapter on every block linear changes."""
    return sorted(n for n in names if any(n.endswith(f".{layer}.weight") for layer in LAYERS))


def write_adapter(bund: Path, out: Path, seed: int, rank: int) -> Path:
    """A random adapter of rank `rank` on every block linear of `bund`'s DiT (the layout of runtime/lora.py)."""
    from safetensors.numpy import save_file

    from runtime import manifest as mf
    from runtime.lora import FORMAT

    m = mf.read(bund)
    wf = m.weights["transformer"]
    rng = np.random.default_rng(seed)
    tensors = {}
    for name in block_linears(wf.tensors):
        rows, cols = wf.tensors[name].shape
        tensors[f"transformer.{name}.lora_A"] = (rng.standard_normal((rank, cols), np.float32) / np.sqrt(cols))
        tensors[f"transformer.{name}.lora_B"] = (rng.standard_normal((rows, rank), np.float32) * 1e-2)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"format": FORMAT, "bundle_id": m.bundle_id, "targets": str(len(tensors))})
    return out


def _itemsize(dtype: str) -> int:
    return np.dtype(getattr(ml_dtypes, dtype, dtype)).itemsize


def _memory() -> dict[str, float]:
    """This process's resident memory in GB: anonymous (its own) and file-backed (mapped files, page cache)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1e6
    return out


# -- switch ---------------------------------------------------------------------------------------------------------

def switch_child(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    import runtime
    from runtime import cache

    cache.enable(None)
    pipe = runtime.load(a["bundle"], lora_dir=a["dir"])
    t = time.perf_counter()
    pipe.bundle.weights("transformer", "denoise_step")
    load_plain = time.perf_counter() - t
    memory = {"loaded": _memory()}
    rounds = []
    for _ in range(a["repeats"] + 1):
        rounds.append([(name, (pipe.use_loras(entries) or {"seconds": 0.0, "tensors": 0}))
                       for name, entries in SEQUENCE])
        memory.setdefault("switched", _memory())
    memory["after"] = _memory()
    return {"load_plain": load_plain, "memory": memory,
            "rounds": [[(n, s["seconds"], s["tensors"]) for n, s in r] for r in rounds]}


def fresh_child(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    """The DiT loaded with A merged in a fresh pipeline: its time and the process's memory after."""
    import runtime
    from runtime import cache, host_memory

    cache.enable(None)
    pipe = runtime.load(a["bundle"], loras=[(Path(a["dir"]) / "A.safetensors", 1.0)])
    t = time.perf_counter()
    pipe.bundle.weights("transformer", "denoise_step")
    took = time.perf_counter() - t
    host_memory.release_freed()
    return {"load_a": took, "memory": _memory()}


def switch_table(a: argparse.Namespace, bund: Path, lora_dir: Path) -> tuple[Table, dict[str, Any]]:
    from runtime import manifest as mf

    m = mf.read(bund)
    wf = m.weights["transformer"]
    touched = block_linears(wf.tensors)
    weight_bytes = sum(math.prod(wf.tensors[n].shape) * _itemsize(wf.tensors[n].dtype) for n in touched)
    adapter_bytes = (lora_dir / "A.safetensors").stat().st_size
    args = {"bundle": str(bund), "dir": str(lora_dir), "repeats": a.repeats}
    fresh = [spawn("lora:fresh_child", args) for _ in range(a.repeats)]
    r = spawn("lora:switch_child", args)
    r["load_a"] = median([f["load_a"] for f in fresh])
    r["memory"]["fresh with A"] = fresh[0]["memory"]
    first, *later = r["rounds"]
    t = Table(f"a switch between jobs, the 1.3b workload ({a.dtype[0]}, rank {a.rank} on the 30 blocks' 300 linear "
              "layers)", ["switch", "tensors merged again", "first round s (compiles)", "s (median)",
                          "vs loading the DiT with A"])
    for i, (name, _) in enumerate(SEQUENCE):
        before = SEQUENCE[i - 1][0] if i else "none"
        secs = [rnd[i][1] for rnd in later]
        t.add(f"{before} -> {name}" if i else "none (as loaded)", first[i][2] if i else 0,
              num(first[i][1], 2) if i else "-", num(median(secs), 2) if i else "-",
              ratio(median(secs), r["load_a"]) if i else "-")
    mem = r["memory"]
    t.notes += [
        f"Loading the DiT: {num(r['load_plain'], 2)} s without adapters (mapped, verified stamp), "
        f"{num(r['load_a'], 2)} s with A merged (a fresh pipeline: what a restart with A costs for the weights).",
        f"A switch touches {len(touched)} tensors, {num(weight_bytes / 1e9, 2)} GB of weights (placed again from the "
        f"weight file) and {num(adapter_bytes / 1e9, 3)} GB per adapter (A and B, float32, read and placed).",
        f"Memory (RSS, GB): loaded without adapters {num(mem['loaded']['RssAnon'], 2)} private + "
        f"{num(mem['loaded']['RssFile'], 2)} mapped; after the rounds of switches, holding A, "
        f"{num(mem['after']['RssAnon'], 2)} private + {num(mem['after']['RssFile'], 2)} mapped; a fresh load with A "
        f"{num(mem['fresh with A']['RssAnon'], 2)} private + {num(mem['fresh with A']['RssFile'], 2)} mapped. The "
        "unmodified copy is the weight file's mapping (page cache, shared with other processes): switching adds no "
        "private memory of its own beyond what a fresh load of the same set holds (the merged tensors and the set's "
        "adapters)."]
    return t, {"touched": len(touched), "weight_bytes": weight_bytes, "adapter_bytes": adapter_bytes, **r}


# -- designs --------------------------------------------------------------------------------------------------------

def _times(fns: dict[str, Any], repeats: int) -> dict[str, float]:
    """Each function's median wall time (after one call that compiles), called in turn, interleaved."""
    import jax

    for fn in fns.values():
        jax.block_until_ready(fn())
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn())
            out[k].append(time.perf_counter() - t)
    return {k: median(v) for k, v in out.items()}


def designs_child(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    """One 1.3B block's ten linears: a step's matmuls plain and with an unmerged rank-r branch, and a switch each way
    (merge from host copies of the weights; or place A and B)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from runtime import lora

    dim, ffn, r, n = 1536, 8960, a["rank"], a["tokens"]
    shapes = [(dim, dim)] * 8 + [(ffn, dim), (dim, ffn)]
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array([dev]), ("x",))
    rep = NamedSharding(mesh, PartitionSpec())
    host_w = [rng.standard_normal(s, np.float32).astype(jnp.bfloat16) for s in shapes]
    host_a = [(rng.standard_normal((r, s[1]), np.float32) / np.sqrt(s[1])) for s in shapes]
    host_b = [(rng.standard_normal((s[0], r), np.float32) * 1e-2) for s in shapes]
    w = [jax.device_put(x, rep) for x in host_w]
    xs = [jax.device_put(rng.standard_normal((n, s[1]), np.float32).astype(jnp.bfloat16), rep) for s in shapes]
    ab = [(jax.device_put(x.astype(jnp.bfloat16), rep), jax.device_put(y.astype(jnp.bfloat16), rep))
          for x, y in zip(host_a, host_b)]
    plain = jax.jit(lambda xs, ws: [x @ wt.T for x, wt in zip(xs, ws)])
    branch = jax.jit(lambda xs, ws, ab: [x @ wt.T + (x @ p.T) @ q.T for x, wt, (p, q) in zip(xs, ws, ab)])
    names = [f"l{i}" for i in range(len(shapes))]
    updates = {nm: [lora.Update(x, y, 1.0)] for nm, x, y in zip(names, host_a, host_b)}

    def merge() -> Any:  # what Bundle.set_loras does: the unmodified tensors placed again, then merged
        base = {nm: jax.device_put(x, rep) for nm, x in zip(names, host_w)}
        return lora.apply(base, updates)

    def place() -> Any:  # the unmerged design's switch: only A and B go to the device
        return [(jax.device_put(x.astype(jnp.bfloat16), rep), jax.device_put(y.astype(jnp.bfloat16), rep))
                for x, y in zip(host_a, host_b)]

    r = _times({"step_plain": lambda: plain(xs, w), "step_branch": lambda: branch(xs, w, ab),
                "switch_merge": merge, "switch_place": place}, a["repeats"])
    return {**r, "device": str(dev.device_kind), "tokens": n}


def designs_table(a: argparse.Namespace) -> tuple[Table, dict[str, Any]]:
    tokens = a.tokens or (32760 if a.device == "cuda" else 192)
    r = spawn("lora:designs_child", {"rank": a.rank, "tokens": tokens, "repeats": 2 * a.repeats + 1},
              device=a.device)
    extra = r["step_branch"] - r["step_plain"]
    t = Table(f"the two designs, one 1.3B block's ten linear layers (bf16, {tokens} tokens, rank {a.rank}, "
              f"{r['device']})", ["design", "a step's matmuls ms", "vs plain", "a switch ms (per block)",
                                  "steps until the branch cost more than the merge"])
    t.add("merged into the weights, from an unmodified copy (chosen)", num(r["step_plain"] * 1e3, 2), "1.00x",
          num(r["switch_merge"] * 1e3, 2), "-")
    t.add("unmerged low-rank inputs to the programs", num(r["step_branch"] * 1e3, 2),
          ratio(r["step_branch"], r["step_plain"]), num(r["switch_place"] * 1e3, 2),
          num((r["switch_merge"] - r["switch_place"]) / extra, 0) if extra > 0 else "never")
    t.notes.append("The unmerged design also needs programs exported with a LoRA input per layer and a fixed rank "
                   "buffer (a rank above it cannot run), its output differs from `runtime generate --lora` (merged), "
                   "and a CFG step runs the DiT twice: the branch is paid twice per step, per expert phase.")
    return t, r


# -- v6e ------------------------------------------------------------------------------------------------------------

def _shard(shape: tuple[int, ...], spec: list[Any], mesh: dict[str, int]) -> tuple[int, ...]:
    out = []
    for size, axes in zip(shape, list(spec) + [None] * (len(shape) - len(spec))):
        axes = [] if axes is None else [axes] if isinstance(axes, str) else list(axes)
        out.append(size // math.prod(mesh[x] for x in axes))
    return tuple(out)


def merge_child(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    """A switch's weights on one device: bf16 tensors of the shapes given (`shapes`: [shape, count] pairs), placed from
    host memory and merged with a rank-`rank` update each by the runtime's merge program (runtime/lora.py apply), as
    Bundle.set_loras does; the median wall time. One host copy per distinct shape serves every tensor of that shape."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from runtime import lora

    dev = jax.devices()[0]
    rep = NamedSharding(jax.sharding.Mesh(np.array([dev]), ("x",)), PartitionSpec())
    rng = np.random.default_rng(0)
    host, updates, names = {}, {}, []
    for shape, count in a["shapes"]:
        shape = tuple(shape)
        w = rng.standard_normal(shape, np.float32).astype(jnp.bfloat16)
        up = lora.Update(rng.standard_normal((a["rank"], shape[1]), np.float32) / np.sqrt(shape[1]),
                         rng.standard_normal((shape[0], a["rank"]), np.float32) * 1e-2, 1.0)
        for _ in range(count):
            name = f"t{len(names)}"
            names.append(name)
            host[name], updates[name] = w, [up]

    def switch() -> Any:
        return list(lora.apply({k: jax.device_put(v, rep) for k, v in host.items()}, updates).values())

    return {"seconds": _times({"switch": switch}, a["repeats"])["switch"], "device": str(dev.device_kind),
            "tensors": len(names), "bytes": sum(v.nbytes for v in host.values())}


def widths_13b() -> list[list[Any]]:
    """The 1.3B DiT's block linears (30 blocks): [shape, count] pairs."""
    return [[[1536, 1536], 8 * 30], [[8960, 1536], 30], [[1536, 8960], 30]]


def widths_table(a: argparse.Namespace) -> tuple[Table, dict[str, Any]]:
    r = spawn("lora:merge_child", {"shapes": widths_13b(), "rank": a.rank, "repeats": a.repeats}, device=a.device)
    t = Table(f"a switch's merge at the 1.3B's widths on {r['device']} (rank {a.rank}, 300 block linears, bf16)",
              ["tensors", "weights GB (host to device)", "s (median)", "GB/s of weights"])
    t.add(r["tensors"], num(r["bytes"] / 1e9, 2), num(r["seconds"], 3), num(r["bytes"] / 1e9 / r["seconds"], 1))
    t.notes.append("Each tensor placed from host memory (its unmodified copy) and merged by runtime/lora.py's program, "
                   "as Bundle.set_loras does; the adapters' A and B placed too.")
    return t, r


def v6e_table(a: argparse.Namespace) -> tuple[Table, dict[str, Any]]:
    from runtime import manifest as mf

    arch, res, frames, target = V6E
    out = a.work / "quantize-bytes" / f"{arch}-{target}-bf16"  # shared with `bench.py quantize`
    if not (out / "manifest.json").is_file():
        log(f"exporting {out}")
        export(["--model", arch, "--no-weights", "--resolution", res, "--frames", str(frames), "--target", target], out)
    m = mf.read(out)
    mesh = m.target.mesh
    wf = m.weights["transformer"]
    touched = block_linears(wf.tensors)
    per_device = {n: _shard(wf.tensors[n].shape, wf.partition.get(n, []), mesh) for n in touched}
    itemsize = _itemsize(wf.tensors[touched[0]].dtype)
    weights = sum(math.prod(s) for s in per_device.values()) * itemsize
    # A is split like W's columns, B like W's rows: the device's shard of each (float32, as adapters are stored)
    adapter = sum((a.rank * s[1] + s[0] * a.rank) * 4 for s in per_device.values())
    devices = math.prod(mesh.values())
    blocks = a.blocks or (40 if a.device == "cuda" else 2)
    first = [n for n in touched if n.startswith(tuple(f"blocks.{i}." for i in range(blocks)))]
    counts: dict[tuple[int, ...], int] = {}
    for n in first:
        counts[per_device[n]] = counts.get(per_device[n], 0) + 1
    r = spawn("lora:merge_child", {"shapes": [[list(k), v] for k, v in counts.items()], "rank": a.rank,
                                   "repeats": a.repeats}, device=a.device)
    scale = len(touched) / len(first)
    t = Table(f"one switch of the 14B on tpu-v6e-8 (dp=2, tp=4; bf16; rank {a.rank} on every block linear), per device",
              ["tensors changed", "weight bytes per device GB", "adapter bytes per device GB",
               "host-to-device per device GB", "host-to-device per host GB (8 devices)",
               f"one device's merge on {r['device']} s"])
    t.add(len(touched), num(weights / 1e9, 2), num(adapter / 1e9, 3), num((weights + adapter) / 1e9, 2),
          num((weights + adapter) * devices / 1e9, 1), num(r["seconds"] * scale, 2))
    t.notes.append(f"From the sharding rules of the exported programs ({out.name}): each device holds 1/4 of every "
                   "column- and row-parallel linear (tp=4) and the dp halves hold the same shards, so a host sends "
                   f"each shard twice. The merge timed: {blocks} of the 40 blocks' per-device tensors placed from host "
                   f"memory and merged by the runtime's program, times {scale:g}.")
    return t, {"per_device_weights": weights, "per_device_adapter": adapter, "tensors": len(touched), **r,
               "blocks": blocks}


# -- queue ----------------------------------------------------------------------------------------------------------

def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        body = r.read()
    return json.loads(body) if body[:1] in b"{[" else body.decode()


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _metric(text: str, name: str) -> float:
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


def queue_run(bund: Path, lora_dir: Path, affinity: int, jobs: int, steps: int, work: Path) -> dict[str, Any]:
    from .serve import _port, wait_ready

    port = _port()
    url = f"http://127.0.0.1:{port}"
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "server.log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", str(bund), "--port", str(port), "--jobs-dir",
                                 str(work / "jobs"), "--queue-size", str(jobs + 1), "--lora-dir", str(lora_dir),
                                 "--lora-affinity-max", str(affinity)], cwd=ROOT, env=child_env(), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc)
        sets = [[{"name": "A"}], [{"name": "B"}], []]
        t0 = time.perf_counter()
        ids = [_post(url + "/v1/videos", {"prompt": "a red fox", "num_inference_steps": steps, "seed": i,
                                          "lora": sets[i % 3]})["id"] for i in range(jobs)]
        pending = set(ids)
        while pending:
            for video_id in list(pending):
                if _get(f"{url}/v1/videos/{video_id}")["status"] in ("completed", "failed"):
                    pending.discard(video_id)
            time.sleep(0.2)
        wall = time.perf_counter() - t0
        metrics = _get(url + "/metrics")
        return {"wall": wall, "switches": _metric(metrics, "wan_aot_lora_switches_total"),
                "switch_seconds": _metric(metrics, "wan_aot_lora_switch_seconds_sum"),
                "failed": sum(_get(f"{url}/v1/videos/{i}")["status"] == "failed" for i in ids)}
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def queue_table(a: argparse.Namespace, bund: Path, lora_dir: Path) -> tuple[Table, dict[str, Any]]:
    runs: dict[int, list[dict[str, Any]]] = {0: [], 4: []}
    for i in range(a.repeats):
        for affinity in runs:
            log(f"queue: --lora-affinity-max {affinity}, round {i + 1}")
            runs[affinity].append(queue_run(bund, lora_dir, affinity, a.jobs, a.steps,
                                            a.work / "lora" / f"queue-{affinity}-{i}"))
    t = Table(f"a mixed queue on one server: {a.jobs} jobs A, B, none, A, B, none, ... sent at once, the 1.3b workload "
              f"({a.dtype[0]}, {a.steps} steps, rank {a.rank})",
              ["--lora-affinity-max", "jobs per minute", "vs in turn", "switches", "seconds switching"])
    base = median([60 * a.jobs / r["wall"] for r in runs[0]])
    for affinity, rs in runs.items():
        jpm = median([60 * a.jobs / r["wall"] for r in rs])
        t.add(f"{affinity}" + (" (strictly in turn)" if affinity == 0 else " (the default)"), num(jpm, 2),
              ratio(jpm, base), num(median([r["switches"] for r in rs]), 0),
              num(median([r["switch_seconds"] for r in rs]), 1))
    t.notes.append("The first job is claimed as it arrives (the set it needs is a switch either way); the others "
                   "queue behind it. No job failed." if all(r["failed"] == 0 for rs in runs.values() for r in rs)
                   else "Some jobs failed: see the server logs under --work.")
    return t, {"runs": runs}


def run(a: argparse.Namespace) -> Report:
    tables, raw = [], {}
    bund = lora_dir = None
    if {"switch", "queue"} & set(a.what):
        bund = bundle(a.work, WORKLOADS[a.workload[0]], a.dtype[0], "cpu")
        lora_dir = a.work / "lora" / f"adapters-{bund.name}-r{a.rank}"
        for seed, name in enumerate("AB"):
            if not (lora_dir / f"{name}.safetensors").is_file():
                write_adapter(bund, lora_dir / f"{name}.safetensors", seed, a.rank)
    for what, make in (("switch", lambda: switch_table(a, bund, lora_dir)), ("widths", lambda: widths_table(a)),
                       ("designs", lambda: designs_table(a)),
                       ("v6e", lambda: v6e_table(a)), ("queue", lambda: queue_table(a, bund, lora_dir))):
        if what in a.what:
            log(f"measuring {what}")
            t, raw[what] = make()
            tables.append(t)
    return Report(tables, raw)
