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


def answering_gguf(path: str, answer: str, context: int = 32768, hidden: int = 64) -> str:
    """A tiny Llama with the embedded model's tokenizer and chat template whose every answer is `answer`
    then end-of-turn, whatever the prompt and temperature: a real GGUF, run by the real llama.cpp engine,
    at a prefill speed where a coding-agent CLI's 10-20k-token first prompt takes seconds.

    How: attention and MLP outputs are zero, so the residual stream is the current token's embedding and
    the model is a table of next tokens; every token embeds as e0 except the answer's tokens, each its
    own direction, and the output rows send e0 to the answer's first token, each answer token to the next
    and the last to end-of-turn, by a margin no sampling overcomes. The answer's tokens must be distinct."""
    import gguf

    from exactspec.embedded import embedded_model_path

    source = gguf.GGUFReader(embedded_model_path())
    field = lambda name: source.fields[name]  # noqa: E731
    tokens = [bytes(field("tokenizer.ggml.tokens").parts[i]).decode() for i in field("tokenizer.ggml.tokens").data]
    merges = [bytes(field("tokenizer.ggml.merges").parts[i]).decode() for i in field("tokenizer.ggml.merges").data]
    types = [int(field("tokenizer.ggml.token_type").parts[i][0]) for i in field("tokenizer.ggml.token_type").data]
    scalar = lambda name: field(name).parts[field(name).data[0]][0]  # noqa: E731
    eos = int(scalar("tokenizer.ggml.eos_token_id"))
    template = bytes(field("tokenizer.chat_template").parts[field("tokenizer.chat_template").data[0]]).decode()
    script = _bpe(answer, tokens)
    assert len(set(script)) == len(script) and len(script) < hidden, script
    vocab = len(tokens)
    embed = np.zeros((vocab, hidden), np.float32)
    embed[:, 0] = 1.0
    out = np.zeros((vocab, hidden), np.float32)
    for i, t in enumerate(script):
        embed[t] = 0.0
        embed[t, i + 1] = 1.0
    chain = [0] + [i + 1 for i in range(len(script))]  # e0 -> script[0] -> ... -> script[-1] -> eos
    for here, nxt in zip(chain, script + [eos]):
        out[nxt, here] = 4.0  # RMSNorm scales a unit vector by sqrt(hidden): a margin of 4 * 8 = 32
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(8192)  # the embedded model's: a longer context takes YaRN, as there
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(hidden)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_key_length(hidden)
    writer.add_value_length(hidden)
    writer.add_rope_dimension_count(hidden)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(bytes(field("tokenizer.ggml.pre").parts[field("tokenizer.ggml.pre").data[0]]).decode())
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for name, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("unknown", writer.add_unk_token_id), ("padding", writer.add_pad_token_id)):
        add(int(scalar(f"tokenizer.ggml.{name}_token_id")))
    writer.add_add_bos_token(False)
    writer.add_chat_template(template)
    zero = np.zeros((hidden, hidden), np.float32)
    writer.add_tensor("token_embd.weight", embed)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        writer.add_tensor(f"blk.0.{name}.weight", zero)
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output.weight", out)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _bpe(text: str, tokens: list[str]) -> list[int]:
    """`text`'s ids in the embedded vocabulary by longest match (a GPT-2 byte-level vocabulary: a space is
    'Ġ'); enough for a short ASCII answer."""
    ids, i, index = [], 0, {t: n for n, t in enumerate(tokens)}
    text = text.replace(" ", "\u0120")
    while i < len(text):
        j = max(j for j in range(i + 1, len(text) + 1) if text[i:j] in index)
        ids.append(index[text[i:j]])
        i = j
    return ids
