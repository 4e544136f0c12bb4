"""Text encoders that stream through the engine like a transformer (their own block lists).

Owns: `T5EncoderFamily` (`UMT5EncoderModel` of Wan, `T5EncoderModel` of Flux: blocks
`encoder.block`). These are block-list adapters only (no pipeline of their own): `family_of` finds
them for `dlo.engine.load`, the pipeline families name which of their components may stream
(`Family.streamable_encoders`).
Must never: import torch or transformers at import time.
"""

from __future__ import annotations

from dlo.engine.families.base import Family


class T5EncoderFamily(Family):
    name = "t5-encoder"
    class_names = ("UMT5EncoderModel", "T5EncoderModel")
    block_lists = ("encoder.block",)
