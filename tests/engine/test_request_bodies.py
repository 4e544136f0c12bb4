"""Form data of `POST /v1/videos` (`dlo.serving.request_bodies.nested_form`): a nested `extra_body`
value as the official SDK writes it (`cache[preset]`, `cache[mag_ratios][]` once per item) comes
back as the object it was, its numbers as numbers; a field both plain and nested is a 400 naming it."""

from __future__ import annotations

import pytest

from dlo.serving.api_models import ApiError
from dlo.serving.request_bodies import nested_form


def test_nested_fields_fold_back_into_objects_and_lists():
    got = nested_form([("prompt", "a lighthouse"), ("seed", "5"), ("cache[preset]", "mag"),
                       ("cache[threshold]", "0.06"), ("cache[mag_ratios][]", "1.0"), ("cache[mag_ratios][]", "0.98"),
                       ("cache[note]", "text"), ("tags[]", "a"), ("tags[]", "2")])
    assert got == {"prompt": "a lighthouse", "seed": "5",  # plain fields as they came (the model coerces them)
                   "cache": {"preset": "mag", "threshold": 0.06, "mag_ratios": [1.0, 0.98], "note": "text"},
                   "tags": ["a", 2]}


def test_a_field_both_plain_and_nested_is_refused_naming_it():
    for items in ([("cache", "first-block"), ("cache[threshold]", "0.2")],
                  [("cache[threshold]", "0.2"), ("cache", "first-block")]):  # either order
        with pytest.raises(ApiError) as e:
            nested_form(items)
        assert e.value.status == 400 and e.value.param == "cache"
