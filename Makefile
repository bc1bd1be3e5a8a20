# kvtier developer entry points. `make run` and `make test` are the README's two commands.
# Each target first brings .venv up to what it needs (deploy/bootstrap.py: runtime dependencies
# for `run`, test tools for `test`; the CPU build of torch where there is no CUDA; a lock
# makes concurrent targets take turns).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BOOTSTRAP := $(PYTHON) deploy/bootstrap.py --venv $(VENV)
PROTO_OUT ?= proto
# The generated modules are made with this grpcio-tools: the oldest whose output runs on every
# protobuf from 3.20.3 to 7.x and every grpcio from 1.49.1 (tests/packaging checks both ends).
GRPC_TOOLS ?= 1.62.3
PROTO_VENV ?= .venv-proto

.PHONY: run test test-soak test-l3-cluster system-deps example proto lint bench client-wheel test-packaging clean

run:
	@$(BOOTSTRAP) --profile run
	$(VENV)/bin/kvtierd $(ARGS)

# The L3 tests start real redis-server processes: install Debian's when it is missing (as root),
# or say what to install.
system-deps:
	@if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "[kvtier] installing redis-server and redis-tools (the L3 tests run real Redis servers)"; \
			DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
				redis-server redis-tools >/dev/null; \
		else \
			echo "make test needs redis-server and redis-cli (Debian: apt-get install redis-server redis-tools)"; \
			exit 1; \
		fi; \
	fi

test: system-deps
	@$(BOOTSTRAP) --profile dev
	$(PY) -m pytest $(PYTEST_ARGS)

# The full soak: 8 client processes of two tenants for 60 s, half of them SIGKILLed midway
# (`make test` runs a few seconds of it); prints its figures. .ci/run runs it too.
SOAK_S ?= 60
test-soak: system-deps
	@$(BOOTSTRAP) --profile dev
	KVTIER_SOAK_S=$(SOAK_S) $(PY) -m pytest -q -s tests/test_soak.py $(PYTEST_ARGS)

# L3 on a real 3-master Redis Cluster (resharding, a master killed mid-workload): slower, so
# outside `make test`'s budget; .ci/run runs it too.
test-l3-cluster: system-deps
	@$(BOOTSTRAP) --profile dev
	$(PY) -m pytest -m redis_cluster tests/tiers/test_remote_cluster.py $(PYTEST_ARGS)

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
	$(VENV)/bin/mypy daemon tiers client kernels bench cli sim paths.py deploy/bootstrap.py deploy/build_client.py

bench:
	@$(BOOTSTRAP) --profile dev
	$(VENV)/bin/kvtier bench l1

# The pure-Python client distribution (dist/kvtier_client-*.whl).
client-wheel:
	@$(BOOTSTRAP) --profile dev
	$(PY) deploy/build_client.py --out dist

# The client wheel in fresh venvs with the oldest and newest supported grpcio, protobuf and
# numpy (downloads them), and the generated modules against the pinned grpcio-tools.
test-packaging:
	@$(BOOTSTRAP) --profile dev
	$(PY) -m pytest -q -m packaging tests/packaging

clean:
	rm -rf $(VENV) $(PROTO_VENV) .$(notdir $(VENV)).lock build dist *.egg-info var
