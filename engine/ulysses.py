"""Wan's Ulysses self-attention with fewer copies and its exchanges beside compute (`DLO_ULYSSES`).

diffusers' Ulysses (`TemplatedUlyssesAttention`, diffusers 0.42) projects q, k and v, copies each into
the all-to-all's head-major layout, exchanges the three one after the other (each waited for at once),
runs attention, copies the output head-major again and exchanges it back: on a 480p Wan2.1-14B block on
two H200s, ~1.5-2.4 ms of all-to-alls and ~1.2 ms of five permute copies on top of half the one-GPU
block (record `raw-h200x2-sp-2026-11-30-profile`). `lean` (`DLO_ULYSSES=lean`) takes out three of those copies:

- q and k: the rotary embedding writes its result straight into the send buffer (diffusers writes a
  fresh tensor, then copies it head-major); v is still copied once.
- the output: one attention call over the whole sequence, as diffusers makes it, exchanged back in
  attention's own token-major layout (no copy for one request; diffusers copies it head-major first).
  Attention is not split by query chunk: flash attention picks its KV-split count from the number of
  query blocks, so a chunk's rows could sum in another order than the whole call's.
- `overlap` (`DLO_ULYSSES=overlap`, the default) also starts each input's exchange as soon as it is
  ready (`async_op=True`) and projects the next meanwhile.

Measured on two H200s at 40 layers, 480p (records `h200x2-sp-2026-12-01-lean`, `-lean-b`, `-whole`),
against diffusers' Ulysses:
`overlap` 0.986x resident, 0.995x with streamed weights (DLO); `lean` 0.99x resident but 1.033-1.041x
under DLO, whose weight gathers then run beside synchronous input exchanges. Hence `overlap` by
default; `DLO_ULYSSES=diffusers` goes back to diffusers' path.

Same values through the same attention call in the same dtype: the output is bit-identical to
diffusers' Ulysses and to one rank (tests/engine/test_seqpar.py on gloo; the sp bench's bitwise check
on NCCL) with the native attention backend (diffusers' default; other backends are called the same
way, but untested). Forward only: the exchanges carry no gradient (serving). Cross-attention (the
text's keys are not split), masks, fused projections, ring or uneven splits and head counts the sp
degree does not divide go through diffusers' processor as before.
"""

from __future__ import annotations

from typing import Any

# The order the inputs are projected and sent in (with `overlap`, the last one's exchange is exposed).
_ORDER = ("q", "k", "v")


