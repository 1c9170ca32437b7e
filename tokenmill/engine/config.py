"""One dataclass holding every engine setting, validated up front.

Each field carries its help text (and its allowed values, where there is a fixed list): the
command-line flags of every command that builds an engine are generated from them
(engine/args.py), so a new field is a new flag everywhere at once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar

from tokenmill.engine.speculative.config import METHODS, speculative_config, speculative_settings
from tokenmill.models.weight_formats import WEIGHT_FORMATS
from tokenmill.settings import SettingError, json_object, setting

if TYPE_CHECKING:
    import torch


# --dtype: torch dtypes by name. torch is imported only where a dtype or device is needed, so the
# flags generated from this class cost no torch import.
DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", *DTYPES)
SCHEDULING_POLICIES = ("fcfs", "priority", "length")
ATTENTION_KERNEL = ("auto", "kernel", "sdpa")
SMALL_BATCH_LINEAR = ("auto", "kernel", "off")


@dataclass
class EngineConfig:
    """Everything the engine needs to know; `None` means "derive it from the model/machine"."""

    engine: ClassVar[str] = "embedded"

    model: str | None = setting(None, "GGUF file, Hugging Face folder or hub id (default: the embedded SmolLM2)")
    tokenizer: str | None = setting(None, "tokenizer folder or hub id (default: the model's own)")
    dtype: str = setting("float32", "weights and activations (fp32 on CPU: no native bf16 GEMM there)",
                          DTYPES)
    device: str = setting("auto", "auto (cuda if available, else cpu), cpu or cuda[:N]")
    max_num_seqs: int = setting(64, "sequences in the running batch at once")
    max_num_batched_tokens: int = setting(2048, "token budget of one step, prefill and decode together")
    max_model_len: int | None = setting(
        None, "context length; longer prompts are refused with the reason (default: the model's)")
    block_size: int = setting(16, "tokens per KV-cache block")
    kv_cache_bytes: int | None = setting(None, "KV-cache budget in bytes")
    kv_cache_memory_fraction: float = setting(
        0.4, "without --kv-cache-bytes: this fraction of the memory free after loading the weights")
    num_kv_blocks: int | None = setting(None, "KV-cache blocks; overrides both budgets")
    kv_cache_dtype: str = setting(
        "auto", "KV-cache elements: float16 holds twice the tokens of float32 and halves what attention reads, "
        "rounding K and V to 11 significant bits; auto: float16 where the C kernels run (CPU fp32), else the "
        "activations' dtype; bfloat16 runs attention on PyTorch ops", KV_CACHE_DTYPES)
    enable_prefix_caching: bool = setting(True, "reuse the KV of shared prompt prefixes")
    enable_chunked_prefill: bool = setting(True, "split long prompts across steps under the token budget")
    scheduling_policy: str = setting(
        "fcfs", "fcfs; priority (a request's priority, lower first); length (shortest remaining "
        "prefill first, with aging)", SCHEDULING_POLICIES)
    length_aging_s: float = setting(
        10.0, "under 'length': a request is never passed by one that arrived this many seconds later")
    max_preemptions: int = setting(3, "after this many, a request is preempted only as a last resort")
    kv_watermark: float = setting(0.01, "admissions keep this fraction of KV blocks free for running requests")
    seed: int = setting(0, "seeds the requests that do not bring their own seed")
    grammar_compile_timeout_s: float = setting(
        10.0, "structured outputs: a schema, regex or grammar that takes longer to compile fails its request")
    num_threads: int | None = setting(None, "torch CPU threads (default: torch's)")
    weight_format: str = setting(
        "auto", "linear weights in memory: q4/q8 keep blocks of 4/8 bits read by AVX2 integer kernels (CPU "
        "fp32 only; embeddings and lm_head stay 8 bits under q4 unless the file has them in 4); fp32 "
        "dequantises everything (exact comparisons); auto keeps a quantised GGUF's blocks where the "
        "kernels build, else fp32", WEIGHT_FORMATS)
    pack_weights: bool = setting(True, "CPU: pre-pack linear weights for oneDNN (much faster small GEMMs)")
    decode_attention: str = setting(
        "auto", "kernel: decodes read the paged cache in place with a C kernel (CPU fp32, compiled on first "
        "use); sdpa: gather blocks + PyTorch SDPA; auto: the kernel where it builds", ATTENTION_KERNEL)
    prefill_attention: str = setting(
        "auto", "kernel: prompt tokens attend straight from the paged cache with a C kernel that visits only the "
        "keys each query's causal (and sliding-window) bounds reach (CPU fp32, compiled on first use); sdpa: "
        "gather blocks + PyTorch SDPA with a mask; auto: the kernel where it builds", ATTENTION_KERNEL)
    small_batch_linear: str = setting(
        "auto", "kernel: steps of up to 16 tokens stream the weights with a C kernel (CPU fp32, 1.3-1.7x "
        "oneDNN) at the cost of a second copy of them; off: oneDNN at every size; auto: the kernel where "
        "it builds and the copy fits in a quarter of free memory", SMALL_BATCH_LINEAR)

    speculative_method: str | None = setting(
        None, "speculative decoding: ngram (prompt lookup: a draft copied from where the sequence's last tokens "
        "occurred before), suffix (a job-wide suffix tree over earlier outputs, and prompt lookup); exact under "
        "greedy and a seed, and used only where measured to pay (docs/speculative.md) (default: off)", METHODS)
    num_speculative_tokens: int | None = setting(
        None, "draft tokens a sequence may carry in one step, at most (default: ngram 8, suffix 24)")
    speculative_config: dict[str, Any] | None = setting(
        None, "vLLM's speculative_config JSON (method, num_speculative_tokens, prompt_lookup_min/max, "
        "suffix_decoding_*): the whole of it reaches vLLM under --engine vllm", metavar="JSON", parse=json_object)

    def __post_init__(self) -> None:
        speculative_settings(self.speculative)  # refused here, with the field named
        self._check_positive("max_num_seqs", "max_num_batched_tokens", "block_size")
        for name in ("max_model_len", "kv_cache_bytes", "num_kv_blocks", "num_threads"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise SettingError(f"{{{name}}} must be positive, got {{got}}", got=value)
        if not 0.0 <= self.kv_watermark < 1.0:
            raise SettingError("{kv_watermark} must be in [0, 1), got {got}", got=self.kv_watermark)
        if not self.grammar_compile_timeout_s > 0:
            raise SettingError("{grammar_compile_timeout_s} must be > 0, got {got}", got=self.grammar_compile_timeout_s)
        for name in ("length_aging_s", "max_preemptions"):
            if getattr(self, name) < 0:
                raise SettingError(f"{{{name}}} must be >= 0, got {{got}}", got=getattr(self, name))
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise SettingError("{kv_cache_memory_fraction} must be in (0, 1], got {got}",
                               got=self.kv_cache_memory_fraction)
        for f in fields(self):
            choices = f.metadata["choices"]
            if choices is not None and getattr(self, f.name) not in (None, *choices):
                raise SettingError(f"{{{f.name}}} must be one of {{choices}}, got {{got!r}}",
                                   choices=choices, got=getattr(self, f.name))
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise SettingError("{device} must be 'auto', 'cpu' or 'cuda[:N]', got {got!r}", got=self.device)

    # ---- as an EngineSpec (engine/interface.py; loaded by tokenmill/engines.py) ---------------------
    def for_share_of_machine(self, share: float) -> EngineConfig:
        """Beside other engines on one machine (Ray replicas), with `share` (0–1] of it: the KV cache
        takes that part of the memory-fraction budget, instead of each engine taking the whole
        fraction of the memory free when it starts. A budget given in bytes or blocks stays."""
        if self.kv_cache_bytes is not None or self.num_kv_blocks is not None:
            return self
        return replace(self, kv_cache_memory_fraction=self.kv_cache_memory_fraction * min(1.0, share))

    @property
    def speculative(self) -> dict[str, Any] | None:
        """The speculative_config the three speculative settings make together (None: off)."""
        return speculative_config(self.speculative_method, self.num_speculative_tokens, self.speculative_config)

    def _check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise SettingError(f"{{{name}}} must be a positive integer, got {{got!r}}", got=value)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    def kv_torch_dtype(self, cpu_kernels: bool) -> torch.dtype:
        """kv_cache_dtype as a torch dtype; `cpu_kernels`: the C kernels run on this device and dtype."""
        import torch

        if self.kv_cache_dtype != "auto":
            return getattr(torch, self.kv_cache_dtype)
        return torch.float16 if cpu_kernels else self.torch_dtype

    def resolved_device(self) -> torch.device:
        """The device to run on; ValueError, before any loading, for a GPU this machine lacks."""
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                build = "has no CUDA" if torch.version.cuda is None else "finds no GPU"
                raise SettingError("{device} {got}: this torch ({version}) {build}; use {device} cpu, or install "
                                   "torch's CUDA build (README, \"Running on GPUs\")",
                                   got=self.device, version=torch.__version__, build=build)
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise SettingError("{device} {got}: this machine has {count} GPU(s)", got=self.device,
                                   count=torch.cuda.device_count())
        return device
