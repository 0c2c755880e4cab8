# Quick start: `make demo` runs the main job, `make test` runs the tests. Both set themselves up.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup test demo bench proto proto-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install_torch.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	scripts/install_torch.sh $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

proto-check: setup
	$(BIN)/python scripts/compile_proto.py --check

proto: setup
	$(BIN)/python scripts/compile_proto.py

test: setup proto-check
	$(BIN)/python -m pytest -q -ra

demo: setup
	$(BIN)/python scripts/demo.py

bench: setup
	$(BIN)/python bench/tier_bandwidth.py

clean:
	rm -rf $(VENV) build *.egg-info
