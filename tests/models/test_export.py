"""A GGUF file exported as a Hugging Face folder (for engines that cannot read GGUF): the same
weights, a config transformers reads, the file's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.models.export import export_gguf, hf_folder_for
from tokenmill.models.loader import LoadedWeights, load_weights


@pytest.mark.slow
def test_exported_folder_holds_the_gguf_weights(gguf_path: Path, smollm_weights: LoadedWeights,
                                                tmp_path: Path) -> None:
    from transformers import AutoConfig

    folder = tmp_path / "smollm2"
    export_gguf(gguf_path, folder)
    exported = load_weights(str(folder))
    assert exported.config == smollm_weights.config
    assert exported.state_dict.keys() == smollm_weights.state_dict.keys()
    for name, tensor in smollm_weights.state_dict.items():
        assert torch.equal(exported.state_dict[name], tensor), name
    hf = AutoConfig.from_pretrained(folder)
    assert hf.architectures == ["LlamaForCausalLM"] and hf.tie_word_embeddings
    text = "The capital of France"
    assert exported.tokenizer.encode(text) == smollm_weights.tokenizer.encode(text)


def test_folders_and_hub_ids_are_used_as_they_are(tmp_path: Path) -> None:
    assert hf_folder_for(str(tmp_path)) == str(tmp_path)
    assert hf_folder_for("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    with pytest.raises(FileNotFoundError):
        hf_folder_for(str(tmp_path / "missing.gguf"))
