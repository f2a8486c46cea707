# Two commands for a fresh clone: `make demo` and `make test`. Both create .venv when it is
# missing and install the project with the exact versions in constraints.txt.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: demo test lint bench docs docs-examples docs-serve sample-data checkpoint-example clean

$(INSTALLED): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check \
		--constraint constraints.txt --editable '.[test,docs]'
	touch $@

demo: $(INSTALLED)
	@mkdir -p demo-output
	$(BIN)/maskln inspect sample_data/pair_features.safetensors
	$(BIN)/maskln normalize sample_data/pair_features.safetensors demo-output/pair_features.safetensors
	$(BIN)/maskln inspect demo-output/pair_features.safetensors
	$(BIN)/maskln verify sample_data/pair_features.safetensors sample_data/pair_features_expected.safetensors
	@# examples/first_attempt.py has one real mistake: its grade is a FAIL (exit 1), by design;
	@# any other exit code (2: the grader could not run it; 0: it passed) fails the demo.
	$(BIN)/maskln grade examples/first_attempt.py || test $$? -eq 1

test: $(INSTALLED)
	$(BIN)/python -m pytest --numprocesses auto --maxprocesses 4

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# BENCH_ARGS: e.g. --quick (a smoke test) or --only 10,11,12; see benchmarks/README.md.
bench: $(INSTALLED)
	$(BIN)/python benchmarks/bench.py --markdown $(BENCH_ARGS)

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

clean:
	rm -rf $(VENV) site demo-output checkpoint-example .pytest_cache .hypothesis .ruff_cache build *.egg-info
