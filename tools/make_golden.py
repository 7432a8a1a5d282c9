"""Freeze a golden bundle: the embedded tiny model exported by this code, plus the output of a fixed generation.

    python tools/make_golden.py                 # -> artifacts/golden/schema-<N>/ (N: this code's schema)

Golden bundles are never regenerated: each one is what its exporter wrote, and
tests/test_golden.py checks that the current runtime still reads it and reproduces its
recorded output. Run this once for each new manifest schema version (after adding the
migration from the previous one), and commit the directory.

It uses whichever `export` and `runtime` packages Python imports, so an older checkout on
PYTHONPATH freezes an older format (that is how schema-1 was made, from commit 9444d60).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# A small, fixed workload: 32x32 pixels, 5 frames, 16 prompt tokens, fp32, 3 steps.
EXPORT_ARGS = ["--model", "tiny", "--resolution", "32x32", "--frames", "5", "--max-sequence-length", "16",
               "--dtype", "fp32"]
GENERATION = {"prompt": "a golden retriever surfing a wave at sunset", "negative_prompt": "blurry", "seed": 42,
              "steps": 3, "guidance": 4.0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="default: artifacts/golden/schema-<N>")
    p.add_argument("--quantize", default=None, help="export with --quantize MODE (schema 8's golden is int8)")
    p.add_argument("--defaults", default=None, help="export with --defaults KEY=VALUE,... (schema 9's golden samples "
                                                    "with euler at flow shift 5 by default)")
    p.add_argument("--precompile", action="store_true", help="export with --precompile (schema 11's golden holds "
                                                              "executables; a host whose key differs compiles)")
    args = p.parse_args()
    export_args = EXPORT_ARGS + (["--quantize", args.quantize] if args.quantize else []) \
        + (["--defaults", args.defaults] if args.defaults else []) + (["--precompile"] if args.precompile else [])

    import runtime
    from runtime import manifest as mf

    code = Path(runtime.__file__).resolve().parents[1]
    out = (args.out or ROOT / "artifacts" / "golden" / f"schema-{mf.SCHEMA_VERSION}").resolve()
    if out.exists():
        print(f"error: {out} exists; golden bundles are frozen (delete it by hand to re-make it)", file=sys.stderr)
        return 2
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(code)}
    subprocess.run([sys.executable, "-m", "export", *export_args, "--out", str(tmp / "bundle"), "-q"], cwd=code,
                   env=env, check=True)

    pipe = runtime.load(tmp / "bundle")
    embeds = pipe.encode(GENERATION["prompt"], GENERATION["negative_prompt"])
    latents = pipe.denoise(embeds, seed=GENERATION["seed"], steps=GENERATION["steps"],
                           guidance=GENERATION["guidance"], progress=False)
    frames = pipe.decode(latents)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=code, capture_output=True, text=True).stdout.strip()
    import jax
    from safetensors.numpy import save_file

    meta = {"generation": json.dumps(GENERATION, sort_keys=True), "commit": commit, "jax": jax.__version__,
            "schema_version": str(mf.SCHEMA_VERSION), "bundle_id": pipe.manifest.bundle_id}
    tensors = {"latents": latents, "frames": frames}
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, str(tmp / "expected.safetensors"),
              metadata=meta)
    tmp.rename(out)
    print(f"wrote {out} (bundle {pipe.manifest.bundle_id}, commit {commit[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
