"""One configuration for the reference models, with the presets named in NSA_SEMANTICS.md."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ModelConfig", "PRESETS", "preset"]

COMPRESSIONS = ("mean", "mlp")
GATES = ("group", "head")
ROPES = ("half", "interleaved")
ATTENTIONS = ("nsa", "dense")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and variant of a TinyLM. Symbols follow NSA_SEMANTICS.md (l, d, l', n, w)."""

    vocab_size: int = 256
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12  # H
    n_kv_groups: int = 2  # G
    head_dim: int = 64  # D_k
    head_dim_v: int | None = None  # D_v; None means D_k
    cmp_block: int = 32  # l
    cmp_stride: int = 16  # d
    sel_block: int = 64  # l'
    n_selected: int = 16  # n
    window: int = 512  # w
    compression: str = "mean"  # 'mean' or 'mlp' (the paper's Eq. 7)
    gate: str = "group"  # 'group' (seed) or 'head' (paper)
    rope: str = "half"  # 'half' (rotate-half) or 'interleaved'
    rotary_dim: int | None = None  # None means the full D_k
    rope_base: float = 10000.0
    shared_kv: bool = False  # one k, v for all three branches
    mlp_ratio: int = 4
    attention: str = "nsa"  # 'nsa', or 'dense' for the dense twin (causal SDPA)

    def __post_init__(self) -> None:
        _check_choice("compression", self.compression, COMPRESSIONS)
        _check_choice("gate", self.gate, GATES)
        _check_choice("rope", self.rope, ROPES)
        _check_choice("attention", self.attention, ATTENTIONS)
        if self.n_heads % self.n_kv_groups:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_groups={self.n_kv_groups}")
        if self.cmp_block % self.cmp_stride or self.sel_block % self.cmp_stride:
            raise ValueError("the stride d must divide both l (cmp_block) and l' (sel_block)")
        if self.n_selected < 3:
            raise ValueError("n_selected must be >= 3 (block 0 and two local blocks are forced)")
        if self.rot_dim % 2 or self.rot_dim > self.head_dim:
            raise ValueError(f"rotary_dim={self.rot_dim} must be even and <= head_dim={self.head_dim}")

    @property
    def dim_v(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def rot_dim(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def group_size(self) -> int:  # h = H / G
        return self.n_heads // self.n_kv_groups

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _check_choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{field}={value!r} is not one of {', '.join(choices)}")


PRESETS: dict[str, ModelConfig] = {
    # The seed project's model.
    "seed": ModelConfig(),
    # Seconds on a CPU; keeps every NSA structure (h = 2, n*l' < S possible at S = 100).
    "tiny": ModelConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_groups=2, head_dim=16,
        cmp_block=8, cmp_stride=4, sel_block=16, n_selected=3, window=32,
    ),
    # The paper's kernel shape (64 query heads, 4 KV heads, head dim 128) with its variants.
    "paper": ModelConfig(
        dim=2048, n_layers=2, n_heads=64, n_kv_groups=4, head_dim=128,
        compression="mlp", gate="head",
    ),
}


def preset(name: str, **changes) -> ModelConfig:
    """The named preset ('tiny', 'seed', 'paper'; a '-dense' suffix gives the dense twin)."""
    base, _, suffix = name.partition("-")
    if base not in PRESETS or suffix not in ("", "dense"):
        valid = sorted(PRESETS) + sorted(f"{p}-dense" for p in PRESETS)
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(valid)}")
    config = PRESETS[base]
    if suffix == "dense":
        changes = {"attention": "dense", **changes}
    return config.replace(**changes) if changes else config
