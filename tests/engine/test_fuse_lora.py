"""`dlo fuse-lora MODEL ADAPTER[:SCALE] DST` through the real command on tiny presets: the fused
transformer is diffusers' `load_lora_weights` + `fuse_lora(lora_scale=SCALE)` byte for byte (Wan in
float32 with a sharded transformer and a diffusers-format adapter; Wan in bfloat16 with a lora bias
and a module diffusers keeps in float32 stored in bfloat16; Flux in bfloat16 with an `.alpha`-keys
adapter), in the same files, every other file a hard link, MODEL untouched; served, the fused folder
answers a CFG-free 4-step request with the PNG the base model gives with the adapter merged per
request; a killed run's `DST.partial` is resumed (its whole shards kept) or, made for other inputs,
written anew; what would delete or write into what it did not make, and a bad SCALE, are one line
and exit 2 with nothing changed."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from dlo.delivery.owned import MARKER
from dlo.engine.checkpoint import Checkpoint
from tests.engine.lora_reference import REFERENCE_DIR
from tests.engine.serving_helpers import offline_env

ROOT = Path(__file__).resolve().parents[2]
DLO = Path(sys.executable).parent / "dlo"
# case -> (preset, transformer dtype, transformer shard bytes, adapter, scale)
CASES = {
    "wan-f32-sharded": ("tiny-wan2.1-t2v", "float32", 80_000, "diffusers", 0.7),
    "wan-bf16-bias-fp32-module": ("tiny-wan2.1-t2v", "bfloat16", None, "bias", 1.25),
    "flux-bf16-alpha-keys": ("tiny-flux.1-dev", "bfloat16", None, "alpha-keys", 1.5),
}
KEPT_IN_FP32 = "condition_embedder.time_embedder.linear_1"  # in WanTransformer3DModel._keep_in_fp32_modules


@dataclass
class Fused:
    model: Path
    adapter: Path
    scale: float
    dst: Path
    summary: dict
    reference: Path
    model_before: dict[str, str]


def snapshot(root: Path) -> dict[str, str]:
    files = [p for p in sorted(root.rglob("*")) if p.is_file()] if root.is_dir() else [root]
    return {p.relative_to(root).as_posix() if root.is_dir() else p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files}


def fuse(model: Path, adapter: str, dst: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(DLO), "fuse-lora", str(model), adapter, str(dst), *extra], capture_output=True,
                          text=True, timeout=300, env=offline_env())


def _model(root: Path, name: str, dtype: str, shard: int | None) -> Path:
    """A tiny preset stored in `dtype` but its VAE (as the full-size ones are), the transformer cut into
    files of `shard` bytes; a bfloat16 Wan stores its float32-kept time embedder in bfloat16 too
    (diffusers upcasts it on load)."""
    import torch
    from safetensors.torch import load_file, save_file

    from dlo.engine.presets import preset
    from dlo.engine.random_model import write_pipeline

    p = preset(name)
    parts = tuple(c if c.name == "vae" else replace(c, dtype=dtype, max_shard_bytes=shard if c.name == "transformer"
                                                    else c.max_shard_bytes) for c in p.components)
    write_pipeline(root, replace(p, components=parts), seed=1)
    if name.startswith("tiny-wan") and dtype == "bfloat16":
        f = root / "transformer" / "diffusion_pytorch_model.safetensors"
        state = {k: v.to(torch.bfloat16) if "time_embedder" in k else v for k, v in load_file(f).items()}
        save_file(state, f, metadata={"format": "pt"})
    return root


def _adapter(model: Path, out: Path, kind: str) -> Path:
    from dlo.engine.random_lora import write_adapter

    if kind == "diffusers":  # alpha 2.5 over rank 3: a scaling that is no power of two
        write_adapter(model, out / "pytorch_lora_weights.safetensors", rank=3, alpha=2.5, seed=1)
        return out
    if kind == "alpha-keys":
        path = out.with_suffix(".safetensors")
        write_adapter(model, path, rank=3, alpha=5.0, seed=2, fmt="alpha-keys", dtype="float32")
        return path
    return _adapter_with_bias(model, out.with_suffix(".safetensors"))


def _adapter_with_bias(model: Path, path: Path) -> Path:
    """A diffusers-format adapter with lora biases (metadata lora_bias) on two block layers and on a
    layer of a module the class keeps in float32."""
    import torch
    from safetensors.torch import save_file

    ckpt = Checkpoint(model / "transformer")
    modules = ["blocks.0.attn1.to_q", "blocks.1.ffn.net.2", KEPT_IN_FP32]
    g, r, tensors = torch.Generator().manual_seed(5), 4, {}
    for m in modules:
        out_f, in_f = ckpt.tensors[f"{m}.weight"].shape
        tensors[f"transformer.{m}.lora_A.weight"] = (torch.randn(r, in_f, generator=g) / in_f ** 0.5).bfloat16()
        tensors[f"transformer.{m}.lora_B.weight"] = (torch.randn(out_f, r, generator=g) * 0.05).bfloat16()
        tensors[f"transformer.{m}.lora_B.bias"] = (torch.randn(out_f, generator=g) * 0.05).bfloat16()
    meta = {"transformer.r": r, "transformer.lora_alpha": 3.0, "transformer.lora_bias": True,
            "transformer.target_modules": modules}
    save_file(tensors, path, metadata={"format": "pt", "lora_adapter_metadata": json.dumps(meta)})
    return path


@pytest.fixture(scope="module")
def fused(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Fused]:
    """Each case's model, adapter and fused folder (the real command), and diffusers' reference."""
    base = tmp_path_factory.mktemp("fuse-lora")
    cases, spec = {}, []
    for case, (name, dtype, shard, kind, scale) in CASES.items():
        model = _model(base / case, name, dtype, shard)
        adapter = _adapter(model, base / f"{case}-lora", kind)
        before = snapshot(model)
        proc = fuse(model, f"{adapter}:{scale}", base / f"{case}-fused", "--no-progress")
        assert proc.returncode == 0, proc.stderr
        reference = base / f"{case}-reference.safetensors"
        cases[case] = Fused(model, adapter, scale, base / f"{case}-fused", json.loads(proc.stdout), reference, before)
        spec.append({"model_dir": str(model), "dtype": dtype, "adapter": str(adapter), "scale": scale,
                     "out": str(reference)})
    if not (REFERENCE_DIR / "peft").is_dir():
        raise AssertionError(f"peft for the LoRA reference is missing from {REFERENCE_DIR}: run `make install`")
    (base / "spec.json").write_text(json.dumps(spec))
    r = subprocess.run([sys.executable, "-m", "tests.engine.fuse_reference", str(base / "spec.json")], cwd=ROOT,
                       env={**offline_env(), "PYTHONPATH": str(REFERENCE_DIR)}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"the diffusers + peft reference failed:\n{r.stdout[-2000:]}{r.stderr[-4000:]}"
    return cases


def _raw(ckpt: Checkpoint, name: str) -> bytes:
    info = ckpt.tensors[name]
    return bytes(ckpt.mapping(info.path)[info.start:info.end])


def _loaded(ckpt: Checkpoint, name: str, dtype: str) -> bytes:
    """A tensor's bytes as a model computing it in `dtype` (a safetensors name) holds it."""
    import torch

    from dlo.engine.dtypes import torch_dtype

    return ckpt.view(name).to(torch_dtype(dtype)).reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("case", CASES)
