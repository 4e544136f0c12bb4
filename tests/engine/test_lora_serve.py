"""`dlo serve --lora-dir` end to end (real processes, gloo ranks, real HTTP, the official openai SDK):
adapters listed in /v1/models as MODEL:NAME with their parent; chosen by that model id or by
`"lora"` (+ `"lora_scale"`) in `extra_body`; the bytes of plain diffusers with `load_lora_weights`;
requests for different adapters (or none) in ONE wave, each equal to itself served alone, so a
rank's adapter never reaches another rank's output; merged per call (`--lora-apply merge`), the bytes
of diffusers' `fuse_lora`, in one wave too; scale 0 is the base model; an unknown adapter is
a 400 naming it; an adapter that does not fit the model is refused at start (exit 2, one line, the
file named); and the serving path never imports peft."""

from __future__ import annotations

import base64
import subprocess
import sys

import openai
import pytest
from openai import OpenAI

from dlo.serving.launch import ServerProcess
from tests.engine.lora_helpers import SIZE, STEPS, LoraSetup
from tests.engine.serving_helpers import offline_env, submit_in_order

pytestmark = pytest.mark.slow
WINDOW_MS = 800  # two requests sent together land in one wave even on a loaded 2-core machine


def _image(client: OpenAI, model: str, seed: int, **extra) -> bytes:
    r = client.images.generate(model=model, prompt="a lighthouse", size=f"{SIZE}x{SIZE}", response_format="b64_json",
                               extra_body={"seed": seed, "num_inference_steps": STEPS, **extra})
    return base64.b64decode(r.data[0].b64_json or "")


def _waves(srv: ServerProcess) -> tuple[float, float]:
    m = srv.metrics()
    return m["dlo_wave_size_count"][0][1], m["dlo_wave_size_sum"][0][1]


def _one_wave(srv: ServerProcess, fns: list) -> list[bytes]:
    """Send `fns` together (arrival order = rank order) and check they ran as ONE wave of that size."""
    before = _waves(srv)
    outs = submit_in_order(srv.url, fns, seconds=120)
    after = _waves(srv)
    assert (after[0] - before[0], after[1] - before[1]) == (1, len(fns)), "the requests did not share one wave"
    return outs


def _server(s: LoraSetup, tmp_path, *flags: str, env: dict | None = None) -> ServerProcess:
    return ServerProcess(s.model, "--device", "cpu", "--small-limits", "--no-warmup", "--lora-dir", str(s.lora_dir),
                         "--wave-window-ms", str(WINDOW_MS), *flags, log_path=tmp_path / "serve.log", env=env)


