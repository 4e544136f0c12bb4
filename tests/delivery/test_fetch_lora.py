"""`dlo fetch --kind lora`: a folder of LoRA adapters (what `dlo serve --lora-dir` and the operator's
`spec.lora.uri` take) fetched from moto's S3 server with the real boto3 client, and refused, with
nothing left at DEST, when its top holds no adapter."""

from __future__ import annotations

import pytest

from dlo.delivery.adapters import adapter_entries
from dlo.delivery.staging import staging_dir
from tests.delivery.conftest import dlo_fetch, files_of, result_of, upload

pytestmark = pytest.mark.slow


def test_adapter_entries_are_what_the_engine_takes_from_the_folders_top():
    paths = ["style.safetensors", "ink/pytorch_lora_weights.safetensors", "README.md", ".hidden.safetensors",
             "deep/below/x.safetensors", "notes/readme.txt", ".safetensors"]
    assert adapter_entries(paths) == ["ink", "style"]
    assert adapter_entries(["deep/below/x.safetensors", "README.md"]) == []


def test_an_adapters_folder_is_fetched_and_only_with_kind_lora(s3, tmp_path):
    src = tmp_path / "src"
    (src / "ink").mkdir(parents=True)
    (src / "style.safetensors").write_bytes(b"\x08" + bytes(200))
    (src / "ink" / "pytorch_lora_weights.safetensors").write_bytes(b"\x09" + bytes(300))
    (src / "README.md").write_text("two adapters")
    upload(s3.client(), src, "adapters", "wan")
    dest = tmp_path / "cache" / ".lora" / "wan"
    as_model = dlo_fetch("s3://adapters/wan", str(dest), "--endpoint", s3.url, env=s3.env())
    assert as_model.returncode == 2 and "no model_index.json" in as_model.stderr  # the default kind: a pipeline
    fetched = dlo_fetch("s3://adapters/wan/", str(dest), "--kind", "lora", "--endpoint", s3.url, "--json", env=s3.env())
    assert fetched.returncode == 0, fetched.stderr
    assert result_of(fetched)["state"] == "complete" and files_of(dest) == files_of(src)
    again = dlo_fetch("s3://adapters/wan", str(dest), "--kind", "lora", "--endpoint", s3.url, "--json", env=s3.env())
    assert again.returncode == 0 and result_of(again)["already_complete"] is True


def test_a_source_without_an_adapter_at_its_top_is_refused_and_nothing_is_left(s3, tmp_path):
    src = tmp_path / "src"
    (src / "deep" / "below").mkdir(parents=True)
    (src / "deep" / "below" / "x.safetensors").write_bytes(bytes(100))
    (src / "README.md").write_text("adapters elsewhere")
    upload(s3.client(), src, "adapters", "nested")
    dest = tmp_path / "cache" / ".lora" / "nested"
    proc = dlo_fetch("s3://adapters/nested", str(dest), "--kind", "lora", "--endpoint", s3.url, env=s3.env())
    assert proc.returncode == 2, proc.stderr
    assert "refused" in proc.stderr and "is not a folder of LoRA adapters" in proc.stderr
    assert not dest.exists() and not staging_dir(dest).exists()
