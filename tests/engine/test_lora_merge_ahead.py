"""The look-ahead merge of streamed layers (`dlo.engine.lora.ahead`, [Note: merging ahead]), on cpu
where a queued merge is made at once: the same logic as on cuda without the overlap."""

from __future__ import annotations

import torch

from dlo.engine.lora.ahead import MergeAhead
from dlo.engine.lora.bank import LoraBank
from dlo.engine.lora.merge import MergeScratch
from dlo.engine.lora.weights import Branch


def _setup():
    torch.manual_seed(3)
    # two "blocks" of three layers of one shape: the look-ahead and the bank's scratch hold views of
    # the same shape, so a merge queued into the buffer the running layer reads (the second layer's,
    # taken from the look-ahead, while the third's is queued) would change its output
    model = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(6)))
    for p in model.parameters():
        p.requires_grad_(False)
    streamed = {layer: i // 3 for i, layer in enumerate(model)}
    adapters = {"a": {layer: Branch(torch.randn(2, 6), torch.randn(6, 2), torch.randn(6), 0.5) for layer in model}}
    return model, streamed, adapters, [b for br in adapters.values() for b in br.values()]


def _bank(adapters, branches, streamed, ahead: bool) -> LoraBank:
    cpu = torch.device("cpu")
    return LoraBank(adapters, scratch=MergeScratch(branches, cpu), streamed=streamed,
                    ahead=MergeAhead(MergeScratch(branches, cpu)) if ahead else None)


def test_merging_ahead_takes_the_next_layers_merge_and_changes_no_bit():
    """The first call learns the order; later calls take each block's second layer as queued (never
    across a block's end), and every call equals the bank without look-ahead bit for bit."""
    model, streamed, adapters, branches = _setup()
    plain, ahead = _bank(adapters, branches, streamed, False), _bank(adapters, branches, streamed, True)
    x = torch.randn(5, 6)
    with torch.inference_mode():
        for call in range(3):
            with plain.applied("a", 0.7):
                expected = model(x)
            with ahead.applied("a", 0.7):
                got = model(x)
            assert torch.equal(got, expected), call
            assert ahead.ahead.hits == 4 * call, (call, ahead.ahead.hits)  # layers 1, 2, 4, 5 from the second call
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in model)


def test_a_queued_merge_of_another_weight_is_dropped():
    """A layer whose bound weight is not the one its merge was queued from (a block rebound between)
    merges again: the output is the new weight's."""
    model, streamed, adapters, branches = _setup()
    plain, ahead = _bank(adapters, branches, streamed, False), _bank(adapters, branches, streamed, True)
    x = torch.randn(5, 6)
    with torch.inference_mode():
        with ahead.applied("a"):
            model(x)  # learns the order
        hits = ahead.ahead.hits
        new = torch.nn.Parameter(torch.randn(6, 6), requires_grad=False)

        def rebind(_m, _args, _out):
            model[1]._parameters["weight"] = new

        handle = model[0].register_forward_hook(rebind)  # after layer 0's pre-hook queued layer 1's merge
        try:
            with ahead.applied("a"):
                got = model(x)
            with plain.applied("a"):
                expected = model(x)
        finally:
            handle.remove()
    assert torch.equal(got, expected)
    assert ahead.ahead.hits == hits + 3  # layers 2, 4, 5: layer 1's queued merge was of the old weight
