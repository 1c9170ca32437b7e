"""Model sources: Hugging Face folders (with tokenizer), hub ids, GGUF, and clear failures."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineConfig
from tokenmill.models.config import SUPPORTED_ARCHITECTURES
from tokenmill.models.loader import LoadedWeights, load_weights

# Enough for ModelConfig.from_hf; load_weights builds no model, so the tensors need not fit it.
TINY_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 8,
               "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2}
REFUSAL = "tokenmill runs fp32/bf16/fp16 safetensors and GGUF files"


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.1.mlp.down_proj.weight", "model.norm.weight"]
    return {name: torch.randn(16, 8, generator=generator).to(torch.bfloat16) for name in names}


def _folder(path: Path, config: dict[str, Any] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or TINY_CONFIG))
    return path


def _shard(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Two shards and their index, as transformers writes them."""
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for file, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(folder / file))
    weight_map = {name: file for file, part in shards.items() for name in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _assert_same(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], tensor.float()), name


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


def test_shards_through_an_index_load_exactly_what_one_file_holds(tmp_path: Path) -> None:
    tensors = _tensors(0)
    single = _folder(tmp_path / "single")
    save_file(tensors, str(single / "model.safetensors"))
    sharded = _folder(tmp_path / "sharded")
    _shard(sharded, tensors)
    save_file({"stray.weight": torch.ones(2)}, str(sharded / "leftover.safetensors"))  # not in the index
    one, shards = load_weights(str(single)).state_dict, load_weights(str(sharded)).state_dict
    _assert_same(one, tensors)
    _assert_same(shards, tensors)


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    _shard(folder, _tensors(0))
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors listed in .*index.json"):
        load_weights(str(folder))


@pytest.mark.parametrize("layout", ["single file", "index"])
def test_mistral_consolidated_beside_hf_weights_is_not_read(tmp_path: Path, layout: str) -> None:
    tensors = _tensors(0)
    folder = _folder(tmp_path)
    if layout == "index":
        _shard(folder, tensors)
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    # Same names, other values, and a Mistral-only name: any of them read would show.
    save_file({**_tensors(1), "layers.0.attention.wq.weight": torch.ones(2)},
              str(folder / "consolidated.safetensors"))
    _assert_same(load_weights(str(folder)).state_dict, tensors)


