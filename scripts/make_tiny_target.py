#!/usr/bin/env python
"""Build a random-weight Llama target with a real trained BPE tokenizer and a chat template
that has a thinking section. Used by the tests (tiny preset: vLLM on CPU runs it in seconds)
and on GPU nodes to prove the GPU code paths at a real size (1b preset, no hub needed).

The tiny-reasoning preset is the tiny shape with weights set on purpose so that greedy
decoding reasons and then answers, as a thinking model does: its chat template opens
`<think>` in the generation prompt, and from there the target writes REASONING, `</think>`,
ANSWER and its end-of-turn token, whatever the prompt. (Embeddings are scaled up so the last
token dominates the final hidden state, and the lm_head maps each token of that chain to the
next one; the random layers still mix in a little context.) vLLM's deepseek_r1 parser then
really splits reasoning from answer; the think markers are plain added tokens, as in real
thinking models, so they survive detokenization.

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
THINK_MARKERS = ["<think>", "</think>"]
# tiny-reasoning: the generation prompt opens the thinking section; a finished assistant turn
# renders exactly the tokens the target generates (reasoning, </think>, answer, end of turn).
REASONING_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{ '<think>' + message['reasoning_content'] + '</think>' }}"
    "{% endif %}"
    "{{ message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>' }}{% endif %}"
)
# What the tiny-reasoning target says (every token of the chain must be distinct).
REASONING = "Let me think about what they want first."
ANSWER = "Good morning, nice talking with you!"
# Scale of the embeddings relative to the random layers' output (std 0.02 init): the last
# token then decides the next one by a wide margin in bf16 and fp32 alike.
REASONING_EMBED_STD = 1.0

PRESETS = {
    # 8 layers so speculators' default aux ids [2, 4, 5] are distinct; head_dim 64 for vLLM CPU.
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=2048, max_position_embeddings=2048),
    # A 1B-class Llama (Llama-3.2-1B shapes, smaller vocab), for GPU throughput runs.
    "tiny-reasoning": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=2,
                           num_key_value_heads=1, vocab_size=2048, max_position_embeddings=2048),
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


def build_tokenizer(vocab_size: int, reasoning: bool = False):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A reasoning target keeps its think markers out of the special tokens (they must survive
    # detokenization for the reasoning parser) and adds them after training, in the same ids.
    specials = [t for t in SPECIALS if t not in THINK_MARKERS] if reasoning else SPECIALS
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - (len(THINK_MARKERS) if reasoning else 0),
                                  special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(), trainer=trainer)
    if reasoning:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_MARKERS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = REASONING_CHAT_TEMPLATE if reasoning else CHAT_TEMPLATE
    return fast


def reasoning_chain(tokenizer) -> list[int]:
    """The token ids the tiny-reasoning target emits after its generation prompt, starting
    with the prompt's last token (`<think>`)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    chain = [prompt[-1], *encode(REASONING), tokenizer.convert_tokens_to_ids("</think>"), *encode(ANSWER),
             tokenizer.eos_token_id]
    if len(set(chain)) != len(chain):  # a bigram chain needs every token once
        raise ValueError(f"REASONING/ANSWER repeat a token: {tokenizer.convert_ids_to_tokens(chain)}")
    return chain


def plant_reasoning(model, chain: list[int]) -> None:
    """Weights that make greedy decoding follow `chain`: each chain token's lm_head row points
    along the previous token's (normalized) embedding, which dominates the final hidden state."""
    import torch

    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed.normal_(0.0, REASONING_EMBED_STD)
        head = model.get_output_embeddings().weight
        scale = head.detach().float().norm(dim=1).mean() * 20
        for current, following in zip(chain, chain[1:]):
            direction = embed[current].float() / embed[current].float().norm()
            head[following] = (direction * scale).to(head.dtype)


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
    reasoning = args.preset == "tiny-reasoning"
    tokenizer = build_tokenizer(min(shape["vocab_size"], 32000) if args.preset.startswith("tiny") else 8192,
                                reasoning=reasoning)
    shape["vocab_size"] = max(shape["vocab_size"], len(tokenizer))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos,
                         pad_token_id=pad, rms_norm_eps=1e-5, rope_theta=10000.0,
                         torch_dtype=args.dtype)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    if reasoning:
        plant_reasoning(model, reasoning_chain(tokenizer))
    model = model.to(getattr(torch, args.dtype))
    with atomic_dir(args.out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None).save_pretrained(tmp)
    print(f"wrote {args.preset} target ({sum(p.numel() for p in model.parameters())/1e6:.2f}M params, "
          f"vocab {shape['vocab_size']}) to {args.out}")


if __name__ == "__main__":
    run_main(main)
