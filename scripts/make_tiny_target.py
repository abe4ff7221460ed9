#!/usr/bin/env python
"""Build a random-weight Llama target with a real trained BPE tokenizer and a chat template
that has a thinking section. Used by the tests (tiny preset: vLLM on CPU runs it in seconds)
and on GPU boxes to prove the GPU code paths at a real size (1b preset, no hub needed).

    python scripts/make_tiny_target.py --out /tmp/tiny --preset tiny
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli  # noqa: E402
from pipeline_lib.assets import resolve_asset  # noqa: E402
from pipeline_lib.errors import run_main  # noqa: E402
from pipeline_lib.io import atomic_dir  # noqa: E402

# ChatML with a thinking section: an assistant turn's `reasoning_content` is rendered inside
# <think>...</think> before the answer (the Qwen3 convention).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{ '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}"
    "{% endif %}"
    "{{ message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

PRESETS = {
    # 8 layers so speculators' default aux ids [2, 4, 5] are distinct; head_dim 64 for vLLM CPU.
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=2048, max_position_embeddings=2048),
    # A 1B-class Llama (Llama-3.2-1B shapes, smaller vocab), for GPU throughput runs.
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192),
}


def training_text(limit: int = 20000) -> list[str]:
    """Real English chat text for the BPE: the chitchat corpus shipped on PyPI."""
    data = json.loads(Path(resolve_asset("pypi:chitchat_dataset/dataset.json")).read_text())
    texts = []
    for conv in data.values():
        for turn in conv["messages"]:
            for msg in turn:
                texts.append(msg["text"])
                if len(texts) >= limit:
                    return texts
    return texts


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--out", required=True, help="output model dir")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    shape = dict(PRESETS[args.preset])
    tokenizer = build_tokenizer(min(shape["vocab_size"], 32000) if args.preset == "tiny" else 8192)
    shape["vocab_size"] = max(shape["vocab_size"], len(tokenizer))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos,
                         pad_token_id=pad, rms_norm_eps=1e-5, rope_theta=10000.0,
                         torch_dtype=args.dtype)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    with atomic_dir(args.out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None).save_pretrained(tmp)
    print(f"wrote {args.preset} target ({sum(p.numel() for p in model.parameters())/1e6:.2f}M params, "
          f"vocab {shape['vocab_size']}) to {args.out}")


if __name__ == "__main__":
    run_main(main)
