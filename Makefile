# The two commands that do all set-up on a fresh machine:
#   make demo   runs the main job on the embedded SQLite default
#   make test   runs the tests on SQLite, PostgreSQL and MariaDB
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint venv clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/cronoq-store --url cronoq.db demo --overwrite

test: venv
	scripts/test-servers
	CRONOQ_REQUIRE_DIALECTS=1 $(BIN)/pytest

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy --strict cronoq_store

clean:
	rm -rf $(VENV) cronoq.db cronoq.db-wal cronoq.db-shm cronoq.db.acks.jsonl cronoq.db.*.log
