"""transformers backend: a hooked decoder forward (no vLLM needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Sequence

from ..errors import PipelineError
from .store import FileRecord, HSStore, LayerSpec, Row, batches, register


@register("transformers")
class TransformersBackend:
    """A forward pass of the decoder (no lm_head) with hooks on exactly the needed layers:
    a pre-hook on decoder layer k captures the residual stream entering it (aux id k), a
    pre-hook on the final norm captures its input (id N) and stops the forward there."""

    class _StopForward(Exception):
        pass

    def __init__(self, target_dir: str | Path, spec: LayerSpec, settings: dict[str, Any], max_len: int):
        import torch
        from transformers import AutoModelForCausalLM

        from ..runtime import has_cuda

        self.spec = spec
        self.batch_size = int(settings.get("batch_size", 8))
        self.device = "cuda" if has_cuda() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(
            str(target_dir), dtype=spec.torch_dtype, device_map=self.device,
            trust_remote_code=bool(settings.get("trust_remote_code", False)))
        self.decoder = model.get_decoder().eval()
        del model  # only the decoder is kept (the lm_head and its logits are never needed)
        layers = getattr(self.decoder, "layers", None)
        norm = getattr(self.decoder, "norm", None)
        if layers is None or norm is None or len(layers) != spec.num_layers:
            raise PipelineError(
                f"{target_dir}: the transformers backend needs a decoder with `.layers` "
                f"({spec.num_layers} of them) and a final `.norm`; this architecture has neither "
                f"layout; set hidden_states.backend: vllm")
        self._captured: dict[int, Any] = {}
        for slot, layer_id in enumerate(spec.aux_layer_ids):
            layers[layer_id].register_forward_pre_hook(self._capture_hook(slot), with_kwargs=True)
        norm.register_forward_pre_hook(self._capture_hook(len(spec.aux_layer_ids), stop=True), with_kwargs=True)
        self.torch = torch

    def _capture_hook(self, slot: int, stop: bool = False):
        def hook(module, args, kwargs):
            self._captured[slot] = args[0] if args else kwargs["hidden_states"]
            if stop:
                raise self._StopForward()
        return hook

    def extract(self, rows: Sequence[Row], store: HSStore) -> Iterator[FileRecord]:
        torch = self.torch
        # Similar lengths together: less padding. Padding goes on the right and needs no
        # attention mask: under causal attention a real token never sees the pads after it,
        # and the plain causal path is the fast one (a padding mask forces the slow SDPA path).
        ordered = sorted(rows, key=lambda r: len(r.input_ids))
        for batch in batches(ordered, self.batch_size):
            width = max(len(r.input_ids) for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            for b, r in enumerate(batch):
                ids[b, :len(r.input_ids)] = torch.tensor(r.input_ids)
            self._captured.clear()
            with torch.inference_mode():
                try:
                    self.decoder(input_ids=ids.to(self.device), use_cache=False)
                except self._StopForward:
                    pass
            stacked = torch.stack([self._captured[s] for s in range(len(self.spec.layer_ids))], dim=2)
            stacked = stacked.to("cpu", self.spec.torch_dtype)
            for b, r in enumerate(batch):
                yield store.write(r, stacked[b, :len(r.input_ids)].clone())

    def close(self) -> None:
        self.decoder = None

