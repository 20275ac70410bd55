"""The tiny random Llama as a GGUF llama.cpp loads, and a backend's exact law enumerated from its logits."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from exactspec.speculative.sampling import SamplingParams, warp

from ..conftest import TINY_VOCAB
from .laws import LENGTH, PROMPT


def write_tiny_gguf(module: torch.nn.Module, path) -> str:
    """A transformers Llama (tests' tiny random one) as an f32 GGUF that llama.cpp loads: llama
    architecture, a minimal SentencePiece-type vocabulary, q/k rows permuted to llama.cpp's RoPE layout."""
    import gguf

    cfg = module.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // n_head

    def w(t: torch.Tensor) -> np.ndarray:
        return t.detach().float().numpy().copy()

    def permute(t: torch.Tensor, heads: int) -> np.ndarray:  # as convert_hf_to_gguf.py LlamaModel.permute
        x = w(t)
        return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = cfg.vocab_size
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(3, vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                           + [gguf.TokenType.NORMAL] * (vocab - 3))
    writer.add_tensor("token_embd.weight", w(module.model.embed_tokens.weight))
    writer.add_tensor("output_norm.weight", w(module.model.norm.weight))
    writer.add_tensor("output.weight", w(module.lm_head.weight))
    for i, layer in enumerate(module.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        writer.add_tensor(f"blk.{i}.attn_norm.weight", w(layer.input_layernorm.weight))
        writer.add_tensor(f"blk.{i}.attn_q.weight", permute(attn.q_proj.weight, n_head))
        writer.add_tensor(f"blk.{i}.attn_k.weight", permute(attn.k_proj.weight, n_kv))
        writer.add_tensor(f"blk.{i}.attn_v.weight", w(attn.v_proj.weight))
        writer.add_tensor(f"blk.{i}.attn_output.weight", w(attn.o_proj.weight))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", w(layer.post_attention_layernorm.weight))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(mlp.gate_proj.weight))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(mlp.up_proj.weight))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(mlp.down_proj.weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def backend_law(lm, params: SamplingParams) -> torch.Tensor:
    """[V**LENGTH] probability of every continuation of PROMPT, enumerated from the backend's own logits."""
    law = torch.zeros(TINY_VOCAB**LENGTH, dtype=torch.float64)
    for prefix in itertools.product(range(TINY_VOCAB), repeat=LENGTH - 1):
        lm.reset()
        logits = lm.forward(torch.tensor([PROMPT + list(prefix)]))[0, len(PROMPT) - 1:]  # [LENGTH, V]
        probs = warp(logits, params).double()
        head = torch.prod(torch.stack([probs[i, t] for i, t in enumerate(prefix)])) if prefix else 1.0
        index = sum(t * TINY_VOCAB ** (LENGTH - 1 - i) for i, t in enumerate(prefix))
        law[index : index + TINY_VOCAB] = head * probs[LENGTH - 1]
    lm.reset()
    return law
