"""Golden tests: the engine's greedy output equals transformers', on every cache path."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.reference import ReferenceCache, TeacherForcedReference, assert_matches_reference
from tokenmill import LLM, SamplingParams
from tokenmill.models.config import ModelConfig, rope_attention_factor, rope_inv_freq
from tokenmill.models.loader import LoadedWeights, load_weights

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
# An fp32 KV cache, the reference's precision: a token that differs must be an fp32 near-tie. The
# default fp16 cache has a test of its own (test_fp16_kv_cache_stays_within_its_rounding_on_every_cache_path).
EXACT_KV = {"kv_cache_dtype": "float32"}


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


Checker = ReferenceCache | TeacherForcedReference


def _check(llm: LLM, ref: Checker, prompts: list[list[int]], what: str) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, progress=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        ref.check(prompt, out.token_ids, f"{what} prompt {i}")
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_NEW


def _check_cache_paths(make_llm: Callable[..., LLM], ref: Checker, vocab: int) -> None:
    mixed = _prompts(vocab, [1, 5, 17, 33, 8, 50])
    _check(make_llm(), ref, mixed[:1], "single prompt")
    _check(make_llm(), ref, mixed, "mixed-length batch")
    _check(make_llm(max_num_batched_tokens=7), ref, mixed, "chunked prefill (7-token budget)")

    shared = _prompts(vocab, [40], seed=1)[0]
    tails = _prompts(vocab, [3, 9, 1, 14], seed=2)
    prefixed = [shared + t for t in tails] + [shared]
    llm = make_llm()
    _check(llm, ref, prefixed[:1], "prefix warm-up")
    _check(llm, ref, prefixed, "prefix-cache hits")
    stats = llm.engine.scheduler.stats
    assert stats.prefix_cache_hits >= 4 * 40 - 4 * 4, "shared 40-token prefix was not served from cache"

    llm = make_llm(num_kv_blocks=12)  # 48 tokens of 4-token blocks: forces preemption
    _check(llm, ref, _prompts(vocab, [20, 18, 15, 22, 9], seed=3), "preemption")
    assert llm.engine.scheduler.stats.num_preemptions > 0, "the small cache did not preempt"
    _check_arrivals(make_llm(), ref, vocab)


def _check_arrivals(llm: LLM, ref: Checker, vocab: int) -> None:
    """Requests that arrive while others are decoding join the running batch."""
    engine = llm.engine
    prompts = _prompts(vocab, [12, 30, 7, 25], seed=4)
    finished = {}
    for i, prompt in enumerate(prompts):
        engine.add_request({"prompt_token_ids": prompt}, GREEDY, request_id=f"r{i}")
        for _ in range(3):
            finished.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    for i, prompt in enumerate(prompts):
        ref.check(prompt, finished[f"r{i}"].token_ids, f"arrival {i}")


# ---- tiny random models built from transformers configs ------------------------------------
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.2, tie_word_embeddings=False,
)


def _tiny_config(arch: str):  # type: ignore[no-untyped-def]
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if arch == "llama":  # with Llama-3 rope scaling and tied embeddings
        return LlamaConfig(**{**TINY, "tie_word_embeddings": True}, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        }, rope_theta=10000.0)
    if arch == "qwen2":  # QKV bias, YaRN (Qwen2.5's long context), in the older config.json shape
        return Qwen2Config(**TINY, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "phi3":
        # Fused qkv/gate_up checkpoints, half of each head rotated, longrope's short factors and
        # attention factor (the pretraining length is the whole context; the long factors are
        # tested on their own below).
        return _phi3_config(original_context=TINY["max_position_embeddings"], attention_factor=1.2)
    if arch == "qwen3":  # q/k norms; the second layer slides (max_window_layers), the first does not
        return Qwen3Config(**TINY, head_dim=16, use_sliding_window=True, sliding_window=12, max_window_layers=1)
    if arch == "gemma3":
        # Both layer kinds (every third layer global) with an 8-token window, a query scalar
        # other than head_dim, a local RoPE base other than the global one, linear scaling on
        # the global layers only, tied embeddings.
        return Gemma3TextConfig(**{**TINY, "num_hidden_layers": 5, "tie_word_embeddings": True}, head_dim=16,
                                query_pre_attn_scalar=24, sliding_window=8,
                                layer_types=["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(5)],
                                rope_parameters={
                                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                                })
    if arch == "mixtral":  # top-2 of 4 experts in every layer
        from transformers import MixtralConfig

        return MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen2_moe":  # QKV bias, a dense first layer, a shared expert, weights not renormalised
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=96, mlp_only_layers=[0], norm_topk_prob=False)
    if arch == "qwen3_moe":  # q/k norms, renormalised top-2 of 6
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**TINY, head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                              norm_topk_prob=True)
    return MistralConfig(**TINY, sliding_window=24, head_dim=16)  # window shorter than prompts


def _phi3_config(original_context: int, attention_factor: float | None = None, partial: float = 0.5):  # type: ignore[no-untyped-def]
    from transformers import Phi3Config

    pairs = int(TINY["hidden_size"] // TINY["num_attention_heads"] * partial) // 2
    rope = {"type": "longrope", "short_factor": [1.0 + i / 2 for i in range(pairs)],
            "long_factor": [3.0 + 2 * i for i in range(pairs)]}
    if attention_factor is not None:
        rope["attention_factor"] = attention_factor
    return Phi3Config(**TINY, partial_rotary_factor=partial, original_max_position_embeddings=original_context,
                      rope_scaling=rope, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def _tiny_model(arch: Any) -> torch.nn.Module:
    """`arch`: a name _tiny_config knows, or a transformers config."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _tiny_config(arch) if isinstance(arch, str) else arch
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).eval()
    if arch in ("qwen3", "gemma3"):
        # Norm weights start at ones (Gemma's at zeros: it scales by 1 + w). Random ones check
        # that each norm, and Gemma's unit offset, is applied where transformers applies it.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.3).add_(0.0 if arch == "gemma3" else 1.0)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral", "qwen3", "gemma3", "phi3", "mixtral",
                                        "qwen2_moe", "qwen3_moe"])