def test_the_fused_transformer_is_diffusers_fuse_lora_byte_for_byte(fused, case):
    f = fused[case]
    got, ref, base = (Checkpoint(f.dst / "transformer"), Checkpoint(f.reference), Checkpoint(f.model / "transformer"))
    assert set(got.tensors) == set(ref.tensors) == set(base.tensors)
    # diffusers holds (and saves) a module it keeps in float32 upcast: every tensor as diffusers holds it
    differ = [n for n in ref.tensors if _loaded(got, n, ref.tensors[n].dtype) != _raw(ref, n)]
    assert not differ, f"{len(differ)} tensors differ from diffusers' fuse_lora(lora_scale={f.scale}): {differ[:5]}"
    adapter = Checkpoint(f.adapter if f.adapter.is_file() else f.adapter / "pytorch_lora_weights.safetensors")
    modules = {k.removeprefix("transformer.").partition(".lora_")[0] for k in adapter.tensors if ".lora_" in k}
    biases = {f"{m}.bias" for m in modules} if case.startswith("wan-bf16") else set()
    merged = {n for n in base.tensors if _raw(base, n) != _raw(got, n)}
    assert merged == {f"{m}.weight" for m in modules} | biases
    assert all(got.tensors[n].dtype == ref.tensors[n].dtype for n in merged)  # stored as computed
    assert f.summary["merged_weights"] == len(modules) and f.summary["merged_biases"] == len(biases)
    # the same files, each tensor in the file it was in; dtypes kept but for a module computed in float32
    assert [p.name for p in got.files] == [p.name for p in base.files]
    assert all(got.tensors[n].path.name == base.tensors[n].path.name for n in base.tensors)
    upcast = {n for n in base.tensors if got.tensors[n].dtype != base.tensors[n].dtype}
    assert upcast == ({f"{KEPT_IN_FP32}.weight", f"{KEPT_IN_FP32}.bias"} if case.startswith("wan-bf16") else set())
    assert all(got.tensors[n].dtype == "F32" for n in upcast)
    if case == "wan-f32-sharded":
        assert len(base.files) >= 3 and f.summary["written_files"] == len(base.files)


