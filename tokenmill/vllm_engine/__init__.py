"""vLLM as a second engine (`--engine vllm`): its engine, in this process, behind the interface the
job backend, the benchmark and the server drive the embedded engine by. `VllmConfig` says what to
load; vLLM itself (and torch) is imported only when an engine is loaded (`pip install
'tokenmill[vllm]'`), from tokenmill/vllm_engine/engine.py."""

from tokenmill.vllm_engine.args import ENGINES, add_engine_choice, engine_spec
from tokenmill.vllm_engine.config import VllmConfig

__all__ = ["ENGINES", "VllmConfig", "add_engine_choice", "engine_spec"]
