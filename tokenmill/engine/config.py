"""One dataclass holding every engine setting, validated up front."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SCHEDULING_POLICIES = ("fcfs", "priority", "length")
DECODE_ATTENTION = ("auto", "kernel", "sdpa")
SMALL_BATCH_LINEAR = ("auto", "kernel", "off")


@dataclass
class EngineConfig:
    """Everything the engine needs to know; `None` means "derive it from the model/machine"."""

    model: str | None = None  # GGUF file, HF folder or hub id; None = the embedded default
    tokenizer: str | None = None  # defaults to the model's own tokenizer
    dtype: str = "float32"  # fp32 on CPU: no native bf16 GEMM there
    device: str = "auto"  # "auto" = cuda if available else cpu
    max_num_seqs: int = 64  # sequences in the running batch at once
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill + decode)
    max_model_len: int | None = None  # context length; default: the model's
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_bytes: int | None = None  # explicit KV budget in bytes
    kv_cache_memory_fraction: float = 0.4  # else: this fraction of free memory (after weights)
    num_kv_blocks: int | None = None  # explicit block count; overrides both budgets (tests)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True  # split long prompts across steps under the budget
    scheduling_policy: str = "fcfs"  # fcfs | priority (lower value first) | length (shortest first)
    length_aging_s: float = 10.0  # "length": never passed by a request arriving this much later
    max_preemptions: int = 3  # after this many, a request is preempted only as a last resort
    kv_watermark: float = 0.01  # admissions keep this fraction of blocks free for running requests
    seed: int = 0  # seed for requests that do not bring their own
    num_threads: int | None = None  # torch CPU threads; None = torch's default
    pack_weights: bool = True  # CPU: pre-pack linear weights for oneDNN (much faster small GEMMs)
    # Decode attention: "kernel" reads the paged cache in place (CPU fp32; compiled on first
    # use), "sdpa" gathers blocks and calls PyTorch SDPA, "auto" = kernel where it builds.
    decode_attention: str = "auto"
    # Linear layers of steps with few tokens (batch-1 decode): "kernel" streams the weights with
    # a small C kernel (CPU fp32) at 1.3-1.7x oneDNN's speed, at the cost of a second copy of
    # the weights; "auto" = the kernel where it builds and the copy fits in a quarter of the
    # free memory; "off" = oneDNN (or F.linear) at every size.
    small_batch_linear: str = "auto"

    def __post_init__(self) -> None:
        self._check_positive("max_num_seqs", "max_num_batched_tokens", "block_size")
        for name in ("max_model_len", "kv_cache_bytes", "num_kv_blocks", "num_threads"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {value}")
        if not 0.0 <= self.kv_watermark < 1.0:
            raise ValueError(f"EngineConfig.kv_watermark must be in [0, 1), got {self.kv_watermark}")
        if self.length_aging_s < 0 or self.max_preemptions < 0:
            raise ValueError("EngineConfig.length_aging_s and max_preemptions must be >= 0")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(
                "EngineConfig.kv_cache_memory_fraction must be in (0, 1], "
                f"got {self.kv_cache_memory_fraction}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"EngineConfig.scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"EngineConfig.decode_attention must be one of {DECODE_ATTENTION}, got {self.decode_attention!r}"
            )
        if self.small_batch_linear not in SMALL_BATCH_LINEAR:
            raise ValueError(
                f"EngineConfig.small_batch_linear must be one of {SMALL_BATCH_LINEAR}, "
                f"got {self.small_batch_linear!r}"
            )
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"EngineConfig.device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")

    def _check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
