"""this-machine measurement: tiny sizes, only that it yields sane positive figures."""

from __future__ import annotations

from tokenmill.plan.measure import measure_this_machine, total_ram_bytes


def test_measure_cpu_quickly() -> None:
    hw = measure_this_machine(gemm_size=128, copy_mib=8, reps=1, device="cpu")
    assert hw.measured and hw.name == "this-machine" and hw.price_per_hour == 0
    assert hw.memory_bytes == total_ram_bytes() > 1e8
    # any machine that runs torch does more than 10 MFLOP/s and 10 MB/s, and no CPU does
    # more than 100 TFLOP/s fp32 or 10 TB/s
    assert 1e7 < hw.bf16_flops < 1e14
    assert 1e7 < hw.bandwidth_bytes_per_s < 1e13
