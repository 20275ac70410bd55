"""A Llama-family checkpoint as a bare module tree for the lean forward (fast_llama.py), without transformers.

Why: importing transformers' model classes costs 2-4 s of a start that should take about three, and
`fast_llama.FastLlamaLM` reads only weights and a few config fields from the module it is given. This
module gives it exactly that: `nn.Module`s named as in transformers' state dict
(`model.layers.N.self_attn.q_proj.weight`, ...) holding the memory-mapped safetensors tensors (no
random init, no copy), a `config` read from config.json, and the rotary `inv_freq`. It runs no forward
of its own: `hf_module` builds the transformers module over the same tensors for code that needs one
(the Hugging Face generate anchors of the bench, the transformers adapter, tests).

Only used for a converted checkpoint whose conversion checked that its rotary frequencies equal
transformers' (`rotary_matches_transformers`, run once by checkpoint.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch


class Config(SimpleNamespace):
    """config.json's fields as attributes (what the lean forward and the adapters read)."""

    def __getattr__(self, name: str):  # absent optional fields read as None, as getattr(config, x, None) expects
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    def to_dict(self) -> dict:
        return dict(vars(self))


class LightCausalLM(torch.nn.Module):
    """transformers' module layout for a causal LM (weights only; see the module docstring)."""

    def __init__(self, directory: Path, state: dict[str, torch.Tensor]):
        super().__init__()
        self.directory = directory
        config = json.loads((directory / "config.json").read_text())
        self.config = Config(**config)
        generation = directory / "generation_config.json"
        self.generation_config = Config(**(json.loads(generation.read_text()) if generation.exists() else {}))
        for name, tensor in state.items():
            _place(self, name, torch.nn.Parameter(tensor, requires_grad=False))
        if "lm_head.weight" not in state:  # tied: the same tensor, as transformers ties it
            _place(self, "lm_head.weight", self.model.embed_tokens.weight)
        for module in self.modules():  # nn.Linear's contract: a weight has a bias, maybe None
            if "weight" in module._parameters and "bias" not in module._parameters:
                module.register_parameter("bias", None)
        rotary = torch.nn.Module()
        rotary.register_buffer("inv_freq", default_inv_freq(self.config), persistent=False)
        rotary.attention_scaling = 1.0
        self.model.rotary_emb = rotary


def _place(root: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    """Create the sub-modules on `name`'s dotted path (a numbered part makes its parent a ModuleList)."""
    *path, leaf = name.split(".")
    node = root
    for i, part in enumerate(path):
        numbered = i + 1 < len(path) and path[i + 1].isdigit()
        if part.isdigit():
            while len(node) <= int(part):
                node.append(torch.nn.Module())
            node = node[int(part)]
        else:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.ModuleList() if numbered else torch.nn.Module())
            node = getattr(node, part)
    node.register_parameter(leaf, param)


def default_inv_freq(config) -> torch.Tensor:
    """transformers' default rotary frequencies, computed the same way (bit for bit)."""
    rope = config.rope_parameters or {}
    base = rope.get("rope_theta", config.rope_theta)
    dim = config.head_dim or config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def can_load(config: dict) -> bool:
    """Whether a config is one this module reproduces: plain rotary, a model type the lean forward runs."""
    from .fast_llama import SUPPORTED

    rope = config.get("rope_parameters") or {}
    return (config.get("model_type") in SUPPORTED and rope.get("rope_type", "default") == "default"
            and rope.get("partial_rotary_factor") in (None, 1.0) and not config.get("rope_scaling"))


def rotary_matches_transformers(directory: Path) -> bool:
    """Whether transformers computes the same rotary frequencies for this checkpoint (checked once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    with torch.device("meta"):
        rotary_cls = type(AutoModelForCausalLM.from_config(config).model.rotary_emb)
    reference = rotary_cls(config=config)
    mine = default_inv_freq(Config(**json.loads((directory / "config.json").read_text())))
    return torch.equal(reference.inv_freq, mine) and float(reference.attention_scaling) == 1.0


def load_light(directory: Path) -> LightCausalLM:
    """The checkpoint's module over its memory-mapped weights (float32, as converted)."""
    from safetensors.torch import load_file

    return LightCausalLM(directory, load_file(str(directory / "model.safetensors"))).eval()


def hf_module(module: torch.nn.Module) -> torch.nn.Module:
    """A transformers module for `module`: itself if it is one, else one built over the same tensors."""
    if not isinstance(module, LightCausalLM):
        return module
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(module.directory), local_files_only=True)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=module.model.embed_tokens.weight.dtype)
    state = {name: p for name, p in module.state_dict().items()}
    hf.load_state_dict(state, strict=False, assign=True)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)  # its buffers are computed, not stored
    hf.tie_weights()
    return hf.to(module.model.embed_tokens.weight.device).eval()
