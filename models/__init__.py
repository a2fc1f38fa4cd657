"""Eager reference models: the oracle every nsa_compile rewrite is tested against."""

from .config import PRESETS, ModelConfig, preset
from .lm import TinyLM, build_model
from .nsa import DenseAttention, NSAAttention, check_positions, positions_from_cu_seqlens

__all__ = ["ModelConfig", "PRESETS", "preset", "TinyLM", "build_model", "NSAAttention", "DenseAttention",
           "positions_from_cu_seqlens", "check_positions"]
