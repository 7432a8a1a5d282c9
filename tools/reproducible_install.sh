#!/usr/bin/env bash
# Do two fresh installs from requirements/export.lock export byte-identical bundles? This checkout's HEAD commit
# (git archive: committed files only) is installed twice, each time into a new venv from the lock (pip's cache off,
# so each downloads and hash-checks its own files) and as a regular, not editable, package; each venv then exports
# the README's first bundle (the embedded tiny model, 256x144, 17 frames) from a directory of its own, and every
# file of the two bundles is compared by sha256. Not a test: it installs (about 1.5 min and 1 GB a venv here).
#
#   tools/reproducible_install.sh [WORKDIR]     # default: a new directory under /tmp; prints the result last
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d /tmp/wan-aot-reproduce-XXXXXX)}
mkdir -p "$work"
commit=$(git -C "$root" rev-parse --short HEAD)
rm -rf "$work/src" && mkdir "$work/src"
git -C "$root" archive HEAD | tar -x -C "$work/src"
for i in 1 2; do
    venv="$work/venv$i"
    rm -rf "$venv" "$work/run$i"
    start=$(date +%s)
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --no-cache-dir -r "$work/src/requirements/export.lock"
    "$venv/bin/pip" install -q --no-cache-dir --no-deps "$work/src"
    installed=$(($(date +%s) - start))
    mkdir "$work/run$i"  # not the source tree: the installed package is what runs
    (cd "$work/run$i" && JAX_PLATFORMS=cpu "$venv/bin/python" -m export --model tiny --resolution 256x144 \
        --frames 17 --out bundle -q)
    (cd "$work/run$i/bundle" && find . -type f -print0 | sort -z | xargs -0 sha256sum) > "$work/sha256-$i.txt"
    echo "install $i: ${installed} s; $("$venv/bin/python" -c 'import jax, torch, transformers, diffusers;
print("jax", jax.__version__, "torch", torch.__version__, "transformers", transformers.__version__,
"diffusers", diffusers.__version__)')"
done
files=$(wc -l < "$work/sha256-1.txt")
bytes=$(du -sb "$work/run1/bundle" | cut -f1)
bundle_id=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["bundle_id"])' \
    "$work/run1/bundle/manifest.json")
if cmp -s "$work/sha256-1.txt" "$work/sha256-2.txt"; then
    echo "commit $commit: two installs from requirements/export.lock exported identical bundles: $files files," \
         "$bytes bytes, every sha256 equal (bundle $bundle_id)"
else
    echo "commit $commit: the bundles differ:"
    diff "$work/sha256-1.txt" "$work/sha256-2.txt" || true
    exit 1
fi
