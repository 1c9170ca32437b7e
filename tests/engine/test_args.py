"""Every command that builds an engine takes every EngineConfig field as a flag, shown with the
dataclass's own default and set only when given: a new field, or a command that drifts from the
dataclass, fails here."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from tokenmill.cli import build_parser
from tokenmill.engine import EngineConfig, StructuredOutputsParams
from tokenmill.engine.args import add_engine_arguments, engine_settings, flag, structured_outputs_from_args

# The fields a command sets itself instead of taking a flag for them, and why. Nothing else may
# be missing, and no command may change a default except as listed in DEFAULTS.
EXCLUDED = {
    "generate": {"seed"},  # its --seed is the sampling seed of its prompts
    "run": set(),
    "serve": set(),
    "bench": {"max_num_seqs", "seed", "tokenizer"},  # the sweep's batch sizes; --seed and --tokenizer are
    # the workload's (prompt sampling, endpoint prompts)
}
DEFAULTS = {"serve": {"scheduling_policy": "priority"}}  # live requests go ahead of Batch API lines
REQUIRED = {"run": ["in.jsonl", "-o", "out/"]}
FIELDS = {f.name: f for f in fields(EngineConfig)}


def commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def parse(command: str, *extra: str) -> dict[str, Any]:
    return engine_settings(commands()[command].parse_args([*REQUIRED.get(command, []), *extra]))


def other_value(name: str) -> tuple[list[str], Any]:
    """Command-line words that set `name` to something other than its default, and that value."""
    f = FIELDS[name]
    if f.metadata["choices"]:
        value = next(c for c in f.metadata["choices"] if c != f.default)
    elif isinstance(f.default, bool):
        return ["--no-" + flag(name)[2:] if f.default else flag(name)], not f.default
    elif isinstance(f.default, float):
        value = 0.25
    elif name in ("model", "tokenizer"):
        value = "some/model"
    elif name == "device":
        value = "cpu"
    elif name == "speculative_config":
        return [flag(name), '{"prompt_lookup_max": 3}'], {"prompt_lookup_max": 3}
    else:
        value = (f.default or 0) + 7
    return [flag(name), str(value)], value


@pytest.mark.parametrize("command", sorted(EXCLUDED))
def test_engine_flags_are_the_engine_config_fields(command: str) -> None:
    every = [word for name in sorted(set(FIELDS) - EXCLUDED[command]) for word in other_value(name)[0]]
    assert set(parse(command, *every)) == set(FIELDS) - EXCLUDED[command]


@pytest.mark.parametrize("command", sorted(EXCLUDED))
def test_a_flag_left_out_is_not_set(command: str) -> None:
    """Only the command's own choices are set; the engine fills the rest with its defaults (the
    embedded engine's are EngineConfig's, vLLM's its own), so EngineConfig() is what runs."""
    values = parse(command)
    assert values == DEFAULTS.get(command, {})
    assert EngineConfig(**values) == EngineConfig(**DEFAULTS.get(command, {}))


@pytest.mark.parametrize("command", sorted(EXCLUDED))
def test_help_shows_the_dataclass_defaults(command: str) -> None:
    actions = {a.dest: a for a in commands()[command]._actions}
    for name in sorted(set(FIELDS) - EXCLUDED[command]):
        default = DEFAULTS.get(command, {}).get(name, FIELDS[name].default)
        if default is not None:
            shown = (("on" if default else "off") if isinstance(default, bool)
                     else f"{default:g}" if isinstance(default, float) else default)
            assert actions[name].help.endswith(f"(default: {shown})"), (command, name, actions[name].help)


@pytest.mark.parametrize("command", sorted(EXCLUDED))
def test_every_flag_reaches_its_field(command: str) -> None:
    for name in sorted(set(FIELDS) - EXCLUDED[command]):
        words, value = other_value(name)
        assert value != FIELDS[name].default
        assert parse(command, *words)[name] == value, (command, name)


def test_a_bad_value_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(**parse("serve", "--max-num-seqs", "0"))
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parse("run", "--scheduling-policy", "random")


def test_unknown_field_names_are_refused() -> None:
    with pytest.raises(ValueError, match="max_num_seq"):
        add_engine_arguments(argparse.ArgumentParser(), exclude=("max_num_seq",))


def test_generate_reads_a_structured_output_from_its_flags(tmp_path: Path) -> None:
    def setting(*words: str) -> StructuredOutputsParams | None:
        return structured_outputs_from_args(commands()["generate"].parse_args(["a prompt", *words]))

    (tmp_path / "schema.json").write_text('{"type": "object"}')
    (tmp_path / "broken.json").write_text('{"type": ')
    (tmp_path / "unknown.json").write_text('{"type": "string", "format": "credit-card"}')
    assert setting() is None
    assert setting("--json-schema", str(tmp_path / "schema.json")) == StructuredOutputsParams(json={"type": "object"})
    assert setting("--choice", "yes, no") == StructuredOutputsParams(choice=["yes", "no"])
    assert setting("--regex", "[0-9]+") == StructuredOutputsParams(regex="[0-9]+")
    for words, message in ((["--choice", "yes,"], "--choice must be a non-empty list of non-empty strings"),
                           (["--json-schema", str(tmp_path / "broken.json")], "broken.json: not JSON"),
                           (["--json-schema", str(tmp_path / "none.json")], "none.json: cannot read it"),
                           (["--regex", "(ab"], "--regex: .*unclosed group"),
                           (["--json-schema", str(tmp_path / "unknown.json")], "--json-schema: Unknown format")):
        with pytest.raises(ValueError, match=message):
            setting(*words)


def test_a_gpu_the_machine_lacks_is_refused_before_any_loading(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from tokenmill.cli import main

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count:
        with pytest.raises(ValueError, match=rf"device cuda:{count}: this machine has {count} GPU\(s\)"):
            EngineConfig(device=f"cuda:{count}").resolved_device()
    else:
        assert main(["generate", "--device", "cuda", "a prompt"]) == 2
        assert "--device cuda: this torch" in capsys.readouterr().err
        with pytest.raises(ValueError, match="use device cpu, or install torch's CUDA build"):
            EngineConfig(device="cuda:0").resolved_device()
    assert EngineConfig(device="cpu").resolved_device() == torch.device("cpu")
