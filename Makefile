# The README's two commands are `make run` and `make test`; each installs what it needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test lint typecheck pytest bench bench-workers clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Main job on embedded defaults: replay the shipped synthetic week through the example config
# and print the policy comparison table.
run: $(STAMP)
	$(BIN)/residency replay --config configs/home.yaml --trace bench/traces/home-week-seed1.jsonl

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/python bench/replay_quality.py > bench/results/replay_quality.json
	$(BIN)/python bench/replay_speed.py > bench/results/replay_speed.json
	$(BIN)/python bench/tune_gain.py > bench/results/tune_gain.json
	$(BIN)/python bench/results_tables.py

# Workers: load path (our safetensors reader vs raw read vs torch.load, cold and warm) and the measured
# load times per transition of configs/local-cpu.yaml's real models (a couple of minutes).
bench-workers: $(STAMP)
	$(BIN)/python bench/load_path.py --repeats 5 > bench/results/load_path.json
	$(BIN)/residency measure --config configs/local-cpu.yaml --repeats 5 --json > bench/results/measure_local_cpu.json
	COLUMNS=100 $(BIN)/residency measure --config configs/local-cpu.yaml --repeats 5 > bench/results/measure_local_cpu.txt

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
