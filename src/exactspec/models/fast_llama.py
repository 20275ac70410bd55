"""A lean Llama-family forward over the weights of a loaded transformers model (gpt-fast style).

Why: on a small CPU the transformers forward spends most of a decode step in Python and framework
overhead, not in matmuls. This module runs the same arithmetic with fused q/k/v and gate/up
projections and a preallocated KV cache whose rollback is a length pointer. Supported: model types
`llama`, `mistral` (without an active sliding window) and `qwen2` (q/k/v biases); anything else uses
the transformers adapter. Its logits match transformers' to float32 rounding (tested).

Batch invariance (greedy identity by construction): a token's logits must not depend on how many
tokens share its forward (a k-token verification block, other rows of a batch). Three things broke
that, each a reduction whose order depended on the block: (1) the fused attention kernel computes
q.K^T for a block of queries with another kernel than for one query; (2) the P.V product and the
softmax sum run over the keys up to the block's end, so a token inside a block summed over more
(masked, zero) keys than alone, in another order; (3) the CPU matmul libraries pick their kernel by
the row count M (MKL fp32: 1-row vs k-row results differ by ~5e-5; oneDNN bf16 mostly agrees, not
always, and bf16 rounding amplified all of it to 0.75 in the logits). The fix, `batch_invariant`
mode: attention in float32 with q·Kᵀ and P·V as matmuls over exactly INVARIANT_ROWS queries per KV head
and exactly ATTN_BLOCK keys per block (`_invariant_attention`: blocks summed in order, so blocks beyond
a query add exact zeros), and every projection on exactly INVARIANT_ROWS rows (zero-padded chunks).
Whether a layout (dtype, mode) is bit-equal on a given CPU, and which is fastest, is measured at load
(models/layouts.py: `dtype auto`); on an Intel Xeon with AMX both bf16 and fp32 in this mode pass and
neither passes without it (an AMD EPYC with AVX-512 BF16 passed bf16 in the mode). Price (embedded model, 2 threads, 300-token context,
AMD EPYC): a plain step computes 8 rows, 42.5 ms in bf16 vs 32.7 ms without the mode, while 4- and
8-token blocks cost about one step (42.2 / 45.7 ms). The prefill runs in the mode too, in the same shapes
(`_causal_spans`: spans of PREFILL_SPAN queries over the key blocks up to each span's end). A prompt's KV is
then computed in the same shapes alone, padded beside another prompt, after a prefix-cache restore and
by decode steps, so it is the same bits wherever blocks vs steps is (the identity self-test checks it).
Outside the mode the fused attention, the bf16 RMSNorm over all rows and MKL's fp32 kernel
choice by M made them differ (docs/devices-and-dtypes.md). Its price is the prefill's time, 2.5-3x (bf16,
300 tokens: 1.5 s vs 0.6 s on a loaded 2-core EPYC). A layout chosen explicitly (`--dtype`) keeps the
old default: the mode for bf16 / fp16 on a CPU, not for fp32.
CUDA runs unchunked (cuBLAS is not
row-invariant either: there greedy identity is tested, not guaranteed bit for bit).
The weights, the cache and the logits live on the module's device (CPU or CUDA); the cache lengths
are host bookkeeping.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import ExactSpecError
from ..speculative.prefix_cache import prefill_prompt

SUPPORTED = ("llama", "mistral", "qwen2")
INVARIANT_ROWS = 8  # rows per matmul in batch-invariant mode: one step of γ <= 7 verification is one chunk
ATTN_BLOCK = 128  # invariant mode attends over whole blocks of this many keys (the same lengths alone or in a block)
PREFILL_SPAN = 128  # invariant mode: queries per attention call of a long prefill (whole INVARIANT_ROWS chunks)
# Fused attention off the CPU, without cuDNN's: it builds an execution plan for every new key length, and
# a decode step meets a new one every time (gpu-check, H200, torch 2.11: a 1B Llama's plain step 73 ms with
# it, 9.5 ms without; docs/devices-and-dtypes.md).
GPU_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def supports(module: torch.nn.Module) -> bool:
    config = module.config
    window = getattr(config, "sliding_window", None)
    return (config.model_type in SUPPORTED and not getattr(config, "use_sliding_window", False)
            and (window is None or config.model_type != "mistral" or window >= config.max_position_embeddings)
            and getattr(config, "hidden_act", "silu") == "silu")


class Layer:
    def __init__(self, hf_layer: torch.nn.Module, dtype: torch.dtype):
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        cast = lambda *ws: torch.cat(ws).detach().to(dtype) if len(ws) > 1 else ws[0].detach().to(dtype)  # noqa: E731
        self.norm1 = cast(hf_layer.input_layernorm.weight)
        self.norm2 = cast(hf_layer.post_attention_layernorm.weight)
        self.wqkv = cast(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)  # [(H+2Hkv)·d, D]
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        self.bqkv = cast(*biases) if biases[0] is not None else None
        self.wo = cast(attn.o_proj.weight)  # [D, H·d]
        self.w_gate_up = cast(mlp.gate_proj.weight, mlp.up_proj.weight)  # [2I, D]
        self.w_down = cast(mlp.down_proj.weight)  # [D, I]


class FastLlamaLM:
    """`CausalLM` over a Llama-family transformers module (weights shared, not copied).

    The KV cache holds B rows, each with its own length: row b's next token goes to position
    lengths[b], and a query attends only to its own row's positions up to itself. Rows therefore
    advance, roll back, leave, are duplicated or join independently (batched speculative decoding
    with uneven acceptance, continuous batching). The cache tensors have room for at least B rows;
    rows [0, B) are live, so rows leave and join by moving only the rows that change slot.
    The `CausalLM` methods are the B = 1 view.
    `dtype`: compute in this dtype (default: the module's); weights of another dtype are cast copies, so a
    layout can be tried (models/layouts.py) without touching the module.
    """

    batched = True
    identity = ""  # not self-tested at load (the torch loader sets it: models/layouts.py)
    cache_generated_kv = True  # a step writes what a prefill writes (the prefix cache may keep answers)
    cost_key: str | None = None  # set by the loader: keys auto γ's cached T(k)

    def __init__(self, module: torch.nn.Module, eos_token_ids: set[int] | None = None, capacity: int = 1024,
                 batch_invariant: bool | None = None, dtype: torch.dtype | None = None):
        if not supports(module):
            raise ExactSpecError(f"fast path does not support model type {module.config.model_type!r}")
        config = module.config
        self.module = module
        dtype = dtype or module.model.embed_tokens.weight.dtype
        self.layers = [Layer(layer, dtype) for layer in module.model.layers]
        self.embed = module.model.embed_tokens.weight.detach().to(dtype)  # [V, D]
        self.final_norm = module.model.norm.weight.detach().to(dtype)
        self.lm_head = module.lm_head.weight.detach().to(dtype)  # [V, D]
        self.eps = config.rms_norm_eps
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        rotary = module.model.rotary_emb
        self.inv_freq = rotary.inv_freq.float()  # [d/2]
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.vocab_size = int(self.lm_head.shape[0])
        eos = eos_token_ids if eos_token_ids is not None else getattr(module.generation_config, "eos_token_id", None)
        self.eos_token_ids = set(eos if isinstance(eos, (list, tuple, set)) else ([eos] if eos is not None else []))
        self.max_length = int(config.max_position_embeddings)
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        if batch_invariant is None:  # where it buys bit-equality: bf16 on a CPU (fp32 stays ~5e-5 apart anyway)
            batch_invariant = self.device.type == "cpu" and self.dtype != torch.float32
        self.batch_invariant = batch_invariant
        self.initial_capacity = min(capacity, self.max_length)
        self.prefix_cache = None  # a PrefixCache consulted on prefill (see prefix_cache.py)
        self.reset()

    # --- cache -------------------------------------------------------------------------------
    def _new_cache(self, batch: int, capacity: int) -> torch.Tensor:
        return torch.zeros(len(self.layers), batch, self.n_kv, capacity, self.head_dim, dtype=self.dtype,
                           device=self.device)  # [L,B,Hkv,T,d]

    def reset(self, batch: int = 1) -> None:
        """Empty cache with `batch` rows."""
        self.k_cache = self._new_cache(batch, self.initial_capacity)
        self.v_cache = self._new_cache(batch, self.initial_capacity)
        self.lengths = torch.zeros(batch, dtype=torch.long)  # [B]

    def _grow(self, rows: int, capacity: int) -> None:
        """Room for at least `rows` rows of `capacity` positions (doubling); the live rows are kept."""
        old_rows, old_capacity = self.k_cache.shape[1], self.k_cache.shape[3]
        if rows <= old_rows and capacity <= old_capacity:
            return
        rows = max(rows, 2 * old_rows) if rows > old_rows else old_rows
        capacity = min(max(capacity, 2 * old_capacity), self.max_length) if capacity > old_capacity else old_capacity
        B = self.batch_size
        for name in ("k_cache", "v_cache"):
            old = getattr(self, name)
            grown = self._new_cache(rows, capacity)
            grown[:, :B, :, :old_capacity] = old[:, :B]
            setattr(self, name, grown)

    def _ensure_capacity(self, needed: int) -> None:
        self._grow(0, needed)

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def length(self) -> int:
        return int(self.lengths[0])

    def truncate(self, length: int) -> None:
        self.truncate_rows(torch.tensor([length]))

    def truncate_rows(self, lengths: list[int] | torch.Tensor) -> None:
        """lengths [B]: keep the first lengths[b] positions of each row."""
        lengths = torch.as_tensor(lengths, dtype=torch.long).cpu()
        if (lengths < 0).any() or (lengths > self.lengths).any():
            raise ValueError(f"cannot truncate to {lengths.tolist()}: {self.lengths.tolist()} tokens cached")
        self.lengths = lengths.clone()

    @torch.inference_mode()
    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) the given rows, in that order: finished rows leave, samples share a prefill.
        In place: only the rows whose slot changes are copied."""
        rows = rows.long()
        self._grow(len(rows), 0)
        moved = (rows != torch.arange(len(rows))).nonzero().flatten()  # [M] slots that get another row
        if len(moved):
            moved_to, moved_from = moved.to(self.device), rows[moved].to(self.device)
            for cache in (self.k_cache, self.v_cache):
                cache[:, moved_to] = cache[:, moved_from]  # the right side is gathered first: overlap is safe
        self.lengths = self.lengths[rows]

    def save_cache(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cache as it stands, for `restore_cache` after the model was used for something else."""
        return self.k_cache, self.v_cache, self.lengths

    def restore_cache(self, saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self.k_cache, self.v_cache, self.lengths = saved

    @torch.inference_mode()
    def append_rows(self, prompt_ids: list[int], copies: int = 1) -> int:
        """Append `copies` rows holding prompt_ids[:-1] after the live rows (continuous batching: a
        request joins a running batch between iterations; its n samples share one prefill). The
        prefill runs alone on a one-row scratch cache, exactly as a lone generation's would (through the
        prefix cache, if any), so the running rows are untouched if it fails. Returns the tokens reused."""
        if not prompt_ids or len(prompt_ids) >= self.max_length:
            raise ExactSpecError(f"a prompt of {len(prompt_ids)} tokens cannot join a {self.max_length}-token context")
        width = len(prompt_ids) - 1
        running = self.save_cache()
        self.restore_cache((self._new_cache(1, max(width, 1)), self._new_cache(1, max(width, 1)),
                            torch.zeros(1, dtype=torch.long)))
        try:
            reused = prefill_prompt(self, prompt_ids[:-1])  # through the prefix cache, if any
            k_new, v_new, _ = self.save_cache()  # [L, 1, Hkv, >= width, d]
        finally:
            self.restore_cache(running)
        B = self.batch_size
        self._grow(B + copies, width)
        self.k_cache[:, B : B + copies, :, :width] = k_new[:, :, :, :width]  # broadcast over the copies
        self.v_cache[:, B : B + copies, :, :width] = v_new[:, :, :, :width]
        self.lengths = torch.cat([self.lengths, torch.full((copies,), width, dtype=torch.long)])
        return reused

    def snapshot_prefix(self, length: int, row: int = 0) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        """A copy of row `row`'s KV for positions [0, length) (prefix cache) and its size in bytes."""
        k = self.k_cache[:, row, :, :length].clone()  # [L, Hkv, length, d]
        v = self.v_cache[:, row, :, :length].clone()
        return (k, v), 2 * k.numel() * k.element_size()

    @torch.inference_mode()
    def restore_prefix(self, state: tuple[torch.Tensor, torch.Tensor], length: int) -> None:
        """A one-row cache holding the first `length` positions of a `snapshot_prefix` state."""
        k, v = state
        self.reset(1)
        self._ensure_capacity(length)
        self.k_cache[:, 0, :, :length] = k[:, :, :length]
        self.v_cache[:, 0, :, :length] = v[:, :, :length]
        self.lengths = torch.tensor([length])

    # --- forward -----------------------------------------------------------------------------
    def _per_row(self, fn, x: torch.Tensor, invariant: bool) -> torch.Tensor:
        """fn over the rows of x [..., K] -> [..., N]; `invariant`: in zero-padded chunks of exactly
        INVARIANT_ROWS rows, so every row meets the same kernel whatever the row count."""
        if not invariant:
            return fn(x)
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        if rows.shape[0] % INVARIANT_ROWS:
            rows = F.pad(rows, (0, 0, 0, -rows.shape[0] % INVARIANT_ROWS))
        chunks = rows.split(INVARIANT_ROWS)
        out = fn(chunks[0]) if len(chunks) == 1 else torch.cat([fn(chunk) for chunk in chunks])
        return out[: x.numel() // x.shape[-1]].view(*x.shape[:-1], -1)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, invariant: bool) -> torch.Tensor:
        return self._per_row(lambda rows: F.linear(rows, weight, bias), x, invariant)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor, invariant: bool) -> torch.Tensor:
        return self._per_row(lambda r: r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + self.eps) * weight, x,
                             invariant)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, k] -> cos, sin [B, 1, k, d]."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [B, k, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, k, d]
        return (emb.cos() * self.rope_scale).to(self.dtype), (emb.sin() * self.rope_scale).to(self.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(self, new_ids: torch.Tensor) -> torch.Tensor:
        """new_ids [B, k] -> logits [B, k, V]; every row appends k positions at its own length."""
        return self.forward_rows(new_ids)

    def prefill(self, new_ids: torch.Tensor) -> None:
        """`forward` without the output projection."""
        self.forward_rows(new_ids, logits=False)

    @torch.inference_mode()
    def forward_rows(self, new_ids: torch.Tensor, logits: bool = True) -> torch.Tensor | None:
        """new_ids [B, k] -> logits [B, k, V] (None if not `logits`); every row appends k positions."""
        B, k = new_ids.shape
        new_ids = new_ids.to(self.device)
        if B != self.batch_size:
            raise ValueError(f"got {B} rows for a cache of {self.batch_size}")
        end = int(self.lengths.max()) + k
        if end > self.max_length:
            raise ExactSpecError(f"context length {end} exceeds the model's {self.max_length} tokens")
        # Prefill runs in the mode too: a prompt's KV is then computed in the same shapes whatever it is
        # prefilled beside (a padded batch), after (a prefix-cache restore) or in how many pieces, and in
        # the shapes decode steps write theirs (an agent's next step may reuse those from the prefix cache).
        inv = self.batch_invariant
        if inv:  # keys beyond a query's position are masked: whole blocks, same order
            end = min(-(-end // ATTN_BLOCK) * ATTN_BLOCK, self.max_length)
        self._ensure_capacity(end)
        positions = (self.lengths[:, None] + torch.arange(k)).to(self.device)  # [B, k]
        cos, sin = self._rope(positions)
        mask = None  # the single query of a plain step sees the whole (exactly sized) cache
        if not inv and (B > 1 or k > 1):
            mask = (torch.arange(end, device=self.device) <= positions[..., None])[:, None]  # [B, 1, k, end]
        x = F.embedding(new_ids, self.embed)  # [B, k, D]
        with sdpa_kernel(GPU_ATTENTION) if self.device.type == "cuda" else contextlib.nullcontext():
            x = self._layers(x, positions, cos, sin, mask, end, inv)
        self.lengths = self.lengths + k
        if not logits:
            return None
        return self._linear(self._rms(x, self.final_norm, inv), self.lm_head, None, inv).float()  # [B, k, V]

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, end: int, inv: bool) -> torch.Tensor:
        """x [B, k, D] through every layer, each writing its k new K/V positions into the cache."""
        B, k = positions.shape
        H, Hkv, d = self.n_heads, self.n_kv, self.head_dim
        rows = torch.arange(B, device=self.device)[:, None]  # [B, 1]
        for i, layer in enumerate(self.layers):
            h = self._rms(x, layer.norm1, inv)
            q, kk, v = self._linear(h, layer.wqkv, layer.bqkv, inv).split([H * d, Hkv * d, Hkv * d], dim=-1)
            q = self._rotate(q.view(B, k, H, d).transpose(1, 2), cos, sin)  # [B, H, k, d]
            kk = self._rotate(kk.view(B, k, Hkv, d).transpose(1, 2), cos, sin)  # [B, Hkv, k, d]
            self.k_cache[i][rows, :, positions] = kk.transpose(1, 2)  # index -> [B, k, Hkv, d]
            self.v_cache[i][rows, :, positions] = v.view(B, k, Hkv, d)
            keys, values = self.k_cache[i, :B, :, :end], self.v_cache[i, :B, :, :end]  # [B, Hkv, end, d]
            if inv:
                attn = _causal_spans(q, keys, values, positions)
            else:
                attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=H != Hkv)
            x = x + self._linear(attn.view(B, H, k, d).transpose(1, 2).reshape(B, k, H * d), layer.wo, None, inv)
            gate, up = self._linear(self._rms(x, layer.norm2, inv), layer.w_gate_up, None, inv).chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, layer.w_down, None, inv)
        return x


