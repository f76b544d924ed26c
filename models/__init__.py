"""Llama-family model definitions: what a model is, nothing about serving it."""

from jkv_models.config import PRESETS, ModelConfig, RopeScaling, preset

__all__ = ["PRESETS", "ModelConfig", "RopeScaling", "preset"]