def _rope_into(out: Any, x: Any, freqs_cos: Any, freqs_sin: Any) -> None:
    """Wan's rotary embedding of `x` written into `out` (any view of x's shape), op for op as
    diffusers' `WanAttnProcessor` applies it: the same values, elementwise (bitwise)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos


def _send_buffer(x: Any, world: int) -> tuple[Any, Any]:
    """The all-to-all buffer for `x` (B, S_local, H, D): (world, S_local, B, H/world, D), chunk r for
    rank r (diffusers' layout), and a (B, S_local, world, H/world, D) view of it to write x's heads into."""
    import torch

    b, s, h, d = x.shape
    buf = torch.empty((world, s, b, h // world, d), dtype=x.dtype, device=x.device)
    return buf, buf.permute(2, 1, 0, 3, 4)


def _forwarded(name: str) -> tuple[Any, Any]:
    """Getter and setter of the wrapped processor's attribute `name`."""
    return (lambda self: getattr(self.inner, name)), (lambda self, value: setattr(self.inner, name, value))


class UlyssesWanProcessor:
    """Wraps a (context-parallel) `WanAttnProcessor`: self-attention through DLO's exchanges (`lean`,
    or `overlap` when `overlap`), everything else through the wrapped processor."""

    def __init__(self, inner: Any, group: Any, world: int, *, overlap: bool = False) -> None:
        self.inner = inner
        self.group = group
        self.world = world
        self.overlap = overlap
        self.calls = 0  # self-attention calls that took DLO's path (tests, logs)

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

    def _project_into_send(self, attn: Any, x: Any, which: str, rotary_emb: Any) -> Any:
        """One of q, k, v with the norm and rotary embedding diffusers applies, written head-major into
        a fresh all-to-all buffer (q and k: by the rotary embedding itself, no copy of its own)."""
        if which == "v":
            t = attn.to_v(x).unflatten(2, (attn.heads, -1))
        else:
            proj, norm = (attn.to_q, attn.norm_q) if which == "q" else (attn.to_k, attn.norm_k)
            t = norm(proj(x)).unflatten(2, (attn.heads, -1))
        buf, view = _send_buffer(t, self.world)
        t = t.unflatten(2, (self.world, -1))
        if which == "v" or rotary_emb is None:
            view.copy_(t)
        else:
            cos, sin = (f.unsqueeze(-3) for f in rotary_emb)  # (.., S, 1, D) -> (.., S, 1, 1, D)
            _rope_into(view, t, cos, sin)
        return buf

    def _exchange_inputs(self, attn: Any, hidden_states: Any, rotary_emb: Any) -> dict[str, Any]:
        """q, k, v as (B, S, H/world, D): the whole sequence, this rank's heads."""
        import torch
        import torch.distributed as dist

        pending: dict[str, tuple[Any, Any, Any]] = {}
        for which in _ORDER:
            send = self._project_into_send(attn, hidden_states, which, rotary_emb)
            recv = torch.empty_like(send)
            work = dist.all_to_all_single(recv, send, group=self.group, async_op=self.overlap)
            pending[which] = (work, recv, send)  # `send` stays referenced until its exchange is waited for
        full = {}
        for which in _ORDER:
            work, recv, _ = pending.pop(which)
            if work is not None:
                work.wait()
            # (world, S_local, B, H/world, D) -> (B, S, H/world, D); no copy for B = 1
            full[which] = recv.flatten(0, 1).permute(1, 0, 2, 3).contiguous()
        return full

    def _attention_exchanged_back(self, full: dict[str, Any], s_local: int) -> Any:
        """Attention over the whole sequence with this rank's heads (one call, as diffusers makes it),
        exchanged back: (B, S_local, H * D), this rank's tokens with every rank's heads."""
        import torch
        import torch.distributed as dist
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        out = dispatch_attention_fn(full["q"], full["k"], full["v"], attn_mask=None, dropout_p=0.0, is_causal=False,
                                    backend=self._attention_backend, parallel_config=None)
        # (B, S, H/world, D) -> (world, B, S_local, H/world, D), token-major like attention's output:
        # no copy for B = 1 (diffusers sends head-major, a copy of the whole output)
        send = out.unflatten(1, (self.world, s_local)).transpose(0, 1).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        # (world, B, S_local, H/world, D) -> (B, S_local, H * D): every rank's heads in rank order
        return recv.permute(1, 2, 0, 3, 4).flatten(2, 4)

    def _self_attention(self, attn: Any, hidden_states: Any, rotary_emb: Any) -> Any:
        full = self._exchange_inputs(attn, hidden_states, rotary_emb)
        out = self._attention_exchanged_back(full, hidden_states.shape[1])
        out = out.to(full["q"].dtype)  # diffusers casts to the query's dtype
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


def use_dlo_ulysses(module: Any, group: Any, world: int, *, overlap: bool = False) -> int:
    """Wrap every `WanAttnProcessor` of `module` (after diffusers' `enable_parallelism`); returns how
    many were wrapped (0 for other families, which keep diffusers' Ulysses)."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    n = 0
    for m in module.modules():
        proc = getattr(m, "processor", None)
        if type(proc) is WanAttnProcessor and hasattr(m, "set_processor"):
            m.set_processor(UlyssesWanProcessor(proc, group, world, overlap=overlap))
            n += 1
    return n


def dlo_ulysses_calls(module: Any) -> int:
    """Self-attention calls of `module` that took DLO's Ulysses path so far."""
    return sum(getattr(m, "processor", None).calls for m in module.modules()
               if isinstance(getattr(m, "processor", None), UlyssesWanProcessor))
