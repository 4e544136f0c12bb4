"""Deterministic transformer inputs for the tiny families (test helper, not a test module)."""

from __future__ import annotations

import torch


def example_inputs(family: str, dtype: torch.dtype, seed: int = 0, text_dim: int = 32) -> dict:
    gen = torch.Generator().manual_seed(seed)
    if family == "wan":
        return dict(
            hidden_states=torch.randn(1, 16, 3, 8, 8, generator=gen).to(dtype),
            timestep=torch.tensor([500 + seed]),
            encoder_hidden_states=torch.randn(1, 7, text_dim, generator=gen).to(dtype),
            return_dict=False,
        )
    if family == "flux":
        seq, txt = 16, 5
        return dict(
            hidden_states=torch.randn(1, seq, 64, generator=gen).to(dtype),
            encoder_hidden_states=torch.randn(1, txt, text_dim, generator=gen).to(dtype),
            pooled_projections=torch.randn(1, text_dim, generator=gen).to(dtype),
            timestep=torch.tensor([0.5 + seed / 10]).to(dtype),
            img_ids=torch.randint(0, 4, (seq, 3), generator=gen).float(),
            txt_ids=torch.zeros(txt, 3),
            return_dict=False,
        )
    raise ValueError(family)


def forward(model, family: str, seed: int, dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad():
        return model(**example_inputs(family, dtype, seed))[0]
