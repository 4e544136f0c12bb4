"""dlo.agent.modelcheck: each way a model folder breaks gets its reason; sound folders get none."""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import time
from pathlib import Path

import pytest

from dlo.agent.modelcheck import MAX_MESSAGE_CHARS, REASONS, ModelError, check_folder
from dlo.agent.topology import model_folders

from .conftest import write_safetensors, write_wan_folder

WEIGHTS = Path("transformer") / "diffusion_pytorch_model.safetensors"


def cut(path: Path, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def test_a_sound_folder_has_no_error(models_root: Path) -> None:
    assert check_folder(models_root / "tiny-wan") is None
    (m,) = model_folders(models_root)
    assert m.error is None and m.facts is not None and m.resident_ratio == 1.0


def test_file_cut_in_its_data_is_truncated(tmp_path: Path) -> None:
    folder = write_wan_folder(tmp_path / "m")
    path = folder / WEIGHTS
    cut(path, path.stat().st_size - 100)
    err = check_folder(folder)
    assert err is not None and err.reason == "truncated" and str(path) in err.message


@pytest.mark.parametrize("keep", [0, 5, 20])  # empty, inside the length prefix, inside the header
def test_file_cut_before_its_data_is_truncated(tmp_path: Path, keep: int) -> None:
    folder = write_wan_folder(tmp_path / "m")
    cut(folder / WEIGHTS, keep)
    assert check_folder(folder) == ModelError("truncated", check_folder(folder).message)  # type: ignore[union-attr]


def test_vae_file_truncated_breaks_the_pipeline_too(tmp_path: Path) -> None:
    folder = write_wan_folder(tmp_path / "m")
    vae = folder / "vae" / "diffusion_pytorch_model.safetensors"
    cut(vae, vae.stat().st_size - 8)
    err = check_folder(folder)
    assert err is not None and err.reason == "truncated" and "vae" in err.message


def test_header_that_is_not_json_is_a_bad_header(tmp_path: Path) -> None:
    folder = write_wan_folder(tmp_path / "m")
    path = folder / WEIGHTS
    data = bytearray(path.read_bytes())
    data[8] = ord("#")  # the header's first byte
    path.write_bytes(bytes(data))
    err = check_folder(folder)
    assert err is not None and err.reason == "bad_header"


def test_unknown_dtype_is_a_bad_header(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    write_wan_folder(folder)
    header = json.dumps({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}}).encode()
    (folder / WEIGHTS).write_bytes(struct.pack("<Q", len(header)) + header + b"xx")
    assert check_folder(folder).reason == "bad_header"  # type: ignore[union-attr]


def test_unreadable_file_is_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = write_wan_folder(tmp_path / "m")
    target = folder / WEIGHTS
    from dlo.engine.checkpoint import open_regular as real_open

    def denying_open(file, *args, **kwargs):  # as a file mode 000 is to a non-root reader
        if Path(file) == target:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("dlo.engine.checkpoint.open_regular", denying_open)
    err = check_folder(folder)
    assert err is not None and err.reason == "unreadable" and "Permission denied" in err.message


def test_missing_config_is_no_config(tmp_path: Path) -> None:
    folder = write_wan_folder(tmp_path / "m")
    (folder / "transformer" / "config.json").unlink()
    assert check_folder(folder).reason == "no_config"  # type: ignore[union-attr]
    (folder / "transformer" / "config.json").write_text("{not json")
    assert check_folder(folder).reason == "no_config"  # type: ignore[union-attr]


@pytest.mark.parametrize("config", [{"architectures": 5}, {"architectures": []}, {"_class_name": ["Wan"]},
                                    {"architectures": [{"x": 1}]}])
def test_config_whose_class_fields_have_the_wrong_type_is_a_bad_config(tmp_path: Path, config: object) -> None:
    folder = write_wan_folder(tmp_path / "models" / "m")
    (folder / "transformer" / "config.json").write_text(json.dumps(config))
    err = check_folder(folder)
    assert err is not None and err.reason == "bad_config" and "config.json" in err.message
    (m,) = model_folders(tmp_path / "models")  # the scan flags it instead of raising
    assert m.error == err and m.facts is None


def test_config_of_another_kind_of_model_is_not_broken(tmp_path: Path) -> None:
    """A class DLO has no family for (another engine's model) has no facts, and no error."""
    root = tmp_path / "models"
    write_wan_folder(root / "other")
    (root / "other" / "transformer" / "config.json").write_text(json.dumps({"architectures": ["Llama"]}))
    (m,) = model_folders(root)
    assert m.error is None and m.facts is None


def sharded_folder(folder: Path) -> Path:
    t = folder / "transformer"
    t.mkdir(parents=True)
    (t / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
    write_safetensors(t / "a.safetensors", {"blocks.0.attn1.to_q.weight": ("BF16", [8, 8])})
    write_safetensors(t / "b.safetensors", {"blocks.1.attn1.to_q.weight": ("BF16", [8, 8])})
    (t / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "blocks.0.attn1.to_q.weight": "a.safetensors", "blocks.1.attn1.to_q.weight": "b.safetensors"}}))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    return folder


