"""Text encoders that stream through the engine like a transformer (their own block lists).

Owns: `T5_ENCODER_BLOCKS` (`UMT5EncoderModel` of Wan, `T5EncoderModel` of Flux: blocks
`encoder.block`), `QWEN_VL_ENCODER_BLOCKS` (Qwen-Image's Qwen2.5-VL: the language model's
decoder layers `model.language_model.layers`; the vision tower and the head stay whole) and
`QWEN3_VL_ENCODER_BLOCKS` (MiniMax-H3's Qwen3-VL-32B: the same decoder layers; MiniMax-H3 reads
hidden state 50 of `text_encoder.model`, so `lm_head` (1.56 GB) never runs and stays in the host
page cache, and the 1.56 GB token embedding is looked up on the host). These are
the offload half of the family contract only (`BlockFamily`: no pipeline of their own):
`family_of` finds them for `dlo.engine.load`, the pipeline families name which of their components
may stream (`PipelineFamily.streamable_encoders`).
Must never: import torch or transformers.
"""

from __future__ import annotations

from dlo.engine.families.base import BlockFamily

T5_ENCODER_BLOCKS = BlockFamily("t5-encoder", ("UMT5EncoderModel", "T5EncoderModel"), ("encoder.block",))

# Checkpoint keys as transformers 5 names the modules (`model.language_model.*`, `model.visual.*`,
# as `dlo make-random-model` writes them); hub files saved by transformers 4 (`model.layers.*`,
# `visual.*`) would need transformers' key conversion first.
QWEN_VL_ENCODER_BLOCKS = BlockFamily("qwen2.5-vl-encoder", ("Qwen2_5_VLForConditionalGeneration",),
                                     ("model.language_model.layers",))

QWEN3_VL_ENCODER_BLOCKS = BlockFamily("qwen3-vl-encoder", ("Qwen3VLForConditionalGeneration",),
                                      ("model.language_model.layers",), unused=("lm_head",),
                                      host_lookups=("model.language_model.embed_tokens",))
