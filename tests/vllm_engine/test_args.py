"""--engine and vLLM's flags: what reaches vllm.EngineArgs (everything given, nothing else), what is
refused (no vLLM needed)."""

from __future__ import annotations

import argparse
import importlib.util
import json
from typing import Any

import pytest

from tokenmill.cli import build_parser
from tokenmill.engine import EngineConfig
from tokenmill.vllm_engine import VllmConfig, engine_spec
from tokenmill.vllm_engine.args import parse_engine_args


def _run_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", "in.jsonl", "-o", "out", *flags])


def _vllm_args(*flags: str) -> dict[str, Any]:
    spec = engine_spec(_run_args("--engine", "vllm", *flags))
    assert isinstance(spec, VllmConfig)
    return spec.vllm_engine_args()


# Every EngineConfig field vLLM has too, set explicitly to the embedded engine's own default (the
# case that was once dropped), and the vLLM argument it must arrive as.
SHARED = {
    "--model": ("model", "some/model", "some/model"), "--tokenizer": ("tokenizer", "some/tok", "some/tok"),
    "--dtype": ("dtype", "float32", "float32"), "--max-model-len": ("max_model_len", "2048", 2048),
    "--max-num-seqs": ("max_num_seqs", "64", 64), "--max-num-batched-tokens": ("max_num_batched_tokens", "2048", 2048),
    "--block-size": ("block_size", "16", 16), "--seed": ("seed", "0", 0),
    "--scheduling-policy": ("scheduling_policy", "fcfs", "fcfs"),
    "--kv-cache-bytes": ("kv_cache_memory_bytes", "1000000", 1_000_000),
}


def test_every_shared_flag_given_reaches_vllm_even_at_the_embedded_default() -> None:
    words = [w for flag, (_, text, _) in SHARED.items() for w in (flag, text)]
    words += ["--enable-prefix-caching", "--enable-chunked-prefill"]  # both on by default in the embedded engine
    expected = {name: value for name, _, value in SHARED.values()}
    assert _vllm_args(*words) == {**expected, "enable_prefix_caching": True, "enable_chunked_prefill": True}
    assert _vllm_args("--dtype", "float32") == {"dtype": "float32"}
    assert _vllm_args("--no-enable-prefix-caching") == {"enable_prefix_caching": False}


def test_a_flag_left_out_leaves_vllm_its_own_default() -> None:
    assert _vllm_args() == {}


def test_vllm_flags_and_engine_args_reach_vllm() -> None:
    assert _vllm_args("--max-model-len", "4096", "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.85",
                      "--engine-arg", "enforce_eager=true", "--engine-arg", "kv-cache-dtype=fp8",
                      "--engine-arg", 'hf_overrides={"a": 1}') == {
        "max_model_len": 4096, "tensor_parallel_size": 2, "gpu_memory_utilization": 0.85,
        "enforce_eager": True, "kv_cache_dtype": "fp8", "hf_overrides": {"a": 1},
    }
    assert _vllm_args("--dtype", "bfloat16", "--engine-arg", "dtype=half") == {
        "dtype": "half"}  # --engine-arg has the last word


def test_the_speculative_flags_reach_vllm_as_one_speculative_config() -> None:
    assert _vllm_args("--speculative-method", "ngram") == {
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 8}}  # the embedded engine's default
    assert _vllm_args("--speculative-method", "suffix", "--num-speculative-tokens", "12") == {
        "speculative_config": {"method": "suffix", "num_speculative_tokens": 12}}
    eagle = {"method": "eagle", "model": "some/eagle-head", "num_speculative_tokens": 3}
    assert _vllm_args("--speculative-config", json.dumps(eagle)) == {"speculative_config": eagle}  # vLLM's, whole
    with pytest.raises(ValueError, match="contradicts"):
        _vllm_args("--speculative-method", "ngram", "--speculative-config", '{"method": "suffix"}')


def test_vllm_flags_without_engine_vllm_are_refused() -> None:
    with pytest.raises(ValueError, match="--tensor-parallel-size, --engine-arg need --engine vllm"):
        engine_spec(_run_args("--tensor-parallel-size", "2", "--engine-arg", "x=1"))
    assert engine_spec(_run_args()) == EngineConfig()  # nothing given: the embedded engine as it comes


@pytest.mark.parametrize("words", [["--weight-format", "q4"], ["--weight-format", "auto"], ["--num-threads", "2"],
                                   ["--scheduling-policy", "length"], ["--no-pack-weights"]])
def test_an_embedded_only_setting_with_vllm_is_refused_by_name(words: list[str]) -> None:
    """Given explicitly, it would be dropped on the way to vLLM: refused instead, naming the flag."""
    with pytest.raises(ValueError, match=words[0].removeprefix("--no-").replace("--", "") if "--no-" in words[0]
                       else words[0]):
        engine_spec(_run_args("--engine", "vllm", *words))


def test_bench_of_both_engines_gives_each_its_own_flags() -> None:
    args = build_parser().parse_args(["bench", "--engine", "embedded,vllm", "--weight-format", "q4",
                                      "--dtype", "float32", "--tensor-parallel-size", "2"])
    embedded, vllm = engine_spec(args, "embedded"), engine_spec(args, "vllm", max_num_seqs=8)
    assert embedded == EngineConfig(weight_format="q4", dtype="float32")
    assert isinstance(vllm, VllmConfig)
    assert vllm.vllm_engine_args() == {"dtype": "float32", "max_num_seqs": 8, "tensor_parallel_size": 2}


@pytest.mark.parametrize("item", ["no-equals", "=3"])
def test_engine_arg_needs_key_equals_value(item: str) -> None:
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_engine_args([item])


def test_bench_takes_a_list_of_engines() -> None:
    parser = build_parser()
    assert parser.parse_args(["bench", "--engine", "embedded,vllm"]).engine == ["embedded", "vllm"]
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--engine", "embedded,embedded"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_engine_vllm_without_vllm_names_the_extra(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from tokenmill.cli import main

    (tmp_path / "in.txt").write_text("hello\n")
    code = main(["run", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out"), "--engine", "vllm",
                 "--model", str(tmp_path), "--no-progress"])
    assert code == 2 and "pip install 'tokenmill[vllm]'" in capsys.readouterr().err


def test_ray_with_engine_vllm_makes_each_replica_a_vllm_engine() -> None:
    """--ray --engine vllm --gpus-per-replica N: each Ray replica gets a vLLM backend (built in the
    replica, never here) and N GPUs; the driver only checks bodies."""
    pytest.importorskip("ray.data")
    from tokenmill.jobs.backends.build import build_backend
    from tokenmill.jobs.backends.ray import RaySpec
    from tokenmill.jobs.flags import backend_spec

    spec = backend_spec(_run_args("--ray", "--engine", "vllm", "--replicas", "3", "--gpus-per-replica", "2",
                                  "--tensor-parallel-size", "2", "--max-num-seqs", "128"))
    assert isinstance(spec, RaySpec) and spec.replica == VllmConfig(tensor_parallel_size=2, max_num_seqs=128)
    backend = build_backend(spec)
    assert backend.kind == "vllm" and backend.options.gpus_per_replica == 2  # type: ignore[attr-defined]
    assert backend.options.batch_size == 4 * 128  # type: ignore[attr-defined]
    (replica,) = backend.backends  # type: ignore[attr-defined]
    assert replica.kind == "vllm" and replica._llm is None and not replica._load_to_check
    assert replica.spec.vllm_engine_args() == {"tensor_parallel_size": 2, "max_num_seqs": 128}
