"""dlo.delivery never imports torch (it runs in fetch Jobs and beside the operator); its URI module,
which the operator imports, loads nothing but the standard library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_no_delivery_module_imports_torch() -> None:
    mods = loaded_after("import dlo.delivery.cli, dlo.delivery.fetch, dlo.delivery.s3, dlo.delivery.hf, "
                        "dlo.delivery.cache, dlo.delivery.staging, dlo.delivery.progress")
    assert "torch" not in mods


def test_the_operator_and_the_uri_module_stay_torch_free_and_sdk_free() -> None:
    assert not {"torch", "boto3", "botocore", "huggingface_hub", "pydantic"} & loaded_after("import dlo.delivery.uri")
    mods = loaded_after("import dlo.operator.handlers, dlo.operator.reconcile, dlo.operator.delivery_run")
    assert not {"torch", "boto3", "huggingface_hub"} & mods
