"""The in-process engines a job, a benchmark or the server can run, and the one place a spec is
loaded: `EngineConfig` → tokenmill's own engine (`LLM`), `VllmConfig` → vLLM's (`VllmLLM`).
Both come back as an `InProcessModel` (engine/interface.py), which everything above drives the
same way. An embedding model's spec the same way: `EmbeddingConfig` → `Embedder`,
`VllmEmbeddingConfig` → vLLM's pooling runner, both `EmbeddingInputs` (embed/inputs.py). torch,
and vLLM, load only here, when a model does."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.embed.config import EmbeddingConfig
from tokenmill.engine import EngineConfig, EngineSpec, InProcessModel
from tokenmill.vllm_engine.config import VllmConfig, VllmEmbeddingConfig

if TYPE_CHECKING:
    from tokenmill.embed.inputs import EmbeddingInputs
    from tokenmill.models.loader import LoadedWeights

EmbeddingSpec = EmbeddingConfig | VllmEmbeddingConfig


def load_engine(spec: EngineSpec, weights: LoadedWeights | None = None) -> InProcessModel:
    """Load the model and build the engine `spec` asks for. `weights`: the embedded engine's,
    already in memory (Ray replicas get them with the job); vLLM loads its own."""
    if isinstance(spec, VllmConfig):
        from tokenmill.vllm_engine.engine import VllmLLM

        return VllmLLM(spec)
    if not isinstance(spec, EngineConfig):
        raise TypeError(f"an engine spec is an EngineConfig or a VllmConfig, got {type(spec).__name__}")
    from tokenmill.engine import LLM

    return LLM.from_config(spec, weights)


def load_embedder(spec: EmbeddingSpec) -> EmbeddingInputs:
    """Load the embedding model `spec` asks for, on tokenmill's embedder or vLLM's pooling runner."""
    if isinstance(spec, VllmEmbeddingConfig):
        from tokenmill.vllm_engine.embedder import VllmEmbedder

        return VllmEmbedder(spec)
    from tokenmill.embed.embedder import Embedder

    return Embedder.from_config(spec)
