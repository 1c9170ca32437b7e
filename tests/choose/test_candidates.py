"""A candidate's flags are `tokenmill run`'s, parsed once into its job and backend spec."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tokenmill.choose.candidates import RESERVED, CandidateError, parse_candidate
from tokenmill.engine import EngineConfig
from tokenmill.jobs.backends.endpoint import EndpointSpec
from tokenmill.jobs.flags import add_arguments
from tokenmill.vllm_engine import VllmConfig


def test_reserved_flags_are_run_flags() -> None:
    """The flags choose decides for every candidate must be flags `tokenmill run` has: a renamed
    run flag fails here instead of slipping past the check."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = {option for action in parser._actions for option in action.option_strings}
    assert set(RESERVED) <= options


def test_flags_become_the_candidates_job_and_backend() -> None:
    local = parse_candidate("local=--max-tokens 5 --num-threads 1 --choice a,b", common="--temperature 0",
                            default_price_per_hour=0.5)
    assert local.backend == EngineConfig(num_threads=1) and local.model() is None
    assert local.job.options.max_tokens == 5 and local.job.options.temperature == 0
    assert local.job.options.structured_outputs == {"structured_outputs": {"choice": ["a", "b"]}}
    job = local.job_config(Path("s.jsonl"), Path("out/local"), progress=False)
    assert (job.input, job.output, job.price_per_hour, job.progress) == (Path("s.jsonl"), Path("out/local"), 0.5,
                                                                        False)
    api = parse_candidate("api=--endpoint http://127.0.0.1:9/v1 --model m --concurrency 3 "
                          "--price-per-m-input 0.1 --price-per-m-output 0.4")
    assert isinstance(api.backend, EndpointSpec) and api.backend.concurrency == 3 and api.model() == "m"
    assert api.price.per_m_output == 0.4
    vllm = parse_candidate("v=--engine vllm --dtype float32 --model org/x")  # a hub id: not looked up here
    assert vllm.backend == VllmConfig(dtype="float32", model="org/x")


@pytest.mark.parametrize(("text", "message"), [
    ("bad name=--max-tokens 5", "expected NAME=FLAGS"),
    ("x=-o elsewhere", "-o is set by choose"),
    ("x=--engine vllm --weight-format q4", "--weight-format: the embedded engine's setting"),
    ("x=--replicas 2", "--replicas need --ray"),
    ("x=--choice a,", "--choice must be a non-empty list"),
    ("x=--model missing.gguf", "--model missing.gguf: no such file or folder"),
])
def test_a_bad_candidate_is_refused_naming_it(text: str, message: str) -> None:
    with pytest.raises(CandidateError, match=message):
        parse_candidate(text)
