"""An EAGLE-3 draft (speculators' Eagle3 model) run the way vLLM runs it at inference, for the
transformers backend: fuse the target's aux hidden states, one draft pass over new positions
with an explicit attention mask, draft-vocab ids mapped to target ids. The sequential chain
(chain.py) and the batched proposals (batched.py) both call it, so they run the same math."""
from __future__ import annotations

from pathlib import Path


def load_draft_for_transformers(draft_dir: str, target_dir: str, dtype, device):
    """speculators' own loader, with the verifier path pointed at the target we measure
    (checkpoints store it relative to the draft dir; speculators resolves it from the CWD)."""
    from speculators.model import SpeculatorModel
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(draft_dir)
    config.speculators_config.verifier.name_or_path = str(Path(target_dir).resolve())
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention has no CPU path
    model = SpeculatorModel.from_pretrained(draft_dir, config=config)
    return model.to(device=device, dtype=dtype).eval()


class EagleDraft:
    def __init__(self, model, device):
        import torch

        self.model, self.device = model, device
        self.aux_ids = list(model.config.eagle_aux_hidden_state_layer_ids)
        d2t = getattr(model, "d2t", None)
        self.draft_to_target = (torch.arange(d2t.shape[0], device=device) + d2t.to(device)) if d2t is not None else None

    def aux_hidden(self, hidden_states):
        """The target's hidden states (output_hidden_states tuple) -> concat of the aux layers."""
        import torch

        return torch.cat([hidden_states[i] for i in self.aux_ids], dim=-1)

    def fuse(self, aux_hidden):
        """Target aux hidden states -> draft hidden size, with the draft's optional norms."""
        import torch

        d = self.model
        if d.input_norm is not None:
            aux_hidden = d.input_norm(aux_hidden)
        if d.fc_norm is not None:
            chunks = aux_hidden.chunk(len(d.fc_norm), dim=-1)
            aux_hidden = torch.cat([norm(c) for norm, c in zip(d.fc_norm, chunks)], dim=-1)
        return d.fc(aux_hidden)

    def forward(self, token_ids, hidden, positions, cache, mask):
        """One draft pass over q new positions appended after `cache` (updated in place).

        token_ids [B, q], hidden [B, q, H] (fused target states or the draft's own outputs),
        positions [q] (shared by the batch), mask [q, cached + q] bool (True = attend).
        Returns (out [B, q, H]: the state fed back at the next chain step, ids [B, q]: the
        greedy proposals in target-vocab ids)."""
        import torch

        d = self.model
        x = torch.cat([d.embed_tokens(token_ids), hidden], dim=-1)
        pos = positions[None]
        cos_sin = d.rotary_emb(x, pos)
        for layer in d.layers:
            x = layer(x, attention_mask=mask[None, None], position_ids=pos, past_key_values=cache, use_cache=True,
                      position_embeddings=cos_sin)
            if isinstance(x, tuple):
                x = x[0]
        if d.config.norm_output:  # Eagle 3.1: the normed state is both read out and fed back
            out = d.norm(x)
            logits = d.lm_head(out)
        else:
            out = x
            logits = d.lm_head(d.norm(out))
        ids = logits.argmax(-1)
        if self.draft_to_target is not None:
            ids = self.draft_to_target[ids]
        return out, ids
