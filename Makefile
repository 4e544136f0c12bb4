# The two commands a newcomer runs: `make demo` and `make test`. Both install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
LORA_REFERENCE := tests/engine/lora-reference.txt
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(LORA_REFERENCE) | md5sum | cut -c1-8)

.PHONY: demo test test-quick install prometheus lint crd clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned to the CPU wheel: a bare `torch` would pull a multi-GB CUDA build. peft for
# the LoRA tests' diffusers reference goes to its own folder, which only that reference's process
# puts on its path (see $(LORA_REFERENCE)).
$(STAMP): $(BIN)/python pyproject.toml $(LORA_REFERENCE)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,engine]'
	$(BIN)/pip install -q --no-deps --upgrade --target $(VENV)/lora-reference -r $(LORA_REFERENCE)
	touch $(STAMP)

install: $(STAMP)

# Debian's Prometheus for the metrics tests (only when missing and when we may install it).
prometheus:
	@if ! command -v promtool >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; \
	  else echo "promtool missing and cannot install it: the Prometheus tests will fail" >&2; fi; \
	fi

demo: install
	$(BIN)/dlo demo

test: install prometheus
	$(BIN)/python -m pytest -q

# The unit tests only, for local work: every test but the `slow` ones (multi-process, serving, e2e),
# which CI still runs with the rest (`make test`). How long each takes: README.md ("Tests").
test-quick: install
	$(BIN)/python -m pytest -q -m "not slow"

crd: install
	$(BIN)/dlo crd --write

clean:
	rm -rf $(VENV) demo-output .pytest_cache
