"""serving/api_keys.py: named keys from a file of `name: key` lines or from a folder laid out as a
mounted Kubernetes Secret (timestamped folder, `..data` link, one link per key), and every refusal
in one line that never holds a key."""

from __future__ import annotations

import os

import pytest

from dlo.serving.api_keys import MAX_KEYS, ApiKeyError, read_api_keys
from tests.engine.serving_helpers import secret_volume


def test_a_mounted_secret_gives_each_key_its_name(tmp_path):
    folder = secret_volume(tmp_path / "keys", {"alice": b"sk-alice\n", "ops": b"sk-ops"}, mode=0o440)
    assert read_api_keys(folder) == {"alice": "sk-alice", "ops": "sk-ops"}


def test_a_file_of_name_key_lines_with_comments(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# who may call\nalice: sk-a:with-colon\n\n  bob :  sk-b  \n")
    assert read_api_keys(f) == {"alice": "sk-a:with-colon", "bob": "sk-b"}


SECRET = "sk-secret-value-1"


@pytest.mark.parametrize("text, fragment", [
    (f"Alice_1: {SECRET}\n", "line 1: the name before ':' is not a key name"),
    (f"{SECRET}\n", "line 1: expected 'name: key'"),
    (f"alice: {SECRET}\nalice: sk-2\n", "line 2: the name 'alice' is given twice"),
    (f"alice: {SECRET}\nbob: {SECRET}\n", "'alice' and 'bob' have the same key"),
    ("alice: two words\n", "a key must be printable ASCII"),
    ("alice:\n", "(key of 'alice') is empty"),
    ("# nobody\n", "holds no keys"),
    ("".join(f"t{i}: k{i}\n" for i in range(MAX_KEYS + 1)), f"at most {MAX_KEYS}"),
])
def test_a_bad_keys_file_is_one_line_that_never_holds_a_key(tmp_path, text, fragment):
    f = tmp_path / "keys"
    f.write_text(text)
    with pytest.raises(ApiKeyError) as refused:
        read_api_keys(f)
    message = str(refused.value)
    assert fragment in message and message.startswith(f"--api-keys {f}")
    assert "\n" not in message and SECRET not in message


def test_a_bad_secret_file_name_and_a_fifo_are_refused_without_hanging(tmp_path):
    folder = secret_volume(tmp_path / "upper", {"Alice": b"sk-a"})
    with pytest.raises(ApiKeyError, match="'Alice' is not a key name"):
        read_api_keys(folder)
    fifo_folder = tmp_path / "fifo"
    fifo_folder.mkdir()
    os.mkfifo(fifo_folder / "alice")
    with pytest.raises(ApiKeyError, match="not a regular file"):
        read_api_keys(fifo_folder)
