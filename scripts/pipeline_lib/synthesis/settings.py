"""The `synthesize` config section (defaults as in schemas/config.schema.yaml)."""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

from ..cli import reject_unknown_keys
from ..errors import PipelineError

BACKENDS = ("vllm", "transformers")  # the raw token-id prompt path; an OpenAI endpoint takes chat messages only


@dataclass(frozen=True)
class Topic:
    name: str
    system_prompt: str


@dataclass(frozen=True)
class SynthesisSettings:
    """What a synthesize shard asks for: num_prompts candidates, candidate i under topic
    i % len(topics) (or the global system_prompt), each sampled with its own seed."""
    num_prompts: int = 0
    backend: str = "vllm"
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 64
    request_timeout_s: float = 600.0
    retries: int = 2
    system_prompt: str | None = None
    topics: tuple[Topic, ...] = ()
    chat_template_kwargs: dict = field(default_factory=dict)
    trust_remote_code: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SynthesisSettings":
        reject_unknown_keys(raw, set(cls.__dataclass_fields__), "synthesize")
        values = dict(raw)
        topics = values.get("topics") or []
        if not isinstance(topics, list) or not all(
                isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("system_prompt"), str)
                for t in topics):
            raise PipelineError(f"setting synthesize.topics = {topics!r}: must be a list of {{name, system_prompt}}")
        names = [t["name"] for t in topics]
        if len(set(names)) != len(names):
            raise PipelineError(f"setting synthesize.topics: names {names} repeat; give each topic its own name")
        values["topics"] = tuple(Topic(t["name"], t["system_prompt"]) for t in topics)
        s = cls(**values)
        if s.backend not in BACKENDS:
            raise PipelineError(f"setting synthesize.backend = {s.backend!r}: choose one of {list(BACKENDS)} (the "
                                f"synthesize stage sends the rendered template as token ids)")
        if not isinstance(s.num_prompts, int) or s.num_prompts < 1:
            raise PipelineError(f"setting synthesize.num_prompts = {s.num_prompts!r}: a training source says "
                                f"`synthesized`, so ask for at least 1 request")
        return s

    def topic(self, index: int) -> Topic | None:
        return self.topics[index % len(self.topics)] if self.topics else None

    def system_prompt_for(self, index: int) -> str | None:
        topic = self.topic(index)
        return topic.system_prompt if topic else self.system_prompt

    def request_seed(self, index: int) -> int:
        """Candidate `index`'s own sampling seed: one prompt per topic, many different requests."""
        return int.from_bytes(hashlib.sha256(f"{self.seed}:{index}".encode()).digest()[:4], "big")

    def generation(self):
        """The backends' settings (pipeline_lib.generation)."""
        from ..generation import GenerationSettings

        return GenerationSettings.from_dict({
            "backend": self.backend, "max_tokens": self.max_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "seed": self.seed, "batch_size": self.batch_size,
            "request_timeout_s": self.request_timeout_s, "retries": self.retries,
            "chat_template_kwargs": self.chat_template_kwargs, "trust_remote_code": self.trust_remote_code})

    def sampling(self) -> dict[str, Any]:
        """What decides a candidate besides its prompt and seed: the row cache keys on it."""
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed}

    def public(self) -> dict[str, Any]:
        return asdict(self)
