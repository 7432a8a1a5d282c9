# A precompiled bundle's cold start on a machine with the accelerator (BENCHMARKS section 16, cuda), where only the
# runtime's packages are installed (not torch: `export.precompile` is imported directly).
#   bash tools/device/precompiled.sh DIR     # DIR/plain: a bundle exported for the target (e.g. --target cuda)
# Extra pure-Python packages that machine lacks (ftfy, wcwidth) may be carried in DIR/pylib.
set -e
ROOT=$(pwd); DIR=$(cd "$1" && pwd); cd "$DIR"; export PYTHONPATH=$ROOT:$DIR/pylib
python -c "import jax; print('jax', jax.__version__, jax.devices())"
rm -rf pre && cp -r plain pre
python -c "
import time; from pathlib import Path
from export.precompile import precompile
t = time.time(); m = precompile(Path('pre'))
files = {e.file: e for e in m.executables}.values()
print('precompile s', round(time.time() - t, 1), 'files', len(files), 'MB', round(sum(e.bytes for e in files) / 1e6, 2))
print('key', m.executables[0].key)"
for i in 1 2; do for b in plain pre; do
  python "$ROOT/tools/device/cold_start.py" $b /tmp/cache_$b$i out_$b$i.npy 2>err_$b$i.log | tail -1
  grep -i "not loading\|Error" err_$b$i.log | tail -3 || true
done; done
python -c "
import numpy as np
a = {f'{b}{i}': np.load(f'out_{b}{i}.npy') for b in ('plain', 'pre') for i in (1, 2)}
print('max |plain1-pre1|', float(np.abs(a['plain1'] - a['pre1']).max()), '|pre1-pre2|',
      float(np.abs(a['pre1'] - a['pre2']).max()), '|plain1-plain2|', float(np.abs(a['plain1'] - a['plain2']).max()))"
