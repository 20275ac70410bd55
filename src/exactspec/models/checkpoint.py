"""Where a model's files come from: a local Hugging Face directory as it is, or a GGUF converted ONCE
into a cached Hugging Face directory (config.json, model.safetensors, tokenizer files).

Why: a GGUF holds quantized blocks and a tokenizer description, not a tokenizer; building a torch model
and a fast tokenizer from it takes seconds even with a one-pass reader (models/gguf.py: ~3 s of
dequantizing here). The converted copy under `cache_dir("models", file_identity(path))` is a memory map
of float32 safetensors and a `tokenizer.json`, so every later start of the same file skips all of it;
a changed file has another identity and gets a new entry. Entries are written to a temporary folder and
renamed into place, so a crash or a concurrent start never leaves a half-written one.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

from .. import progress
from ..cachedir import cache_dir, file_identity
from ..errors import ExactSpecError
from . import light_llama
from .gguf import GGUFFile
from .light_tokenizer import matches_transformers

FORMAT = "2"  # bump when the converted layout or its checks change: older entries are then ignored
_DONE = "exactspec-converted.json"  # written last: an entry without it is incomplete
_READ_ERRORS = (ValueError, struct.error, IndexError, OverflowError, UnicodeDecodeError, OSError, KeyError)


def split_path(path: str) -> tuple[str, str | None]:
    """-> (directory, gguf file name or None). Raises ExactSpecError for paths that cannot be a model."""
    if not os.path.exists(path):
        raise ExactSpecError(f"model path not found: {path}")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ExactSpecError(f"not a model: {path} (expected a directory with config.json or a .gguf file)")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ExactSpecError(f"corrupt GGUF file (bad magic): {path}")
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ExactSpecError(f"not a model directory (no config.json): {path}")
    return path, None


def converted_dir(path: str) -> Path | None:
    """The Hugging Face directory holding this model: `path` itself for a directory; for a GGUF the
    cached conversion (made now if missing); None for a GGUF this reader cannot convert (the caller
    loads it through transformers' GGUF reader instead)."""
    split_path(path)
    if os.path.isdir(path):
        return Path(path)
    key = file_identity(path)
    if key not in _resolved:  # once per file and process: tokenizer and weights both ask, one status line
        _resolved[key] = _resolve(path, key)
    return _resolved[key]


_resolved: dict[str, Path | None] = {}  # file identity -> its cache entry, or None (not converted)


def _resolve(path: str, key: str) -> Path | None:
    name = os.path.basename(path)
    try:
        entry = cache_dir("models") / f"{key}-{FORMAT}"
    except OSError as e:
        return _uncached(name, f"no cache folder: {e}")
    if (entry / _DONE).exists():
        progress.status(f"loading {name} (cached)")
        return entry
    try:
        gguf = GGUFFile(path)
    except _READ_ERRORS as e:
        raise ExactSpecError(f"cannot load model from {path}: {type(e).__name__}: {str(e)[:200]}") from None
    try:
        if not gguf.supported:
            return _uncached(name, f"architecture {gguf.architecture!r} is not converted by exactspec")
        progress.status(f"loading {name} (converting once, a few seconds; cached in {entry.parent})")
        with progress.timed("convert"):
            _write_atomically(entry, lambda tmp: convert(gguf, tmp))
    except OSError as e:  # the cache cannot be written (disk full, read-only): load without it
        return _uncached(name, f"cannot write the cache: {e}")
    except _READ_ERRORS as e:
        raise ExactSpecError(f"cannot load model from {path}: {type(e).__name__}: {str(e)[:200]}") from None
    finally:
        gguf.close()
    return entry


def _uncached(name: str, why: str) -> None:
    progress.status(f"loading {name} through transformers' GGUF reader ({why}; slow, not cached)")
    return None


def _write_atomically(entry: Path, write) -> None:
    """`write(tmp)` into a fresh temporary folder beside `entry`, then rename it to `entry`."""
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        shutil.rmtree(entry, ignore_errors=True)  # an incomplete entry (no done marker) from a crash
        os.rename(tmp, entry)
    except OSError:
        if not (entry / _DONE).exists():  # another process finished first: theirs is as good
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert(gguf: GGUFFile, out: Path) -> None:
    """Write config, generation config, float32 weights and tokenizer of `gguf` as a Hugging Face
    directory in `out` (what transformers' GGUF load would build, tensor for tensor)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig
    from transformers.integrations.gguf import convert_gguf_tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    config = AutoConfig.for_model(**gguf.config())
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer_dict, tokenizer_config = gguf.tokenizer_description()
    backend, extra = convert_gguf_tokenizer(gguf.architecture, tokenizer_dict)
    TokenizersBackend(tokenizer_object=backend, **tokenizer_config, **extra).save_pretrained(out)
    weights = gguf.state_dict()
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    # the transformers-free loaders serve this entry only where they reproduce transformers exactly
    light_model = light_llama.can_load(config.to_dict()) and light_llama.rotary_matches_transformers(out)
    marker = {"source": os.path.abspath(gguf.path), "format": FORMAT,
              "light_tokenizer": matches_transformers(out), "light_model": light_model}
    (out / _DONE).write_text(json.dumps(marker))


def entry_info(entry: Path) -> dict:
    """What the conversion recorded about a cache entry (see `convert`)."""
    try:
        return json.loads((entry / _DONE).read_text())
    except (OSError, ValueError):
        return {}
