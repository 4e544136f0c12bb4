"""Serving limits: defaults, the small profile, a file, then flags, in that order."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from dlo.plan.limits import SMALL, Limits


def test_file_overrides_base_and_flags_override_file(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"max_steps": 3, "max_frames": 5}))
    lim = Limits.load(path, SMALL, max_steps=None, max_width=96)
    assert (lim.max_steps, lim.max_frames, lim.max_width, lim.max_height) == (3, 5, 96, SMALL.max_height)


def test_yaml_file_and_defaults(tmp_path):
    path = tmp_path / "limits.yaml"
    path.write_text("max_n: 1\n")
    lim = Limits.load(path)
    assert lim.max_n == 1 and lim.max_steps == Limits().max_steps


def test_unknown_or_invalid_limit_is_rejected(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"max_stepz": 3}))
    with pytest.raises(ValidationError, match="max_stepz"):
        Limits.load(path)
    with pytest.raises(ValidationError):
        Limits.load(None, max_steps=0)
