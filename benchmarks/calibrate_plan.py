"""Measure the embedded engine at fixed lengths and write a `tokenmill plan --measured` file.

    python benchmarks/calibrate_plan.py --out calib-measured.json
    tokenmill plan --hardware this-machine --input-len 256 --output-len 64 --batch-sizes 1,4,16 \
        --weight-dtype fp32 --kv-dtype fp32 --measured calib-measured.json

Each point runs B requests of exactly --input-len prompt tokens (real text, tokenised) and
--output-len generated tokens (ignore_eos), all submitted at once with max_num_seqs = B.
"""

from __future__ import annotations

import argparse
import json
import time

from tokenmill import LLM, SamplingParams
from tokenmill.bench.runner import CpuMeter

TEXT = (
    "Batch inference is bounded by physics. A decode step must read every weight it uses plus "
    "the KV cache of every sequence in the batch, and prefill has to do its floating point work. "
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default="calib-measured.json")
    args = ap.parse_args()
    llm = LLM(max_num_seqs=64, max_model_len=1024)
    ids = llm.tokenizer.encode(TEXT * 40)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    points = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        llm.engine.set_max_num_seqs(b)
        # A distinct first token per request and per run: no prefix-cache hits between them.
        prompts = [{"prompt_token_ids": [1000 + 100 * b + i, *ids[1 : args.input_len]]} for i in range(b)]
        meter, start = CpuMeter(), time.monotonic()
        outs = llm.generate(prompts, params, progress=False)
        wall = time.monotonic() - start
        prefill_end = max(o.timings.first_token for o in outs)
        decode_time = max(o.timings.finished for o in outs) - prefill_end
        point = {
            "batch_size": b,
            "output_tokens_per_s": b * args.output_len / wall,
            "prefill_tokens_per_s": b * args.input_len / (prefill_end - start),
            "decode_tokens_per_s": b * (args.output_len - 1) / decode_time,
            "other_cpu_seconds": meter.other_seconds(),
            "cached_tokens": sum(o.num_cached_tokens for o in outs),
        }
        print(json.dumps(point))
        points.append(point)
    with open(args.out, "w") as f:
        json.dump({"input_len": args.input_len, "output_len": args.output_len, "points": points}, f, indent=1)


if __name__ == "__main__":
    main()
