"""The base of every DLODeployment model: camelCase field names, unknown fields refused.

Owns: `SpecModel`. Must never: talk to the API server or import torch.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class SpecModel(BaseModel):
    """camelCase aliases, snake_case names in Python; extra fields are errors; defaults validated."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_default=True
    )
