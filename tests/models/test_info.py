"""`tokenmill info`: what a model is, from its headers only, checked against independent counts
(gguf.GGUFReader, the transformers model's own parameters) and the loader's own refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tokenmill.cli import main
from tokenmill.models.info import describe
from tokenmill.models.loader import load_weights

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def test_the_embedded_gguf(gguf_path: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(gguf_path)

    def field(key: str) -> int:
        return int(reader.fields[key].contents())

    info = describe(None)
    assert (info.source, info.format, info.family, info.architecture) == (
        str(gguf_path), "GGUF v3", "llama", "LlamaForCausalLM")
    assert info.parameters == sum(int(t.n_elements) for t in reader.tensors)
    assert info.weight_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert sum(info.tensor_types.values()) == len(reader.tensors)
    assert info.tensor_types["Q4_1"] > 0
    assert info.tied_embeddings and "output.weight" not in {t.name for t in reader.tensors}
    layers, kv_heads = field("llama.block_count"), field("llama.attention.head_count_kv")
    head_dim = field("llama.embedding_length") // field("llama.attention.head_count")
    assert (info.layers, info.kv_heads, info.head_dim) == (layers, kv_heads, head_dim)
    assert info.context_length == field("llama.context_length")
    assert info.kv_bytes_per_token == {"fp32": 2 * layers * kv_heads * head_dim * 4,
                                       "fp16": 2 * layers * kv_heads * head_dim * 2}
    assert (info.runs, info.reason, info.sliding_window_layers, info.experts) == (True, None, 0, 0)
    # 30 layers × 7 Q4_1 projections kept as they are; the Q8_0 embedding (tied lm_head) too.
    assert info.held_as == {"4-bit blocks, as in the file": 210, "F32": 61, "8-bit blocks, as in the file": 1}


def test_gemma3_sliding_layers(gemma3_gguf_path: Path) -> None:
    info = describe(str(gemma3_gguf_path))
    assert (info.family, info.model_type, info.architecture) == ("gemma3", "gemma3_text", "Gemma3ForCausalLM")
    assert (info.sliding_window, info.sliding_window_layers, info.layers) == (512, 15, 18)
    assert info.runs
    # Q4_K_M: Q4_K in 4 bits, Q5_0 in 5, Q6_K in 6 (the 9 down_proj), Q8_0 in 8, nothing requantised;
    # the 9 layers whose v_proj is Q8_0 keep their Q5_0 q and k beside it (a layer of two parts).
    assert info.held_as == {"F32": 109, "5-bit blocks, as in the file": 81, "4-bit blocks, as in the file": 27,
                            "8-bit blocks, as in the file": 10, "6-bit blocks, as in the file": 9}


def _save(folder: Path, model_class: str, config_class: str, **settings: Any) -> int:
    """A tiny random transformers model saved as safetensors; its parameter count (tied ones once)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**TINY, **settings)
    model = getattr(transformers, model_class)(config)
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("model_class", "config_class", "settings"), [
    ("LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": True}),
    ("LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": False}),
    ("MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
])
def test_a_hugging_face_folder(tmp_path: Path, model_class: str, config_class: str, settings: dict[str, Any]) -> None:
    parameters = _save(tmp_path, model_class, config_class, **settings)
    info = describe(str(tmp_path))
    assert (info.format, info.architecture, info.runs) == ("safetensors", model_class, True)
    assert info.parameters == parameters
    assert info.tensor_types == {"F32": sum(info.tensor_types.values())}
    assert info.weight_bytes == 4 * parameters
    assert info.tied_embeddings is settings.get("tie_word_embeddings", False)
    assert (info.layers, info.hidden_size, info.kv_heads, info.head_dim, info.vocab_size) == (2, 32, 2, 8, 128)
    assert info.kv_bytes_per_token["fp32"] == 2 * 2 * 2 * 8 * 4
    assert (info.experts, info.experts_per_token) == (settings.get("num_local_experts", 0),
                                                      settings.get("num_experts_per_tok", 0))


@pytest.mark.parametrize("change", [
    {"model_type": "phi", "architectures": ["PhiForCausalLM"]},
    {"quantization_config": {"quant_method": "awq", "bits": 4}},
])
def test_a_refused_folder_says_why_as_the_loader_does(tmp_path: Path, change: dict[str, Any]) -> None:
    parameters = _save(tmp_path, "LlamaForCausalLM", "LlamaConfig")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | change))
    with pytest.raises(ValueError) as refusal:
        load_weights(str(tmp_path))

    info = describe(str(tmp_path))
    assert (info.runs, info.reason) == (False, str(refusal.value))
    assert info.parameters == parameters and info.layers == 2  # still described


def test_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _save(tmp_path, "LlamaForCausalLM", "LlamaConfig")
    assert main(["info", str(tmp_path), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert (facts["source"], facts["family"], facts["runs"]) == (str(tmp_path), "llama", True)
    assert facts["kv_bytes_per_token"] == {"fp32": 256, "fp16": 128}

    config = tmp_path / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"model_type": "phi"}))
    assert main(["info", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "runs here" in text and "no: " in text and "model_type 'phi'" in text


def test_what_is_not_there_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tmp_path / "nope.gguf")]) == 2
    assert "not found" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache"):
        describe("nobody-here/no-such-model")
