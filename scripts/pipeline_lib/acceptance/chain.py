"""Sequential greedy EAGLE-3 chain speculation with transformers: one prompt at a time, the
target's KV cache, vLLM's algorithm written out step by step. The transformers backend times
it at concurrency 1 and checks its batched records against it (batched.py must give the same
verify steps). Also the target-only greedy loop, the concurrency-1 baseline."""
from __future__ import annotations

from .draft import EagleDraft
from .records import RequestRecord


def causal_mask(q: int, past: int, device):
    """q new positions after `past` cached ones: new position i sees the cache and new <= i."""
    import torch

    return torch.ones(q, past + q, dtype=torch.bool, device=device).tril(diagonal=past)


class ChainSpeculator:
    """Greedy EAGLE-3 chain speculation, the way vLLM runs it:

    - draft context pair p = (token x_{p+1}, fused target hidden state g_p) at position p+1,
      g_p = fc(concat of the aux-layer hidden states at p);
    - chain step j feeds (drafted token, the draft's own output) at the next position;
    - the target verifies [last token, d_1..d_k] in one forward; the longest agreeing prefix is
      accepted plus the target's own next token; rejected KV entries are cropped away and the
      draft's context is extended with the accepted tokens' real target hidden states."""

    def __init__(self, target, draft: EagleDraft, k: int, device):
        self.target, self.draft, self.k, self.device = target, draft, k, device

    def _target(self, ids, cache):
        out = self.target(input_ids=ids[None], past_key_values=cache, use_cache=True, output_hidden_states=True)
        return out.logits[0].argmax(-1), self.draft.aux_hidden(out.hidden_states)[0]

    def _draft(self, token_ids, hidden, positions, cache):
        """One draft pass over len(token_ids) new positions, causal after the cache."""
        out, ids = self.draft.forward(token_ids[None], hidden[None], positions, cache,
                                      causal_mask(len(token_ids), cache.get_seq_length(), self.device))
        return out[0], ids[0]

    @staticmethod
    def _crop(cache, length: int) -> None:
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)

    def generate(self, prompt: list[int], max_tokens: int, eos: set[int]) -> RequestRecord:
        import torch
        from transformers import DynamicCache

        tcache, dcache = DynamicCache(), DynamicCache()
        prompt_t = torch.tensor(prompt, device=self.device)
        preds, aux = self._target(prompt_t, tcache)
        tokens = [int(preds[-1])]
        steps_acc, steps_drafted, proposals = [], [], []
        # Draft context for the prompt: pairs (x_{p+1}, g_p), p = 0..n-1, positions 1..n.
        ctx_tokens = torch.cat([prompt_t[1:], preds[-1:]])
        n = len(prompt)
        h, ids = self._draft(ctx_tokens, self.draft.fuse(aux), torch.arange(1, n + 1, device=self.device), dcache)
        h_last, next_draft = h[-1:], ids[-1:]
        while len(tokens) < max_tokens and tokens[-1] not in eos:
            seq_len = n + len(tokens)          # tokens known so far; the last one is not in tcache yet
            ctx_len = dcache.get_seq_length()  # = seq_len - 1 context pairs
            drafts = [next_draft]
            for j in range(1, self.k):
                h_last, nxt = self._draft(drafts[-1], h_last, torch.tensor([seq_len + j - 1], device=self.device),
                                          dcache)
                drafts.append(nxt)
            self._crop(dcache, ctx_len)
            drafted = torch.cat(drafts)
            verify_in = torch.cat([torch.tensor([tokens[-1]], device=self.device), drafted])
            preds, aux = self._target(verify_in, tcache)
            accepted = 0
            while accepted < self.k and int(drafted[accepted]) == int(preds[accepted]):
                accepted += 1
            steps_acc.append(accepted)
            steps_drafted.append(self.k)
            proposals.append([int(t) for t in drafted])
            new = [int(t) for t in drafted[:accepted]] + [int(preds[accepted])]
            self._crop(tcache, seq_len + accepted)
            for t in new:
                if len(tokens) >= max_tokens or tokens[-1] in eos:
                    break
                tokens.append(t)
            # Extend the draft context with the verified tokens and their target hidden states.
            h, ids = self._draft(torch.tensor(new, device=self.device), self.draft.fuse(aux[: accepted + 1]),
                                 torch.arange(seq_len, seq_len + accepted + 1, device=self.device), dcache)
            h_last, next_draft = h[-1:], ids[-1:]
        finish = "stop" if tokens[-1] in eos else "length"
        return RequestRecord(id="", category=None, token_ids=tokens, finish_reason=finish,
                             steps_accepted=steps_acc, steps_drafted=steps_drafted, steps_proposals=proposals)


def greedy_plain(target, prompt: list[int], max_tokens: int, eos: set[int], device) -> RequestRecord:
    """Target-only greedy decoding with a KV cache: the no-speculation baseline."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor(prompt, device=device)
    tokens: list[int] = []
    while len(tokens) < max_tokens and (not tokens or tokens[-1] not in eos):
        out = target(input_ids=ids[None], past_key_values=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
        ids = torch.tensor([tokens[-1]], device=device)
    return RequestRecord(id="", category=None, token_ids=tokens, finish_reason="stop" if tokens[-1] in eos else "length")
