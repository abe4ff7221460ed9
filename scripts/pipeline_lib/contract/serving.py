"""Train vs serve: the prompt tokens the draft trained on are the ones the serving engine
feeds it, compared with vLLM's own chat rendering (no engine started)."""
from __future__ import annotations

from pathlib import Path

from ..errors import PipelineError
from ..io import read_jsonl
from .base import Check, Context, Family, NotRun

FAMILY = Family("serving_render", applies_to=None)

SERVING_RENDER = "training_data.matches_serving_render"
SERVING_RENDER_ROWS = 8   # default of verify.serve_render_rows


class ServingRenderer:
    """vLLM's own chat rendering of the target, built as vLLM's GPU-less render server builds
    it (entrypoints/launchers/render: model config -> VllmConfig -> renderer_from_config, no
    engine) and called as LLM.chat / enqueue_chat call it (LLM._preprocess_chat): vLLM's
    resolved chat template, its tokenizer loading, add_generation_prompt, no special tokens
    added by the tokenizer."""

    def __init__(self, target: Path, settings: dict):
        # ImportError here means "vLLM is not installed": the caller reports the check as not run.
        from vllm.config import VllmConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.renderers import ChatParams, merge_kwargs, renderer_from_config
        from vllm.utils.mistral import is_mistral_tokenizer

        model_config = EngineArgs(model=str(target),
                                  trust_remote_code=bool(settings.get("trust_remote_code"))).create_model_config()
        model_config.quantization = None  # rendering only: no kernels to validate
        self.renderer = renderer_from_config(VllmConfig(model_config=model_config))
        self.chat_params = ChatParams(chat_template_kwargs=merge_kwargs(
            settings.get("chat_template_kwargs") or {},
            dict(add_generation_prompt=True, continue_final_message=False, tools=None,
                 tokenize=is_mistral_tokenizer(self.renderer.tokenizer) or model_config.enable_prompt_embeds)))
        self.tok_params = self.renderer.default_chat_tok_params.with_kwargs(add_special_tokens=False)

    def ids(self, messages: list[dict]) -> list[int]:
        _, (engine_input,) = self.renderer.render_chat([messages], self.chat_params, self.tok_params)
        return list(engine_input["prompt_token_ids"])

    def text(self, ids: list[int]) -> str:
        return self.renderer.tokenizer.decode(ids)


def turn_requests(row: dict) -> list[list[dict]]:
    """The messages each answered user turn of a trace row sent to the target, in order (the
    traces stage's own context rule, pipeline_lib.traces.turn_messages); a failed turn ends it."""
    from ..traces import row_turns, turn_messages

    later_users = [t["user"] for t in row.get("later_turns") or []]
    requests, earlier = [], []
    for k, turn in enumerate(row_turns(row)):
        if turn.get("finish_reason") == "error":
            break
        requests.append(turn_messages(row["messages"], earlier, later_users[:k]))
        earlier.append((turn.get("answer"), turn.get("reasoning") or None))
    return requests


def answer_starts(loss_mask: list[int]) -> list[int]:
    """Where each trained answer starts: the first token of every run of loss-masked tokens."""
    return [i for i, m in enumerate(loss_mask) if m and (i == 0 or not loss_mask[i - 1])]


def sample_indices(n: int, k: int | None) -> list[int]:
    """k row indices evenly spaced over n rows (all when k is None or >= n)."""
    if k is None or k >= n:
        return list(range(n))
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_row(serving: ServingRenderer, row_id: str, ids: list[int], mask: list[int],
                requests: list[list[dict]]) -> tuple[int, list[dict]]:
    """(turns compared, mismatches) of one training row. Each answer's prompt part (the row's
    tokens before it) must equal vLLM's render of one turn's request, turns in order. A row
    that continues a conversation (`<id>#2`) starts at a later turn, and a turn whose answer
    has no token in the loss has no run, so each answer is matched to the first of the
    remaining turns whose render equals it; when none does, the mismatch is reported against
    the turn whose render agrees longest."""
    compared, mismatches, next_turn = 0, [], 0
    renders: dict[int, list[int]] = {}
    for start in answer_starts(mask):
        prompt = ids[:start]
        candidates = range(next_turn, len(requests))
        for k in candidates:
            renders.setdefault(k, serving.ids(requests[k]))
            if renders[k] == prompt:
                compared, next_turn = compared + 1, k + 1
                break
        else:
            compared += 1
            if not candidates:
                mismatches.append({"row": row_id, "turn": None, "answer_at": start,
                                   "problem": f"more answers in the row than the trace has turns ({len(requests)})"})
                break
            k = max(candidates, key=lambda j: first_difference(renders[j], prompt))
            at = first_difference(renders[k], prompt)
            mismatches.append({
                "row": row_id, "turn": k + 1, "answer_at": start, "first_difference": at,
                "training_tokens": len(prompt), "serving_tokens": len(renders[k]),
                "training": serving.text(prompt[at:at + 12]), "serving": serving.text(renders[k][at:at + 12])})
            break  # later answers of this row follow a prompt that already differs
    return compared, mismatches


