"""Small-batch linear layers: the C kernel vs oneDNN's packed GEMM, on the embedded model.

    python benchmarks/small_gemm.py [--rows 1,2,4,8,16,32]

Times every linear layer of one forward (all of the model's weights, so they come from memory as
in a real step) at each row count, then whole batch-1 decode steps of two engines that differ
only in EngineConfig.small_batch_linear. Prints ratios measured in the same run and the CPU
other processes used meanwhile (a busy machine makes both numbers meaningless).
"""

from __future__ import annotations

import argparse

import torch
from timing import median_ms, step_ms

from tokenmill.bench.runner import CpuMeter
from tokenmill.engine import EngineConfig, LLMEngine, SamplingParams
from tokenmill.models.loader import load_weights
from tokenmill.models.packed import PackedLinear, small_gemm


def all_linears(layers: list[PackedLinear], rows_list: list[int]) -> None:
    megabytes = sum(m.blocked.numel() * 4 for m in layers if m.blocked is not None) / 1e6
    print(f"all {len(layers)} linear layers of one forward ({megabytes:.0f} MB of fp32 weights):")
    for rows in rows_list:
        inputs = [torch.randn(rows, m.in_features) for m in layers]

        def onednn(inputs: list[torch.Tensor] = inputs) -> None:
            for m, x in zip(layers, inputs, strict=True):
                torch.ops.mkldnn._linear_pointwise(x, m.weight, m.bias, "none", [], "")

        def kernel(inputs: list[torch.Tensor] = inputs) -> None:
            for m, x in zip(layers, inputs, strict=True):
                assert m.blocked is not None
                small_gemm(x, m.blocked, m.bias)

        meter = CpuMeter()
        one, ker = median_ms(onednn, 10), median_ms(kernel, 10)
        print(f"  {rows:>3} rows: oneDNN {one:6.1f} ms, kernel {ker:6.1f} ms = {one / ker:.2f}x "
              f"({megabytes / ker:.1f} GB/s)  [other CPU {meter.other_seconds()} s]")


def batch1_decode(weights, prompt_len: int = 256) -> None:  # type: ignore[no-untyped-def]
    engines = {}
    for mode in ("kernel", "off"):
        engine = LLMEngine(EngineConfig(max_num_seqs=1, max_model_len=prompt_len + 256,
                                        small_batch_linear=mode), weights=weights)
        prompt = torch.randint(100, 40000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        engine.step()  # the prefill
        engines[mode] = engine
    meter = CpuMeter()
    ms = step_ms(engines)
    k, off = ms["kernel"], ms["off"]
    print(f"batch-1 decode step ({prompt_len}-token prompt): oneDNN {off:.1f} ms, kernel {k:.1f} ms = "
          f"{off / k:.2f}x ({1e3 / k:.1f} vs {1e3 / off:.1f} tokens/s)  [other CPU {meter.other_seconds()} s]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    args = ap.parse_args()
    weights = load_weights(None)
    engine = LLMEngine(EngineConfig(max_num_seqs=1, small_batch_linear="kernel", num_kv_blocks=4), weights=weights)
    layers = [m for m in engine.runner.model.modules() if isinstance(m, PackedLinear)]
    all_linears(layers, [int(r) for r in args.rows.split(",")])
    del engine, layers
    batch1_decode(weights)


if __name__ == "__main__":
    main()
