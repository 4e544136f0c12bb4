"""Ulysses self-attention for Wan blocks with the q/k/v all-to-alls overlapped with the projections.

diffusers' Ulysses (`TemplatedUlyssesAttention`, diffusers 0.42) projects q, k and v, then exchanges
the three one after the other, each waited for at once: exchange and compute take turns (a 480p
Wan2.1-14B block on two H200s: ~45 ms, of which ~1.5-2.4 ms all-to-alls and ~1.2 ms the permutes
around them; bench/NOTES.md section 13). Here each tensor's exchange starts as soon as that tensor is ready (on
the communicator's stream, `async_op=True`) and runs while the next projection computes; only the
last input exchange and the output's are exposed. Opt-in (`DLO_ULYSSES_OVERLAP=1`): measured on two
H200s at 40 layers it took 0.4-0.6% off resident Ulysses-2 and nothing, once 3.8%, off or onto DLO +
Ulysses-2, where the exchanges then run beside the weight gathers (bench/NOTES.md section 13).

Same tensors, same layouts and the same attention call as diffusers' path, in the same dtype: the
output is bit-identical to diffusers' Ulysses and to one rank (tests/engine/test_seqpar.py on
gloo; bench/results/h200x2-sp-2026-11-30-overlap*.md for NCCL) with the native attention backend
(diffusers' default; other backends are called the same way, but untested). Forward only: the
exchanges carry no gradient (serving). Cross-attention (the text's keys are not split), masks, fused
projections and head counts the sp degree does not divide go through diffusers' processor as before.
"""

from __future__ import annotations

from typing import Any

# The order the inputs are projected and sent in: the last one's exchange is the one left exposed.
_ORDER = ("q", "k", "v")


def _rope(x: Any, freqs_cos: Any, freqs_sin: Any) -> Any:
    """Wan's rotary embedding, op for op as diffusers' `WanAttnProcessor` applies it (bitwise)."""
    import torch

    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def _to_heads_major(x: Any, world: int) -> Any:
    """(B, S_local, H, D) -> (world, S_local, B, H/world, D), contiguous: chunk r goes to rank r."""
    b, s, h, d = x.shape
    return x.reshape(b, s, world, h // world, d).permute(2, 1, 0, 3, 4).contiguous()


def _forwarded(name: str) -> tuple[Any, Any]:
    """Getter and setter of the wrapped processor's attribute `name`."""
    return (lambda self: getattr(self.inner, name)), (lambda self, value: setattr(self.inner, name, value))


class OverlappedUlyssesWanProcessor:
    """Wraps a (context-parallel) `WanAttnProcessor`: self-attention with the exchanges overlapped,
    everything else through the wrapped processor."""

    def __init__(self, inner: Any, group: Any, world: int) -> None:
        self.inner = inner
        self.group = group
        self.world = world
        self.calls = 0  # self-attention calls that took the overlapped path (tests, logs)

    # diffusers sets and reads these on every processor (set_attention_backend, enable_parallelism)
    _attention_backend = property(*_forwarded("_attention_backend"))
    _parallel_config = property(*_forwarded("_parallel_config"))

    def __call__(self, attn: Any, hidden_states: Any, encoder_hidden_states: Any = None,
                 attention_mask: Any = None, rotary_emb: Any = None, **kwargs: Any) -> Any:
        if (encoder_hidden_states is not None or attention_mask is not None or kwargs
                or not self._plain_ulysses() or getattr(attn, "fused_projections", False)
                or attn.heads % self.world):
            return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        self.calls += 1
        return self._self_attention(attn, hidden_states, rotary_emb)

    def _plain_ulysses(self) -> bool:
        """Context parallelism on, as Ulysses alone over this wrapper's group: no ring, no uneven
        ("anything") split. Anything else stays with diffusers."""
        cp = getattr(self._parallel_config, "context_parallel_config", None)
        return (cp is not None and cp.ring_degree == 1 and cp.ulysses_degree == self.world
                and not getattr(cp, "ulysses_anything", False))

    def _project(self, attn: Any, x: Any, which: str, rotary_emb: Any) -> Any:
        """One of q, k, v as (B, S_local, H, D), with the norm and rotary embedding diffusers applies."""
        if which == "v":
            return attn.to_v(x).unflatten(2, (attn.heads, -1))
        proj, norm = (attn.to_q, attn.norm_q) if which == "q" else (attn.to_k, attn.norm_k)
        t = norm(proj(x)).unflatten(2, (attn.heads, -1))
        return t if rotary_emb is None else _rope(t, *rotary_emb)

    def _self_attention(self, attn: Any, hidden_states: Any, rotary_emb: Any) -> Any:
        import torch
        import torch.distributed as dist
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        w = self.world
        b, s_local, _ = hidden_states.shape
        pending: dict[str, tuple[Any, Any, Any]] = {}
        for which in _ORDER:
            send = _to_heads_major(self._project(attn, hidden_states, which, rotary_emb), w)
            recv = torch.empty_like(send)
            work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
            pending[which] = (work, recv, send)  # `send` stays referenced until its exchange is waited for
        full = {}
        for which in _ORDER:
            work, recv, _ = pending.pop(which)
            work.wait()
            # (world, S_local, B, H/world, D) -> (B, S, H/world, D): the whole sequence, this rank's heads
            full[which] = recv.flatten(0, 1).permute(1, 0, 2, 3).contiguous()
        out = dispatch_attention_fn(full["q"], full["k"], full["v"], attn_mask=None, dropout_p=0.0,
                                    is_causal=False, backend=self._attention_backend, parallel_config=None)
        h_local, d = out.shape[2], out.shape[3]
        send = out.reshape(b, w, s_local, h_local, d).permute(1, 3, 0, 2, 4).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        # (world, H/world, B, S_local, D) -> (B, S_local, H, D): this rank's tokens, every head
        out = recv.flatten(0, 1).permute(1, 2, 0, 3).contiguous()
        out = out.flatten(2, 3).to(full["q"].dtype)  # diffusers casts to the query's dtype
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


def overlap_ulysses(module: Any, group: Any, world: int) -> int:
    """Wrap every `WanAttnProcessor` of `module` (after diffusers' `enable_parallelism`); returns how
    many were wrapped (0 for other families, which keep diffusers' Ulysses)."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    n = 0
    for m in module.modules():
        proc = getattr(m, "processor", None)
        if type(proc) is WanAttnProcessor and hasattr(m, "set_processor"):
            m.set_processor(OverlappedUlyssesWanProcessor(proc, group, world))
            n += 1
    return n


def overlapped_calls(module: Any) -> int:
    """Self-attention calls of `module` that took the overlapped path so far."""
    return sum(getattr(m, "processor", None).calls for m in module.modules()
               if isinstance(getattr(m, "processor", None), OverlappedUlyssesWanProcessor))
