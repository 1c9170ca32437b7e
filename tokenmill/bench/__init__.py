"""`tokenmill bench`: throughput, latency and cost benchmarks of the embedded engine or any
OpenAI-compatible endpoint. See docs/bench.md."""
