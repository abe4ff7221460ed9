"""Greedy decoding of one left-padded batch with the target's own transformers forward, built
for a small target on a big GPU, where HF `generate` is bound by its per-step work, not the
GPU (bench/decode_designs.py measures the designs side by side):

- a static KV cache sized to this batch (its prompt width + max_new, rounded up to 64), so a
  batch of short prompts never attends over room for the longest one;
- the one-token step (forward, argmax, stop bookkeeping) captured once per batch as a CUDA
  graph and replayed without waiting for the GPU: whether every row has stopped is copied to
  the host asynchronously every few steps and read once that copy has landed (a blocking check
  idles the GPU while the host launches the next graph, which for a 30-layer graph takes about
  as long as the step itself: 6.1 vs 4.2 ms per step on the H200, bench/results);
- grouped-query attention without repeating K/V: in a one-token step the query heads that
  share a K/V head are laid out as that head's query rows (HF's SDPA path expands K/V to every
  query head whenever there is a mask, which at this size is most of the step's memory traffic).

On CPU the same step runs without a graph (tests compare it token for token with `generate`).
`supports(model)` says whether a target can take this path (a plain causal decoder with full
attention in every layer); the transformers backend falls back to `generate` otherwise."""
from __future__ import annotations

import inspect
from typing import Any

ATTENTION = "pipeline_grouped_decode"
STOP_CHECK_EVERY = 8  # steps between the copies of "every row has stopped" to the host
_CACHE_ROUND = 64


def _grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One-token steps: SDPA on [batch, kv_heads, queries_per_kv_head, dim] against the cache's
    [batch, kv_heads, length, dim], the mask [batch, 1, 1, length] broadcast. Else HF's SDPA."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, heads, _, dim = query.shape
    # HF's repeat_kv gives query head h the K/V head h // groups: the same grouping as this view.
    out = F.scaled_dot_product_attention(query.view(b, key.shape[1], groups, dim), key, value,
                                         attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, heads, 1, dim).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _grouped_attention)
    # Masks this path builds itself are 4D (used as given); any other caller gets SDPA's.
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def supports(model) -> str | None:
    """None if `model` can decode here; else why not (the backend then uses `generate`)."""
    cfg = model.config.get_text_config(decoder=True)
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not take transformers' attention interface"
    if getattr(cfg, "sliding_window", None) or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return "the target has sliding-window layers (this path builds full causal masks)"
    if getattr(model.config, "is_encoder_decoder", False):
        return "encoder-decoder target"
    return None


def prepare(model) -> None:
    """Switch `model` to the grouped one-token attention (SDPA for everything else)."""
    _register()
    model.set_attn_implementation(ATTENTION)


def greedy_batch(model, input_ids, attention_mask, max_new: int, eos_ids: set[int], pad_id: int,
                 deadline: float | None = None) -> list[list[int]]:
    """Greedy answers to one left-padded batch, as `generate` returns them: per row the tokens
    of every step taken (pad_id after the row's eos; the caller cuts each row at its first eos):
    max_new steps, fewer once every row stopped, or once time.monotonic() passed `deadline`
    (the caller treats a row without eos and short of max_new as timed out, as `generate`'s
    max_time)."""
    import time

    import torch
    from transformers import StaticCache

    b, width = input_ids.shape
    dev = input_ids.device
    length = -(-(width + max_new) // _CACHE_ROUND) * _CACHE_ROUND
    positions = torch.arange(length, device=dev)
    pads = (width - attention_mask.sum(-1)).view(b, 1)  # left padding of each row
    eos = torch.tensor(sorted(eos_ids), device=dev)
    # Older transformers take cache_position in the forward (and the cache needs it); newer
    # ones keep the position in the cache itself.
    takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters

    def forward(ids, mask4, pos, cache_pos) -> Any:
        extra = {"cache_position": cache_pos} if takes_cache_position else {}
        return model(input_ids=ids, attention_mask=mask4, position_ids=pos, past_key_values=cache,
                     use_cache=True, logits_to_keep=1, **extra).logits[:, -1]

    with torch.inference_mode():
        cache = StaticCache(config=model.config, max_cache_len=length)
        # Prefill: causal over the row's own tokens; a padding query sees only itself (a fully
        # masked row would give NaN, and NaN keys poison later steps even where masked).
        own = positions[None, :] >= pads  # [b, length]
        causal = positions[:width, None] >= positions[None, :]  # [width, length]
        diagonal = positions[:width, None] == positions[None, :]
        mask4 = ((causal[None] & own[:, None]) | diagonal[None])[:, None]
        first = forward(input_ids, mask4, (positions[None, :width] - pads).clamp(min=0), positions[:width]).argmax(-1)
        del mask4
        generated = torch.full((b, max_new), pad_id, dtype=torch.long, device=dev)
        generated[:, 0] = first
        done = torch.isin(first, eos)
        token = first.view(b, 1).clone()
        cache_pos = torch.tensor([width], device=dev)
        write_at = torch.tensor([1], device=dev)

        def step() -> None:
            mask = ((positions[None, :] >= pads) & (positions[None, :] <= cache_pos))[:, None, None, :]
            nxt = forward(token, mask, cache_pos.view(1, 1) - pads, cache_pos).argmax(-1)
            nxt = torch.where(done, pad_id, nxt)
            generated.index_copy_(1, write_at, nxt.view(b, 1))
            done.logical_or_(torch.isin(nxt, eos))
            token.copy_(nxt.view(b, 1))
            cache_pos.add_(1)
            write_at.add_(1)

        run, steps = step, 1
        if dev.type == "cuda" and max_new > 2:
            # The first step runs eagerly on a side stream (warm-up, as torch's graph docs ask),
            # then the same step is captured; replays continue from there.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            steps += 1
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            run = graph.replay
        stopped = _StopFlag(done)
        while steps < max_new:
            if steps % STOP_CHECK_EVERY == 0 and stopped.poll():
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            run()
            steps += 1
        return generated[:, :steps].tolist()


class _StopFlag:
    """`done.all()` read by the host without waiting for the GPU (CUDA): each poll reads the
    copy started by an earlier poll if it has landed, then starts a new one. A batch may run a
    few steps past its last stop (pad_id in every stopped row). On CPU: read now."""

    def __init__(self, done):
        import torch

        self.done = done
        self.cuda = done.device.type == "cuda"
        if self.cuda:
            self.host = torch.zeros((), dtype=torch.bool, pin_memory=True)
            self.copied = None

    def poll(self) -> bool:
        import torch

        if not self.cuda:
            return bool(self.done.all())
        if self.copied is not None and self.copied.query() and bool(self.host):
            return True
        if self.copied is None or self.copied.query():
            self.host.copy_(self.done.all(), non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()
        return False
