"""Peak host memory while placing sharded weights: the runtime's per-device loader vs load-then-place.

Writes the real Wan2.1-T2V-1.3B DiT tensors (names, shapes, dtypes from the
architecture; random values) to a safetensors file once, then in a fresh process per
method places them on N fake CPU devices with the DiT's partition rules for the mesh:

  runtime       runtime.weights.load_file: the file mapped, each device's slice cut from the mapping
                (one device: the mapped tensors themselves)
  load-then-put every tensor read whole into host memory, then jax.device_put

CPU "devices" live in host memory too, so the placed arrays themselves are in RSS
after loading; what the loader costs is the peak above that (transient). Anonymous
memory (RssAnon) is reported separately from file-backed pages (mmap of the file,
which the kernel can drop at any time).

    python tools/bench_weight_loading.py [--arch wan2.1-t2v-1.3b] [--mesh dp=2,sp=1,tp=4] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class Sampler(threading.Thread):
    """Peak RssAnon and VmRSS of this process, sampled every millisecond."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_anon = self.peak_rss = 0
        self.running = True

    def run(self) -> None:
        while self.running:
            self.peak_anon = max(self.peak_anon, _status_kb("RssAnon"))
            self.peak_rss = max(self.peak_rss, _status_kb("VmRSS"))
            time.sleep(0.001)


def write_weights(path: Path, arch: str, dtype: str) -> dict[str, list]:
    """Random weights with the architecture's DiT names/shapes; returns {name: [shape, dtype]}."""
    import torch

    from export import weights as writer
    from export.source import load

    src = load(arch, dtype, weights=False)
    module = src.load_transformer()
    tensors: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.device.type == "meta":
            t = (torch.randn(t.shape, generator=gen, dtype=torch.float32) * 0.02).to(t.dtype)
        tensors[name] = t
    writer.write(path, tensors)
    return {k: [list(t.shape), str(t.dtype).removeprefix("torch.")] for k, t in tensors.items()}


def measure(method: str, path: Path, index: dict[str, list], mesh_sizes: dict[str, int]) -> dict[str, float]:
    """Runs in a fresh process with the fake devices already configured."""
    import jax
    import ml_dtypes  # noqa: F401
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    from export import sharding
    from runtime import manifest as mf
    from runtime import weights as wio

    names = tuple(mesh_sizes)
    mesh = Mesh(np.array(jax.devices()).reshape(tuple(mesh_sizes.values())), names)
    shardings = {k: NamedSharding(mesh, sharding.partition("wan_transformer", k, tuple(s), mesh_sizes))
                 for k, (s, _) in index.items()}
    expected = {k: (tuple(s), np.dtype(d)) for k, (s, d) in index.items()}
    base_anon, base_rss = _status_kb("RssAnon"), _status_kb("VmRSS")
    sampler = Sampler()
    sampler.start()
    t0 = time.perf_counter()
    if method == "runtime":
        arrays = wio.load_file(path, mf.FileRef(path.name, ""), None, shardings, expected, lambda name, entry: None)
    else:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            host = {k: np.asarray(f.get_slice(k)[:]) for k in expected}
        arrays = {k: jax.device_put(v, shardings[k]) for k, v in host.items()}
        del host
    jax.block_until_ready(arrays)
    seconds = time.perf_counter() - t0
    time.sleep(0.05)
    sampler.running = False
    sampler.join()
    placed = sum(s.data.nbytes for a in arrays.values() for s in a.addressable_shards)
    largest = max(np.prod(s) * np.dtype(d).itemsize for s, d in expected.values())
    largest_shard = max(s.data.nbytes for a in arrays.values() for s in a.addressable_shards)
    mib = 1 / 1024
    return {"seconds": seconds, "placed_mib": placed / 2**20, "largest_tensor_mib": largest / 2**20,
            "largest_shard_mib": largest_shard / 2**20,
            "peak_anon_mib": (sampler.peak_anon - base_anon) * mib,
            "final_anon_mib": (_status_kb("RssAnon") - base_anon) * mib,
            "peak_rss_mib": (sampler.peak_rss - base_rss) * mib}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="wan2.1-t2v-1.3b")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--mesh", default="dp=2,sp=1,tp=4")
    p.add_argument("--workdir", type=Path, default=None, help="where to write the weights (default: a temp dir)")
    p.add_argument("--child", nargs=2, metavar=("METHOD", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()

    from runtime.targets import parse_mesh

    mesh = parse_mesh(args.mesh)
    if args.child:
        method, d = args.child
        index = json.loads((Path(d) / "index.json").read_text())
        print(json.dumps(measure(method, Path(d) / "weights.safetensors", index, mesh)))
        return

    n = 1
    for v in mesh.values():
        n *= v
    with tempfile.TemporaryDirectory(dir=args.workdir) as d:
        t0 = time.perf_counter()
        index = write_weights(Path(d) / "weights.safetensors", args.arch, args.dtype)
        (Path(d) / "index.json").write_text(json.dumps(index))
        size = (Path(d) / "weights.safetensors").stat().st_size
        print(f"{args.arch} DiT, {args.dtype}: {len(index)} tensors, {size / 2**30:.2f} GiB "
              f"(written in {time.perf_counter() - t0:.0f} s); mesh {args.mesh} on {n} fake CPU devices")
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
        rows = {}
        for method in ("runtime", "load-then-put"):
            out = subprocess.run([sys.executable, __file__, "--mesh", args.mesh, "--child", method, d], env=env,
                                 capture_output=True, text=True, check=True).stdout
            rows[method] = json.loads(out.strip().splitlines()[-1])
    r = rows["runtime"]
    print(f"placed on devices: {r['placed_mib']:.0f} MiB (replicated tensors once per device); "
          f"largest tensor {r['largest_tensor_mib']:.1f} MiB, largest shard {r['largest_shard_mib']:.1f} MiB")
    print(f"{'method':<15}{'seconds':>9}{'peak anon':>12}{'final anon':>12}{'transient':>11}{'peak RSS':>10}")
    for method, m in rows.items():
        transient = max(0.0, m["peak_anon_mib"] - m["final_anon_mib"])
        print(f"{method:<15}{m['seconds']:>9.1f}{m['peak_anon_mib']:>11.0f}M{m['final_anon_mib']:>11.0f}M"
              f"{transient:>10.0f}M{m['peak_rss_mib']:>9.0f}M")
    lt = rows["load-then-put"]
    print(f"peak anonymous memory, runtime / load-then-put: {r['peak_anon_mib'] / lt['peak_anon_mib']:.2f}; "
          f"transient above the placed arrays: {max(0.0, r['peak_anon_mib'] - r['final_anon_mib']):.0f} MiB vs "
          f"{lt['peak_anon_mib'] - lt['final_anon_mib']:.0f} MiB")

if __name__ == "__main__":
    main()
