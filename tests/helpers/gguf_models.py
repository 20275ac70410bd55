"""Tiny random GGUFs of several architectures (the `gguf` package writes them), and llama.cpp's own
quantizations of them: the model matrix of tests/models/test_model_matrix.py."""
from __future__ import annotations

import ctypes

import numpy as np

VOCAB = 64
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 4, 2, 64
WINDOW = 8  # gemma3's sliding window: small, so prompts run past it

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


def write_gguf(arch: str, path: str, seed: int = 0, layers: int = 2, context: int = 512) -> str:
    import gguf

    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float | None = None) -> np.ndarray:
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    layers = 6 if arch == "gemma3" else layers  # gemma3: every sixth layer global, the others windowed
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(context)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "gemma3":
        writer.add_sliding_window(WINDOW)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(3, VOCAB)])
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                           + [gguf.TokenType.NORMAL] * (VOCAB - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_tensor("token_embd.weight", w(VOCAB, HIDDEN, scale=1.0))
    for i in range(layers):
        b = f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", ones(HIDDEN))
        writer.add_tensor(b + "attn_q.weight", w(HEADS * HEAD_DIM, HIDDEN))
        writer.add_tensor(b + "attn_k.weight", w(KV_HEADS * HEAD_DIM, HIDDEN))
        writer.add_tensor(b + "attn_v.weight", w(KV_HEADS * HEAD_DIM, HIDDEN))
        writer.add_tensor(b + "attn_output.weight", w(HIDDEN, HEADS * HEAD_DIM))
        if arch == "qwen2":
            for name, n in (("attn_q", HEADS), ("attn_k", KV_HEADS), ("attn_v", KV_HEADS)):
                writer.add_tensor(b + name + ".bias", w(n * HEAD_DIM, scale=0.1))
        if arch in ("qwen3", "gemma3"):
            writer.add_tensor(b + "attn_q_norm.weight", ones(HEAD_DIM))
            writer.add_tensor(b + "attn_k_norm.weight", ones(HEAD_DIM))
        if arch == "gemma3":
            writer.add_tensor(b + "post_attention_norm.weight", ones(HIDDEN))
            writer.add_tensor(b + "post_ffw_norm.weight", ones(HIDDEN))
        writer.add_tensor(b + "ffn_norm.weight", ones(HIDDEN))
        writer.add_tensor(b + "ffn_gate.weight", w(FFN, HIDDEN))
        writer.add_tensor(b + "ffn_up.weight", w(FFN, HIDDEN))
        writer.add_tensor(b + "ffn_down.weight", w(HIDDEN, FFN))
    writer.add_tensor("output_norm.weight", ones(HIDDEN))
    if arch != "gemma3":
        writer.add_tensor("output.weight", w(VOCAB, HIDDEN, scale=8.0 / np.sqrt(HIDDEN)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


QUANTS = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}


def quantize(source: str, path: str, quant: str) -> str:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANTS[quant]
    params.nthread = 2
    if llama_cpp.llama_model_quantize(source.encode(), path.encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {quant}")
    return path
