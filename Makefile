# The README's two commands: `make demo` and `make test`. Both install what they need into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

# onnxruntime-openvino replaces the `onnxruntime` module, so the OpenVINO provider gets an environment of
# its own: the runtime only (no torch), where tests/test_openvino.py decodes with the draft on OpenVINO
OPENVINO_VENV := .venv-openvino

.PHONY: demo test install openvino

$(BIN)/edgespec: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch==2.13.0 is the CPU wheel; any other spec would pull several GB of CUDA packages
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[export,dev]"
	touch $(BIN)/edgespec

install: $(BIN)/edgespec

$(OPENVINO_VENV)/bin/edgespec: pyproject.toml
	$(PYTHON) -m venv $(OPENVINO_VENV)
	$(OPENVINO_VENV)/bin/pip install --quiet --upgrade pip
	$(OPENVINO_VENV)/bin/pip install --quiet onnxruntime-openvino==1.24.1 "numpy>=1.26" "tokenizers>=0.21" "jinja2>=3.1" "llguidance>=1.9,<2"
	$(OPENVINO_VENV)/bin/pip install --quiet --no-deps -e .
	touch $(OPENVINO_VENV)/bin/edgespec

openvino: $(OPENVINO_VENV)/bin/edgespec

demo: install
	$(BIN)/edgespec demo

test: install openvino
	EDGESPEC_OPENVINO_PYTHON=$(abspath $(OPENVINO_VENV))/bin/python $(BIN)/python -m pytest -q