def tiny_model(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:  # type: ignore[no-untyped-def]
    model = _tiny_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return folder, model


# The C kernels (paged decode and prefill attention, small-batch linears), or PyTorch ops only.
KERNELS = {"kernels": {"decode_attention": "kernel", "prefill_attention": "kernel", "small_batch_linear": "kernel"},
           "torch": {"decode_attention": "sdpa", "prefill_attention": "sdpa", "small_batch_linear": "off"}}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("policy", "ops"), [("fcfs", "kernels"), ("priority", "kernels"), ("length", "kernels"), ("fcfs", "torch")],
)
def test_tiny_models_match_transformers_on_every_cache_path(tiny_model, policy: str, ops: str) -> None:  # type: ignore[no-untyped-def]
    folder, model = tiny_model
    weights = load_weights(str(folder))
    assert weights.config.model_type == model.config.model_type

    def make_llm(**overrides: int) -> LLM:
        settings = {"block_size": 4, "max_num_seqs": 8, "scheduling_policy": policy, **KERNELS[ops], **overrides}
        return LLM(**EXACT_KV, weights=weights, **settings)

    _check_cache_paths(make_llm, ReferenceCache(model), vocab=512)


# K and V rounded to fp16 (relative error <= 2^-11) move these tiny models' logits by ~1e-3: each token
# the engine picks must be within FP16_TOLERANCE of the reference's best, ~1e-3 on average. A cache
# read or written wrongly (a misplaced row, fp16 bits taken for fp32) puts tokens whole logits below.
FP16_TOLERANCE, FP16_MEAN_SHORTFALL = 0.02, 2e-3


@pytest.mark.slow
@pytest.mark.parametrize("ops", KERNELS)
def test_fp16_kv_cache_stays_within_its_rounding_on_every_cache_path(tiny_model, ops: str) -> None:  # type: ignore[no-untyped-def]
    folder, model = tiny_model
    weights = load_weights(str(folder))
    checker = TeacherForcedReference(model, FP16_TOLERANCE)

    def make_llm(**overrides: int) -> LLM:
        llm = LLM(weights=weights, kv_cache_dtype="float16", block_size=4, max_num_seqs=8, **KERNELS[ops], **overrides)
        assert all(k.dtype == v.dtype == torch.float16 for k, v in llm.engine.runner.kv_caches)
        return llm

    _check_cache_paths(make_llm, checker, vocab=512)
    checker.assert_mean_shortfall_within(FP16_MEAN_SHORTFALL)


@pytest.mark.parametrize("kv", ["float32", "float16"])
@pytest.mark.parametrize("ops", KERNELS)
def test_uninitialised_kv_memory_never_leaks_into_attention(tiny_model, ops: str, kv: str) -> None:  # type: ignore[no-untyped-def]
    """The cache is allocated uninitialised and whole blocks are gathered; poison it with NaN
    to stand for garbage and the output must still match the reference."""
    folder, model = tiny_model
    llm = LLM(weights=load_weights(str(folder)), kv_cache_dtype=kv, block_size=8, max_num_seqs=4, **KERNELS[ops])
    for k, v in llm.engine.runner.kv_caches:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    prompts = _prompts(512, [3, 11, 21], seed=5)
    ref = ReferenceCache(model) if kv == "float32" else TeacherForcedReference(model, FP16_TOLERANCE)
    _check(llm, ref, prompts, "NaN-poisoned cache")


