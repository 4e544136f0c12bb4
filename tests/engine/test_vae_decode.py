"""The VAE's first decode made beside the warm-up request (`dlo.engine.serving.vae_decode`,
[Note: the first decode beside the request]): the smallest latent each VAE decodes, and the
pipeline's decode waiting for that first one (the VAEs keep per-call state on the module). The
cuda stream it runs on is the GPU's: measured in the ready benchmark."""

from __future__ import annotations

import threading

import pytest
import torch

from dlo.engine.serving.prewarm import Background
from dlo.engine.serving.vae_decode import first_decode, gate_decode, smallest_latent, warm_decode_beside
from tests.engine.serving_helpers import tiny_pipeline, wait_until


@pytest.mark.parametrize("family, vae_class, rank", [("wan", "AutoencoderKLWan", 5), ("flux", "AutoencoderKL", 4)])
def test_the_smallest_latent_decodes_to_the_smallest_image(tmp_path_factory, family, vae_class, rank):
    import diffusers

    from dlo.engine.families import pipeline_facts

    folder = tiny_pipeline(tmp_path_factory, family)
    vae = getattr(diffusers, vae_class).from_pretrained(folder / "vae").eval()
    side = pipeline_facts(folder).smallest_side
    shape = smallest_latent(vae, side)
    assert shape is not None and len(shape) == rank and shape[0] == 1
    with torch.inference_mode():
        out = vae.decode(torch.zeros(shape, dtype=vae.dtype), return_dict=False)[0]
    assert tuple(out.shape[-2:]) == (side, side)  # the image the warm-up request decodes
    assert first_decode(vae, shape, torch.device("cpu")) == shape  # the class's own decode, no wrapper
    assert warm_decode_beside(type("Pipe", (), {"vae": vae})(), "cpu", side) is None  # cuda only
    assert smallest_latent(torch.nn.Linear(1, 1), side) is None  # a module that is no known VAE


def test_the_pipelines_decode_waits_for_the_first_decode(caplog):
    """Two decodes of one VAE never run at once: the request's waits for the one beside it."""
    release, calls = threading.Event(), []

    class Vae:
        def decode(self, z):
            calls.append(z)
            return z

    vae = Vae()
    job = Background("first-decode", lambda: release.wait(30) and (1, 2))
    gate_decode(vae, job)
    request = Background("request", lambda: vae.decode("latents"))
    request._thread.join(0.3)
    assert request._thread.is_alive() and calls == []  # held while the first decode runs
    release.set()
    with caplog.at_level("INFO", logger="dlo.engine.serving.vae_decode"):
        assert request.join() == "latents"
    assert calls == ["latents"] and "first decode beside the request" in caplog.text
    wait_until(lambda: vae.decode("again") == "again", 5, "later decodes pass at once")
