"""Model specs: parameter counts from the architecture, KV bytes per token, file readers."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from tokenmill.environment import embedded_model_path
from tokenmill.plan.errors import PlanError
from tokenmill.plan.hardware import HardwareSpec
from tokenmill.plan.model_specs import (
    PRESET_CONFIGS,
    MLASpec,
    MoESpec,
    kv_elements_per_token,
    load_model,
    param_counts,
    preset,
)
from tokenmill.plan.roofline import PlanConfig, make_setup

# Published totals (model cards / papers) in billions: (total, active). Scout's 109B includes
# its ~1B vision encoder, which the text-only preset leaves out; hence 2% tolerance.
PUBLISHED = {
    "qwen2.5-7b-instruct": (7.61, 7.61),
    "phi-4": (14.7, 14.7),
    "qwen2.5-72b-instruct": (72.7, 72.7),
    "llama-3.1-70b-instruct": (70.6, 70.6),
    "mixtral-8x7b-instruct": (46.7, 12.9),
    "llama-4-scout-17b-16e-instruct": (109, 17),
    "deepseek-v3": (671, 37),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_counts_match_published_totals(name: str) -> None:
    counts = param_counts(preset(name))
    total, active = PUBLISHED[name]
    assert counts.total / 1e9 == pytest.approx(total, rel=0.02)
    assert counts.active / 1e9 == pytest.approx(active, rel=0.02)


def test_llama_70b_param_count_by_hand() -> None:
    # per layer: q,o 2*8192*8192 = 134,217,728; k,v 2*8192*1024 = 16,777,216;
    # MLP 3*8192*28672 = 704,643,072; 2 norms 16,384 -> 855,654,400; x80 = 68,452,352,000
    # + untied embedding and lm_head 2*128256*8192 = 2,101,346,304 + final norm 8,192
    assert param_counts(preset("llama-3.1-70b")).total == 70_553_706_496


def test_moe_active_counts_only_routed_top_k() -> None:
    # Mixtral: 32 layers x 8 experts x 3*4096*14336 (176,160,768) = 45.1B routed; a token
    # uses 2 of 8, so active = total - 6/8 of the routed experts
    c = param_counts(preset("mixtral-8x7b"))
    assert c.routed_experts == 32 * 8 * 176_160_768
    assert c.total - c.active == 32 * 6 * 176_160_768


@pytest.mark.parametrize(("name", "per_token"), [
    ("llama-3.1-70b", 80 * 8 * 128 * 2 * 2),  # 327,680 B = 320 KiB
    ("qwen2.5-72b", 80 * 8 * 128 * 2 * 2),  # the same as Llama-3.1-70B
    ("qwen2.5-7b", 28 * 4 * 128 * 2 * 2),  # 57,344
    ("phi-4", 40 * 10 * 128 * 2 * 2),  # 204,800
    ("mixtral-8x7b", 32 * 8 * 128 * 2 * 2),  # 131,072
    ("llama-4-scout", 48 * 8 * 128 * 2 * 2),  # 196,608
    ("deepseek-v3", (512 + 64) * 61 * 2),  # MLA: latent + rope key, no x2 for K/V: 70,272
])
def test_kv_bytes_per_token_in_bf16(name: str, per_token: int) -> None:
    assert kv_elements_per_token(preset(name)) * 2 == per_token


def test_llama_70b_kv_is_320_kib_per_token() -> None:
    assert kv_elements_per_token(preset("llama-3.1-70b")) * 2 == 320 * 1024


def test_deepseek_preset_structure() -> None:
    m = preset("DeepSeek V3")  # the study's spelling resolves too
    assert m.moe is not None and m.mla is not None
    assert (m.moe.num_experts, m.moe.top_k, m.moe.num_moe_layers) == (256, 8, 58)  # 3 dense
    assert m.default_weight_dtype == "fp8"  # the checkpoint ships in fp8


@pytest.mark.parametrize(("label", "name"), [
    ("Qwen2.5 7B", "qwen2.5-7b-instruct"),
    ("Phi-4 14B", "phi-4"),
    ("Mixtral 8x7B", "mixtral-8x7b-instruct"),
    ("Llama 4 Scout", "llama-4-scout-17b-16e-instruct"),
    ("DeepSeek V3", "deepseek-v3"),
    ("Llama 3.1 70B", "llama-3.1-70b-instruct"),
    ("Qwen2.5 72B", "qwen2.5-72b-instruct"),
    ("Qwen2.5 72B Instruct", "qwen2.5-72b-instruct"),
])
def test_every_study_spelling_resolves_to_its_model(label: str, name: str) -> None:
    # the model the study names, not merely some preset: the spec carries that checkpoint's config
    m = preset(label)
    assert m.name == name
    assert param_counts(m).total == param_counts(preset(name)).total


def test_unknown_preset_names_the_field_and_lists_known() -> None:
    with pytest.raises(PlanError, match=r"^model: unknown preset 'gpt-5'.*llama-3.1-70b"):
        load_model("gpt-5")


def test_missing_file_names_the_field() -> None:
    with pytest.raises(PlanError, match=r"^model: file or folder .* does not exist"):
        load_model("/nonexistent/config.json")


def test_hf_config_file_and_folder(tmp_path: Path) -> None:
    cfg = dict(PRESET_CONFIGS["llama-3.1-70b-instruct"], architectures=["LlamaForCausalLM"],
               rope_theta=500000.0)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for ref in (str(tmp_path / "config.json"), str(tmp_path)):
        assert param_counts(load_model(ref)).total == 70_553_706_496


def test_hf_config_nested_text_config(tmp_path: Path) -> None:
    # Llama 4 checkpoints nest the language model under text_config
    cfg = {"model_type": "llama4", "text_config": PRESET_CONFIGS["llama-4-scout-17b-16e-instruct"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model(str(tmp_path))
    assert m.moe is not None and m.moe.num_shared_experts == 1
    assert param_counts(m).total == param_counts(preset("llama-4-scout")).total


def test_hf_config_missing_key(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(PlanError, match=r"model: .*no 'num_hidden_layers'"):
        load_model(str(tmp_path / "config.json"))


def test_gguf_metadata(smollm2_gguf: Path) -> None:
    m = load_model(str(smollm2_gguf))
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (
        30, 576, 9, 3, 64)
    assert (m.ffn_size, m.vocab_size, m.tie_embeddings) == (1536, 49152, True)
    # the architecture formula must give exactly the file's tensor element count (checked
    # once against gguf.GGUFReader: 272 tensors, 134,515,008 elements, 96,576,768 bytes)
    c = param_counts(m)
    assert c.total == 134_515_008
    w = m.native_widths
    assert w is not None
    # the file states a Q8_0 embedding (34 B per block of 32) and Q4_1 blocks (20 B per 32)
    # with F32 norms (a little above 0.625 B/param)
    assert w.embedding == 34 / 32
    assert 0.625 < w.blocks < 0.63
    stored = c.embedding * w.embedding + c.blocks * w.blocks  # tied: no separate lm_head
    assert stored == pytest.approx(96_576_768)
    assert stored < smollm2_gguf.stat().st_size < stored * 1.05  # the rest is the header


def _write_untied_gguf(path: Path) -> Path:
    """A one-layer llama GGUF whose tensors have three widths: Q8_0 token table, F16 output
    matrix, Q4_0 blocks (18 B per 32 weights) with F32 norms, as llama.cpp's quantisers mix."""
    d, heads, kv_heads, head_dim, ffn, vocab = 64, 4, 2, 16, 128, 96
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", d), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads), ("feed_forward_length", ffn),
                       ("context_length", 256)):
        writer.add_uint32(f"llama.{key}", value)

    def add(name: str, rows: int, cols: int, kind: gguf.GGMLQuantizationType) -> None:
        data = rng.standard_normal((rows, cols)).astype(np.float32)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)

    q4, f32 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.F32
    add("token_embd.weight", vocab, d, gguf.GGMLQuantizationType.Q8_0)
    add("output.weight", vocab, d, gguf.GGMLQuantizationType.F16)
    add("output_norm.weight", 1, d, f32)
    for name, rows, cols in (("attn_q", heads * head_dim, d), ("attn_k", kv_heads * head_dim, d),
                             ("attn_v", kv_heads * head_dim, d), ("attn_output", d, d),
                             ("ffn_gate", ffn, d), ("ffn_up", ffn, d), ("ffn_down", d, ffn)):
        add(f"blk.0.{name}.weight", rows, cols, q4)
    add("blk.0.attn_norm.weight", 1, d, f32)
    add("blk.0.ffn_norm.weight", 1, d, f32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_states_its_own_tensor_widths(tmp_path: Path, fake_machine: HardwareSpec) -> None:
    # a GGUF's stored bytes are used role by role, not as one average: the untied output
    # matrix read every decode step is F16 here, wider than the Q4_0 blocks
    m = load_model(str(_write_untied_gguf(tmp_path / "tiny.gguf")))
    assert not m.tie_embeddings and m.default_weight_dtype == "native"
    w = m.native_widths
    assert w is not None
    assert (w.embedding, w.lm_head) == (34 / 32, 2.0)
    c = param_counts(m)
    norms = 3 * 64  # two per layer + the final one, stored as F32
    assert w.blocks * c.blocks == pytest.approx((c.blocks - norms) * 18 / 32 + norms * 4)
    setup = make_setup(m, fake_machine, PlanConfig(input_len=8, output_len=8))
    assert setup.weight_bytes == pytest.approx(96 * 64 * (34 / 32 + 2) + w.blocks * c.blocks)


def _write_expert_gguf(path: Path) -> Path:
    """A DeepSeek-style GGUF header, tensors all F32 zeros: 3 layers, the first dense and the others
    with 4 routed experts (2 used) and 2 shared ones by count, latent attention."""
    d, ffn, expert_ffn, vocab = 32, 48, 16, 64
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    for key, value in (("block_count", 3), ("embedding_length", d), ("attention.head_count", 4),
                       ("feed_forward_length", ffn), ("context_length", 128), ("expert_count", 4),
                       ("expert_used_count", 2), ("expert_feed_forward_length", expert_ffn),
                       ("expert_shared_count", 2), ("attention.kv_lora_rank", 16),
                       ("attention.q_lora_rank", 8), ("rope.dimension_count", 4),
                       ("attention.key_length", 12), ("attention.value_length", 8)):
        writer.add_uint32(f"deepseek2.{key}", value)
    writer.add_array("deepseek2.attention.head_count_kv", [4, 2, 4])  # per layer: planned at the widest
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,), "blk.0.ffn_up.weight": (ffn, d)}
    shapes |= {f"blk.{layer}.ffn_up_exps.weight": (4, expert_ffn, d) for layer in (1, 2)}
    for name, shape in shapes.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_experts_and_latent_attention(tmp_path: Path) -> None:
    m = load_model(str(_write_expert_gguf(tmp_path / "experts.gguf")))
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.ffn_size, m.max_context) == (3, 4, 12, 48, 128)
    assert m.moe == MoESpec(num_experts=4, top_k=2, expert_ffn=16, num_moe_layers=2,
                            num_shared_experts=2, shared_ffn=16)
    assert m.mla == MLASpec(q_lora_rank=8, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                            v_head_dim=8)


def test_default_model_is_the_embedded_gguf(smollm2_gguf: Path) -> None:
    assert embedded_model_path() == smollm2_gguf
    assert load_model(None).source == str(smollm2_gguf)


def test_gguf_folder(smollm2_gguf: Path, tmp_path: Path) -> None:
    (tmp_path / smollm2_gguf.name).symlink_to(smollm2_gguf)
    assert load_model(str(tmp_path)).num_layers == 30


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(PlanError, match=r"model: .*not a GGUF"):
        load_model(str(bad))
