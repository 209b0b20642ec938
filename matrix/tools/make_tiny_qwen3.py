"""Write random bf16 weights for a tiny Qwen3 into DIR (which already holds config.json and the tokenizer),
then read them back and check them.

Runs with a runtime's own interpreter (it needs torch, transformers and safetensors, not matrix). Nothing is
downloaded: the architecture comes from DIR/config.json and the weights are random, which is all a serving
test needs, as long as the model still writes visible text. A checkpoint that loads without an error may
not: zeros give uniform logits, and a random model whose output layer is tied to its embeddings tends to
repeat its last input token, which in a chat prompt was <unk>, skipped as special, so the completion was
blank. Whether that happened depended on the library's default initialisation, which differs between
transformers releases. So every parameter is initialised here from a fixed seed (the same file on any
host), and the saved file is checked (exit 3 with the reasons otherwise): the expected tensor names, no
NaN/inf, no constant matrix, the file equal to what was initialised, logits over the vocabulary that are
not uniform, and a greedy completion of a chat prompt that holds visible text.
    python make_tiny_qwen3.py DIR            write, then check
    python make_tiny_qwen3.py --check DIR    only check what DIR holds
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file  # type: ignore[import-not-found, unused-ignore]
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

SEED = 0
WEIGHTS_FILE = "model.safetensors"
# Logits of a random model vary by ~0.2 across the vocabulary; a loaded-but-zero model gives exactly 0.
MIN_LOGIT_STD = 1e-3
GREEDY_TOKENS = 8
CHAT_PROMPT = "Explain why prefill and decode run on separate workers, kalo mine."


def build(directory: Path) -> PreTrainedModel:
    """The architecture DIR/config.json describes, in bf16, before any weights are set."""
    config = AutoConfig.from_pretrained(directory)
    # The dtype is set afterwards: its keyword to from_config changed name between transformers releases.
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


def initialise(model: PreTrainedModel, std: float) -> None:
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)  # RMSNorm scales: identity, as in a freshly initialised model
            elif param.dim() >= 2:
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
                param.copy_(values.to(param.dtype))
            else:
                param.zero_()  # biases
    model.tie_weights()


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def check(directory: Path, model: PreTrainedModel, written: dict[str, torch.Tensor] | None) -> list[str]:
    """What is wrong with DIR's weights for `model`'s architecture; `written` is what was just initialised."""
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        return [f"{path} was not written"]
    saved = load_file(str(path))
    expected = set(model.state_dict())
    if model.config.tie_word_embeddings:
        expected = {k for k in expected if not k.startswith("lm_head.")}  # one tensor, saved once
    problems = [f"missing tensor {k}" for k in sorted(expected - set(saved))]
    problems += [f"unexpected tensor {k}" for k in sorted(set(saved) - expected - {"lm_head.weight"})]
    for name, tensor in sorted(saved.items()):
        values = tensor.float()
        if not torch.isfinite(values).all():
            problems.append(f"{name} has NaN or inf values")
        elif not _is_norm(name) and tensor.dim() >= 2 and float(values.std()) == 0.0:
            problems.append(f"{name} {tuple(tensor.shape)} is constant ({float(values.flatten()[0])})")
        elif _is_norm(name) and float(values.abs().max()) == 0.0:
            problems.append(f"{name} is all zero")
        if written is not None and name in written and not torch.equal(written[name].cpu(), tensor):
            problems.append(f"{name} read back differs from what was written")
    if problems:
        return problems
    model.load_state_dict(saved, strict=False)
    model.tie_weights()
    with torch.no_grad():
        logits = model(torch.tensor([[2, 10, 11, 12, 3, 2]])).logits[0, -1].float()
    if float(logits.std()) < MIN_LOGIT_STD:
        problems.append(f"logits over the vocabulary are uniform (std {float(logits.std()):.2e})")
    return problems or _check_chat_completion(directory, model)


def _check_chat_completion(directory: Path, model: PreTrainedModel) -> list[str]:
    """A greedy completion of a chat prompt must hold visible text: what a serving test checks."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    # Like a serving test's prompt: mostly words outside the vocabulary (<unk>), then the template's tail.
    message = {"role": "user", "content": CHAT_PROMPT}
    prompt = tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt)["input_ids"]
    generated: list[int] = []
    with torch.no_grad():
        for _ in range(GREEDY_TOKENS):
            next_id = int(model(torch.tensor([ids + generated])).logits[0, -1].argmax())
            generated.append(next_id)
            if next_id == tokenizer.eos_token_id:
                break
    text = tokenizer.decode(generated, skip_special_tokens=True)
    if len(generated) < 2 or not text.strip():
        return [f"a greedy chat completion is blank or ends at once: prompt ids {ids} -> {generated} ({text!r})"]
    return []


def main(argv: list[str]) -> int:
    only_check = argv[:1] == ["--check"]
    args = argv[1:] if only_check else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    directory = Path(args[0])
    model = build(directory)
    written = None
    if not only_check:
        initialise(model, std=float(getattr(model.config, "initializer_range", 0.02)))
        written = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.save_pretrained(directory, safe_serialization=True)
    problems = check(directory, model, written)
    if problems:
        print(f"bad weights in {directory}:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 3
    count = sum(p.numel() for p in model.parameters())
    print(f"{'checked' if only_check else 'wrote'} {count} random parameters in {directory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
