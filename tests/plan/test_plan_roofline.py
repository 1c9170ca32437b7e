"""The roofline on hand-checked cases; every expected number is worked out in a comment."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from tokenmill.plan.catalog import CATALOG
from tokenmill.plan.errors import PlanError
from tokenmill.plan.hardware import HardwareSpec
from tokenmill.plan.model_specs import ModelSpec, load_model, param_counts, preset
from tokenmill.plan.report import does_not_fit
from tokenmill.plan.roofline import (
    PlanConfig,
    compute_bound_from,
    decode_step,
    expected_experts_touched,
    make_plan,
    make_setup,
    matmul_flops,
    memory_plan,
    min_batch_for,
    plan_point,
    prefill,
    usd_per_million,
    weight_bytes_read,
)

LLAMA_70B_PARAMS = 70_553_706_496  # test_plan_models.test_llama_70b_param_count_by_hand
LLAMA_EMBED = 128_256 * 8192  # 1,050,673,152: the untied input table, not read per step
LLAMA_KV_TOKEN = 80 * 8 * 128 * 2 * 2  # 327,680 B
# An "80 GB" A100 reports 81920 MiB = 80 GiB to nvidia-smi; CUDA (and so torch and vLLM) sees
# 0.5-1% less, ~85.0e9 B, after the driver's reservation. Any honest figure lies in between.
A100_REPORTED_BYTES_RANGE = (85.0e9, 80 * 2**30)


def largest_batch_by_hand(device_bytes: float, devices: int, weight_bytes: float,
                          kv_per_request: float, reserve: float = 0.10) -> int:
    """floor((devices x memory x (1 - reserve) - weights) / KV per request)"""
    return math.floor((devices * device_bytes * (1 - reserve) - weight_bytes) / kv_per_request)


def llama_on_2xa100() -> PlanConfig:
    return PlanConfig(num_devices=2, tp=2, weight_dtype="bf16", input_len=2048, output_len=512)


def test_llama_70b_bf16_on_2xa100_memory() -> None:
    s = make_setup(preset("llama-3.1-70b"), CATALOG["a100-80gb"], llama_on_2xa100())
    mem = memory_plan(s)
    assert mem.weight_bytes == LLAMA_70B_PARAMS * 2  # 141.1 GB
    assert mem.weight_bytes == pytest.approx(141.1e9, rel=1e-3)
    assert mem.weight_bytes_per_device == pytest.approx(70.55e9, rel=1e-3)
    assert mem.kv_bytes_per_token == LLAMA_KV_TOKEN
    assert mem.kv_bytes_per_request == 2560 * LLAMA_KV_TOKEN  # 838,860,800 B at 2048+512
    # (2 x 85.0e9 x 0.9 - 141.107e9) / 0.8389e9 = 11.89e9 / 0.8389e9 = 14.2 -> 14 requests;
    # (2 x 85.9e9 x 0.9 - 141.107e9) / 0.8389e9 = 13.51e9 / 0.8389e9 = 16.1 -> 16 requests.
    # (Counting 80 GB as 80e9 bytes would leave room for 3.)
    lo, hi = (largest_batch_by_hand(m, 2, LLAMA_70B_PARAMS * 2, 2560 * LLAMA_KV_TOKEN)
              for m in A100_REPORTED_BYTES_RANGE)
    assert (lo, hi) == (14, 16)
    assert lo <= mem.max_batch <= hi


def test_llama_70b_bf16_on_2xa100_decode_b1() -> None:
    s = make_setup(preset("llama-3.1-70b"), CATALOG["a100-80gb"], llama_on_2xa100())
    step = decode_step(s, 1)
    # bytes = (70,553,706,496 - 1,050,673,152) x 2 + 2304 avg ctx x 327,680 = 139.76 GB;
    # over 2 x 2.039 TB/s = 34.27 ms; FLOPs ~145 G / 624 TFLOP/s = 0.23 ms -> bandwidth-bound
    expected = (LLAMA_70B_PARAMS - LLAMA_EMBED) * 2 + (2048 + 256) * LLAMA_KV_TOKEN
    assert step.bytes == expected
    assert step.seconds == pytest.approx(expected / 4.078e12)
    assert step.seconds == pytest.approx(0.03427, rel=1e-3)
    assert step.bound == "bandwidth"
    point = plan_point(s, 1, max_batch=16)
    assert point.decode_tokens_per_s == pytest.approx(29.18, rel=1e-3)
    assert point.limit == "weights-bw"


def test_llama_70b_prefill_is_compute_bound() -> None:
    s = make_setup(preset("llama-3.1-70b"), CATALOG["h100-sxm"],
                   PlanConfig(num_devices=4, input_len=2048))
    pre = prefill(s, 1)
    # 2 x 68.45e9 block matmul params x 2048 tokens = 280.4 TFLOP; the lm_head (1.05e9 params)
    # for the one row that produces logits: 2.1 GFLOP; causal attention 4*80*64*128 per pair
    # x 2048*2049/2 pairs = 5.5 TFLOP; 285.9 TFLOP / (4 x 989.4 TFLOP/s) = 72.2 ms
    assert pre.bound == "compute"
    assert pre.seconds == pytest.approx(0.0722, rel=0.01)


def without_lm_head(name: str) -> ModelSpec:
    """The same model with an empty vocabulary: its output projection costs nothing."""
    return replace(preset(name), vocab_size=0)


@pytest.mark.parametrize("input_len", [128, 2048])
def test_prefill_runs_the_lm_head_once_per_prompt(input_len: int) -> None:
    # The engine samples from the last position of each prompt only, so the lm_head's FLOPs in
    # prefill are 2 x vocab x d per prompt, whatever the prompt length.
    cfg = PlanConfig(num_devices=4, input_len=input_len)
    hw = CATALOG["h100-sxm"]
    for prompts in (1, 8):
        full = prefill(make_setup(preset("llama-3.1-70b"), hw, cfg), prompts).flops
        bare = prefill(make_setup(without_lm_head("llama-3.1-70b"), hw, cfg), prompts).flops
        assert full - bare == pytest.approx(prompts * 2 * 128_256 * 8192)


def test_decode_runs_the_lm_head_for_every_sequence() -> None:
    cfg, hw = PlanConfig(num_devices=4), CATALOG["h100-sxm"]
    full = decode_step(make_setup(preset("llama-3.1-70b"), hw, cfg), 8).flops
    bare = decode_step(make_setup(without_lm_head("llama-3.1-70b"), hw, cfg), 8).flops
    assert full - bare == pytest.approx(8 * 2 * 128_256 * 8192)


def test_tied_embedding_is_the_output_projection() -> None:
    # SmolLM2 ties lm_head to the embedding: the table is multiplied once per logit row
    c = param_counts(preset("smollm2-135m"))
    assert c.lm_head == 0
    assert matmul_flops(c, 100, 3) - matmul_flops(c, 100, 0) == 3 * 2 * 49_152 * 576


def test_dollars_per_million() -> None:
    # $25/h at 6,000 tok/s: 21.6 M tokens/h -> $1.157/M (the study's second source)
    assert usd_per_million(25, 6000) == pytest.approx(1.1574, rel=1e-4)


def test_plan_point_price_and_e2e_formula() -> None:
    plan = make_plan(preset("llama-3.1-70b"), CATALOG["h100-sxm"],
                     PlanConfig(num_devices=4, price_per_hour=2.5, batch_sizes=(32,)))
    p = plan.points[0]
    assert plan.price_per_hour_total == 10.0  # 4 devices x $2.5
    # end to end: 32 x 512 tokens over prefill(32 x 2048) + 512 decode steps
    assert p.e2e_tokens_per_s == pytest.approx(32 * 512 / (p.prefill_s + 512 * p.decode_step_s))
    assert p.usd_per_m_output == pytest.approx(10.0 / (p.e2e_tokens_per_s * 3600) * 1e6)
    # overlapping prefill with decode can only help, and never beats pure decode
    assert p.e2e_tokens_per_s < p.e2e_overlap_tokens_per_s <= p.decode_tokens_per_s


def test_no_price_means_no_cost() -> None:
    plan = make_plan(preset("qwen2.5-7b"), CATALOG["l4"], PlanConfig(price_per_hour=0))
    assert all(p.usd_per_m_output is None for p in plan.points)


def test_decode_uses_average_context() -> None:
    s = make_setup(preset("qwen2.5-7b"), CATALOG["h100-sxm"],
                   PlanConfig(input_len=1000, output_len=200))
    # 8 sequences x (1000 + 200/2) tokens x 57,344 B
    assert decode_step(s, 8).kv_bytes == 8 * 1100 * 57_344


def test_expected_experts_touched() -> None:
    assert expected_experts_touched(8, 2, 1) == pytest.approx(2)  # one token: its top-k
    assert expected_experts_touched(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
    # DeepSeek-V3 at 64 tokens: 256 x (1 - (248/256)^64) = 222.5 of 256 experts
    assert expected_experts_touched(256, 8, 64) == pytest.approx(222.5, abs=0.1)
    assert expected_experts_touched(256, 8, 10_000) == pytest.approx(256)


def test_moe_reads_active_params_at_batch_1_and_all_experts_at_large_batch() -> None:
    m = preset("mixtral-8x7b")
    s = make_setup(m, CATALOG["h100-sxm"], PlanConfig(num_devices=2))
    c = param_counts(m)
    assert weight_bytes_read(s, 1) == pytest.approx((c.active - c.embedding) * 2)
    assert weight_bytes_read(s, 4096) == pytest.approx((c.total - c.embedding) * 2)


INT4_WITH_SCALES = 0.5 + 2 / 128  # 4 bits + one fp16 scale per group of 128 weights


def test_int4_keeps_embeddings_and_lm_head_in_16_bits() -> None:
    # AWQ/GPTQ quantise the transformer blocks only. Qwen2.5-7B: embedding and lm_head are
    # 152,064 x 3,584 = 544,997,376 params each, 2.18 GB in 16 bits together; the other
    # 6.52e9 params at 0.515625 B are 3.36 GB -> 5.54 GB (not 3.9 GB, all at 4 bits)
    m = preset("qwen2.5-7b")
    table = 152_064 * 3584
    rest = param_counts(m).total - 2 * table
    s = make_setup(m, CATALOG["h100-sxm"], PlanConfig(weight_dtype="int4"))
    assert s.weight_bytes == pytest.approx(2 * table * 2 + rest * INT4_WITH_SCALES, rel=1e-6)
    assert 5.4e9 < s.weight_bytes < 5.6e9


def test_int4_batch_1_decode_reads_the_lm_head_in_16_bits() -> None:
    # every step reads the blocks (4-bit) and the whole lm_head (16-bit), not the input table
    m = preset("qwen2.5-7b")
    s = make_setup(m, CATALOG["h100-sxm"], PlanConfig(weight_dtype="int4", input_len=2048,
                                                      output_len=512))
    table = 152_064 * 3584
    rest = param_counts(m).total - 2 * table
    kv = (2048 + 256) * 28 * 4 * 128 * 2 * 2
    expected = rest * INT4_WITH_SCALES + table * 2 + kv  # 3.36 + 1.09 + 0.13 = 4.59 GB
    assert decode_step(s, 1).bytes == pytest.approx(expected, rel=1e-6)
    assert plan_point(s, 1, 1).decode_tokens_per_s == pytest.approx(3.35e12 / expected)


@pytest.mark.parametrize(("dtype", "blocks", "tables"), [
    ("int4", INT4_WITH_SCALES, 2), ("int8", 1, 2), ("fp8", 1, 2),  # quantised: tables 16-bit
    ("bf16", 2, 2), ("fp32", 4, 4),  # not quantised: one width throughout
])
def test_weight_widths_by_role(dtype: str, blocks: float, tables: float) -> None:
    m = preset("llama-3.1-70b")
    c = param_counts(m)
    s = make_setup(m, CATALOG["a100-80gb"], PlanConfig(num_devices=4, weight_dtype=dtype))
    assert s.weight_bytes == pytest.approx(
        (c.embedding + c.lm_head) * tables + (LLAMA_70B_PARAMS - 2 * LLAMA_EMBED) * blocks)


def test_fp8_uses_fp8_units_only_where_they_exist() -> None:
    m, cfg = preset("llama-3.1-70b"), PlanConfig(num_devices=2, weight_dtype="fp8")
    assert make_setup(m, CATALOG["h100-sxm"], cfg).peak_flops == 2 * 1978.9e12
    assert make_setup(m, CATALOG["a100-80gb"], cfg).peak_flops == 2 * 312e12  # no fp8 units


def test_data_parallel_replicas_scale_throughput() -> None:
    m = preset("qwen2.5-7b")
    one = make_plan(m, CATALOG["h100-sxm"], PlanConfig(num_devices=1, batch_sizes=(16,)))
    two = make_plan(m, CATALOG["h100-sxm"], PlanConfig(num_devices=2, tp=1, batch_sizes=(32,)))
    assert two.points[0].decode_tokens_per_s == pytest.approx(
        2 * one.points[0].decode_tokens_per_s)
    assert two.memory.max_batch == 2 * one.memory.max_batch


def test_kv_replication_across_tp() -> None:
    # GQA: 8 KV heads over TP16 -> each head on 2 ranks; MLA: every rank keeps the latent
    llama = make_setup(preset("llama-3.1-70b"), CATALOG["h100-sxm"], PlanConfig(num_devices=16))
    assert llama.kv_bytes_per_token_stored == 2 * LLAMA_KV_TOKEN
    ds = make_setup(preset("deepseek-v3"), CATALOG["h200"], PlanConfig(num_devices=8))
    assert ds.kv_bytes_per_token_stored == 8 * 70_272


@pytest.mark.parametrize(("hardware", "needed"), [
    # (141.1 GB + 0.84 GB) / (85.5 GB x 0.9) = 1.84 -> 2 H100s
    ("h100-sxm", 2),
    # / (24.15 GB x 0.9) = 6.53 -> 7 L4s, but TP must divide the 64 heads: 8
    ("l4", 8),
])
def test_weights_that_do_not_fit_say_how_many_devices(hardware: str, needed: int) -> None:
    m, hw = preset("llama-3.1-70b"), CATALOG[hardware]
    plan = make_plan(m, hw, PlanConfig())
    assert plan.memory.max_batch == 0 and not plan.fits
    assert plan.devices_needed == needed
    # no price for a batch that cannot run; the points stay, marked as not fitting
    assert all(not p.fits and p.limit == "kv-memory" and p.usd_per_m_output is None
               for p in plan.points)
    # the count is enough, and the next smaller TP the model splits into is not
    assert make_plan(m, hw, PlanConfig(num_devices=needed)).fits
    smaller = max(tp for tp in range(1, needed) if 64 % tp == 0)
    assert not make_plan(m, hw, PlanConfig(num_devices=smaller)).fits


def test_mla_cache_on_every_rank_raises_the_devices_needed() -> None:
    # DeepSeek-V3 fp8: 671.03e9 params at 1 B + the 16-bit embedding and lm_head (2 x 0.93e9
    # params, 1 B more each) = 672.9 GB. Every rank stores a request's whole latent cache
    # (2,560 x 70,272 B = 0.18 GB), so n H100s hold n x (77.0 - 0.18) GB: n >= 8.76, and the
    # next TP dividing 128 heads is 16
    plan = make_plan(preset("deepseek-v3"), CATALOG["h100-sxm"], PlanConfig(num_devices=8))
    assert plan.memory.weight_bytes == pytest.approx(672.9e9, rel=1e-3)
    assert not plan.fits and plan.devices_needed == 16


def test_no_tp_group_is_enough(fake_machine: HardwareSpec) -> None:
    # SmolLM2 in bf16 is 269 MB; 9 heads allow TP 9 at most: 9 x 10 MB x 0.9 = 81 MB
    tiny = replace(fake_machine, memory_bytes=10e6)
    plan = make_plan(preset("smollm2-135m"), tiny, PlanConfig(weight_dtype="bf16"))
    assert not plan.fits and plan.devices_needed is None
    assert "no tensor-parallel group of up to 9" in does_not_fit(plan)


def test_a_fitting_plan_prices_only_the_batches_that_fit() -> None:
    plan = make_plan(preset("llama-3.1-70b"), CATALOG["a100-80gb"], llama_on_2xa100())
    assert plan.fits and plan.devices_needed == 2
    for p in plan.points:
        assert p.fits == (p.batch_size <= plan.memory.max_batch)
        assert (p.usd_per_m_output is not None) == p.fits


def test_compute_bound_knee_is_where_the_bound_flips() -> None:
    s = make_setup(preset("qwen2.5-7b"), CATALOG["h100-sxm"],
                   PlanConfig(input_len=128, output_len=128))
    knee = compute_bound_from(s)
    assert knee is not None and knee > 1
    assert decode_step(s, knee).bound == "compute"
    assert decode_step(s, knee - 1).bound == "bandwidth"
    # at 2,304 tokens of context each extra sequence adds 755 MB of KV reads and ~145 GFLOP:
    # 192 FLOP/byte, under H100's bf16 ridge of 295 FLOP/byte, so it never turns compute-bound
    long = make_setup(preset("llama-3.1-70b"), CATALOG["h100-sxm"], PlanConfig(num_devices=4))
    assert compute_bound_from(long) is None


def test_min_batch_for_target() -> None:
    s = make_setup(preset("llama-3.1-70b"), CATALOG["h100-sxm"], PlanConfig(num_devices=8))
    b = min_batch_for(s, 6000, "e2e")
    assert b is not None
    assert plan_point(s, b, b).e2e_tokens_per_s >= 6000 > plan_point(s, b - 1, b).e2e_tokens_per_s


def test_this_machine_plan_with_native_gguf_bytes(fake_machine: HardwareSpec,
                                                  smollm2_gguf: Path) -> None:
    plan = make_plan(load_model(str(smollm2_gguf)), fake_machine,
                     PlanConfig(input_len=64, output_len=64, batch_sizes=(1,)))
    assert plan.config.weight_dtype == "native"
    assert plan.memory.weight_bytes == pytest.approx(96_576_768)  # the file's tensor bytes
    # tied embeddings: the whole table is read as the output projection every step;
    # 96.6 MB + 96 ctx x 23,040 B at 20 GB/s = 4.94 ms
    assert plan.points[0].decode_step_s == pytest.approx((96_576_768 + 96 * 23_040) / 20e9)


@pytest.mark.parametrize(("model", "config", "message"), [
    ("llama-3.1-70b", PlanConfig(num_devices=8, tp=3), r"^tp: tp=3 does not divide num_devices=8"),
    ("phi-4", PlanConfig(num_devices=16), r"^tp: .*40 attention heads"),
    ("phi-4", PlanConfig(num_devices=4), r"^tp: tp=4 and the model's 10 KV heads"),
    ("qwen2.5-7b", PlanConfig(output_len=0), r"^output_len: must be >= 1"),
    ("qwen2.5-7b", PlanConfig(batch_sizes=()), r"^batch_sizes:"),
    ("qwen2.5-7b", PlanConfig(weight_dtype="native"), r"^weight_dtype: 'native' needs"),
    ("qwen2.5-7b", PlanConfig(weight_dtype="int3"), r"^weight_dtype: unknown 'int3'"),
    ("qwen2.5-7b", PlanConfig(kv_dtype="int4"), r"^kv_dtype: unknown 'int4'"),
    ("qwen2.5-7b", PlanConfig(reserve_fraction=1.0), r"^reserve_fraction:"),
])
def test_bad_input_names_the_field(model: str, config: PlanConfig, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        make_plan(preset(model), CATALOG["h100-sxm"], config)


def test_knee_with_replicas_counts_the_fullest_replica() -> None:
    cfg = PlanConfig(input_len=128, output_len=128)
    one = compute_bound_from(make_setup(preset("qwen2.5-7b"), CATALOG["h100-sxm"], cfg))
    dp = make_setup(preset("qwen2.5-7b"), CATALOG["h100-sxm"],
                    PlanConfig(num_devices=2, tp=1, input_len=128, output_len=128))
    assert one is not None
    # 2 replicas: the fullest one carries ceil(B/2), so B = 2 x (knee - 1) + 1 is the first
    assert compute_bound_from(dp) == 2 * (one - 1) + 1
