"""Tiny random GGUFs of several architectures (the `gguf` package writes them), and llama.cpp's own
quantizations of them: the model matrix of tests/models/test_model_matrix.py."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Shape:
    vocab: int = 64
    hidden: int = 256  # a multiple of 256: every K-quant applies
    ffn: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    window: int = 8  # gemma3's sliding window: small, so prompts run past it
    gemma3_layers: int = 6  # every sixth layer global, the others windowed


TINY = Shape()
# Gemma 3 270M's shapes (random weights): a speed stand-in for the real file (scripts/bench_kquant_peer.py)
GEMMA3_270M = Shape(vocab=262144, hidden=640, ffn=2048, heads=4, kv_heads=1, head_dim=256, window=512,
                    gemma3_layers=18)
# a small Llama whose every matrix takes K-quants (rows of 1,024 and 2,816), 12 layers: a speed stand-in for
# a Q4_K_M file made of K-quants (scripts/time_passes.py --shaped llama)
LLAMA_K = Shape(vocab=32000, hidden=1024, ffn=2816, heads=16, kv_heads=2, head_dim=64)
# the speed stand-ins by name: write_gguf(name, path, **SHAPED[name], context=...)
SHAPED = {"gemma3": {"shape": GEMMA3_270M}, "llama": {"shape": LLAMA_K, "layers": 12}}

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


def write_gguf(arch: str, path: str, seed: int = 0, layers: int = 2, context: int = 512, shape: Shape = TINY) -> str:
    import gguf

    rng = np.random.default_rng(seed)

    def w(*dims: int, scale: float | None = None) -> np.ndarray:
        scale = scale if scale is not None else 1.0 / np.sqrt(dims[-1])
        return (rng.standard_normal(dims) * scale).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    layers = shape.gemma3_layers if arch == "gemma3" else layers
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "gemma3":
        writer.add_sliding_window(shape.window)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(3, shape.vocab)])
    writer.add_token_scores([0.0] * shape.vocab)
    writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                           + [gguf.TokenType.NORMAL] * (shape.vocab - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_tensor("token_embd.weight", w(shape.vocab, shape.hidden, scale=1.0))
    for i in range(layers):
        b = f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", ones(shape.hidden))
        writer.add_tensor(b + "attn_q.weight", w(shape.heads * shape.head_dim, shape.hidden))
        writer.add_tensor(b + "attn_k.weight", w(shape.kv_heads * shape.head_dim, shape.hidden))
        writer.add_tensor(b + "attn_v.weight", w(shape.kv_heads * shape.head_dim, shape.hidden))
        writer.add_tensor(b + "attn_output.weight", w(shape.hidden, shape.heads * shape.head_dim))
        if arch == "qwen2":
            for name, n in (("attn_q", shape.heads), ("attn_k", shape.kv_heads), ("attn_v", shape.kv_heads)):
                writer.add_tensor(b + name + ".bias", w(n * shape.head_dim, scale=0.1))
        if arch in ("qwen3", "gemma3"):
            writer.add_tensor(b + "attn_q_norm.weight", ones(shape.head_dim))
            writer.add_tensor(b + "attn_k_norm.weight", ones(shape.head_dim))
        if arch == "gemma3":
            writer.add_tensor(b + "post_attention_norm.weight", ones(shape.hidden))
            writer.add_tensor(b + "post_ffw_norm.weight", ones(shape.hidden))
        writer.add_tensor(b + "ffn_norm.weight", ones(shape.hidden))
        writer.add_tensor(b + "ffn_gate.weight", w(shape.ffn, shape.hidden))
        writer.add_tensor(b + "ffn_up.weight", w(shape.ffn, shape.hidden))
        writer.add_tensor(b + "ffn_down.weight", w(shape.hidden, shape.ffn))
    writer.add_tensor("output_norm.weight", ones(shape.hidden))
    if arch != "gemma3":
        writer.add_tensor("output.weight", w(shape.vocab, shape.hidden, scale=8.0 / np.sqrt(shape.hidden)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


QUANTS = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
# rarer K-quant files (llama_ftype ids): the other types ggml's tiled K-quant kernel serves
MORE_K_QUANTS = {"Q2_K": 10, "Q3_K_M": 12, "IQ4_XS": 30}


def quantize(source: str, path: str, quant: str) -> str:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {**QUANTS, **MORE_K_QUANTS}[quant]
    params.nthread = 2
    if llama_cpp.llama_model_quantize(source.encode(), path.encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {quant}")
    return path
