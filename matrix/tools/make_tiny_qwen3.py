"""Write random bf16 weights for a tiny Qwen3 into DIR (which already holds config.json and the tokenizer).

Runs with a runtime's own interpreter (it needs torch and transformers, not matrix). Nothing is downloaded:
the architecture comes from DIR/config.json, the weights are random, which is all a serving test needs.
    python make_tiny_qwen3.py DIR
"""

import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> int:
    target = sys.argv[1]
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(target)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    # Special tokens get zero embeddings (hence zero logits with tied embeddings), so greedy decoding of
    # random weights emits ordinary words instead of specials that detokenise to an empty completion.
    specials = [i for i in (config.bos_token_id, config.eos_token_id, 0, 1, 2, 3) if i is not None]
    with torch.no_grad():
        model.get_input_embeddings().weight[sorted(set(specials))] = 0
    model.save_pretrained(target, safe_serialization=True)
    print(f"wrote {sum(p.numel() for p in model.parameters())} random parameters to {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
