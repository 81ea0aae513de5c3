# The commands that do all set-up on a fresh machine:
#   make demo   runs the main job on the embedded SQLite default
#   make test   runs the tests on SQLite, PostgreSQL and MariaDB
#   make docs   builds the documentation site (guides and API reference) into site/, warnings as errors
# and the ends of the supported range, each in a venv of its own made fresh from PyPI:
#   make test-lowest   Python 3.11, every dependency at the lowest version pyproject.toml allows
#   make test-newest   Python 3.13, every dependency at its newest release
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

# The first of these that runs (pyenv's shims name versions that are not selected).
find_python = $(firstword $(foreach p,$(1),$(shell $(p) -c 'import sys; print(sys.executable)' 2>/dev/null)))
PYTHON_LOWEST ?= $(call find_python,python3.11 $(wildcard $(HOME)/.pyenv/versions/3.11*/bin/python3.11))
PYTHON_NEWEST ?= $(call find_python,python3.13 $(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3.13))
# The range's ends run SQLite and the dialect-free tests (the main run has all three dialects),
# but not the real-process failover rounds (`slow`: a minute), which exercise no dependency edge,
# nor the dashboard's real-browser tests (`browser`), which exercise the browser, not the range.
RANGE_TESTS := -m 'not postgresql and not mysql and not galera and not slow and not browser and not netlab'

.PHONY: demo test test-lowest test-newest lint docs venv clean screenshots mutants mutmut

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/cronoq-store demo --overwrite  # ./cronoq-demo.db; it never overwrites another database

# Every dialect is required in CI (CI or CRONOQ_REQUIRE_DIALECTS set: .ci/run sets the latter);
# elsewhere a server that is not there is said by test-servers, its tests skip, and pytest's
# summary names the dialects that did not run.
# The replica tests' clusters, the network lab (scripts/netlab: a namespace, servers and loop
# filesystems of tests/faults/test_netlab.py's own) and the previous release's source that the
# rolling-deploy test extracts from git history (scripts/previous-release) are removed when
# pytest ends, however it ends (their fixtures remove them too; this catches a run killed before
# its teardown).
test: venv
	scripts/test-servers
	trap 'scripts/pg-pair clean; scripts/netlab clean; scripts/previous-release clean' EXIT; CRONOQ_REQUIRE_DIALECTS=$${CRONOQ_REQUIRE_DIALECTS:-$${CI:+1}} $(BIN)/pytest

# The named mutants of the central promises (scripts/mutants): each applied to a copy of the
# package, its own few tests run against it; fails when one survives or no longer applies.
mutants: venv
	scripts/test-servers
	$(BIN)/python scripts/mutants

# mutmut over the pure modules (the fold, the codec, the leadership core; [tool.mutmut] in
# pyproject.toml), against their own tests: not in CI (over an hour here: the codec has
# 1,362 mutants and hypothesis tests; `mutmut run "cronoq_store.leadership*"` runs one). Then
# `$(BIN)/mutmut results` lists the survivors, `$(BIN)/mutmut show NAME` shows one.
mutmut: venv
	rm -rf mutants
	$(BIN)/mutmut run
	$(BIN)/python scripts/mutmut-rates

# Each from PyPI by uv, which also resolves the floors (--resolution lowest-direct).
.venv-lowest/.installed: RANGE_PYTHON = $(PYTHON_LOWEST)
.venv-lowest/.installed: RESOLUTION = --resolution lowest-direct
.venv-newest/.installed: RANGE_PYTHON = $(PYTHON_NEWEST)
.venv-newest/.installed: RESOLUTION =
.venv-%/.installed: pyproject.toml
	@test -n "$(RANGE_PYTHON)" || { echo "no Python found for the $* run: set PYTHON_LOWEST or PYTHON_NEWEST"; exit 1; }
	rm -rf .venv-$*
	$(RANGE_PYTHON) -m venv .venv-$*
	.venv-$*/bin/pip install --quiet uv
	.venv-$*/bin/uv pip install --quiet --python .venv-$*/bin/python $(RESOLUTION) -e '.[dev]'
	touch $@

test-lowest test-newest: test-%: .venv-%/.installed
	.venv-$*/bin/python --version
	.venv-$*/bin/uv pip list --python .venv-$*/bin/python
	.venv-$*/bin/pytest $(RANGE_TESTS)

# The docs extra goes into the same venv, on demand: `make test` and the range runs never need it.
$(BIN)/.docs-installed: $(BIN)/.installed
	$(BIN)/pip install --quiet -e '.[docs]'
	touch $@

# --strict: a warning (a broken link, a docstring naming a parameter the signature lacks, a
# reference to a name that does not exist, a public name without a docstring: see
# scripts/griffe_reference.py) fails the build. No plugin reaches the network.
# NO_MKDOCS_2_WARNING silences mkdocs-material's banner about MkDocs 2, which is not a warning
# about this site.
docs: $(BIN)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The dashboard's pictures in docs/img (docs/dashboard.md), taken in Debian's headless Chromium.
screenshots: venv
	scripts/browser setup
	$(BIN)/python scripts/dashboard-screenshots docs/img

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy --strict cronoq_store

clean:
	rm -rf $(VENV) .venv-lowest .venv-newest site cronoq-demo.db cronoq-demo.db-wal cronoq-demo.db-shm cronoq-demo.db.acks.jsonl cronoq-demo.db.*.log
