"""An embedding model on vLLM's pooling runner, in this process: what `--engine vllm` gives an
embedding model. Inputs are checked and tokenized as the embedded embedder checks them
(embed/inputs.py: the same limits, errors and Matryoshka sizes); vLLM batches and pools them (its
pooling read from the same sentence-transformers folder)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from tokenmill.embed.embedder import embedding_model_folder
from tokenmill.embed.inputs import NO_TOKENIZER_LIMIT, EmbedderStats, EmbeddingInputs, matryoshka_dimensions
from tokenmill.environment import DEFAULT_EMBEDDING_MODEL, model_name
from tokenmill.models.loader import read_config
from tokenmill.models.pooling import PoolingConfig
from tokenmill.vllm_engine.config import VllmEmbeddingConfig
from tokenmill.vllm_engine.engine import import_vllm, set_cpu_defaults, with_cpu_kv_budget
from tokenmill.vllm_engine.lifeline import tie_engine_processes_to_this_one


class VllmEmbedder(EmbeddingInputs):
    def __init__(self, config: VllmEmbeddingConfig) -> None:
        on_cpu = set_cpu_defaults()
        vllm = import_vllm()
        self.config = config
        self.folder = embedding_model_folder(config.model)
        self.name = model_name(config.model or DEFAULT_EMBEDDING_MODEL)
        args = {**config.vllm.vllm_engine_args(), "model": str(self.folder), "runner": "pooling"}
        if on_cpu:
            args = with_cpu_kv_budget(args)
        tie_engine_processes_to_this_one()  # a kill -9 of this process takes vLLM's engine processes too
        self._llm = vllm.LLM(**args)
        model_config = self._llm.llm_engine.vllm_config.model_config
        self.tokenizer = self._llm.get_tokenizer()
        self.tokenizer.model_max_length = NO_TOKENIZER_LIMIT
        self.max_model_len = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())
        self.dimensions = int(model_config.get_hidden_size())
        pooling = PoolingConfig.read(self.folder)
        self.normalize = pooling is not None and pooling.normalize
        self.matryoshka_dimensions = matryoshka_dimensions(read_config(self.folder))
        self.stats = EmbedderStats()

    def embed_token_ids(self, ids: Sequence[Sequence[int]]) -> np.ndarray:
        start = time.perf_counter()
        outputs = self._llm.embed([{"prompt_token_ids": list(seq)} for seq in ids], use_tqdm=False)
        vectors = np.asarray([out.outputs.embedding for out in outputs], dtype=np.float32)
        s = self.stats
        s.inputs += len(ids)
        s.tokens += sum(map(len, ids))
        s.forwards += 1  # one call: vLLM's own steps are not seen from here
        s.seconds += time.perf_counter() - start
        return vectors.reshape(len(ids), self.dimensions)

    def close(self) -> None:
        """vLLM's engine process goes now, not at interpreter exit."""
        engine = getattr(self._llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
