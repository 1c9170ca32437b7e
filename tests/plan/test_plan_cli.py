"""`tokenmill plan` end to end through add_arguments/run, as the tokenmill CLI wires it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tokenmill.plan import cli
from tokenmill.plan.hardware import HardwareSpec

LLAMA_2XA100 = ["--model", "llama-3.1-70b", "--hardware", "a100-80gb", "--num-devices", "2",
                "--tp", "2"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    rc = cli.run(parser.parse_args(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps tables at the terminal width


def test_plan_table_and_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, _ = run([*LLAMA_2XA100, "--json", str(tmp_path / "plan.json")], capsys)
    assert rc == 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    # 14-16 by hand: test_plan_roofline.test_llama_70b_bf16_on_2xa100_memory
    assert 14 <= doc["memory"]["max_batch"] <= 16
    assert f"largest batch {doc['memory']['max_batch']}" in out and "kv-memory" in out
    assert doc["fits"] is True and doc["devices_needed"] == 2
    assert doc["memory"]["weight_bytes"] == 70_553_706_496 * 2
    assert [p["batch_size"] for p in doc["points"]] == [1, 8, 32, 64]
    assert doc["config"]["tp"] == 2 and doc["efficiency"] == []
    assert "80.0 GiB" in out  # the A100's memory as nvidia-smi reports it


def test_a_model_that_does_not_fit(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Llama-3.1-70B in bf16 (141 GB) on one H100: no table and no $/M, but how many it needs
    rc, out, err = run(["--model", "llama-3.1-70b", "--hardware", "h100-sxm",
                        "--json", str(tmp_path / "plan.json")], capsys)
    assert rc == cli.EXIT_DOES_NOT_FIT and err == ""
    assert "Does not fit" in out and "needs at least 2 x H100-SXM" in out
    assert "--num-devices 2" in out and "Ceilings" not in out
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["fits"] is False and doc["devices_needed"] == 2
    assert doc["memory"]["max_batch"] == 0
    assert all(p["usd_per_m_output"] is None and not p["fits"] for p in doc["points"])


def test_does_not_fit_with_replicas_names_the_tp(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["--model", "llama-3.1-70b", "--hardware", "l4", "--num-devices", "4",
                      "--tp", "2"], capsys)
    assert rc == cli.EXIT_DOES_NOT_FIT
    assert "needs at least 8 x L4" in out and "--tp 8" in out


def test_measured_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bench = {"input_len": 1024, "output_len": 256, "points": [
        {"batch_size": 1, "output_tokens_per_s": 20.0, "decode_tokens_per_s": 21.0},
        {"batch_size": 3, "output_tokens_per_s": 1e6}]}  # 3: not a default batch size
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    rc, out, _ = run([*LLAMA_2XA100, "--measured", str(tmp_path / "bench.json"),
                      "--json", str(tmp_path / "plan.json")], capsys)
    assert rc == 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert (doc["config"]["input_len"], doc["config"]["output_len"]) == (1024, 256)
    points = {p["batch_size"]: p for p in doc["points"]}
    eff = {e["batch_size"]: e for e in doc["efficiency"]}
    assert eff[1]["output"] == pytest.approx(20.0 / points[1]["e2e_tokens_per_s"])
    assert eff[1]["decode"] == pytest.approx(21.0 / points[1]["decode_tokens_per_s"])
    assert eff[1]["prefill"] is None and not eff[1]["above_ceiling"]
    assert eff[3]["above_ceiling"]  # a million tok/s from 2 A100s is impossible
    assert "above the ceiling at batch [3]" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "gpt-5", "--hardware", "h100-sxm"], "model: unknown preset 'gpt-5'"),
    (["--model", "llama-3.1-70b", "--hardware", "tpu-v9"], "hardware: unknown hardware"),
    ([*LLAMA_2XA100[:4], "--num-devices", "8", "--tp", "3"], "tp: tp=3 does not divide"),
    ([*LLAMA_2XA100, "--measured", "/nonexistent.json"], "measured: cannot read"),
    (["--study", "--hardware", "this-machine"], "hardware: the study check needs catalog"),
    (["--study", "--study-file", "/nonexistent/batch-study.md"],
     "study: cannot read /nonexistent/batch-study.md: No such file or directory"),
])
def test_errors_name_the_field(argv: list[str], message: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(argv, capsys)
    assert rc == cli.EXIT_BAD_INPUT
    assert message in err
    assert "Traceback" not in err


def test_bad_measured_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "b.json").write_text('{"points": [{"batch_size": 1}]}')
    rc, _, err = run([*LLAMA_2XA100, "--measured", str(tmp_path / "b.json")], capsys)
    assert rc == 2 and "points[0].output_tokens_per_s is missing" in err


def test_bad_batch_sizes_are_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run([*LLAMA_2XA100, "--batch-sizes", "1,x"], capsys)


def test_lists(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["--list-models", "--list-hardware"], capsys)
    assert rc == 0
    for name in ("deepseek-v3", "llama-4-scout-17b-16e-instruct", "a100-80gb", "b200", "l4"):
        assert name in out


def test_study(capsys: pytest.CaptureFixture[str], study_file: Path, tmp_path: Path) -> None:
    rc, out, _ = run(["--study", "--study-file", str(study_file),
                      "--json", str(tmp_path / "s.json")], capsys)
    assert rc == 0 and "Published study vs ceilings" in out
    doc = json.loads((tmp_path / "s.json").read_text())
    assert len(doc["rows"]) == 7 and doc["claims"]


def test_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rc, _, _ = run([*LLAMA_2XA100, "--plot", str(tmp_path / "p.png")], capsys)
    assert rc == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_is_smollm2_on_this_machine(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch,
                                            fake_machine: HardwareSpec,
                                            smollm2_gguf: Path) -> None:
    import tokenmill.plan.measure as measure

    monkeypatch.setattr(measure, "measure_this_machine", lambda: fake_machine)
    rc, out, _ = run(["--input-len", "128", "--output-len", "64"], capsys)
    assert rc == 0
    assert "this-machine" in out and "weights native" in out and "96.6 MB" in out
