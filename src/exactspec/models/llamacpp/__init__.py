"""The llama.cpp backend (the CPU default for GGUF targets), in one place:

- runtime.py: importing llama-cpp-python, its threads and default parameters, the AMX repack probe, and
  the context a machine affords (tokens per row, rows: from the GGUF header, models/gguf.py);
- adapter.py: `LlamaCppLM`, the `CausalLM` over a llama.cpp context (one row, or many with ragged
  passes and chunked prefill: the protocols of speculative/interfaces.py), and `load_llama_cpp`;
- numerics.py: the load-time self-test that picks the cache type, threads and tiling whose blocks equal
  one-token steps bit for bit, and `load_self_tested`;
- prefill_plan.py: TILED PREFILL's plan (which positions of a prompt a tile may compute).

The engine itself is built by scripts/build_llama_cpp.py with the patches beside it
(scripts/llama_cpp_patches/); docs/llama-cpp.md says what each changes and why the bits hold.
"""
