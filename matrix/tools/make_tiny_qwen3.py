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

Decisive logits (the equivalence oracle compares greedy token ids of a disaggregated pair with an aggregated
instance, so a near-tie anywhere turns numerics into a divergence): plain random weights give top-1/top-2
gaps of a few hundredths of a nat, so a bf16 rounding flips the argmax; scaling the output layer only scales
the rounding with it. So the random weights are shaped into a small circuit whose argmax is decided by a
margin, and which still reads the KV cache: a codebook of 64 orthonormal directions (one per *output word*,
1- and 2-syllable words of the vocabulary); every token's embedding points at the codeword of its successor
word (a random map) in the first 64 dimensions, with a random signature in the other 64 that attention keys
on; layer 0 has one sharp attention pattern (two heads sharing it) whose values copy the attended token's
codeword with gain GAIN; everything else is quiet (std QUIET). The next token is the successor of the token
attention picks (by the KV cache), or of the current one: the two compete with coefficients GAIN and 1, so
the gap is large unless attention itself is split. `check` measures it: greedy steps whose top-1/top-2 gap is
below NEAR_TIE_NATS must stay rare, decoding with the KV cache must equal recomputing the prompt, and a
corrupted KV cache must change the continuation (the oracle can see wrong KV).
    python make_tiny_qwen3.py DIR            write, then check
    python make_tiny_qwen3.py --seed N DIR   write another revision (same architecture and tokenizer, other
                                             weights: another successor map), then check
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
# The circuit (see the module docstring).
CODEWORDS = 64
GAIN = 3.0
EMBED_NORM = 8.0
ATTENTION_SHARPNESS = 12.0  # q_norm scale: attention scores with a standard deviation of about this
QUIET = 1e-3
# The decisiveness check: prompts x greedy tokens, the gap (nats) below which a step is a near-tie, and the
# share of near-tie steps allowed; corrupting the KV cache must change at least this share of continuations.
CHECK_PROMPTS, CHECK_TOKENS = 6, 24
NEAR_TIE_NATS = 0.5
MAX_NEAR_TIE_SHARE = 0.03
MIN_KV_SENSITIVITY = 0.5
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vi", "so", "pe", "du", "ga", "zo", "fi", "hu", "be", "ya")


def build(directory: Path) -> PreTrainedModel:
    """The architecture DIR/config.json describes, in bf16, before any weights are set."""
    config = AutoConfig.from_pretrained(directory)
    # The dtype is set afterwards: its keyword to from_config changed name between transformers releases.
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


def initialise(model: PreTrainedModel, std: float, seed: int = SEED) -> None:
    generator = torch.Generator().manual_seed(seed)
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
    shape_circuit(model, seed)


