"""A GGUF file read once: metadata, tokenizer description and tensors from one memory map.

Why not transformers' `from_pretrained(gguf_file=...)`: for Llama-family files it parses the metadata
with `gguf.GGUFReader` once for the config, again for the tokenizer's config and again for the weights
(~7 s per parse of a 49k-token vocabulary here), ~30 s for a 135M model. This reader walks the header
with `struct` (string arrays included, ~0.3 s), maps the tensor data with numpy and dequantizes with the
`gguf` package, as transformers does, so the weights are bit-equal to its load (tested).

Architectures handled: llama (and mistral, which llama.cpp files as llama), qwen2. Others: `supported`
says no and the caller falls back to transformers' reader. `checkpoint.py` turns what this reads into a
cached Hugging Face directory.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass

import numpy as np

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

# GGUF architecture -> the model_type transformers gives it (mistral is decided by the file's name)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

# transformers' GGUF_CONFIG_MAPPING for these architectures: {arch}.KEY -> config field
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_NO_HEAD_DIM = {"qwen2"}  # transformers ignores rope.dimension_count for these
_TOKEN_IDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
              "unknown_token_id": "unk_token_id", "padding_token_id": "pad_token_id"}

# GGUF tensor name (layer part as N) -> transformers state-dict name
_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.N.attn_norm.weight": "model.layers.N.input_layernorm.weight",
    "blk.N.ffn_norm.weight": "model.layers.N.post_attention_layernorm.weight",
    "blk.N.attn_q.weight": "model.layers.N.self_attn.q_proj.weight",
    "blk.N.attn_k.weight": "model.layers.N.self_attn.k_proj.weight",
    "blk.N.attn_v.weight": "model.layers.N.self_attn.v_proj.weight",
    "blk.N.attn_q.bias": "model.layers.N.self_attn.q_proj.bias",
    "blk.N.attn_k.bias": "model.layers.N.self_attn.k_proj.bias",
    "blk.N.attn_v.bias": "model.layers.N.self_attn.v_proj.bias",
    "blk.N.attn_output.weight": "model.layers.N.self_attn.o_proj.weight",
    "blk.N.ffn_gate.weight": "model.layers.N.mlp.gate_proj.weight",
    "blk.N.ffn_up.weight": "model.layers.N.mlp.up_proj.weight",
    "blk.N.ffn_down.weight": "model.layers.N.mlp.down_proj.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: fastest-moving first
    ggml_type: int
    offset: int  # from the start of the data section


class GGUFFile:
    """A GGUF file's metadata (a dict; arrays as lists) and its tensors, read lazily from a memory map."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._read(4) != b"GGUF":
            raise ValueError(f"bad magic: {path}")
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported: {path}")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"))
        self.tensors: dict[str, TensorInfo] = {}
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
            self.tensors[name] = TensorInfo(name, dims, self._scalar("<I"), self._scalar("<Q"))
        align = int(self.metadata.get("general.alignment", 32))
        self._data = (self._pos + align - 1) // align * align

    # --- header parsing ----------------------------------------------------------------------
    def _read(self, n: int) -> bytes:
        out = self._map[self._pos:self._pos + n]
        self._pos += n
        return out

    def _scalar(self, fmt: str):
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        return self._read(self._scalar("<Q")).decode("utf-8", errors="replace")

    def _value(self, vtype: int):
        if vtype in _SCALAR:
            return self._scalar(_SCALAR[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}: {self.path}")
        item, count = self._scalar("<I"), self._scalar("<Q")
        if item in _NUMPY:  # one numpy read for a numeric array
            values = np.frombuffer(self._map, dtype=_NUMPY[item], count=count, offset=self._pos)
            self._pos += values.nbytes
            return values.tolist()
        if item == _STRING:
            return self._strings(count)
        return [self._value(item) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """`count` length-prefixed strings (vocabularies, merges): the hot loop of the header."""
        buf, pos, unpack, out = self._map, self._pos, struct.Struct("<Q").unpack_from, []
        append = out.append
        for _ in range(count):
            (n,) = unpack(buf, pos)
            append(buf[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
        self._pos = pos
        return out

    # --- what the file describes -------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def model_type(self) -> str | None:
        """The transformers model type this reader converts the file to, or None when it cannot."""
        model_type = ARCHITECTURES.get(self.architecture)
        if model_type == "llama" and "mistral" in str(self.metadata.get("general.name", "")):
            model_type = "mistral"  # transformers' rule, from the file's name
        return model_type

    @property
    def supported(self) -> bool:
        return self.model_type is not None and all(_hf_name(name) is not None for name in self.tensors)

    def config(self) -> dict:
        """The transformers config dict (what `AutoConfig.from_pretrained(gguf_file=...)` builds)."""
        arch, meta = self.architecture, self.metadata
        config: dict = {"model_type": self.model_type,
                        "tie_word_embeddings": "output.weight" not in self.tensors}
        for key, field in _CONFIG_KEYS.items():
            if f"{arch}.{key}" in meta and not (field == "head_dim" and arch in _NO_HEAD_DIM):
                config[field] = meta[f"{arch}.{key}"]
        for key, field in _TOKEN_IDS.items():
            if f"tokenizer.ggml.{key}" in meta:
                config[field] = meta[f"tokenizer.ggml.{key}"]
        if "general.name" in meta:
            config["_model_name_or_path"] = meta["general.name"]
        if "vocab_size" not in config and "tokenizer.ggml.tokens" in meta:
            config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
        return config

    def tokenizer_description(self) -> tuple[dict, dict]:
        """(tokenizer_dict, tokenizer_config) in the shape transformers' `convert_gguf_tokenizer` and
        the tokenizer class take (what its `get_gguf_tokenizer` returns, from this one read)."""
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, _SPECIAL_TOKENS

        meta = self.metadata
        grouped = {group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items()
                           if f"tokenizer.{key}" in meta}
                   for group, renames in GGUF_TOKENIZER_MAPPING.items()}
        tokenizer, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
        if tokenizer.get("tokenizer_type") == "llama":
            tokenizer_config.setdefault("add_bos_token", True)
        elif tokenizer.get("tokenizer_type") == "gemma4":
            tokenizer_config["add_bos_token"] = False
        for name, key in _SPECIAL_TOKENS.items():
            token_id = meta.get(f"tokenizer.ggml.{key}")
            tokenizer_config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
        return tokenizer, tokenizer_config

    def tensor(self, name: str) -> np.ndarray:
        """One tensor as float32 in torch order (dequantized; Llama q/k rows un-permuted as transformers does)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
        rows = tuple(reversed(info.dims[1:]))
        row_bytes = info.dims[0] // block * type_size
        raw = np.frombuffer(self._map, dtype=np.uint8, count=int(np.prod(rows, dtype=np.int64)) * row_bytes,
                            offset=self._data + info.offset).reshape(*rows, row_bytes)
        weights = dequantize(raw, qtype)
        if self.architecture == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = self.metadata["llama.attention.head_count" if ".attn_q." in name else "llama.attention.head_count_kv"]
            weights = _unpermute(weights, int(heads))
        return weights

    def state_dict(self):
        """Every tensor under its transformers name, as float32 torch tensors (tied output left out)."""
        import torch

        return {_hf_name(name): torch.from_numpy(np.copy(self.tensor(name))) for name in self.tensors}

    def close(self) -> None:
        self._map.close()


def header_ints(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """Integer values `{arch}.{name}` from the GGUF header (absent or unreadable: left out). Reads key by
    key and stops once all are found, usually before the tokenizer arrays (gguf.GGUFReader parses them
    all: seconds per file)."""
    import struct

    def read(f, fmt):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, f.read(size))[0]

    def string(f):
        n = read(f, "<Q")
        if n > 1 << 20:  # no key or architecture name is that long: a corrupt header
            raise ValueError(f"GGUF string of {n} bytes")
        return f.read(n).decode("utf-8", "replace")

    def skip(f, vtype):
        if vtype in _SCALAR:
            f.seek(struct.calcsize(_SCALAR[vtype]), 1)
        elif vtype == 8:
            f.seek(read(f, "<Q"), 1)
        elif vtype == 9:
            item, count = read(f, "<I"), read(f, "<Q")
            if item in _SCALAR:
                f.seek(count * struct.calcsize(_SCALAR[item]), 1)
            else:
                for _ in range(count):
                    skip(f, item)
        else:
            raise ValueError(f"unknown GGUF value type {vtype}")

    found: dict[str, int] = {}
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF" or read(f, "<I") < 2:
                return found
            read(f, "<Q")  # tensor count
            arch = None
            for _ in range(read(f, "<Q")):
                key, vtype = string(f), read(f, "<I")
                name = key[len(arch) + 1:] if arch is not None and key.startswith(arch + ".") else None
                if key == "general.architecture" and vtype == 8:
                    arch = string(f)
                elif name in names and vtype in _SCALAR:
                    found[name] = int(read(f, _SCALAR[vtype]))
                    if len(found) == len(names):
                        break
                else:
                    skip(f, vtype)
    except (OSError, ValueError, OverflowError, MemoryError, struct.error, UnicodeDecodeError):
        pass  # llama.cpp's own load then says what is wrong with the file
    return found


def _hf_name(gguf_name: str) -> str | None:
    match = _LAYER.match(gguf_name)
    key = _LAYER.sub("blk.N.", gguf_name) if match else gguf_name
    hf = _TENSORS.get(key)
    return hf.replace(".N.", f".{match.group(1)}.") if hf and match else hf


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of q/k rows for its rotary layout (transformers' `_reverse_permute_weights`)."""
    dim = weights.shape[0] // heads // 2
    return weights.reshape(heads, dim, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)
