# kvtier developer entry points. `make run` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtier-installed
# Extras installed into the development environment.
EXTRAS ?= dev,transformers,plot,redis
PROTO_OUT ?= proto

.PHONY: run test test-l3-cluster system-deps proto lint bench clean

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

# The L3 tests start real redis-server processes: install Debian's when it is missing (as root),
# or say what to install.
system-deps:
	@if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing redis-server and redis-tools (the L3 tests run real Redis servers)"; \
			DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
				redis-server redis-tools >/dev/null; \
		else \
			echo "make test needs redis-server and redis-cli (Debian: apt-get install redis-server redis-tools)"; \
			exit 1; \
		fi; \
	fi

test: $(STAMP) system-deps
	$(PY) -m pytest -m "not redis_cluster" $(PYTEST_ARGS)

# L3 on a real 3-master Redis Cluster (resharding, a master killed mid-workload): slower,
# so outside `make test`'s budget; .ci/run runs both.
test-l3-cluster: $(STAMP) system-deps
	$(PY) -m pytest -m redis_cluster tests/tiers/test_remote_cluster.py $(PYTEST_ARGS)

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
	rm -rf $(VENV) build *.egg-info var
