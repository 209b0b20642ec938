"""The generated tiny model directory loads with the real `tokenizers` library and decodes mocker ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from matrix.errors import ConfigError
from matrix.models import ensure_tiny_model, resolve_model_dir


def test_tiny_model_is_cached_and_loads(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    path = ensure_tiny_model(root=tmp_path)
    assert ensure_tiny_model(root=tmp_path) == path
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == 4096
    text = tok.decode(list(range(1000, 2000)))  # the ids Dynamo's mocker emits
    assert len(text.split()) == 1000
    encoded = tok.encode("<|im_start|>user\nkalo mine<|im_end|>")
    assert encoded.ids[0] == 2 and 3 in encoded.ids
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == 4096
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())
    assert not list(path.parent.glob(".building-*"))  # built atomically, nothing half left


def test_model_dir_resolution(tmp_path: Path) -> None:
    assert resolve_model_dir(None, str(tmp_path)) is None
    (tmp_path / "m").mkdir()
    assert resolve_model_dir("m", str(tmp_path)) == tmp_path / "m"
    with pytest.raises(ConfigError, match=r"model directory .* does not exist"):
        resolve_model_dir("missing", str(tmp_path))
    with pytest.raises(ConfigError, match="vocab_size must be >= 2048"):
        ensure_tiny_model(1000, root=tmp_path)
