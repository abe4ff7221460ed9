"""Exact greedy EAGLE-3 acceptance for a batch of prompts at once, without running
speculation step by step.

Under greedy decoding speculation emits the target's greedy output, and the accepted length
of a verify step that starts after token x_s is the longest prefix of the draft's k proposals
from that start that equals x_{s+1..s+k}. The proposals from a start depend only on x_0..x_s
and the target's hidden states there. So:

1. the target's greedy continuation, batched (`greedy_continuations`), `max_tokens + k - 1`
   tokens or up to EOS and k - 1 tokens past it (the last verify step compares drafts beyond
   EOS / max_tokens);
2. one teacher-forced target forward over prompt + continuation -> aux hidden states g_p;
3. the draft's k proposals from EVERY start in k batched draft passes (`draft_proposals`):
   level 0 is the draft's context pass (pair (x_{p+1}, g_p) at position p+1, causal); level j
   at start s feeds (level j-1's proposal, its output state) at position s+j and attends to
   the context pairs at positions <= s plus the chain steps 1..j at the same start - exactly
   what the chain (chain.py) computes at that start;
4. walk the starts as the chain would (s_0 = the prompt's last token index + 1, s_{i+1} =
   s_i + accepted_i + 1) and write the same RequestRecords (`walk_steps`).

Every pass is one batched forward over full sequences (right-padded: causal attention never
lets a real position see padding to its right), so it runs at the target's batched speed."""
from __future__ import annotations

from .draft import EagleDraft
from .records import RequestRecord


def needed_length(continuation: list[int], new_tokens: int, eos: set[int], k: int) -> int:
    """How much of a greedy continuation the step walk reads: up to the first EOS plus the k - 1
    tokens after it (the last verify step may compare drafts past EOS), at most new_tokens."""
    first_eos = next((i for i, t in enumerate(continuation) if t in eos), None)
    return new_tokens if first_eos is None else min(new_tokens, first_eos + k)


class _PastEosEnough:
    """generate stopping criterion: a row is done once it has its first EOS and the k - 1
    tokens after it (EOS itself does not stop generate, so rows continue past it)."""

    def __init__(self, width: int, eos: set[int], k: int):
        self.width, self.eos, self.k = width, sorted(eos), k

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        generated = input_ids[:, self.width:]
        is_eos = torch.isin(generated, torch.tensor(self.eos, device=input_ids.device))
        first = is_eos.int().argmax(dim=1)
        return is_eos.any(dim=1) & (generated.shape[1] >= first + self.k)


def greedy_continuations(target, prompts: list[list[int]], new_tokens: int, eos: set[int], k: int, pad_id: int,
                         device) -> list[list[int]]:
    """Greedy continuations for prompts of one batch (HF generate, left-padded): each row runs
    past its EOS, to `needed_length` (new_tokens without EOS), and is cut there."""
    import torch
    from transformers import StoppingCriteriaList

    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    # generate's own EOS stop would end a row at EOS; it fills an unset eos_token_id from the
    # model's generation config, so that one is cleared meanwhile.
    config, saved = target.generation_config, target.generation_config.eos_token_id
    config.eos_token_id = None
    try:
        out = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=pad_id,
                              stopping_criteria=StoppingCriteriaList([_PastEosEnough(width, eos, k)]))
    finally:
        config.eos_token_id = saved
    conts = []
    for row in out[:, width:].tolist():
        need = needed_length(row, new_tokens, eos, k)
        if len(row) < need:
            raise RuntimeError(f"generate returned {len(row)} new tokens, fewer than the {need} needed")
        conts.append(row[:need])
    return conts


def right_padded(seqs: list[list[int]], device):
    import torch

    width = max(len(s) for s in seqs)
    return torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=device)


def target_aux_hidden(target, draft: EagleDraft, input_ids):
    """Teacher-forced target forward over right-padded sequences [B, L] -> the aux-layer
    hidden states [B, L, n_aux * H] (pure causal attention; no logits computed)."""
    out = target(input_ids=input_ids, output_hidden_states=True, logits_to_keep=1)
    return draft.aux_hidden(out.hidden_states)


def draft_proposals(draft: EagleDraft, input_ids, aux, k: int):
    """[B, L-1, k]: row p holds the chain's k proposals at the step start after token x_{p+1}
    (context pairs 0..p), i.e. its guesses for x_{p+2} .. x_{p+1+k}."""
    import torch
    from transformers import DynamicCache

    n = input_ids.shape[1] - 1
    dev = input_ids.device
    cache = DynamicCache()
    context = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    own_step = torch.eye(n, dtype=torch.bool, device=dev)
    positions = torch.arange(1, n + 1, device=dev)
    h, ids = draft.forward(input_ids[:, 1:], draft.fuse(aux[:, :-1]), positions, cache, context)
    proposals = [ids]
    for j in range(1, k):
        # Level j at start p sees the context pairs <= p and its own chain steps 1..j at p.
        mask = torch.cat([context] + [own_step] * j, dim=1)
        h, ids = draft.forward(ids, h, positions + j, cache, mask)
        proposals.append(ids)
    return torch.stack(proposals, dim=-1)


def walk_steps(prompt_len: int, sequence: list[int], proposals: list[list[int]], k: int, max_tokens: int,
               eos: set[int]) -> RequestRecord:
    """The chain's verify steps, replayed: `sequence` = prompt + greedy continuation (to
    `needed_length`), `proposals[p]` = the k proposals after token x_{p+1}."""
    s = prompt_len  # index of the last known token: the prefill's token x_n
    tokens = [sequence[s]]
    steps_acc: list[int] = []
    used: list[list[int]] = []
    while len(tokens) < max_tokens and tokens[-1] not in eos:
        drafted = proposals[s - 1]
        used.append(drafted)
        accepted = 0
        while accepted < k and drafted[accepted] == sequence[s + 1 + accepted]:
            accepted += 1
        steps_acc.append(accepted)
        for t in sequence[s + 1: s + accepted + 2]:
            if len(tokens) >= max_tokens or tokens[-1] in eos:
                break
            tokens.append(t)
        s += accepted + 1
    return RequestRecord(id="", category=None, token_ids=tokens, finish_reason="stop" if tokens[-1] in eos else "length",
                         steps_accepted=steps_acc, steps_drafted=[k] * len(steps_acc), steps_proposals=used)


def plain_record(continuation: list[int], max_tokens: int, eos: set[int]) -> RequestRecord:
    """The greedy output without speculation: the continuation cut at EOS (kept) or max_tokens."""
    end = next((i + 1 for i, t in enumerate(continuation[:max_tokens]) if t in eos), max_tokens)
    tokens = continuation[:end]
    return RequestRecord(id="", category=None, token_ids=tokens, finish_reason="stop" if tokens[-1] in eos else "length")


def same_steps(a: RequestRecord, b: RequestRecord) -> bool:
    """Same output, same accepted/drafted counts and the same proposals at every verify step."""
    fields = ("token_ids", "finish_reason", "steps_accepted", "steps_drafted", "steps_proposals")
    return all(getattr(a, f) == getattr(b, f) for f in fields)
