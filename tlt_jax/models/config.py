"""Model configuration: one frozen, hashable dataclass shared by every entry point.

Hashable so that it can be a static argument of `jax.jit`; built from an
ml_collections ConfigDict (`from_config_dict`) or from a Hugging Face config.json
(`tlt_jax.models.hf_io`).
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Iterable, Mapping

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency-dependent RoPE scaling (`rope_type: llama3` in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-3 / Qwen2 family decoder.

    `param_dtype` is the storage dtype of the weights, `dtype` the compute dtype of
    activations; attention softmax and norms always accumulate in float32.

    `eos_token_id` is spelt as in a Hugging Face config.json: None, one id, or several
    (chat models end a turn on more than one token, e.g. Qwen2.5-Instruct's <|im_end|>
    and <|endoftext|>). Any int, sequence or None given is stored in one canonical form,
    so equal sets of end tokens compare and hash equal: None when there are none, an int
    when there is one, else a tuple of distinct ids in their order. Code that needs
    every end token reads `end_token_ids`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "llama"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    param_dtype: str = "float32"
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        ids = end_token_ids(self.eos_token_id)
        object.__setattr__(self, "eos_token_id", None if not ids else ids[0] if len(ids) == 1 else ids)
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"Unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} "
                "(grouped-query attention shares each KV head among a whole group of query heads).")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose one of {sorted(_DTYPES)}.")

    @property
    def end_token_ids(self) -> tuple[int, ...]:
        """Every token that ends a sequence, in the checkpoint's order (empty: none)."""
        return end_token_ids(self.eos_token_id)

    @property
    def jnp_param_dtype(self):
        return _DTYPES[self.param_dtype]

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    def num_params(self) -> int:
        d, f, l = self.hidden_size, self.intermediate_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
        if self.qkv_bias:
            per_layer += q + 2 * kv
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + l * per_layer + d + head

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def end_token_ids(eos_token_id) -> tuple[int, ...]:
    """None, an int or a sequence of ints (a config.json / generation_config.json
    `eos_token_id`) as a tuple of distinct ints in their first order."""
    if eos_token_id is None:
        return ()
    ids = (eos_token_id,) if isinstance(eos_token_id, (numbers.Integral, str)) else eos_token_id
    ids = tuple(ids) if isinstance(ids, Iterable) else (ids,)
    if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id must be None, a token id or a sequence of token ids (non-negative "
                         f"ints); got {eos_token_id!r}.")
    return tuple(dict.fromkeys(int(i) for i in ids))


def from_config_dict(cfg: Mapping[str, Any]) -> ModelConfig:
    """Builds a ModelConfig from an ml_collections ConfigDict (or a plain mapping, e.g.
    read from JSON: `eos_token_id` may be a list)."""
    fields = dict(cfg)
    scaling = fields.get("rope_scaling")
    if scaling:
        fields["rope_scaling"] = RopeScaling(**dict(scaling))
    else:
        fields["rope_scaling"] = None
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"Unknown model config keys {unknown}; known keys: {sorted(known)}.")
    return ModelConfig(**fields)