@pytest.mark.parametrize("case", CASES)
def test_every_other_file_is_a_hard_link_and_the_model_is_untouched(fused, case):
    f = fused[case]
    written = {f"transformer/{p.name}" for p in Checkpoint(f.model / "transformer").files}
    if case.startswith("wan-bf16"):
        assert not list((f.model / "transformer").glob("*.index.json"))
    src = {p.relative_to(f.model).as_posix(): p for p in f.model.rglob("*") if p.is_file()}
    dst = {p.relative_to(f.dst).as_posix(): p for p in f.dst.rglob("*") if p.is_file()}
    assert set(dst) == set(src), "DST holds other files than MODEL (a marker, a shard being written?)"
    for rel, p in src.items():
        assert (dst[rel].stat().st_ino == p.stat().st_ino) == (rel not in written), rel
    assert f.summary["linked"] == len(src) - len(written)
    if case == "wan-f32-sharded":  # the index, linked: the same layout
        assert any(r.endswith(".safetensors.index.json") and r.startswith("transformer/") for r in src)
    assert snapshot(f.model) == f.model_before
    assert not f.dst.with_name(f.dst.name + ".partial").exists()


# ---- a killed run -------------------------------------------------------------------------------------
def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def _killed_runs_partial(partial: Path, **facts) -> None:
    (partial / "transformer").mkdir(parents=True)
    record = {"made_by": "dlo fuse-lora", "pid": _dead_pid(), "host": socket.gethostname(), **facts}
    (partial / MARKER).write_text(json.dumps(record))


