"""Text encoders that stream through the engine like a transformer (their own block lists).

Owns: `T5EncoderFamily` (`UMT5EncoderModel` of Wan, `T5EncoderModel` of Flux: blocks
`encoder.block`) and `QwenVLEncoderFamily` (Qwen-Image's Qwen2.5-VL: the language model's decoder
layers `model.language_model.layers`; the vision tower and the head stay whole). These are block-list adapters only (no pipeline of their own): `family_of` finds
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


class QwenVLEncoderFamily(Family):
    # Checkpoint keys as transformers 5 names the modules (`model.language_model.*`, `model.visual.*`,
    # as `dlo make-random-model` writes them); hub files saved by transformers 4 (`model.layers.*`,
    # `visual.*`) would need transformers' key conversion first.
    name = "qwen2.5-vl-encoder"
    class_names = ("Qwen2_5_VLForConditionalGeneration",)
    block_lists = ("model.language_model.layers",)
