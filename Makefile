# `make test` and `make demo` work from a fresh clone: they build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test demo venv clean

$(BIN)/arbor: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,ray]"
	touch $(BIN)/arbor

venv: $(BIN)/arbor

test: venv
	$(BIN)/python -m pytest || [ $$? -eq 5 ]  # 5: no tests collected

demo: venv
	$(BIN)/arbor demo

clean:
	rm -rf $(VENV) runs .pytest_cache