def test_wan_allgather_dp2_adapters_per_request_share_waves_and_equal_diffusers(lora_setups, tmp_path):
    s = lora_setups["wan"]
    # a stand-in `peft` that records being imported: importable, but without the distribution
    # metadata diffusers checks before importing peft itself, so only our own code could import it
    fake = tmp_path / "site" / "peft"
    fake.mkdir(parents=True)
    marker = tmp_path / "peft-imported"
    (fake / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write('imported\\n')\n")
    env = {"PYTHONPATH": str(tmp_path / "site")}
    probe = subprocess.run([sys.executable, "-c", "import peft"], env={**offline_env(), **env})
    assert probe.returncode == 0 and marker.exists()  # the stand-in is what `import peft` finds
    marker.unlink()
    with _server(s, tmp_path, "--dp", "2", "--mode", "allgather", env=env) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        mid = client.models.list().data[0].id
        cards = {m.id: m for m in client.models.list().data}
        assert sorted(cards) == sorted([mid] + [f"{mid}:{a}" for a in s.adapters])
        assert all(getattr(cards[f"{mid}:{a}"], "parent") == mid for a in s.adapters)
        for bad in ({"model": f"{mid}:nope"}, {"lora": "nope"}):
            with pytest.raises(openai.BadRequestError) as e:
                _image(client, bad.pop("model", mid), 1, **bad)
            assert e.value.status_code == 400 and "'nope'" in str(e.value) and "style-a" in str(e.value)

        # two adapters, chosen each way, in ONE wave: each equals diffusers + peft, and itself alone
        a, b = _one_wave(srv, [lambda: _image(client, mid, 1, lora="style-a"),
                               lambda: _image(client, f"{mid}:style-b", 2)])
        assert a == s.ref_bytes(s.case("style-a", 1.0, 1)) and b == s.ref_bytes(s.case("style-b", 1.0, 2))
        assert _image(client, f"{mid}:style-b", 2) == b  # on rank 0 now, rank 1 in the wave
        assert _image(client, mid, 1, lora="style-a") == a
        # an adapter on one rank never reaches the other's output, either way round
        base3 = s.ref_bytes(s.case(None, 1.0, 3))
        _, plain = _one_wave(srv, [lambda: _image(client, mid, 1, lora="style-a"), lambda: _image(client, mid, 3)])
        plain0, scaled = _one_wave(srv, [lambda: _image(client, mid, 3),
                                         lambda: _image(client, mid, 1, lora="style-a", lora_scale=0.7)])
        assert plain == plain0 == base3
        assert scaled == s.ref_bytes(s.case("style-a", 0.7, 1))
        assert _image(client, mid, 3, lora="style-a", lora_scale=0.0) == base3  # scale 0: the base model
        assert a != s.ref_bytes(s.case(None, 1.0, 1))  # and the adapter does change the image
    log = (tmp_path / "serve.log").read_text()
    assert not marker.exists(), "dlo serve imported peft"
    assert "peft" not in "".join(ln for ln in log.splitlines() if "imported only because installed" in ln)


def test_flux_rank_local_dp2_community_formats_share_a_wave_and_equal_diffusers(lora_setups, tmp_path):
    s = lora_setups["flux"]
    with _server(s, tmp_path, "--dp", "2", "--mode", "rank-local") as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        mid = client.models.list().data[0].id
        kohya, alphas = _one_wave(srv, [lambda: _image(client, f"{mid}:k", 2),
                                        lambda: _image(client, mid, 2, lora="ak", lora_scale=0.5)])
        assert kohya == s.ref_bytes(s.case("k", 1.0, 2))  # written by `dlo make-random-lora --format kohya`
        assert alphas == s.ref_bytes(s.case("ak", 0.5, 2))  # `.alpha` keys: Flux's network alphas
        assert _image(client, mid, 2, lora="ak", lora_scale=0.5) == alphas
        assert _image(client, mid, 1, lora="flux-d") == s.ref_bytes(s.case("flux-d", 1.0, 1))


def test_flux_allgather_dp2_merged_adapters_share_a_wave_and_equal_diffusers_fuse_lora(lora_setups, tmp_path):
    """`--lora-apply merge`: each rank computes with its own adapter merged into a scratch, while the
    allgather slot both ranks computed from stays the base (the plain request beside it shows it).
    Flux in bfloat16, where fuse_lora's PNG differs from the branch's."""
    s = lora_setups["flux"]
    with _server(s, tmp_path, "--dp", "2", "--mode", "allgather", "--lora-apply", "merge") as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        mid = client.models.list().data[0].id
        kohya, alphas = _one_wave(srv, [lambda: _image(client, f"{mid}:k", 2),
                                        lambda: _image(client, mid, 2, lora="ak", lora_scale=0.5)])
        assert kohya == s.ref_bytes(s.case("k", 1.0, 2), "merge")
        assert alphas == s.ref_bytes(s.case("ak", 0.5, 2), "merge")
        assert alphas != s.ref_bytes(s.case("ak", 0.5, 2))  # fuse_lora's bytes, not the branch's
        merged, plain = _one_wave(srv, [lambda: _image(client, mid, 1, lora="flux-d"), lambda: _image(client, mid, 1)])
        assert merged == s.ref_bytes(s.case("flux-d", 1.0, 1), "merge") and plain == s.ref_bytes(s.case(None, 1.0, 1))
        assert _image(client, mid, 2, lora="ak", lora_scale=0.5) == alphas  # alone, on rank 0 now
        assert _image(client, mid, 1, lora="flux-d", lora_scale=0.0) == plain  # scale 0: the base model
    assert "apply=merge" in (tmp_path / "serve.log").read_text()


def test_an_adapter_that_does_not_fit_the_model_is_refused_at_start_naming_the_file(lora_setups, tmp_path):
    """A Flux adapter in a Wan server's folder: modules the model does not have (checked from the
    file's header, before any rank starts)."""
    import shutil

    wan, flux = lora_setups["wan"], lora_setups["flux"]
    shutil.copytree(wan.lora_dir / "style-a", tmp_path / "loras" / "style-a")
    shutil.copytree(flux.lora_dir / "flux-d", tmp_path / "loras" / "z-flux")
    r = subprocess.run([sys.executable, "-m", "dlo.cli.main", "serve", str(wan.model), "--device", "cpu",
                        "--lora-dir", str(tmp_path / "loras"), "--port", "0"], capture_output=True, text=True,
                       env=offline_env(), timeout=300)
    message = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(message) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert message[0].startswith("dlo serve: --lora-dir: ")
    assert str(tmp_path / "loras" / "z-flux" / "pytorch_lora_weights.safetensors") in message[0], message[0]
    assert "the transformer has no single_transformer_blocks.0." in message[0], message[0]
    # a merge cache without the merge: refused before anything starts, both flags named
    r = subprocess.run([sys.executable, "-m", "dlo.cli.main", "serve", str(wan.model), "--device", "cpu", "--lora-dir",
                        str(wan.lora_dir), "--lora-apply", "branch", "--lora-merge-cache", "1GiB", "--port", "0"],
                       capture_output=True, text=True, env=offline_env(), timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "dlo serve: lora merge_cache_bytes (--lora-merge-cache) keeps merged weights: it needs lora apply 'merge' "
        "or 'auto' (--lora-apply), not 'branch'"], r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "dlo.cli.main", "serve", str(wan.model), "--device", "cpu", "--lora-dir",
                        str(wan.lora_dir), "--lora-merge-above", "-5", "--port", "0"], capture_output=True, text=True,
                       env=offline_env(), timeout=300)
    assert r.returncode == 2 and "--lora-merge-above" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
