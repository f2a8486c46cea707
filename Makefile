# Two commands for a fresh clone: `make demo` and `make test`. Both create .venv when it is
# missing and install the project with the exact versions in constraints.txt.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: demo test test-slow test-raw test-isa lint bench native docs docs-examples docs-serve sample-data checkpoint-example clean

PIP_INSTALL := $(BIN)/python -m pip install --quiet --disable-pip-version-check \
	--constraint constraints.txt
NATIVE_LOG := $(VENV)/native-build.log
$(INSTALLED): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# What the native build needs comes first (torch, ninja, and numpy, which torch looks for
	@# on import): the native CPU kernels then compile into the per-user cache (~36 s on two
	@# quiet cores; at once when cached, rebuilt when the cached build is damaged) while pip
	@# installs the rest, mostly waiting on indexes. Without a C++ compiler the op falls back
	@# to the raw-op kernels: a warning, not a failure.
	$(PIP_INSTALL) torch ninja numpy
	$(BIN)/python -m maskln_cli.op.native > $(NATIVE_LOG) 2>&1 & native=$$!; \
	$(PIP_INSTALL) --editable '.[test,docs]'; installed=$$?; \
	wait $$native; built=$$?; cat $(NATIVE_LOG); \
	test $$built -eq 0 || echo "maskln: native kernels not built; the op uses the raw-op kernels"; \
	exit $$installed
	touch $@

# say: a line in bold green on a terminal (plain when piped, or with NO_COLOR set).
say = if [ -t 1 ] && [ -z "$${NO_COLOR-}" ]; then printf '\033[1;32m%s\033[0m\n' $(1); \
	else printf '%s\n' $(1); fi

demo: $(INSTALLED)
	@mkdir -p demo-output
	$(BIN)/maskln inspect sample_data/pair_features.safetensors
	$(BIN)/maskln normalize sample_data/pair_features.safetensors demo-output/pair_features.safetensors
	$(BIN)/maskln inspect demo-output/pair_features.safetensors
	$(BIN)/maskln verify sample_data/pair_features.safetensors sample_data/pair_features_expected.safetensors
	@echo
	@echo "Next: maskln grade on examples/first_attempt.py, a first attempt at the op with one"
	@echo "deliberate mistake (NaN in the padding reaches its gradients). FAIL is the expected"
	@echo "outcome: the grade says which clause fails, where, and how to fix it."
	@echo
	@# A FAIL exits 1, by design; any other exit code (2: the grader could not run it; 0: it
	@# passed) fails the demo.
	@echo '$(BIN)/maskln grade examples/first_attempt.py'
	@$(BIN)/maskln grade examples/first_attempt.py; status=$$?; test $$status -eq 1 || \
		{ echo "make demo: the grade exited $$status, not 1 (the expected FAIL)" >&2; exit 1; }
	@echo
	@$(call say,"The demo completed: every step ran as expected (the FAIL above is the deliberate mistake).")

# The suite on the default backend: the native kernels, or the raw-op fallback where no C++
# compiler built them. The adversarial suites marked slow (real processes, signals, fuzzed
# files) are `make test-slow`; the whole suite on the raw-op fallback where the native kernels
# were built is `make test-raw` (CI runs both).
# Python's bytecode caches are written even where PYTHONDONTWRITEBYTECODE is set (as in many
# container images): without them each worker redoes pytest's assertion rewriting of every test
# module, some 6 s of CPU a worker on each run.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest --numprocesses auto --maxprocesses 4
test: $(INSTALLED)
	$(PYTEST) -m "not slow"

# The adversarial suites (CI runs them after `make test`).
test-slow: $(INSTALLED)
	$(PYTEST) -m slow

# The whole suite, slow tests included, on the raw-op backend (CI runs it last); not the
# documentation's examples, which show the default backend's output (`op backend: native`,
# and results rounded by the native kernel).
test-raw: $(INSTALLED)
	MASKLN_BACKEND=raw $(PYTEST) --ignore tests/docs/test_examples.py

# The suite as an AVX2-only CPU runs it (torch's, MKL's, oneDNN's and maskln's AVX2 code paths;
# torch's compiled graphs cached apart, since torch's cache does not tell the paths apart), then
# the op's tests and the documentation's examples on maskln's portable kernels (CI runs it).
AVX2_MACHINE := MASKLN_NATIVE_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
	ONEDNN_MAX_CPU_ISA=AVX2 TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.pytest_cache/torchinductor-avx2
test-isa: $(INSTALLED)
	$(AVX2_MACHINE) $(PYTEST) -m "not slow"
	MASKLN_NATIVE_ISA=base $(PYTEST) -m "not slow" tests/op tests/docs

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# BENCH_ARGS: e.g. --quick (a smoke test) or --only 10,11,12; see benchmarks/README.md.
bench: $(INSTALLED)
	$(BIN)/python benchmarks/bench.py --markdown $(BENCH_ARGS)

# The native CPU kernels compiled into the per-user cache (a C++ compiler and ninja, half a
# minute or so; the install step does it too): later runs, and pytest's workers, load them at once.
native: $(INSTALLED)
	$(BIN)/python -m maskln_cli.op.native

sample-data: $(INSTALLED)
	$(BIN)/python scripts/make_sample_data.py

checkpoint-example: $(INSTALLED)
	$(BIN)/python scripts/make_checkpoint_example.py

# The documentation site, built into site/ with --strict (a broken link or reference fails);
# the CLI reference must match the commands' --help (cog --check).
docs: $(INSTALLED)
	$(BIN)/cog --check --diff --check-fail-msg "make docs-examples regenerates it" docs/reference/cli.md
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

# Regenerate what the docs show from real runs: the CLI reference (cog) and the output of every
# console example (tests/docs/runner.py). Review the diff, then commit it.
docs-examples: $(INSTALLED)
	$(BIN)/cog -r --verbosity 1 docs/reference/cli.md
	$(BIN)/python -m tests.docs.runner --update

docs-serve: $(INSTALLED)
	$(BIN)/mkdocs serve

# Also this checkout's build of the native kernels in the per-user cache (the folder of these
# sources, this torch and this compiler; other checkouts' builds stay), while the venv is there.
clean:
	-test ! -x $(BIN)/python || $(BIN)/python -m maskln_cli.op.native --clean
	rm -rf $(VENV) site demo-output checkpoint-example .pytest_cache .hypothesis .ruff_cache build *.egg-info
