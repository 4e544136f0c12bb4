"""The `vllm serve --omni` command lines the operator renders (engine.kind vllm-omni), checked
against vllm-omni's own argument parser: the flags extracted from the released vllm-omni and vLLM
wheels by `vllm_omni_flags/extract_flags.py` (see its docstring; the JSON records both versions). Every
flag must exist, take a value exactly when the parser says so, and not be one vllm-omni refuses
under `--omni`."""

import json
from pathlib import Path

import pytest

from dlo.operator import builders
from dlo.operator.models import parse_spec

ROOT = Path(__file__).resolve().parents[2]
EXTRACT = Path(__file__).parent / "vllm_omni_flags" / "flags-vllm-omni-0.30.0.json"
FLAGS = json.loads(EXTRACT.read_text())
MODES = ("allgather", "rank-local", "resident")
SPECS = {
    "minimal": {"model": {"path": "/models/wan"}, "engine": {"kind": "vllm-omni"}},
    "dp8-key-port": {
        "model": {"claimName": "models", "subPath": "wan2.1"},
        "devicesPerNode": 8,
        "service": {"port": 9000},
        "engine": {"kind": "vllm-omni", "apiKeySecret": {"name": "k"}, "args": ["--log-stats"]},
    },
}


def parse(command: list[str]) -> dict[str, str | None]:
    """`vllm serve MODEL [--flag [value]]...` -> flag -> value, as vllm-omni's parser reads it."""
    assert command[:3] == ["vllm", "serve", "/model"]
    out: dict[str, str | None] = {}
    rest = command[3:]
    while rest:
        flag, rest = rest[0], rest[1:]
        assert flag.startswith("--"), f"{flag!r} is not a flag (a value without its flag?) in {command}"
        name = flag.split("=", 1)[0]
        assert name in FLAGS["flags"], f"vllm-omni {FLAGS['vllm-omni']} has no flag {name}"
        if FLAGS["flags"][name] and "=" not in flag:
            assert rest and not rest[0].startswith("--"), f"{name} needs a value in {command}"
            out[name], rest = rest[0], rest[1:]
        else:
            assert "=" not in flag, f"{name} takes no value"
            out[name] = None
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", SPECS)
def test_rendered_vllm_omni_command_parses_with_vllm_omnis_flags(case, mode):
    spec = parse_spec(SPECS[case])
    flags = parse(builders.engine_command(spec, mode))
    assert "--omni" in flags
    assert not set(flags) & set(FLAGS["prohibited_with_omni"]), "vllm-omni refuses these under --omni"
    assert flags["--num-gpus"] == str(spec.devices_per_node)
    assert flags["--port"] == str(spec.service.port)
    assert flags["--served-model-name"] == spec.model.folder_name
    assert ("--enable-distributed-layerwise-offload" in flags) == (mode != "resident")
    assert ("--dlo-no-use-allgather" in flags) == (mode == "rank-local")
    assert "--api-key" not in flags  # the key comes as VLLM_API_KEY from the Secret, never as an argument


def test_the_extract_is_of_the_versions_the_docs_name():
    assert (FLAGS["vllm-omni"], FLAGS["vllm"]) == ("0.30.0", "0.30.0")
    docs = (ROOT / "docs" / "operator.md").read_text()
    assert f"vllm-omni {FLAGS['vllm-omni']}" in docs and f"vLLM {FLAGS['vllm']}" in docs
    # the flags the operator relies on, as the extract recorded them (value or not)
    for flag, takes_value in {"--omni": False, "--num-gpus": True, "--enable-distributed-layerwise-offload": False,
                              "--dlo-no-use-allgather": False, "--port": True, "--served-model-name": True}.items():
        assert FLAGS["flags"][flag] is takes_value, flag
    assert "--data-parallel-size" in FLAGS["prohibited_with_omni"]


def test_extract_flags_script_reads_wheels(tmp_path):
    """The extractor on two tiny wheels shaped like the real ones (the real ones are 8 and 300 MB)."""
    import zipfile

    from vllm_omni_flags.extract_flags import extract

    omni = tmp_path / "vllm_omni-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(omni, "w") as z:
        z.writestr("vllm_omni/entrypoints/cli/serve.py", (
            "def validate(args):\n"
            "    prohibited_with_omni: dict[str, str] = {'data_parallel_size': '--data-parallel-size'}\n"
            "def init(g):\n"
            "    g.add_argument('--omni', action='store_true')\n"
            "    g.add_argument('--usp', '--ulysses-degree', type=int)\n"
            "    g.add_argument('--flag', action=argparse.BooleanOptionalAction)\n"))
        z.writestr("vllm_omni/engine/arg_utils.py", "")
    vllm = tmp_path / "vllm-9.8.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(vllm, "w") as z:
        z.writestr("vllm/engine/arg_utils.py", "def f(p):\n    p.add_argument('--data-parallel-size', '-dp', type=int)\n")
        z.writestr("vllm/entrypoints/launchers/cli_args.py",
                   "class FrontendArgs:\n    port: int = 8000\n    enable_ssl: bool = False\n")
    out = extract(omni, vllm)
    assert (out["vllm-omni"], out["vllm"]) == ("9.9.9", "9.8.0")
    assert out["prohibited_with_omni"] == ["--data-parallel-size"]
    assert out["flags"] == {"--data-parallel-size": True, "--enable-ssl": False, "--flag": False, "--omni": False,
                            "--port": True, "--ulysses-degree": True, "--usp": True}


def test_args_vllm_omni_refuses_under_omni_are_refused_up_front():
    from dlo.operator.models import VLLM_OMNI_REFUSED_FLAGS, SpecError

    assert sorted(VLLM_OMNI_REFUSED_FLAGS) == FLAGS["prohibited_with_omni"]
    for args in (["--data-parallel-size", "2"], ["--data-parallel-size=2"], ["--enable-expert-parallel"]):
        with pytest.raises(SpecError, match=r"spec\.engine: .*vllm-omni refuses --"):
            parse_spec({"model": {"path": "/m"}, "engine": {"kind": "vllm-omni", "args": args}})
    # dlo serve has no such flags, and other vLLM flags pass
    parse_spec({"model": {"path": "/m"}, "engine": {"kind": "vllm-omni", "args": ["--log-stats"]}})
