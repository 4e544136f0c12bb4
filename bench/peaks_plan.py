"""What the deployment plan decides under a 24 GiB cap for each limits file, with the committed
table alone and with the decode peaks measured on this device (`bench/peaks_device.sh`), or, with
`--cache FILE`, with a recorded measurement (no device needed: the plan is torch-free).

    python3 bench/peaks_plan.py MODEL_DIR LIMITS_DIR OUT.json [--cache bench/results/peaks-...-cache.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dlo.plan.deployment import PlanAsk, plan_folder
from dlo.plan.limits import Limits
from dlo.plan.measured import MeasuredPeaks, load_peaks
from dlo.plan.profile import Accelerator, NodeProfile

H100_BYTES = 81559 * 2**20  # what the recorded device reported (nvidia-smi)


def main(model: Path, limits_dir: Path, out: Path, cache: Path | None = None) -> int:
    if cache is not None:
        peaks = MeasuredPeaks.from_json(cache.read_text(), str(cache))
        host = NodeProfile(accelerator=Accelerator(vendor="nvidia", model=peaks.device, count=1, memory_bytes=H100_BYTES))
    else:
        from dlo.engine.peaks import device_name, library_versions
        from dlo.serving.host import local_profile

        host = local_profile("cuda")
        peaks = load_peaks(model, device_name("cuda:0"), library_versions())
    rows = []
    for f in sorted(limits_dir.glob("*.json")):
        limits = Limits.load(f)
        for label, measured in (("table", {}), ("measured", dict(peaks.points) if peaks else {})):
            ask = PlanAsk(mode="rank-local", device="cuda", max_device_memory=24 * 2**30, resident_blocks="auto",
                          measured=measured)
            p = plan_folder(model, ask, profile=host, limits=limits, device_memory=host.accelerator.memory_bytes)
            rows.append({"limits": f.name, "peaks": label, "vae_tile_above_pixels": p.vae_tile_above_pixels,
                         "tiling_reason": p.tiling_reason, "predicted_peak_bytes": dict(p.peaks)})
            print(f"{f.name} {label}: {p.describe()}\n  {p.tiling_reason}")
    out.write_text(json.dumps({"device_name": peaks.device if peaks else "", "device": peaks.device if peaks else "",
                               "measured_on_this_host": cache is None,
                               "versions": peaks.versions if peaks else "",
                               "plans": rows}, indent=1))
    return 0


if __name__ == "__main__":
    cache_at = sys.argv.index("--cache") if "--cache" in sys.argv else None
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]),
                  Path(sys.argv[cache_at + 1]) if cache_at else None))
