"""Local model directories, generated here: nothing may come from a model hub at run time.

A *tiny* model directory holds what a serving frontend needs to load a model without weights:
`config.json` (a small Qwen3-shaped config), `tokenizer.json` (a word-level tokenizer in the Hugging Face
`tokenizers` format, written as plain JSON so no tokenizer library is needed) and `tokenizer_config.json`
with a chat template. Dynamo's mocker emits token ids 1000-1999, so the vocabulary must be larger.
Directories are cached under the data directory and built atomically (temp dir + rename), one build at a
time per directory (an flock()ed `.NAME.lock` beside it): the cells of a packed campaign all start at once and
would otherwise each run the weight generator, which on the H200 host made twelve concurrent builds (CPU
torch, each with every core's threads) outlast a 470 s campaign where one build alone takes 14 s.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from matrix.errors import ConfigError
from matrix.paths import data_dir

TINY = "tiny"
# With random weights, for engines that load a real model (vLLM); built with the runtime's interpreter.
TINY_RANDOM = "tiny-random"
DEFAULT_VOCAB = 4096
# Version of tools/make_tiny_qwen3.py's output, part of the cached directory's name: a generator change
# bumps it, so a directory an older generator wrote (possibly broken weights) is never reused.
WEIGHTS_VERSION = 3
# The file tools/make_tiny_qwen3.py writes the random weights to (transformers' single-file name).
WEIGHTS_FILE = "model.safetensors"
SPECIAL_TOKENS = ("<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
# The chat template's own words: without them a chat prompt ends in <unk> ("assistant"), and a random model
# tends to repeat its last input token, so it generated only <unk>, which detokenizes to blank text.
ROLE_WORDS = ("system", "user", "assistant")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Syllables make readable pseudo-words, so a generated completion is visibly text, not ids.
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vi", "so", "pe", "du", "ga", "zo", "fi", "hu", "be", "ya")


def _word(index: int) -> str:
    parts = []
    n = index
    while True:
        parts.append(_SYLLABLES[n % len(_SYLLABLES)])
        n //= len(_SYLLABLES)
        if n == 0:
            break
    return "".join(parts)


def tokenizer_json(vocab_size: int) -> dict[str, Any]:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + ROLE_WORDS)}
    for i in range(len(vocab), vocab_size):
        vocab[_word(i)] = i
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    ]  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def config_json(vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        # Untied: with a tied output layer a random model's logits peak at its last input token (an echo).
        "tie_word_embeddings": False,
        "bos_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"),
        "torch_dtype": "bfloat16",
    }


def tokenizer_config_json() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }


def ensure_tiny_model(
    vocab_size: int = DEFAULT_VOCAB, root: Path | None = None, *, weights_python: str | None = None, revision: int = 0
) -> Path:
    """The cached tiny model directory, built on first use; with random weights when `weights_python`
    (an interpreter with torch and transformers) is given. `revision` N > 0: another revision of the random
    model (the same config and tokenizer, weights from seed N), a directory of its own."""
    if vocab_size < 2048:
        raise ConfigError(f"tiny model vocab_size must be >= 2048 (mocker token ids reach 1999), got {vocab_size}")
    if revision and not weights_python:
        raise ConfigError('a revision of the tiny model needs random weights (model_dir = "tiny-random")')
    base = (root or data_dir()) / "models"
    suffix = f"-random-w{WEIGHTS_VERSION}" + (f"-r{revision}" if revision else "") if weights_python else ""
    target = base / f"tiny-qwen3-v{vocab_size}{suffix}"
    if (target / "tokenizer.json").is_file():
        return target
    base.mkdir(parents=True, exist_ok=True)
    with _build_lock(base / f".{target.name}.lock"):
        if (target / "tokenizer.json").is_file():  # another runner or thread built it while this one waited
            return target
        return _build(target, base, vocab_size, weights_python, revision)


@contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path`: runners and threads of one runner exclude each other (each opens the
    file), and a runner that dies releases it with its file descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _build(target: Path, base: Path, vocab_size: int, weights_python: str | None, revision: int) -> Path:
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=base))
    try:
        files = {
            "config.json": config_json(vocab_size),
            "tokenizer.json": tokenizer_json(vocab_size),
            "tokenizer_config.json": tokenizer_config_json(),
            "generation_config.json": {"eos_token_id": SPECIAL_TOKENS.index("<|im_end|>")},
        }
        for name, content in files.items():
            (staging / name).write_text(json.dumps(content, indent=1))
        if weights_python:
            _write_weights(weights_python, staging, revision)
        staging.chmod(0o755)  # mkdtemp makes it private; the model is for every engine process
        try:
            os.rename(staging, target)
        except OSError:
            # Another runner built it first: theirs is as good as ours.
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_weights(python: str, directory: Path, revision: int = 0) -> None:
    script = Path(__file__).with_name("tools") / "make_tiny_qwen3.py"
    seed = ["--seed", str(revision)] if revision else []
    result = subprocess.run(
        [python, str(script), *seed, str(directory)], capture_output=True, text=True, timeout=600, check=False
    )
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-20:])
        raise ConfigError(
            f"could not write random weights with {python} (it needs torch, transformers and safetensors; "
            f"exit {result.returncode}):\n{tail}"
        )


def resolve_model_dir(spec: str | None, source_dir: str, python: str | None = None) -> Path | None:
    """A case's `launch.model_dir`: "tiny" (generated), "tiny-random" (generated with random weights by the
    runtime's interpreter `python`), a path (relative to the case's directory), or None."""
    if not spec:
        return None
    if spec == TINY:
        return ensure_tiny_model()
    if spec == TINY_RANDOM:
        return ensure_tiny_model(weights_python=python or sys.executable)
    path = Path(source_dir, spec).expanduser()
    if not path.is_dir():
        raise ConfigError(f"model directory {path} does not exist: generate it or fix launch.model_dir")
    return path
