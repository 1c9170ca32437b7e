"""--engine and vLLM's flags: what reaches vllm.EngineArgs, what is refused (no vLLM needed)."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from tokenmill.cli import build_parser
from tokenmill.vllm_engine import check_engine_flags, vllm_engine_args
from tokenmill.vllm_engine.args import parse_engine_args


def _run_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", "in.jsonl", "-o", "out", *flags])


def test_only_settings_away_from_the_embedded_defaults_reach_vllm() -> None:
    args = _run_args("--engine", "vllm", "--max-model-len", "4096", "--max-num-seqs", "64",
                     "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.85",
                     "--engine-arg", "enforce_eager=true", "--engine-arg", "kv-cache-dtype=fp8",
                     "--engine-arg", 'hf_overrides={"a": 1}')
    assert vllm_engine_args(args) == {
        "max_model_len": 4096, "tensor_parallel_size": 2, "gpu_memory_utilization": 0.85,
        "enforce_eager": True, "kv_cache_dtype": "fp8", "hf_overrides": {"a": 1},
    }  # --max-num-seqs 64 is the embedded default: vLLM keeps its own
    assert vllm_engine_args(_run_args("--engine", "vllm", "--dtype", "bfloat16", "--engine-arg", "dtype=half")) == {
        "dtype": "half"}  # --engine-arg has the last word


def test_vllm_flags_without_engine_vllm_are_refused() -> None:
    with pytest.raises(ValueError, match="--tensor-parallel-size, --engine-arg need --engine vllm"):
        check_engine_flags(_run_args("--tensor-parallel-size", "2", "--engine-arg", "x=1"))
    check_engine_flags(_run_args())  # nothing given: fine


def test_a_weight_format_for_vllm_alone_is_refused() -> None:
    with pytest.raises(ValueError, match="--weight-format q4 is the embedded engine's setting"):
        check_engine_flags(_run_args("--engine", "vllm", "--weight-format", "q4"))
    check_engine_flags(_run_args("--engine", "vllm", "--weight-format", "auto"))


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
    from tokenmill.jobs.cli import make_backend

    args = _run_args("--ray", "--engine", "vllm", "--replicas", "3", "--gpus-per-replica", "2",
                     "--tensor-parallel-size", "2", "--max-num-seqs", "128")
    backend = make_backend(args)
    assert backend.kind == "vllm" and backend.options.gpus_per_replica == 2  # type: ignore[attr-defined]
    (replica,) = backend.backends  # type: ignore[attr-defined]
    assert replica.kind == "vllm" and replica._llm is None and not replica._load_to_check
    assert replica._vllm_args == {"tensor_parallel_size": 2, "max_num_seqs": 128}