def _causal_spans(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`_invariant_attention` over spans of PREFILL_SPAN queries, each over the key blocks up to its last
    query. The same bits as one call over all keys (blocks beyond a query add exact zeros, in block
    order), at about half the work of a long prefill (the causal triangle, not the square) and one
    span's memory. Shapes as `_invariant_attention`."""
    k = q.shape[2]
    if k <= PREFILL_SPAN:
        return _invariant_attention(q, keys, values, positions)
    out = []
    for s in range(0, k, PREFILL_SPAN):
        span = positions[:, s : s + PREFILL_SPAN]  # [B, <= PREFILL_SPAN]
        end = min(-(-(int(span.max()) + 1) // ATTN_BLOCK) * ATTN_BLOCK, keys.shape[2])
        out.append(_invariant_attention(q[:, :, s : s + PREFILL_SPAN], keys[:, :, :end], values[:, :, :end], span))
    return torch.cat(out, 2)


def _invariant_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         positions: torch.Tensor) -> torch.Tensor:
    """Causal attention whose result for a query does not depend on how many queries share the call,
    nor on how many key blocks the call spans.

    q [B, H, k, d], keys / values [B, Hkv, end, d] (end: whole ATTN_BLOCKs), positions [B, k] -> [B, H, k, d].
    In float32, per KV head: the queries (G = H / Hkv heads each) are cut into chunks of exactly
    INVARIANT_ROWS (zero-padded) and the keys into blocks of exactly ATTN_BLOCK, so every q·Kᵀ and P·V
    matmul has one shape whatever k and end are, and the library picks one kernel for it. The softmax
    subtracts the max over all allowed keys (a max is exact in any order), sums each block on its own,
    and adds the blocks' sums and P·V products in block order (a cumulative sum: one sequential
    reduction whatever the number of blocks): a block beyond a query's position adds exact zeros, so
    a query alone (end = its own block) and inside a wider call (one more block) get the same bits.
    The element-wise softmax skips the pad queries of a single chunk (whole rows of ATTN_BLOCK keys, so
    every real row meets the same vector code), and the P·V matmul gets them back as zero rows. (A
    softmax and P·V over all `end` keys at once was invariant on an AMD EPYC but not on an Intel Xeon
    with AMX, where the kernels for 512 and 1024 keys summed in different orders.)"""
    B, H, k, d = q.shape
    R, A = INVARIANT_ROWS, ATTN_BLOCK
    if keys.shape[2] % A:  # a model whose context is not whole blocks: zero keys, masked below
        keys, values = (F.pad(t, (0, 0, 0, -t.shape[2] % A)) for t in (keys, values))
    Hkv, end = keys.shape[1], keys.shape[2]
    G, pad, blocks = H // Hkv, -k % R, end // A
    chunks = (k + pad) // R
    qg = q.float().view(B, Hkv, G, k, d).transpose(2, 3)  # [B, Hkv, k, G, d]
    qg = F.pad(qg, (0, 0, 0, 0, 0, pad)).reshape(B, Hkv, chunks, 1, R * G, d)
    kb = keys.float().contiguous().view(B, Hkv, 1, blocks, A, d)  # one memory layout, whatever the cache's
    scores = (_per_chunk(qg, kb.transpose(-1, -2)) * d ** -0.5).view(B, Hkv, chunks, blocks, R, G, A)
    rows = k if chunks == 1 else R  # query rows the softmax computes per chunk
    scores = scores[:, :, :, :, :rows]
    padded = torch.cat([positions, positions[:, -1:].expand(B, pad)], 1)  # pad queries: any valid row
    allowed = torch.arange(end, device=q.device) <= padded[..., None]  # [B, k+pad, end]
    allowed = allowed.view(B, chunks, R, blocks, A).transpose(2, 3)[:, None, :, :, :rows, None]  # [B,1,c,n,r,1,A]
    scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.amax(dim=(3, 6), keepdim=True)  # [B, Hkv, chunks, 1, r, G, 1]
    probs = (scores - top).exp()  # masked keys: exact zeros
    sums = probs.sum(-1)  # [B, Hkv, chunks, blocks, r, G]
    probs = F.pad(probs, (0, 0, 0, 0, 0, R - rows))  # the pad rows back, as zeros: [.., blocks, R, G, A]
    parts = _per_chunk(probs.view(B, Hkv, chunks, blocks, R * G, A),
                       values.float().contiguous().view(B, Hkv, 1, blocks, A, d))
    total = sums.cumsum(3)[:, :, :, -1]  # in block order: [B, Hkv, c, r, G]
    weighted = parts.cumsum(3)[:, :, :, -1].view(B, Hkv, chunks, R, G, d)[:, :, :, :rows]  # [B, Hkv, c, r, G, d]
    out = (weighted / total[..., None]).reshape(B, Hkv, chunks * rows, G, d)[:, :, :k]  # [B, Hkv, k, G, d]
    return out.transpose(2, 3).reshape(B, H, k, d).to(q.dtype)


def _per_chunk(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x [B, Hkv, chunks, ...] @ y [B, Hkv, 1, ...], one matmul per query chunk: each is the very call a
    single chunk (a decode step) makes, on the same memory layout. (One broadcast matmul over all chunks
    copied y per chunk, into another layout than a single chunk's: slower, and another kernel path.)"""
    if x.shape[2] == 1:
        return x @ y
    return torch.cat([x[:, :, c : c + 1] @ y for c in range(x.shape[2])], 2)