def test_shard_named_by_the_index_but_absent_is_missing_shard(tmp_path: Path) -> None:
    folder = sharded_folder(tmp_path / "m")
    (m,) = model_folders(tmp_path)
    assert m.error is None and m.facts is not None and m.facts.blocks == 2
    (folder / "transformer" / "b.safetensors").unlink()
    err = check_folder(folder)
    assert err is not None and err.reason == "missing_shard" and "b.safetensors" in err.message


def test_folder_with_an_index_and_no_shard_at_all_is_a_model_with_missing_shards(tmp_path: Path) -> None:
    folder = sharded_folder(tmp_path / "m")
    for f in (folder / "transformer").glob("*.safetensors"):
        f.unlink()  # a download that stopped after the small files
    (m,) = model_folders(tmp_path)
    assert m.error is not None and m.error.reason == "missing_shard"


def test_index_that_disagrees_with_its_shards_is_a_bad_index(tmp_path: Path) -> None:
    folder = sharded_folder(tmp_path / "m")
    index = folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {  # blocks.1 is in b.safetensors, not where the index says
        "blocks.0.attn1.to_q.weight": "a.safetensors", "blocks.1.attn1.to_q.weight": "a.safetensors"}}))
    (m,) = model_folders(tmp_path)
    assert m.error is not None and m.error.reason == "bad_index" and m.facts is None
    index.write_text("[]")
    assert check_folder(folder).reason == "bad_index"  # type: ignore[union-attr]


def test_pipeline_without_transformer_weights_is_missing_shard(tmp_path: Path) -> None:
    folder = write_wan_folder(tmp_path / "m")
    (folder / WEIGHTS).unlink()
    assert check_folder(folder).reason == "missing_shard"  # type: ignore[union-attr]


def test_every_reason_is_reachable_and_messages_stay_short(tmp_path: Path) -> None:
    assert len(set(REASONS)) == len(REASONS) == 8
    long = ModelError.of("truncated", "x" * 10_000)
    assert len(long.message) == MAX_MESSAGE_CHARS and long.message.endswith("...")


def test_check_reads_headers_only_whatever_the_file_size(tmp_path: Path) -> None:
    """A 1 TiB sparse file (`truncate -s`) whose header is sound, and one whose header promises more
    than the file holds: each checked in milliseconds (no tensor data is read)."""
    t = tmp_path / "m"  # a transformer folder on its own (no pipeline around it)
    t.mkdir(parents=True)
    (t / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
    n = (1 << 40) // 2
    header = json.dumps({"blocks.0.attn1.to_q.weight": {"dtype": "BF16", "shape": [n],
                                                         "data_offsets": [0, 2 * n]}}).encode()
    path = t / "diffusion_pytorch_model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    subprocess.run(["truncate", "-s", str(8 + len(header) + 2 * n), str(path)], check=True)
    start = time.monotonic()
    assert check_folder(tmp_path / "m") is None
    subprocess.run(["truncate", "-s", str(1 << 39), str(path)], check=True)  # half of it
    err = check_folder(tmp_path / "m")
    elapsed = time.monotonic() - start
    assert err is not None and err.reason == "truncated"
    print(f"two checks of a 1 TiB sparse file: {elapsed * 1000:.1f} ms")
    assert elapsed < 1.0


def test_every_reason_has_a_row_and_the_rarer_ones_a_section_in_the_runbook() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "runbooks.md").read_text()
    broken = text.split("## DLOModelBroken", 1)[1].split("\n## ", 1)[0]
    missing = [r for r in REASONS if f"| `{r}` |" not in broken]
    assert not missing, f"docs/runbooks.md's DLOModelBroken table lacks {missing}"
    assert "### bad_config" in broken and "### scan_error" in broken
