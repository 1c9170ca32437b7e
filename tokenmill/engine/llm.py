"""The offline API: `LLM().generate(prompts, params)` and `LLM().chat(conversations, params)`."""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceABC
from dataclasses import asdict
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.interface import EngineRequest, RequestOutput
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.prompt import Prompt
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.models.loader import LoadedWeights

Messages = list[dict[str, str]]
# A template that can think (Qwen3) does not unless asked: a batch job would pay for every
# reasoning token. chat_template_kwargs={"enable_thinking": True} asks (vLLM's request field).
DEFAULT_CHAT_TEMPLATE_KWARGS: dict[str, Any] = {"enable_thinking": False}


def chat_prompt_ids(tokenizer: Any, messages: Messages, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """A conversation through the tokenizer's chat template, ready for the assistant's turn.
    `template_kwargs`: the template's variables, over DEFAULT_CHAT_TEMPLATE_KWARGS."""
    variables = {**DEFAULT_CHAT_TEMPLATE_KWARGS, **(template_kwargs or {})}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **variables)
    # The template already wrote the special tokens (BOS included, where there is one).
    return list(tokenizer.encode(text, add_special_tokens=False))


class LLM:
    """Load a model once, then run batches through the continuous-batching engine.

    `LLM()` loads the embedded default model; `LLM("path/or/hub-id", max_num_seqs=32, ...)`
    takes any `EngineConfig` field as a keyword.
    """

    def __init__(
        self, model: str | None = None, *, weights: LoadedWeights | None = None, **config: Any
    ) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config), weights)

    @classmethod
    def from_config(cls, config: EngineConfig, weights: LoadedWeights | None = None) -> LLM:
        return cls(weights=weights, **asdict(config))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        progress: bool = True,
        raise_on_error: bool = False,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. Every request is validated before any runs; one the
        engine refuses (longer than the context or the KV cache, a token id outside the vocabulary)
        gets an output with FinishReason.ERROR and the reason in `error`, and the others run.
        `raise_on_error`: raise that ValueError instead, before anything runs."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list: list[Prompt] = list(prompts)  # type: ignore[arg-type]
        return self._generate(prompt_list, params, progress, raise_on_error)

    def chat(
        self,
        conversations: Messages | SequenceABC[Messages],
        params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        progress: bool = True,
        raise_on_error: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate (as `generate`).
        `chat_template_kwargs`: variables for the template (thinking is off unless
        {"enable_thinking": True})."""
        batch: SequenceABC[Messages] = (
            [conversations] if conversations and isinstance(conversations[0], dict)  # type: ignore[list-item]
            else conversations  # type: ignore[assignment]
        )
        return self._generate(list(batch), params, progress, raise_on_error, chat=True,
                              template_kwargs=chat_template_kwargs)

    def _generate(
        self,
        prompts: list[Prompt] | list[Messages],
        params: SamplingParams | SequenceABC[SamplingParams] | None,
        progress: bool,
        raise_on_error: bool,
        chat: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Validate every request (a conversation goes through the chat template first, which may
        refuse it too); a refusal becomes that request's error output."""
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompts)
        else:
            param_list = list(params)
            if len(param_list) != len(prompts):
                raise ValueError(f"{len(param_list)} SamplingParams for {len(prompts)} prompts")
        slots: list[EngineRequest | RequestOutput] = []
        for item, sp in zip(prompts, param_list, strict=True):
            try:
                prompt = (
                    {"prompt": None, "prompt_token_ids": self.chat_token_ids(item, template_kwargs)}  # type: ignore[arg-type]
                    if chat else item
                )
                slots.append(self.engine.process_request(prompt, sp))  # type: ignore[arg-type]
            except ValueError as exc:
                if raise_on_error:
                    raise
                slots.append(RequestOutput.refused(self.engine.new_request_id(), str(exc)))
        accepted = [slot for slot in slots if isinstance(slot, EngineRequest)]
        for request in accepted:
            self.engine.add_processed(request)
        finished = self._run_to_completion(len(accepted), progress)
        return [finished[slot.request_id] if isinstance(slot, EngineRequest) else slot for slot in slots]

    def chat_token_ids(self, messages: Messages, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with plain prompts")
        # The template only adds text: a conversation too long for the context is refused untemplated.
        self.engine.check_prompt_chars(sum(len(m.get("content") or "") for m in messages))
        return chat_prompt_ids(tok, messages, template_kwargs)

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
