"""Shared by the LoRA tests (not a test module): tiny pipelines with adapters of every format our
writer emits, and their diffusers + peft reference outputs, made once per session.

Wan in float32 and Flux in bfloat16 (the dtype of the full-size models), each with three adapters:
diffusers' own format with metadata alpha (a power-of-two scaling, folded into B, and a 5/6 or 5/3
one, multiplied), and a community format diffusers converts on load (Wan's original names; Flux's
`.alpha` keys, read as network alphas, and kohya's fused q/k/v, written by the `dlo make-random-lora`
command itself).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dlo.engine.request import Generation
from tests.engine.lora_reference import REFERENCE_DIR
from tests.engine.serving_helpers import offline_env, tiny_pipeline

ROOT = Path(__file__).resolve().parents[2]
SEQ = 32  # the small limits' max_sequence_length, what `dlo serve --small-limits` encodes prompts with
SIZE = 32
STEPS = 2
PROMPT = "a lighthouse"
MERGED = {"branch": "", "merge": "-merged"}  # the reference file of a case per `--lora-apply`

# family -> (model dtype, [(entry name in --lora-dir, write_adapter keywords)], [(adapter, scale, seed)])
SETUPS = {
    "wan": ("float32",
            [("style-a", {"rank": 4, "alpha": 2.0, "seed": 1}),
             ("style-b.safetensors", {"rank": 3, "alpha": 2.5, "seed": 2}),
             ("orig.safetensors", {"rank": 3, "alpha": 1.5, "seed": 3, "fmt": "wan-original"})],
            [(None, 1.0, 1), ("style-a", 1.0, 1), ("style-b", 1.0, 2), (None, 1.0, 3), ("style-a", 0.7, 1),
             ("orig", 1.0, 1)]),
    "flux": ("bfloat16",
             [("flux-d", {"rank": 6, "alpha": 5.0, "seed": 1}),
              ("ak.safetensors", {"rank": 3, "alpha": 5.0, "seed": 2, "fmt": "alpha-keys", "dtype": "float32"}),
              ("k.safetensors", None)],  # None: written by `dlo make-random-lora --format kohya`
             [(None, 1.0, 1), ("flux-d", 1.0, 1), ("k", 1.0, 2), ("ak", 1.0, 1), ("ak", 0.5, 2)]),
}


@dataclass
class LoraSetup:
    family: str
    model: Path
    lora_dir: Path
    dtype: str
    cases: list[tuple[str | None, float, int]]
    reference: Path
    adapters: list[str] = field(default_factory=list)

    def gen(self, i: int) -> Generation:
        adapter, scale, seed = self.cases[i]
        guidance = 5.0 if self.family == "wan" else 3.5  # the families' defaults: what a request without one gets
        return Generation(kind="image", prompt=PROMPT, seed=seed, width=SIZE, height=SIZE, steps=STEPS,
                          guidance_scale=guidance, lora_id=adapter, lora_scale=scale)

    def case(self, adapter: str | None, scale: float, seed: int) -> int:
        return self.cases.index((adapter, scale, seed))

    def ref_array(self, i: int, apply: str = "branch"):
        """Case i's float output from diffusers + peft: the adapter unmerged ("branch") or fused ("merge")."""
        import numpy as np

        return np.load(self.reference / f"case-{i}{MERGED[apply] if self.cases[i][0] else ''}.npy")

    def ref_bytes(self, i: int, apply: str = "branch") -> bytes:
        return (self.reference / f"case-{i}{MERGED[apply] if self.cases[i][0] else ''}.out").read_bytes()


def _spec(setup: LoraSetup) -> list[str]:
    """Write the reference spec of `setup`; the arguments of tests/engine/lora_reference.py for it."""
    adapters = {name: str(setup.lora_dir / entry) for name, entry in
                ((e.removesuffix(".safetensors"), e) for e in sorted(os.listdir(setup.lora_dir)))}
    spec = {"model_dir": str(setup.model), "dtype": setup.dtype, "adapters": adapters, "max_sequence_length": SEQ,
            "cases": [{"adapter": a, "scale": s, "gen": {k: v for k, v in setup.gen(i).__dict__.items()
                                                         if k not in ("lora_id", "lora_scale", "image")}}
                      for i, (a, s, _) in enumerate(setup.cases)]}
    setup.reference.mkdir(parents=True, exist_ok=True)
    (setup.reference / "spec.json").write_text(json.dumps(spec))
    return [str(setup.reference / "spec.json"), str(setup.reference)]


def make_random_lora(*argv: str) -> dict:
    """`dlo make-random-lora ARGV` through the real `dlo` dispatcher (in this process: one import of
    diffusers less); its JSON summary."""
    import contextlib
    import io

    from dlo.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["make-random-lora", *argv])
    assert code == 0, code
    return json.loads(out.getvalue())


@pytest.fixture(scope="session")
def lora_setups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoraSetup]:
    """Per family: the pipeline, its --lora-dir, and the reference outputs of every case."""
    from dlo.engine.random_lora import write_adapter

    base = tmp_path_factory.getbasetemp()
    setups, specs = {}, []
    for family, (dtype, entries, cases) in SETUPS.items():
        model = tiny_pipeline(tmp_path_factory, family, dtype)
        lora_dir = base / f"loras-{family}"
        setup = LoraSetup(family, model, lora_dir, dtype, cases, base / f"lora-reference-{family}",
                          [e.removesuffix(".safetensors") for e, _ in entries])
        for entry, kw in entries:
            if kw is not None:
                write_adapter(model, lora_dir / entry, **kw)
            else:  # the command itself, in a community format
                summary = make_random_lora(str(model), str(lora_dir / entry), "--rank", "3", "--alpha", "2.5",
                                           "--seed", "4", "--format", "kohya", "--no-progress")
                assert summary["format"] == "kohya" and summary["pairs"] > 0
        specs += _spec(setup)
        setups[family] = setup
    if not (REFERENCE_DIR / "peft").is_dir():
        raise AssertionError(f"peft for the LoRA reference is missing from {REFERENCE_DIR}: run `make install`")
    env = {**offline_env(), "PYTHONPATH": str(REFERENCE_DIR)}
    r = subprocess.run([sys.executable, "-m", "tests.engine.lora_reference", *specs], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"the diffusers + peft reference failed:\n{r.stdout[-2000:]}{r.stderr[-4000:]}"
    return setups