def shape_circuit(model: PreTrainedModel, seed: int = SEED) -> None:
    """Make the logits decisive while the KV cache still decides them (the module docstring says how)."""
    cfg = model.config
    d, vocab, head_dim = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    half = d // 2
    if half < CODEWORDS or cfg.num_attention_heads != 4 or cfg.num_key_value_heads != 2 or 2 * head_dim != half:
        raise SystemExit(f"shape_circuit expects hidden {d} = 4 heads x {head_dim} with 2 KV heads")
    gen = torch.Generator().manual_seed(seed + 1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    codebook = torch.linalg.qr(randn(half, half))[0][:, :CODEWORDS].T  # CODEWORDS orthonormal rows
    # Output words: 1- and 2-syllable words of the tokenizer's vocabulary (visible text, never special).
    word_ids = [i for i in range(7, vocab) if 2 <= len(_word(i)) <= 4][: 4 * CODEWORDS]
    order = torch.randperm(len(word_ids), generator=gen)[:CODEWORDS]
    outputs = [word_ids[int(i)] for i in order]
    successor = torch.randint(0, CODEWORDS, (vocab,), generator=gen)
    embed = torch.zeros(vocab, d)
    embed[:, :half] = EMBED_NORM * codebook[successor] @ torch.eye(CODEWORDS, half)
    embed[:, half:] = randn(vocab, half) * (EMBED_NORM / half**0.5)
    head = randn(vocab, d) * QUIET
    for k, token in enumerate(outputs):
        head[token] = 0.0
        head[token, :half] = codebook[k] @ torch.eye(CODEWORDS, half)
    shared_q, shared_k = randn(head_dim, d) / d**0.5, randn(head_dim, d) / d**0.5
    with torch.no_grad():
        params = dict(model.named_parameters())
        params["model.embed_tokens.weight"].copy_(embed)
        params["lm_head.weight"].copy_(head)
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                params[p + name + ".weight"].copy_(randn(*params[p + name + ".weight"].shape) * QUIET)
        p = "model.layers.0.self_attn."
        q, k, v, o = (params[p + n + "_proj.weight"] for n in "qkvo")
        for first in (0, 2 * head_dim):  # heads 0 and 2 (one per KV head) attend alike
            q[first : first + head_dim] = shared_q
        for first in (0, head_dim):  # both KV heads key alike
            k[first : first + head_dim] = shared_k
        v.copy_(torch.cat([GAIN * torch.eye(half), torch.zeros(half, half)], dim=1))
        o[:head_dim, :head_dim] = torch.eye(head_dim)  # head 0 -> codeword dims 0..head_dim
        o[head_dim:half, 2 * head_dim : 3 * head_dim] = torch.eye(head_dim)  # head 2 -> the next head_dim
        params[p + "q_norm.weight"].fill_(ATTENTION_SHARPNESS)


def _word(index: int) -> str:
    """The tokenizer's word for `index` (matrix.model_files._word: syllables, least significant first)."""
    parts, n = [], index
    while True:
        parts.append(_SYLLABLES[n % len(_SYLLABLES)])
        n //= len(_SYLLABLES)
        if n == 0:
            return "".join(parts)


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
    return problems or _check_chat_completion(directory, model) or _check_decisive(directory, model)


def _greedy(model: PreTrainedModel, ids: list[int], count: int, corrupt: bool = False) -> tuple[list[int], list[float]]:
    """Greedy tokens decoded with the KV cache, and each step's top-1/top-2 gap; `corrupt` first replaces
    the prompt's cached keys and values with those of another prompt (what a wrong KV block does)."""
    out: list[int] = []
    gaps: list[float] = []
    with torch.no_grad():
        result = model(torch.tensor([ids]), use_cache=True)
        cache = result.past_key_values
        if corrupt:
            other = model(torch.tensor([list(reversed(ids))]), use_cache=True).past_key_values
            for layer, alien in zip(cache.layers, other.layers, strict=True):
                layer.keys.copy_(alien.keys)
                layer.values.copy_(alien.values)
        logits = result.logits[0, -1].float()
        for _ in range(count):
            top = logits.topk(2)
            gaps.append(float(top.values[0] - top.values[1]))
            out.append(int(top.indices[0]))
            result = model(torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True)
            cache, logits = result.past_key_values, result.logits[0, -1].float()
    return out, gaps


def _check_decisive(directory: Path, model: PreTrainedModel) -> list[str]:
    """Near-ties rare, the KV cache path equal to recomputation, a corrupted KV cache visible."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    gen = torch.Generator().manual_seed(SEED + 2)
    gaps: list[float] = []
    problems, changed = [], 0
    for n in range(CHECK_PROMPTS):
        words = torch.randint(7, 7 + 16 * 16 + 16, (int(torch.randint(8, 40, (1,), generator=gen)),), generator=gen)
        ids = tokenizer(" ".join(_word(int(w)) for w in words))["input_ids"]
        cached, step_gaps = _greedy(model, ids, CHECK_TOKENS)
        gaps += step_gaps
        with torch.no_grad():  # recompute every step from scratch: what an engine without the cache does
            recomputed: list[int] = []
            for _ in range(CHECK_TOKENS):
                recomputed.append(int(model(torch.tensor([ids + recomputed])).logits[0, -1].float().argmax()))
        if recomputed != cached:
            problems.append(f"prompt {n}: greedy tokens with the KV cache {cached} differ from recomputed {recomputed}")
        changed += _greedy(model, ids, CHECK_TOKENS, corrupt=True)[0] != cached
    share = sum(g < NEAR_TIE_NATS for g in gaps) / len(gaps)
    if share > MAX_NEAR_TIE_SHARE:
        problems.append(f"{share:.1%} of greedy steps are near-ties (top-1/top-2 gap < {NEAR_TIE_NATS} nats)")
    if changed < MIN_KV_SENSITIVITY * CHECK_PROMPTS:
        problems.append(f"a corrupted KV cache changed only {changed}/{CHECK_PROMPTS} continuations")
    gaps.sort()
    print(
        f"decisive: {share:.1%} near-tie steps, gap p5 {gaps[len(gaps) // 20]:.2f} median {gaps[len(gaps) // 2]:.2f}"
        f" nats; corrupted KV changed {changed}/{CHECK_PROMPTS} continuations"
    )
    return problems


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
    seed = SEED
    if not only_check and args[:1] == ["--seed"] and len(args) == 3 and args[1].isdigit():
        seed, args = int(args[1]), args[2:]
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    directory = Path(args[0])
    model = build(directory)
    written = None
    if not only_check:
        initialise(model, std=float(getattr(model.config, "initializer_range", 0.02)), seed=seed)
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
