"""Layout and shard math (docs/contracts.md section 4), property-tested."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dlo.engine.layout import ALIGN, build_layout, shard_bytes, shard_pieces

tensor = st.tuples(
    st.sampled_from(["F32", "BF16", "F16", "I8", "F64"]),
    st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
)


@given(st.lists(tensor, min_size=1, max_size=12), st.integers(1, 9))
def test_shards_cover_the_padded_layout_exactly(specs, g):
    lay = build_layout([(f"t{i}", d, s) for i, (d, s) in enumerate(specs)])
    for t in lay.tensors:
        assert t.offset % ALIGN == 0
    assert lay.nbytes % ALIGN == 0 and lay.nbytes >= max(t.end for t in lay.tensors)
    s = shard_bytes(lay.nbytes, g)
    assert s % ALIGN == 0 and g * s >= lay.nbytes and (g - 1) * s < lay.nbytes + g * ALIGN
    # every tensor byte lands in exactly one rank's shard, at the right offset
    covered = {t.name: bytearray(t.nbytes) for t in lay.tensors}
    for r in range(g):
        for p in shard_pieces(lay, g, r):
            t = next(x for x in lay.tensors if x.name == p.name)
            assert 0 <= p.dst and p.dst + p.n <= s
            assert r * s + p.dst == t.offset + p.src  # virtual position is preserved
            for b in range(p.src, p.src + p.n):
                covered[p.name][b] += 1
    assert all(all(c == 1 for c in v) for v in covered.values())


def test_shard_bytes_examples():
    assert shard_bytes(0, 4) == 0
    assert shard_bytes(1, 1) == 256
    assert shard_bytes(1000, 4) == 256
    assert shard_bytes(1025, 4) == 512
    # a Wan2.1-14B block (0.703 GB) over 8 ranks
    assert shard_bytes(703_000_000, 8) == 87_875_072


def test_mixed_dtypes_keep_file_order_and_alignment():
    lay = build_layout([("w", "BF16", (3, 5)), ("n", "F32", (7,)), ("b", "BF16", (1,))])
    assert [t.offset for t in lay.tensors] == [0, 256, 512]
    assert lay.nbytes == 768
