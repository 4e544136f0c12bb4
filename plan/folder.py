"""The plan's one door to a model folder: the engine's torch-free readers of safetensors headers,
configs and family block lists, named once here so that the node agent and the operator read
folders through the plan and never import the engine.

Owns: nothing of its own: `describe` (a transformer's `ModelFacts`), `pipeline_facts` and
`pipeline_index` (a diffusers pipeline folder), `read_header`, `CheckpointError`, `INDEX_SUFFIX`,
`MAX_HEADER_BYTES` (a safetensors file) and `class_fields_error` (a config's class fields), as the
engine defines them (`dlo.engine.checkpoint`, `dlo.engine.families`, `dlo.engine.blocks`).
Must never: import torch (these engine modules do not; `tests/test_skeleton.py` checks it).
"""

from __future__ import annotations

from dlo.engine.blocks import describe
from dlo.engine.checkpoint import INDEX_SUFFIX, MAX_HEADER_BYTES, CheckpointError, read_header
from dlo.engine.families import pipeline_facts, pipeline_index
from dlo.engine.families.base import class_fields_error

__all__ = ["describe", "pipeline_facts", "pipeline_index", "read_header", "CheckpointError", "INDEX_SUFFIX",
           "MAX_HEADER_BYTES", "class_fields_error"]