@FAMILY.check(SERVING_RENDER)
def check_serving_render(ctx: Context) -> Check:
    """A sample of tokenized rows: every answer's prompt part equals, token for token, what
    vLLM's own chat rendering makes of the same request (reasoning and end-of-turn tokens of
    earlier answers included). The digests say the template file is the same; this says the
    engine that serves the target feeds the draft the context it was trained after."""
    import datasets

    if ctx.tokenized_data is None or ctx.traces is None:
        raise NotRun("no tokenized data or traces given (--tokenized-data, --traces)")
    want = ctx.settings.get("serve_render_rows", SERVING_RENDER_ROWS)
    if want is not None and (not isinstance(want, int) or isinstance(want, bool) or want < 1):
        raise PipelineError(f"setting verify.serve_render_rows = {want!r}: give an integer >= 1 (rows compared) "
                            f"or null (all rows)")
    expected = ("each sampled training row's prompt ids before every answer = vLLM's chat render of that "
                "turn's request, token for token")
    try:
        serving = ServingRenderer(ctx.target, ctx.settings)
    except ImportError as err:
        return Check(SERVING_RENDER, None, expected, None,
                     f"not run: vLLM is not importable here ({err}), so the serving engine's own chat rendering "
                     f"cannot be compared with the training rows; run the contract checks where vLLM is "
                     f"installed (the serving stack) to prove it", required=False)
    except Exception as err:  # vLLM refuses the target's config or tokenizer: it could not serve it either
        return Check(SERVING_RENDER, False, expected, None,
                     f"vLLM cannot build its chat renderer for {ctx.target} ({type(err).__name__}: "
                     f"{' '.join(str(err).split())[:400]}), so it could not serve this target as it is")
    row_ids = ctx.stats.get("row_ids")
    datasets.disable_progress_bars()
    data = datasets.load_from_disk(str(ctx.tokenized_data)).with_format(None)
    if not isinstance(row_ids, list) or len(row_ids) != len(data):
        raise NotRun(f"tokenized/stats.json row_ids ({len(row_ids) if isinstance(row_ids, list) else 'missing'}) "
                     f"do not name the {len(data)} rows of {ctx.tokenized_data}; rerun the tokenize stage")
    picked = sample_indices(len(data), want)
    trace_ids = {row_ids[i].split("#")[0] for i in picked}
    traces = {}
    for _, row in read_jsonl(ctx.traces):
        if str(row.get("id")) in trace_ids:
            traces[str(row["id"])] = row
    compared, mismatches, multi_turn = 0, [], 0
    for i in picked:
        trace_id = row_ids[i].split("#")[0]
        if trace_id not in traces:
            raise PipelineError(f"{ctx.traces}: no trace row {trace_id!r}, which tokenized row {i} ({row_ids[i]}) "
                                f"came from; the traces and the tokenized data are of different runs")
        requests = turn_requests(traces[trace_id])
        multi_turn += len(requests) > 1
        n, bad = compare_row(serving, row_ids[i], data[i]["input_ids"], data[i]["loss_mask"], requests)
        compared += n
        mismatches += bad
    seen = {"rows": len(picked), "of_rows": len(data), "answers_compared": compared,
            "multi_turn_rows": multi_turn, "rows_differing": len(mismatches), "mismatches": mismatches[:5]}
    if not mismatches:
        return Check(SERVING_RENDER, True, expected, seen)
    m = mismatches[0]
    where = (f"row {m['row']} turn {m['turn']}: token {m['first_difference']} is {m['training']!r} in training, "
             f"{m['serving']!r} as vLLM renders it" if m["turn"] else f"row {m['row']}: {m['problem']}")
    return Check(SERVING_RENDER, False, expected, seen,
                 f"{len(mismatches)} of {len(picked)} sampled rows were trained after prompt tokens the serving engine "
                 f"does not produce ({where}); the draft learned a context it never sees when served. Retokenize "
                 f"with the template and chat_template_kwargs vLLM serves the target with (rerun tokenize)")
