"""The offline API: `LLM().generate(prompts, params)` and `LLM().chat(conversations, params)`."""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceABC
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine, Prompt
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.models.loader import LoadedWeights

Messages = list[dict[str, str]]


class LLM:
    """Load a model once, then run batches through the continuous-batching engine.

    `LLM()` loads the embedded default model; `LLM("path/or/hub-id", max_num_seqs=32, ...)`
    takes any `EngineConfig` field as a keyword.
    """

    def __init__(
        self, model: str | None = None, *, weights: LoadedWeights | None = None, **config: Any
    ) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config), weights)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        progress: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. Every request is validated before any runs."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"{len(param_list)} SamplingParams for {len(prompt_list)} prompts")
        requests = [self.engine.process_request(p, sp) for p, sp in zip(prompt_list, param_list, strict=True)]
        for request in requests:
            self.engine.add_processed(request)
        finished = self._run_to_completion(len(requests), progress)
        return [finished[request.request_id] for request in requests]

    def chat(
        self,
        conversations: Messages | SequenceABC[Messages],
        params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        progress: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        batch: SequenceABC[Messages] = (
            [conversations] if conversations and isinstance(conversations[0], dict)  # type: ignore[list-item]
            else conversations  # type: ignore[assignment]
        )
        prompts: list[Prompt] = [
            {"prompt": None, "prompt_token_ids": self.chat_token_ids(c)} for c in batch
        ]
        return self.generate(prompts, params, progress)

    def chat_token_ids(self, messages: Messages) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with plain prompts")
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template already wrote the special tokens (BOS included, where there is one).
        return list(tok.encode(text, add_special_tokens=False))

    def _run_to_completion(self, total: int, progress: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        before, start = self.engine.stats(), time.monotonic()
        columns = (
            TextColumn("[bold]generate"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[speed]}"), TimeElapsedColumn(),
        )
        with Progress(*columns, disable=not progress, transient=False) as bar:
            task = bar.add_task("generate", total=total, speed="")
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                elapsed = max(time.monotonic() - start, 1e-9)
                now = self.engine.stats()
                speed = (
                    f"prefill {(now.prefill_tokens - before.prefill_tokens) / elapsed:,.0f} tok/s · "
                    f"decode {(now.decode_tokens - before.decode_tokens) / elapsed:,.0f} tok/s"
                )
                bar.update(task, completed=len(finished), speed=speed)
        return finished
