#!/usr/bin/env bash
# The device prelude: every GPU call of the benchmarks runs its command through this script, from the
# repository root:
#   bash bench/device.sh python -m bench SUITE ...
# The wheel set of the lock (requirements/engine.lock, the set the engine image installs) comes in the
# folders `python -m bench wheels` writes here (.whl, .whl-2, ...; one fits a call's carry): carry them
# one a call; each call gathers what it brought into a store that outlives the call on the device, and
# once the set is whole, the first call makes a private environment that holds exactly the lock's
# packages: a venv without the device's site-packages, the wheels installed into it (bytecode compiled,
# as pip does in the image), every other locked distribution (torch and its CUDA libraries,
# preinstalled on the device) linked from the device's python, dlo and bench linked from this
# checkout. Packages the lock does not name (scipy, pandas, torchvision, ...) are not visible. NVLink
# multicast is turned off for every process (the lent hosts' rule). Then it prints the card and what
# differs from the lock, and runs the command; every record the command writes carries the same facts
# in its `provenance`. Exit 3: a part of the wheel set has not been carried yet.
set -euo pipefail
VENV=${DLO_BENCH_VENV:-/tmp/dlo-bench-venv}
STORE=${DLO_BENCH_WHEELS:-/tmp/dlo-bench-wheels}
PY=${DLO_BENCH_PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  compgen -G ".whl*/MANIFEST.json" > /dev/null || { echo "device.sh: no .whl/ here (python -m bench wheels)" >&2; exit 2; }
  "$PY" -m bench.lib.device_env gather "$STORE" .whl* || exit $?
  "$PY" -m venv --without-pip "$VENV.partial"
  SITE=$("$VENV.partial/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$PY" -m pip install -q --no-index --no-deps --no-cache-dir --target "$SITE" "$STORE"/*.whl
  "$PY" -m bench.lib.device_env site "$SITE" > "$VENV.partial/prepared.json"
  mv "$VENV.partial" "$VENV"
fi
export PATH="$VENV/bin:$PATH" PYTHONUNBUFFERED=1
eval "$(python -c 'from bench._env import MULTICAST_OFF as M; print(" ".join(f"export {k}={v}" for k, v in M.items()))')"
python -c 'import json, sys; p = json.load(open(sys.argv[1])); print("device.sh:", {k: v for k, v in p.items() if k != "installed" and v})' "$VENV/prepared.json"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
[ $# -eq 0 ] || exec "$@"