def test_gemma3_multimodal_checkpoint_runs_text_only() -> None:
    """A Gemma 3 image-text checkpoint: the config under text_config, the weights under
    model.language_model.* beside a vision tower. Its text model runs on its own."""
    model = _tiny_model("gemma3")
    cfg = {"model_type": "gemma3", "text_config": model.config.to_dict(), "eos_token_id": [1, 106]}
    state = {name.replace("model.", "model.language_model.", 1): t for name, t in model.state_dict().items()}
    state["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(8, 3, 2, 2)
    weights = LoadedWeights("gemma3-multimodal", ModelConfig.from_hf(cfg), state, tokenizer=None)
    assert weights.config.model_type == "gemma3_text" and weights.config.eos_token_ids == [1, 106]
    llm = LLM(**EXACT_KV, weights=weights, block_size=4, max_num_seqs=4)
    _check(llm, ReferenceCache(model), _prompts(512, [5, 30], seed=6), "multimodal Gemma 3, text only")


def test_gemma3_flat_config_reads_as_transformers_does() -> None:
    """An older Gemma 3 config.json: RoPE as rope_theta / rope_local_base_freq / rope_scaling,
    layer kinds from sliding_window_pattern, everything else Gemma3TextConfig's defaults."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    flat = {"model_type": "gemma3_text", "num_hidden_layers": 8, "sliding_window": 512,
            "sliding_window_pattern": 4, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 168}
    cfg = ModelConfig.from_hf(flat)
    hf = Gemma3TextConfig(**{k: v for k, v in flat.items() if k != "model_type"})
    assert cfg.layer_windows == [512 if kind == "sliding_attention" else None for kind in hf.layer_types]
    assert None in cfg.layer_windows and cfg.sliding_window is None  # mixed: no model-wide window
    assert (cfg.vocab_size, cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.hidden_act) == (
        hf.vocab_size, hf.hidden_size, hf.head_dim, hf.num_key_value_heads, hf.hidden_activation)
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.query_pre_attn_scalar == 168
    rotary = Gemma3RotaryEmbedding(hf)
    torch.testing.assert_close(rope_inv_freq(cfg), rotary.full_attention_inv_freq)
    torch.testing.assert_close(rope_inv_freq(cfg, local=True), rotary.sliding_attention_inv_freq)


@pytest.mark.parametrize("key", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_gemma_softcapping_is_refused(key: str) -> None:
    with pytest.raises(ValueError, match="softcapping"):
        ModelConfig.from_hf({"model_type": "gemma3_text", key: 30.0})


def test_rope_freq_factors_divide_the_frequencies_instead_of_rope_scaling() -> None:
    """llama.cpp's rope_freqs (GGUF Llama 3.1+): per-frequency divisors, rope_scaling ignored."""
    base = {"model_type": "llama", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 4}
    plain = rope_inv_freq(ModelConfig.from_hf(base))
    factors = [1.0 + i for i in range(8)]
    scaled = ModelConfig.from_hf({**base, "rope_freq_factors": factors,
                                  "rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    torch.testing.assert_close(rope_inv_freq(scaled), plain / torch.tensor(factors))
    with pytest.raises(ValueError, match="rope_freq_factors"):
        rope_inv_freq(ModelConfig.from_hf({**base, "rope_freq_factors": factors[:3]}))


def test_phi3_longrope_uses_long_factors_when_the_context_passes_the_pretraining_length(tmp_path: Path) -> None:
    """Long factors and the attention factor from max_position_embeddings / the pretraining
    length: against transformers on prompts longer than that length (where it switches to the
    long factors), and the short factors when the engine's context stays within it."""
    model = _tiny_model(_phi3_config(original_context=16, partial=0.75))
    model.save_pretrained(tmp_path)
    weights, ref = load_weights(str(tmp_path)), ReferenceCache(model)
    assert weights.config.rotary_dim == 12
    _check(LLM(**EXACT_KV, weights=weights, block_size=4), ref, _prompts(512, [17, 40, 23], seed=7), "long factors")
    short = LLM(**EXACT_KV, weights=weights, block_size=4, max_model_len=16)
    outs = short.generate([{"prompt_token_ids": p} for p in _prompts(512, [4], seed=8)], GREEDY, progress=False)
    assert_matches_reference(outs[0].token_ids, ref(outs[0].prompt_token_ids, MAX_NEW), "short factors")


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2,
     "mscale": 0.7, "mscale_all_dim": 0.5, "truncate": False},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128, "attention_factor": 0.9},
    {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 3.0, 5.0, 9.0],
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "factor": 3.0},
], ids=["yarn", "yarn-mscale-untruncated", "yarn-attention-factor", "longrope", "linear"])
def test_rope_scaling_equals_transformers(rope: dict[str, Any]) -> None:
    """Frequencies (short and long) and attention factor, against transformers' own functions."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(**TINY, rope_parameters={**rope, "rope_theta": 5000.0, "partial_rotary_factor": 0.5})
    cfg = ModelConfig.from_hf(hf.to_dict())
    for context in (None, 256):
        inv, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, None, seq_len=context)
        torch.testing.assert_close(rope_inv_freq(cfg, context_len=context), inv, rtol=0, atol=0)
        assert rope_attention_factor(cfg) == pytest.approx(factor, rel=1e-12)


def test_unsupported_rope_scaling_is_refused_when_the_config_is_read() -> None:
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        ModelConfig.from_hf({**TINY, "model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2.0}})


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_on_every_cache_path(
    smollm_weights: LoadedWeights, smollm_reference: torch.nn.Module
) -> None:
    def make_llm(**overrides: int) -> LLM:
        return LLM(**EXACT_KV, weights=smollm_weights, **{"block_size": 4, "max_num_seqs": 8, **overrides})

    _check_cache_paths(make_llm, ReferenceCache(smollm_reference), vocab=49152)


@pytest.mark.slow
def test_smollm2_text_prompts_match_transformers(
    smollm_weights: LoadedWeights, smollm_reference: torch.nn.Module
) -> None:
    llm = LLM(**EXACT_KV, weights=smollm_weights, max_num_seqs=4)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
    outs = llm.generate(prompts, GREEDY, progress=False)
    ref = ReferenceCache(smollm_reference)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_reference(out.token_ids, ref(out.prompt_token_ids, MAX_NEW), prompt)
    assert "Paris" in outs[0].text


@pytest.mark.slow
def test_gemma3_270m_gguf_matches_transformers(gemma3_gguf_path: Path, gemma3_reference: torch.nn.Module) -> None:
    """The second real model: Gemma 3 270M's Q4_K_M weights (K-quants dequantised by our reader),
    sliding and global layers, against transformers reading the same file. Every cache path runs
    on the tiny random Gemma 3 above; here a mixed batch under chunked prefill, a prompt longer
    than the sliding window, and text."""
    weights = load_weights(str(gemma3_gguf_path))
    assert weights.config.model_type == "gemma3_text" and None in weights.config.layer_windows
    ref, vocab = ReferenceCache(gemma3_reference), weights.config.vocab_size
    llm = LLM(**EXACT_KV, weights=weights, block_size=16, max_num_seqs=8, max_num_batched_tokens=64)
    _check(llm, ref, _prompts(vocab, [1, 17, 50]), "mixed batch, 64-token prefill chunks")
    window = max(w for w in weights.config.layer_windows if w is not None)
    _check(llm, ref, _prompts(vocab, [window + 40], seed=9), "longer than the sliding window")
    out = llm.generate(["The capital of France is"], GREEDY, progress=False)[0]
    assert_matches_reference(out.token_ids, ref(out.prompt_token_ids, MAX_NEW))


@pytest.mark.parametrize("padding_waste", [0.0, float("inf")])
def test_prefill_attended_in_query_chunks_matches_transformers(tiny_model, monkeypatch, padding_waste) -> None:  # type: ignore[no-untyped-def]
    """The SDPA prefill path (where the C kernel does not run): queries attended 4 at a time, each
    chunk against only the keys its mask can let in (the sliding windows of 8–24 tokens are
    outgrown by the 50-token prompt), in a batch of mixed lengths and under chunked prefill; every
    prompt span in a group of its own, or all in one padded group (padded query rows)."""
    from tokenmill.engine import model_runner
    from tokenmill.models import decoder

    monkeypatch.setattr(decoder, "QUERY_CHUNK", 4)
    monkeypatch.setattr(model_runner, "MAX_PADDING_WASTE", padding_waste)
    folder, model = tiny_model
    weights, ref = load_weights(str(folder)), ReferenceCache(model)
    mixed = _prompts(512, [1, 5, 17, 33, 8, 50])
    sdpa = {"prefill_attention": "sdpa", "block_size": 4, "max_num_seqs": 8, **EXACT_KV}
    _check(LLM(weights=weights, **sdpa), ref, mixed, "query chunks, mixed batch")
    _check(LLM(weights=weights, max_num_batched_tokens=13, **sdpa), ref, mixed, "query chunks, chunked prefill")
