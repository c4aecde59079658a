# The README's two commands are `make run` and `make test`; each installs what it needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install proto redis-server run run-cpu replay test lint typecheck pytest bench bench-workers clean

PROTOS := $(wildcard protos/residency_proto/*/*.proto)

$(STAMP): pyproject.toml $(PROTOS)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q 'grpcio-tools==1.81.1' 'protobuf>=6.30,<7'
	$(MAKE) proto
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# Python code for protos/ (the source of truth), generated, never committed (residency_proto/ is ignored).
proto:
	rm -rf residency_proto
	$(BIN)/python -m grpc_tools.protoc -I protos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
	for d in residency_proto residency_proto/*/; do touch $$d/__init__.py; done

# The Redis tests start a private redis-server; install Debian's package when the binary is missing.
redis-server:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) \
		|| echo "redis-server is missing and could not be installed: the Redis tests will fail under CI=true"

install: $(STAMP)

# Main job on embedded defaults: the service (gRPC on 127.0.0.1:50051) with a local Ray, the embedded
# SQLite store and the example home, configs/home.yaml (without CUDA its GPU's models run on the CPU;
# silero-vad, all-MiniLM-L6-v2 and WorldPager's MG2-shaped stand-in load offline, the others need
# their checkpoint files). Ctrl-C stops it.
# LISTEN=HOST:PORT serves on another address than the config's (give it to `residency ps --target` too).
LISTEN ?=
run: $(STAMP)
	$(BIN)/residency serve --config configs/home.yaml $(if $(LISTEN),--listen $(LISTEN))

# The CPU-only home: only the models that load offline, with load times measured on this machine.
run-cpu: $(STAMP)
	$(BIN)/residency serve --config configs/local-cpu.yaml $(if $(LISTEN),--listen $(LISTEN))

# The replay of a shipped synthetic home week through configs/home.yaml, every policy side by side.
replay: $(STAMP)
	$(BIN)/residency replay --config configs/home.yaml --trace bench/traces/home-week-seed1.jsonl

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# Two pytest processes: tests/e2e imports tritonclient, whose `inference` protos collide with ours
# in one process (see tests/conftest.py).
pytest: $(STAMP) redis-server
	$(BIN)/pytest -q
	RESIDENCY_E2E=1 $(BIN)/pytest -q tests/e2e

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/python bench/replay_quality.py > bench/results/replay_quality.json
	$(BIN)/python bench/replay_quality.py --heldout 10 --heldout-start 401 --no-shipped > bench/results/replay_quality_heldout401.json
	$(BIN)/python bench/gap_decomposition.py > bench/results/gap_decomposition.json
	$(BIN)/python bench/gap_decomposition.py --heldout 10 --heldout-start 401 --no-shipped > bench/results/gap_decomposition_heldout401.json
	$(BIN)/python bench/replay_speed.py --weeks 4 --repeat 5 > bench/results/replay_speed.json
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