def test_only_consolidated_weights_is_a_clear_error(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    save_file(_tensors(0), str(folder / "consolidated.safetensors"))
    with pytest.raises(ValueError, match="only Mistral-format consolidated"):
        load_weights(str(folder))


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _serve_mistral_style_repo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tensors: dict[str, torch.Tensor], config: dict[str, Any]
) -> list[tuple[set[str], str | None]]:
    """A repo with HF shards beside Mistral's own consolidated weights, original/ copies and a .bin,
    behind a fake snapshot_download that copies what the patterns let through (matched as
    huggingface_hub matches them). Returns each call's (files fetched, revision asked for)."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    remote, local = tmp_path / "remote", tmp_path / "snapshots" / COMMIT
    _shard(_folder(remote, config), tensors)
    save_file(_tensors(1), str(remote / "consolidated.safetensors"))
    (remote / "params.json").write_text("{}")
    (remote / "original").mkdir()
    (remote / "original" / "consolidated.00.pth").write_bytes(b"x")
    (remote / "original" / "params.json").write_text("{}")
    (remote / "pytorch_model.bin").write_bytes(b"x")
    calls: list[tuple[set[str], str | None]] = []

    def snapshot_download(repo_id: str, *, allow_patterns: Any = None, ignore_patterns: Any = None,
                          revision: str | None = None, **kwargs: Any) -> str:
        files = [p.relative_to(remote).as_posix() for p in remote.rglob("*") if p.is_file()]
        fetched = set(filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        calls.append((fetched, revision))
        for name in fetched:
            (local / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(remote / name, local / name)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_a_hub_id_downloads_only_what_will_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = _tensors(0)
    calls = _serve_mistral_style_repo(tmp_path, monkeypatch, tensors, TINY_CONFIG)
    _assert_same(load_weights("SomeOrg/some-model").state_dict, tensors)
    (metadata, _), (weights, revision) = calls
    assert metadata == {"config.json", "model.safetensors.index.json"}, "config first: nothing to refuse"
    assert weights == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert revision == COMMIT, "the weights come from the commit the config came from"


def test_a_refused_hub_model_downloads_no_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = {**TINY_CONFIG, "quantization_config": {"quant_method": "awq", "bits": 4}}
    calls = _serve_mistral_style_repo(tmp_path, monkeypatch, _tensors(0), config)
    with pytest.raises(ValueError, match="quant_method 'awq'"):
        load_weights("SomeOrg/some-model-AWQ")
    assert [fetched for fetched, _ in calls] == [{"config.json", "model.safetensors.index.json"}]


def _refused_before_reading(tmp_path: Path, config: dict[str, Any], match: str) -> None:
    """The weights file is not even a safetensors file: reading it would fail differently."""
    folder = _folder(tmp_path, config)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=match):
        load_weights(str(folder))


def test_an_unsupported_architecture_is_named_with_what_runs(tmp_path: Path) -> None:
    runs = ".*".join(re.escape(name) for name in SUPPORTED_ARCHITECTURES)
    assert "gpt_neox" not in SUPPORTED_ARCHITECTURES
    neox = {**TINY_CONFIG, "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}
    _refused_before_reading(tmp_path / "a", neox, f"model_type 'gpt_neox' .*GPTNeoXForCausalLM.*{runs}")
    classifier = {**TINY_CONFIG, "architectures": ["LlamaForSequenceClassification"]}
    _refused_before_reading(tmp_path / "b", classifier, f"'LlamaForSequenceClassification' does not generate.*{runs}")


@pytest.mark.parametrize("method", ["awq", "gptq", "fp8", "bitsandbytes", "compressed-tensors"])
def test_a_quantised_checkpoint_is_refused_naming_the_method(tmp_path: Path, method: str) -> None:
    config = {**TINY_CONFIG, "quantization_config": {"quant_method": method}}
    _refused_before_reading(tmp_path, config, f"quantised checkpoint \\(quant_method '{re.escape(method)}'.*{REFUSAL}")


def test_legacy_gptq_and_fp8_tensors_are_refused_without_a_quantization_config(tmp_path: Path) -> None:
    legacy = _folder(tmp_path / "gptq")
    (legacy / "quantize_config.json").write_text(json.dumps({"bits": 4}))
    save_file(_tensors(0), str(legacy / "model.safetensors"))
    with pytest.raises(ValueError, match=f"quantised checkpoint \\(gptq.*quantize_config.json.*{REFUSAL}"):
        load_weights(str(legacy))
    fp8 = _folder(tmp_path / "fp8")
    save_file({"model.norm.weight": torch.ones(8), "model.layers.0.mlp.up_proj.weight":
               torch.ones(8, 8).to(torch.float8_e4m3fn)}, str(fp8 / "model.safetensors"))
    refusal = f"\\(FP8: tensor 'model.layers.0.mlp.up_proj.weight' is F8_E4M3\\).*{REFUSAL}"
    with pytest.raises(ValueError, match=refusal):
        load_weights(str(fp8))


_PEAK_PROBE = """
import re, sys, torch
from pathlib import Path
from tokenmill.models.loader import read_tensors
def status(field):  # KiB. VmHWM, unlike ru_maxrss, is not inherited from the parent across fork and exec.
    return int(re.search(field + r":\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1))
before = status("VmRSS")
state = read_tensors([Path(sys.argv[1])], torch.float32)
print(status("VmHWM") - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc/self/status")
def test_safetensors_weights_load_without_a_second_copy(tmp_path: Path) -> None:
    """Peak host memory while reading a bf16 file to fp32 stays near the fp32 weights: the file's
    bytes are never all resident beside them (as an mmap of the whole file would leave them)."""
    import subprocess
    import sys

    file = tmp_path / "model.safetensors"
    generator = torch.Generator().manual_seed(0)
    save_file({f"w{i}": torch.randn(1024, 2048, generator=generator).to(torch.bfloat16) for i in range(24)},
              str(file))
    file_kib, fp32_kib = file.stat().st_size // 1024, 2 * file.stat().st_size // 1024
    out = subprocess.run([sys.executable, "-c", _PEAK_PROBE, str(file)], capture_output=True, text=True, check=True)
    grown = int(out.stdout.split()[-1])
    assert grown < fp32_kib + file_kib // 2, f"peak grew {grown} KiB for {fp32_kib} KiB of fp32 weights"


def test_a_named_model_resolves_to_its_installed_file_unless_a_path_of_that_name_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill.environment import named_model_path
    from tokenmill.models.loader import model_path

    try:
        installed = named_model_path("gemma3-270m")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    assert model_path("gemma3-270m") == installed
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()
    assert model_path("gemma3-270m") == Path("gemma3-270m")
