"""vLLM as a second engine (`--engine vllm`): its engine, in this process, behind the interface the
job backend and the benchmark drive the embedded engine by. vLLM itself is imported only when an
engine is built (`pip install 'tokenmill[vllm]'`)."""

from tokenmill.vllm_engine.args import (
    ENGINES,
    add_engine_choice,
    check_engine_flags,
    uses_vllm,
    vllm_engine_args,
)
from tokenmill.vllm_engine.engine import INSTALL_HINT, VllmEngine, VllmLLM

__all__ = ["ENGINES", "INSTALL_HINT", "VllmEngine", "VllmLLM", "add_engine_choice", "check_engine_flags",
           "uses_vllm", "vllm_engine_args"]
