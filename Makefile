# kvtier developer entry points. `make run` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtier-installed
# Extras installed into the development environment.
EXTRAS ?= dev,transformers,plot
PROTO_OUT ?= proto

.PHONY: run test proto lint bench clean

$(STAMP): pyproject.toml setup.py kernels/_copy.c
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# Without CUDA take the CPU build of torch from its pinned release; any other spec may
	@# pull a multi-GB CUDA build.
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvtierd $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# Regenerate the committed protobuf modules (tests fail when they are stale).
proto: $(STAMP)
	@mkdir -p $(PROTO_OUT)/.gen
	$(PY) -m grpc_tools.protoc -Ikvtier/proto=proto --python_out=$(PROTO_OUT)/.gen \
		--pyi_out=$(PROTO_OUT)/.gen --grpc_python_out=$(PROTO_OUT)/.gen proto/kvtier.proto
	mv $(PROTO_OUT)/.gen/kvtier/proto/kvtier_pb2*.py* $(PROTO_OUT)/
	rm -rf $(PROTO_OUT)/.gen

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy daemon tiers client kernels bench sim cli

bench: $(STAMP)
	$(VENV)/bin/kvtier bench l1

clean:
	rm -rf $(VENV) build *.egg-info var