def test_a_killed_runs_staging_folder_is_resumed_its_whole_shards_kept(fused, tmp_path):
    from dlo.engine.fuse_lora import run_facts

    f = fused["wan-f32-sharded"]
    shards = [p.name for p in Checkpoint(f.dst / "transformer").files]
    partial = tmp_path / "out.partial"
    weight_file = f.adapter.resolve() / "pytorch_lora_weights.safetensors"
    _killed_runs_partial(partial, **run_facts(f.model.resolve(), weight_file, f.scale, "cpu"))
    shutil.copy2(f.dst / "transformer" / shards[0], partial / "transformer" / shards[0])  # written whole
    half = (f.dst / "transformer" / shards[1]).read_bytes()
    (partial / "transformer" / shards[1]).write_bytes(half[: len(half) // 2])  # cut short
    (partial / ".dlo-writing").mkdir()
    (partial / ".dlo-writing" / shards[2]).write_bytes(b"\0" * 64)  # being written when the run died
    kept = (partial / "transformer" / shards[0]).stat().st_ino
    proc = fuse(f.model, f"{f.adapter}:{f.scale}", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["kept_files"] == 1 and summary["written_files"] == len(shards) - 1
    out = tmp_path / "out"
    assert (out / "transformer" / shards[0]).stat().st_ino == kept
    assert snapshot(out) == snapshot(f.dst) and not partial.exists() and not (out / MARKER).exists()


def test_a_killed_runs_staging_folder_for_another_scale_is_written_anew(fused, tmp_path):
    from dlo.engine.fuse_lora import run_facts

    f = fused["wan-f32-sharded"]
    shard = Checkpoint(f.dst / "transformer").files[0].name
    partial = tmp_path / "out.partial"
    weight_file = f.adapter.resolve() / "pytorch_lora_weights.safetensors"
    _killed_runs_partial(partial, **run_facts(f.model.resolve(), weight_file, 0.5, "cpu"))
    shutil.copy2(f.dst / "transformer" / shard, partial / "transformer" / shard)  # whole, but at scale 0.5
    proc = fuse(f.model, f"{f.adapter}:{f.scale}", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["kept_files"] == 0 and snapshot(tmp_path / "out") == snapshot(f.dst)


# ---- refusals ------------------------------------------------------------------------------------------
def _layout(case: str, f: Fused, tmp: Path) -> tuple[Path, Path, Path, Path]:
    """(MODEL, ADAPTER, DST, the folder that must come through untouched) for each refused case."""
    dst, partial = tmp / "out", tmp / "out.partial"
    if case == "model-is-dst-partial":
        shutil.copytree(f.model, partial)
        return partial, f.adapter, dst, partial
    if case == "model-inside-dst-partial":
        shutil.copytree(f.model, partial / "model")
        return partial / "model", f.adapter, dst, partial
    model = tmp / "model"
    shutil.copytree(f.model, model)
    if case == "dst-is-model":
        return model, f.adapter, model, model
    if case == "dst-inside-model":
        return model, f.adapter, model / "fused", model
    if case == "adapter-inside-dst-partial":  # marked by a killed run: removing it would delete the adapter
        _killed_runs_partial(partial)
        shutil.copytree(f.adapter, partial / "lora")
        return model, partial / "lora", dst, partial
    partial.mkdir()
    if case == "foreign-dst-partial":
        (partial / "notes.txt").write_text("not dlo's")
    else:  # "dst-partial-in-use": another fuse-lora, alive, is writing it
        (partial / MARKER).write_text(json.dumps({"made_by": "dlo fuse-lora", "pid": os.getpid(),
                                                  "host": socket.gethostname()}))
        (partial / "half.safetensors").write_bytes(b"\0" * 64)
    return model, f.adapter, dst, partial


@pytest.mark.parametrize("case", ["model-is-dst-partial", "model-inside-dst-partial", "dst-is-model",
                                  "dst-inside-model", "adapter-inside-dst-partial", "foreign-dst-partial",
                                  "dst-partial-in-use"])
def test_fuse_lora_refuses_to_delete_or_write_into_what_it_did_not_make(fused, tmp_path, case):
    f = fused["wan-f32-sharded"]
    model, adapter, dst, kept = _layout(case, f, tmp_path)
    before, model_before = snapshot(kept), snapshot(model)
    proc = fuse(model, f"{adapter}:{f.scale}", dst)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("dlo fuse-lora: ") and str(kept.resolve()) in lines[0], lines[0]
    assert snapshot(kept) == before and snapshot(model) == model_before and proc.stdout == ""
    assert dst == model or not dst.exists()


@pytest.mark.parametrize("scale, message", [("abc", "SCALE 'abc' must be a finite number"),
                                            ("nan", "SCALE 'nan' must be a finite number"),
                                            ("-inf", "SCALE '-inf' must be a finite number"),
                                            ("", "SCALE '' must be a finite number")])
def test_a_bad_scale_is_one_line_and_exit_2(fused, tmp_path, scale, message):
    f = fused["wan-f32-sharded"]
    proc = fuse(f.model, f"{f.adapter}:{scale}", tmp_path / "out")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_an_adapter_that_does_not_fit_the_model_is_refused_by_the_start_check(fused, tmp_path):
    f, other = fused["wan-f32-sharded"], fused["flux-bf16-alpha-keys"]
    proc = fuse(f.model, str(other.adapter), tmp_path / "out")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"dlo fuse-lora: ADAPTER {other.adapter.resolve()}: ") and "dlo-fuse-lora-" not in proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


# ---- served ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("case", ["wan-f32-sharded", "flux-bf16-alpha-keys"])
def test_the_fused_folder_serves_the_bytes_of_the_adapter_merged_per_request(fused, tmp_path, case):
    """A CFG-free few-step request (guidance 1, 4 steps): the fused folder, with no adapter, answers
    the PNG the base model answers with the adapter merged per call at the same scale."""
    from openai import OpenAI

    from dlo.serving.launch import ServerProcess

    f = fused[case]
    lora_dir = tmp_path / "loras"
    lora_dir.mkdir()
    (lora_dir / f.adapter.name).symlink_to(f.adapter)
    name = f.adapter.name.removesuffix(".safetensors")
    flags = ("--device", "cpu", "--small-limits", "--no-warmup")

    def image(srv: ServerProcess, model_suffix: str = "", **extra) -> bytes:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        mid = client.models.list().data[0].id
        r = client.images.generate(model=mid + model_suffix, prompt="a lighthouse", size="32x32",
                                   response_format="b64_json",
                                   extra_body={"seed": 3, "num_inference_steps": 4, "guidance_scale": 1.0, **extra})
        return base64.b64decode(r.data[0].b64_json or "")

    with ServerProcess(f.model, *flags, "--lora-dir", str(lora_dir), "--lora-apply", "merge",
                       log_path=tmp_path / "base.log") as srv:
        merged = image(srv, f":{name}", lora_scale=f.scale)
        plain = image(srv)
    with ServerProcess(f.dst, *flags, log_path=tmp_path / "fused.log") as srv:
        served = image(srv)
    assert merged[:8] == b"\x89PNG\r\n\x1a\n" and merged != plain
    assert served == merged
