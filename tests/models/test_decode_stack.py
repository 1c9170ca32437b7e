"""The decode stack (all layers of a decode step in one C call) against the layer-by-layer path it
replaces: the same kernels in the same order, so the same logits bit for bit, on every step of a
real batch; and the models it does not cover keep the layer-by-layer path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.test_equivalence import _prompts, _tiny_model
from tests.models.test_quant import needs_kernel
from tokenmill import LLM, SamplingParams
from tokenmill.models.decode_stack import DecodeStack
from tokenmill.models.fused import FusedCausalLM
from tokenmill.models.loader import load_weights

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _compare_every_decode_step(model: FusedCausalLM) -> list[bool]:
    """Runs each decode step layer by layer, then again on the stack (which rewrites the same K/V
    slots), and records whether the logits are equal."""
    forward, equal = model.forward, []

    def both_paths(*args):  # type: ignore[no-untyped-def]
        model.use_decode_stack = False
        layered = forward(*args)
        model.use_decode_stack = True
        stacked = forward(*args)
        if model.decode_stack(args[3]) is not None:
            equal.append(torch.equal(layered, stacked))
        return stacked

    model.forward = both_paths  # type: ignore[method-assign]
    return equal


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "phi3", "qwen3", "gemma3"])
@pytest.mark.parametrize(("setting", "kv"), [("q4", "float16"), ("q8", "float16"), ("q4", "float32")])
def test_decode_stack_gives_the_layer_by_layer_logits_bitwise(arch: str, setting: str, kv: str, tmp_path: Path) -> None:
    """llama: tied embeddings, Llama-3 RoPE scaling; qwen2: q/k/v biases; mistral: a 24-token
    sliding window the prompts outgrow; phi3: half of each head rotated; qwen3: per-head q/k
    norms; gemma3: four norms scaling by 1 + w, a GELU gate, a query scalar, sliding layers on a
    local RoPE table. The stack writes fp16 K/V with the rounding torch's .half() has."""
    _tiny_model(arch).save_pretrained(tmp_path)
    llm = LLM(weights=load_weights(str(tmp_path)), weight_format=setting, kv_cache_dtype=kv, block_size=4,
              max_num_seqs=8)
    equal = _compare_every_decode_step(llm.engine.runner.model)
    prompts = [{"prompt_token_ids": p} for p in _prompts(512, [1, 30, 17, 5, 40])]
    outputs = llm.generate(prompts, GREEDY, progress=False)
    assert all(len(o.token_ids) == 10 for o in outputs)
    assert len(equal) >= 9 and all(equal), f"{equal.count(False)} of {len(equal)} decode steps differ"


@needs_kernel
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_layers_the_stack_does_not_cover_keep_the_layer_by_layer_path(arch: str, tmp_path: Path) -> None:
    """MoE experts (which stay fp32)."""
    _tiny_model(arch).save_pretrained(tmp_path)
    llm = LLM(weights=load_weights(str(tmp_path)), weight_format="q8", block_size=4)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, progress=False)
    model = llm.engine.runner.model
    assert model._decode_stack_built and model._decode_stack is None


def test_fp32_weights_keep_the_layer_by_layer_path(gguf_path: Path) -> None:
    llm = LLM(str(gguf_path), weight_format="fp32")
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, progress=False)
    assert llm.engine.runner.model._decode_stack is None


def test_a_layer_the_stack_does_not_know_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="layer 0 is a Linear, not decoder.py's DecoderLayer"):
        DecodeStack.build([torch.nn.Linear(8, 8)], rotary_dim=8)
