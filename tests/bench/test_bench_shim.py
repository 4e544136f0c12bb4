"""The GPU benches import `dlo` from a plain checkout (the device machine installs nothing): the
shim must link every top-level package pyproject.toml maps, or `dlo serve` fails at its imports."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_shim_makes_every_dlo_package_importable_without_an_install(tmp_path: Path) -> None:
    # -S: no site processing, so the installed (editable) dlo's finder is not loaded and the shim is used;
    # the third-party packages come from site-packages on PYTHONPATH (a .pth file there is not read)
    import sysconfig

    code = ("import sys; sys.path.insert(0, 'bench'); import wan_bench; wan_bench.ensure_dlo_importable(); "
            "import dlo.serving.options, dlo.delivery.uri, dlo.operator, dlo.cli.args, dlo.agent; "
            "print(dlo.serving.options.__file__)")
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": sysconfig.get_paths()["purelib"]})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().startswith(str(tmp_path / "dlo_shim")), r.stdout
