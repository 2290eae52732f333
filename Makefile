# The README's two commands: `make demo` and `make test`. Both install what they need into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test install

$(BIN)/edgespec: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch==2.13.0 is the CPU wheel; any other spec would pull several GB of CUDA packages
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[export,dev]"
	touch $(BIN)/edgespec

install: $(BIN)/edgespec

demo: install
	$(BIN)/edgespec demo

test: install
	$(BIN)/python -m pytest -q
