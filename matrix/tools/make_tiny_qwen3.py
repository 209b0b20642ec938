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
    model.save_pretrained(target, safe_serialization=True)
    print(f"wrote {sum(p.numel() for p in model.parameters())} random parameters to {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
