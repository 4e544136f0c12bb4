#!/usr/bin/env bash
# The device prelude: every GPU call of the benchmarks runs its command through this script, from the
# repository root, with the wheel set of the lock carried as `.whl/` (built here by `python -m bench
# wheels`; `python -m bench stamp` writes the commit into it):
#   bash bench/device.sh python -m bench SUITE ...
# It makes a private environment that holds exactly the lock's packages (engine.lock: the set the
# engine image installs): a venv without the device's site-packages, the carried wheels installed
# into it (bytecode compiled, as pip does in the image), every other locked distribution (torch and
# its CUDA libraries, preinstalled on the device) linked from the device's python, dlo and bench
# linked from this checkout. Packages the lock does not name (scipy, pandas, torchvision, ...) are
# not visible. NVLink multicast is turned off for every process (the lent hosts' rule). Then it
# prints the card and what differs from the lock, and runs the command; every record the command
# writes carries the same facts in its `provenance`.
set -euo pipefail
VENV=${DLO_BENCH_VENV:-/tmp/dlo-bench-venv}
PY=${DLO_BENCH_PYTHON:-python3}
[ -d .whl ] || { echo "device.sh: no .whl/ here (build it with: python -m bench wheels)" >&2; exit 2; }
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --without-pip "$VENV"
  SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$PY" -m pip install -q --no-index --no-deps --no-cache-dir --target "$SITE" .whl/*.whl
  "$PY" -m bench.lib.device_env "$SITE" > "$VENV/prepared.json"
fi
export PATH="$VENV/bin:$PATH" PYTHONUNBUFFERED=1
eval "$(python -c 'from bench._env import MULTICAST_OFF as M; print(" ".join(f"export {k}={v}" for k, v in M.items()))')"
python -c 'import json, sys; p = json.load(open(sys.argv[1])); print("device.sh:", {k: v for k, v in p.items() if k != "installed" and v})' "$VENV/prepared.json"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
[ $# -eq 0 ] || exec "$@"
