#!/usr/bin/env bash
# Decode peaks measured on the device by the product itself (`dlo calibrate --peaks`, issue 54 item 1),
# against the committed table's predictions, and what the plan decides with each under a 24 GiB cap.
# One device call, from the repository root, with the wheels folder `.whl` carried (diffusers 0.42.1,
# transformers, pydantic and their requirements: see bench/results/peaks-*.txt for the set):
#   bash bench/peaks_device.sh $OUT
# The model: Wan2.1-T2V-14B's pipeline with real VAE weights' shapes (random values) and a 2-block
# transformer and text encoder (the decode does not depend on them).
set -uo pipefail
OUT=${1:-/tmp/peaks-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -c "import sys; sys.path.insert(0, 'bench'); import wan_bench; wan_bench.ensure_dlo_importable()" || exit 1
export PYTHONPATH=/tmp/dlo_shim:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__, torch.cuda.get_device_name(0))"
M=/tmp/models/wan
[ -d $M ] || python3 -m dlo.cli.main make-random-model $M --preset wan2.1-t2v-14b --layers 2 --device cuda --no-progress || exit 1
L=/tmp/limits; mkdir -p $L
echo '{"max_width": 832, "max_height": 480, "max_frames": 81, "max_n": 1, "default_size": "832x480"}' > $L/a.json
echo '{"max_width": 1280, "max_height": 720, "max_frames": 81, "max_n": 1, "default_size": "832x480"}' > $L/b.json
echo '{"max_width": 832, "max_height": 832, "max_frames": 1, "max_n": 4, "default_size": "832x480"}' > $L/c.json
echo '{"max_width": 1024, "max_height": 1024, "max_frames": 1, "max_n": 4, "default_size": "832x480"}' > $L/d.json
echo '{"max_width": 1920, "max_height": 1088, "max_frames": 1, "max_n": 1, "default_size": "832x480"}' > $L/e.json
for f in a b c d e; do
  echo "== limits $f: $(cat $L/$f.json)"
  timeout 150 python3 -m dlo.cli.main calibrate --peaks $M --limits $L/$f.json --deadline 120 2>&1 | grep -v "^Loading\|it/s"
done
cp $M/.dlo-peaks/*.json "$OUT/" 2>/dev/null
python3 bench/peaks_plan.py $M $L "$OUT/plans.json"
