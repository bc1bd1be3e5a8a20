# kvtier developer entry points. `make run` and `make test` are the README's two commands.
# Each target first brings .venv up to what it needs (tools/bootstrap.py: runtime dependencies
# for `run`, test tools for `test`; the CPU build of torch where there is no CUDA; a lock
# makes concurrent targets take turns).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BOOTSTRAP := $(PYTHON) tools/bootstrap.py --venv $(VENV)
PROTO_OUT ?= proto
# The generated modules are made with this grpcio-tools: the oldest whose output runs on every
# protobuf from 3.20.3 to 7.x and every grpcio from 1.49.1 (tests/packaging checks both ends).
GRPC_TOOLS ?= 1.62.3
PROTO_VENV ?= .venv-proto

.PHONY: run test example proto lint bench client-wheel test-packaging clean

run:
	@$(BOOTSTRAP) --profile run
	$(VENV)/bin/kvtierd $(ARGS)

test:
	@$(BOOTSTRAP) --profile dev
	$(PY) -m pytest $(PYTEST_ARGS)

# The transformers example; needs a running daemon (`make run` in another shell).
example:
	@$(BOOTSTRAP) --profile example
	$(PY) examples/prefix_reuse.py $(ARGS)

# Regenerate the committed protobuf modules with the pinned grpcio-tools, in its own venv.
proto:
	@test -x $(PROTO_VENV)/bin/python || $(PYTHON) -m venv $(PROTO_VENV)
	@$(PROTO_VENV)/bin/python -m pip install -q "grpcio-tools==$(GRPC_TOOLS)"
	@mkdir -p $(PROTO_OUT)/.gen
	$(PROTO_VENV)/bin/python -m grpc_tools.protoc -Ikvtier/proto=proto \
		--python_out=$(PROTO_OUT)/.gen --pyi_out=$(PROTO_OUT)/.gen \
		--grpc_python_out=$(PROTO_OUT)/.gen proto/kvtier.proto
	mv $(PROTO_OUT)/.gen/kvtier/proto/kvtier_pb2*.py* $(PROTO_OUT)/
	rm -rf $(PROTO_OUT)/.gen

lint:
	@$(BOOTSTRAP) --profile dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy daemon tiers client kernels bench cli paths.py tools packaging

bench:
	@$(BOOTSTRAP) --profile dev
	$(VENV)/bin/kvtier bench l1

# The pure-Python client distribution (dist/kvtier_client-*.whl).
client-wheel:
	@$(BOOTSTRAP) --profile dev
	$(PY) packaging/build_client.py --out dist

# The client wheel in fresh venvs with the oldest and newest supported grpcio, protobuf and
# numpy (downloads them), and the generated modules against the pinned grpcio-tools.
test-packaging:
	@$(BOOTSTRAP) --profile dev
	$(PY) -m pytest -q -m packaging tests/packaging

clean:
	rm -rf $(VENV) $(PROTO_VENV) .$(notdir $(VENV)).lock build dist *.egg-info var
