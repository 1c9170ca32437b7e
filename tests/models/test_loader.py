"""Model sources: Hugging Face folders (with tokenizer), hub ids, GGUF, and clear failures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineConfig
from tokenmill.models.loader import LoadedWeights, load_weights


def test_unknown_model_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        load_weights(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_weights(str(tmp_path))
    (tmp_path / "x.bin").write_text("x")
    with pytest.raises(ValueError, match="neither a .gguf file nor a model folder"):
        load_weights(str(tmp_path / "x.bin"))


def test_hub_id_failure_says_what_was_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(*args: object, **kwargs: object) -> str:
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="could not be fetched from the hub: no network"):
        load_weights("SomeOrg/some-model")


def test_bad_engine_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineConfig(kv_cache_memory_fraction=1.5)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int3")
    with pytest.raises(ValueError, match="small_batch_linear"):
        EngineConfig(small_batch_linear="fast")


@pytest.mark.slow
def test_hf_folder_with_tokenizer_loads_and_generates(smollm_weights: LoadedWeights, tmp_path: Path) -> None:
    """Save the embedded model as a Hugging Face folder; it must load and give the same text."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg = smollm_weights.config
    hf = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )
    hf.save_pretrained(tmp_path)
    tensors = {k: v.contiguous() for k, v in smollm_weights.state_dict.items() if k != "lm_head.weight"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    smollm_weights.tokenizer.save_pretrained(tmp_path)

    params = SamplingParams(max_tokens=8, temperature=0)
    folder = LLM(str(tmp_path), max_model_len=256).generate("The capital of France is", params, progress=False)
    gguf = LLM(weights=smollm_weights, max_model_len=256).generate("The capital of France is", params,
                                                                 progress=False)
    assert folder[0].text == gguf[0].text and "Paris" in folder[0].text
    assert torch.equal(load_weights(str(tmp_path)).state_dict["model.norm.weight"],
                       smollm_weights.state_dict["model.norm.weight"])
