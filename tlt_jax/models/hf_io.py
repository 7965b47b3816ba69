"""Hugging Face checkpoints <-> our parameter layout (see `transformer.py`).

A checkpoint is a directory with `config.json` and `model.safetensors` (or shards listed
in `model.safetensors.index.json`), as `transformers` writes for LlamaForCausalLM and
Qwen2ForCausalLM. Weights are read straight from the safetensors files with numpy
(memory-mapped; no torch), so loading needs no accelerator and the caller places the
host arrays on its mesh (`transformer.shard_params`).

HF linear weights are [out, in]; ours are [in, ...out] with heads split out:
    q_proj.weight [H*Dh, D] -> wq [D, H, Dh]     o_proj.weight [D, H*Dh] -> wo [H, Dh, D]
    gate/up_proj.weight [F, D] -> [D, F]         down_proj.weight [D, F] -> [F, D]
    q_proj.bias [H*Dh] -> bq [H, Dh]             lm_head.weight [V, D] -> lm_head [D, V]
Both sides use the half-split ("rotate_half") RoPE layout, so no row permutation is needed.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import struct
import tempfile
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from tlt_jax import faults, sharding
from tlt_jax.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, RopeScaling, end_token_ids

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class _Family:
    architecture: str
    # transformers' class defaults, used when config.json omits the key.
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None


_FAMILIES = {
    "llama": _Family("LlamaForCausalLM", 2048, 1, 2),
    "qwen2": _Family("Qwen2ForCausalLM", 32768, None, None),
}
assert tuple(_FAMILIES) == SUPPORTED_MODEL_TYPES
_SUPPORTED = ", ".join(f"{f.architecture} (model_type {t!r})" for t, f in _FAMILIES.items())
_ROPE_TYPES = ("default", "llama3")

# safetensors dtype tags. safetensors' own numpy backend has no bfloat16, hence our reader.
_ST_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}


# ----------------------------------------------------------------------------- config


def config_from_hf(hf: Mapping[str, Any], dtype=None,
                   generation_config: Mapping[str, Any] | None = None) -> ModelConfig:
    """ModelConfig from a config.json dict (transformers 4 or 5 spelling).

    `dtype` (e.g. "bfloat16") overrides the checkpoint's dtype for both the stored
    parameters and the compute; by default both follow `dtype` / `torch_dtype`. The end
    tokens are config.json's `eos_token_id` (an id or a list) followed by those of
    `generation_config` (a generation_config.json dict) not already among them: chat
    models often list their end-of-turn tokens only there.
    """
    model_type = hf.get("model_type")
    if model_type not in _FAMILIES:
        raise ValueError(f"Unsupported model_type {model_type!r}; supported: {_SUPPORTED}.")
    family = _FAMILIES[model_type]
    for arch in hf.get("architectures") or [family.architecture]:
        if arch != family.architecture:
            raise ValueError(f"Unsupported architecture {arch!r} for model_type {model_type!r}; "
                             f"supported: {_SUPPORTED}.")
    _require(hf, "hidden_act", "silu", "silu")
    _require(hf, "mlp_bias", False, False)
    _require(hf, "partial_rotary_factor", 1.0, 1.0)
    if model_type == "qwen2" and any(t != "full_attention" for t in _qwen2_layer_types(hf)):
        raise ValueError("Sliding-window attention (qwen2 use_sliding_window / layer_types) is not "
                         "supported; every layer must be 'full_attention'.")

    num_heads = hf["num_attention_heads"]
    if dtype is None:
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    dtype = jnp.dtype(dtype).name
    eos = end_token_ids(hf.get("eos_token_id", family.eos_token_id))
    eos += end_token_ids((generation_config or {}).get("eos_token_id"))
    rope_theta, rope_scaling = _rope_from_hf(hf, family)
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", family.max_position_embeddings),
        param_dtype=dtype,
        dtype=dtype,
        bos_token_id=hf.get("bos_token_id", family.bos_token_id),
        eos_token_id=eos,
    )


def config_to_hf(config: ModelConfig) -> dict:
    """config.json dict in the transformers 5 spelling (`rope_parameters`, `dtype`)."""
    c = config
    if c.model_type == "qwen2" and not c.qkv_bias:
        raise ValueError("Qwen2ForCausalLM always has q/k/v biases; a qwen2 config needs qkv_bias=True "
                         "(use model_type 'llama' with attention_bias for a bias-free model).")
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": c.rope_theta, **dataclasses.asdict(c.rope_scaling)}
    hf = {
        "architectures": [_FAMILIES[c.model_type].architecture],
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_dropout": 0.0,
        "dtype": c.param_dtype,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": _hf_token_ids(c.eos_token_id),
        "use_cache": True,
    }
    if c.model_type == "llama":
        hf.update(attention_bias=c.qkv_bias, mlp_bias=False)
    else:
        hf.update(use_sliding_window=False, sliding_window=None,
                  layer_types=["full_attention"] * c.num_layers)
    return hf


def _hf_token_ids(ids):
    """An id, or a list of several, as transformers writes them."""
    return list(ids) if isinstance(ids, tuple) else ids


def _require(hf, key, allowed, default):
    if hf.get(key, default) != allowed:
        raise ValueError(f"Unsupported {key}={hf[key]!r} in config.json; this model supports only "
                         f"{allowed!r}.")


def _qwen2_layer_types(hf):
    if hf.get("layer_types"):
        return hf["layer_types"]
    if not hf.get("use_sliding_window", False) or hf.get("sliding_window") is None:
        return ["full_attention"] * hf["num_hidden_layers"]
    return ["sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
            for i in range(hf["num_hidden_layers"])]


def _rope_from_hf(hf, family):
    """(rope_theta, RopeScaling | None) from `rope_parameters` (transformers 5) or
    top-level `rope_theta` + `rope_scaling` (transformers 4)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError("Per-layer-type rope_parameters are not supported; give one global RoPE.")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"Unsupported rope_type {rope_type!r}; supported: {', '.join(_ROPE_TYPES)}.")
    if rope_type == "default":
        return theta, None
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params.get(
            "original_max_position_embeddings",
            hf.get("max_position_embeddings", family.max_position_embeddings))))


# ----------------------------------------------------------------------------- tensor map


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One HF tensor: its name, HF shape, where it lives in our tree and how it maps."""

    hf_name: str
    hf_shape: tuple[int, ...]
    path: tuple[str, ...]         # key path in our params
    layer: int | None             # index on the stacked layer axis, None for unstacked
    shape: tuple[int, ...]        # our shape (per layer)
    transpose: bool               # HF linear weights are [out, in]

    def to_ours(self, a: np.ndarray) -> np.ndarray:
        return (a.T if self.transpose else a).reshape(self.shape)

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        if self.transpose:
            return np.ascontiguousarray(a.reshape(self.hf_shape[::-1]).T)
        return np.ascontiguousarray(a.reshape(self.hf_shape))


def _tensor_map(c: ModelConfig) -> list[_Tensor]:
    """Every HF tensor of the model, in transformers' order."""
    d, f, h, k, dh, v = (c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
                         c.head_dim, c.vocab_size)
    per_layer = [  # (our name, HF suffix, HF shape, our shape, transpose)
        ("attn_norm", "input_layernorm.weight", (d,), (d,), False),
        ("wq", "self_attn.q_proj.weight", (h * dh, d), (d, h, dh), True),
        ("wk", "self_attn.k_proj.weight", (k * dh, d), (d, k, dh), True),
        ("wv", "self_attn.v_proj.weight", (k * dh, d), (d, k, dh), True),
        ("wo", "self_attn.o_proj.weight", (d, h * dh), (h, dh, d), True),
        ("mlp_norm", "post_attention_layernorm.weight", (d,), (d,), False),
        ("w_gate", "mlp.gate_proj.weight", (f, d), (d, f), True),
        ("w_up", "mlp.up_proj.weight", (f, d), (d, f), True),
        ("w_down", "mlp.down_proj.weight", (d, f), (f, d), True),
    ]
    if c.qkv_bias:
        per_layer += [("bq", "self_attn.q_proj.bias", (h * dh,), (h, dh), False),
                      ("bk", "self_attn.k_proj.bias", (k * dh,), (k, dh), False),
                      ("bv", "self_attn.v_proj.bias", (k * dh,), (k, dh), False)]
    out = [_Tensor("model.embed_tokens.weight", (v, d), ("embed",), None, (v, d), False)]
    for i in range(c.num_layers):
        out += [_Tensor(f"model.layers.{i}.{suffix}", hf_shape, ("layers", name), i, shape, t)
                for name, suffix, hf_shape, shape, t in per_layer]
    out.append(_Tensor("model.norm.weight", (d,), ("final_norm",), None, (d,), False))
    if not c.tie_embeddings:
        out.append(_Tensor("lm_head.weight", (v, d), ("lm_head",), None, (d, v), True))
    return out


def _zero_o_bias_names(c: ModelConfig) -> list[str]:
    """Llama's attention_bias also adds an o_proj bias, which our model lacks: it is
    written as zeros and must be zero on load."""
    if c.model_type == "llama" and c.qkv_bias:
        return [f"model.layers.{i}.self_attn.o_proj.bias" for i in range(c.num_layers)]
    return []


# ----------------------------------------------------------------------------- load


def load_hf(path: str | os.PathLike, dtype=None) -> tuple[ModelConfig, dict]:
    """Loads a Llama / Qwen2 checkpoint directory.

    Returns (config, params): params in our layout as host numpy arrays (bfloat16 via
    ml_dtypes) of `config.param_dtype`, i.e. `dtype` when given, else the checkpoint's
    dtype. Place them on devices with `jax.device_put` / `transformer.shard_params`.
    The end tokens are those of config.json and, when present, generation_config.json.
    """
    path = os.fspath(path)
    hf, generation_config = _read_configs(path)
    tensors = _read_weights(path)
    if dtype is None and not (hf.get("dtype") or hf.get("torch_dtype")):
        embed = tensors.get("model.embed_tokens.weight")  # config.json silent: the weights decide
        dtype = None if embed is None else embed.dtype
    config = config_from_hf(hf, dtype=dtype, generation_config=generation_config)
    return config, _params_from_tensors(config, tensors, path)


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a checkpoint directory without reading its weights (a launcher's
    check before a run: an unsupported model type fails here, naming the supported ones).
    The dtype is config.json's, float32 when it names none."""
    hf, generation_config = _read_configs(os.fspath(path))
    return config_from_hf(hf, generation_config=generation_config)


def _read_configs(path: str) -> tuple[dict, dict | None]:
    """config.json and, when present, generation_config.json of a checkpoint directory."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Checkpoint directory {path!r} does not exist.")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path!r} is not a Hugging Face checkpoint: no {CONFIG_FILE}.")
    with open(config_path) as fh:
        hf = json.load(fh)
    generation_config = None
    if os.path.isfile(os.path.join(path, GENERATION_CONFIG_FILE)):
        with open(os.path.join(path, GENERATION_CONFIG_FILE)) as fh:
            generation_config = json.load(fh)
    return hf, generation_config


def _params_from_tensors(c: ModelConfig, tensors: Mapping[str, np.ndarray], path: str) -> dict:
    np_dtype = np.dtype(c.jnp_param_dtype)
    expected = _tensor_map(c)
    missing = [t.hf_name for t in expected if t.hf_name not in tensors]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"Checkpoint {path!r} lacks tensor(s) {', '.join(missing[:5])}{more} "
                         f"(config: model_type={c.model_type}, qkv_bias={c.qkv_bias}, "
                         f"tie_word_embeddings={c.tie_embeddings}).")
    zero_biases = _zero_o_bias_names(c)
    for name in zero_biases:
        if name in tensors and np.any(np.asarray(tensors[name], np.float32) != 0):
            raise ValueError(f"Tensor {name} is non-zero, but this model has no attention output "
                             "bias (only q/k/v biases); it cannot be loaded without changing outputs.")
    ignorable = set(zero_biases) | {"lm_head.weight"}  # a tied checkpoint may still store the head
    known = {t.hf_name for t in expected}
    unexpected = sorted(n for n in tensors if n not in known and n not in ignorable
                        and not n.endswith("rotary_emb.inv_freq"))  # derived, in old checkpoints
    if unexpected:
        raise ValueError(f"Checkpoint {path!r} has tensor(s) this {c.model_type} model has no place for: "
                         f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}.")

    params: dict = {"layers": {}}
    for t in expected:
        a = tensors[t.hf_name]
        if tuple(a.shape) != t.hf_shape:
            raise ValueError(f"Tensor {t.hf_name}: expected shape {t.hf_shape}, found {tuple(a.shape)}.")
        value = np.array(t.to_ours(a), dtype=np_dtype, order="C")  # a copy: files may be replaced
        if t.layer is None:
            _set(params, t.path, value)
        else:
            group, name = t.path
            if name not in params[group]:
                params[group][name] = np.empty((c.num_layers,) + t.shape, np_dtype)
            params[group][name][t.layer] = value
    return params


def _set(tree, path, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _read_weights(path: str) -> dict[str, np.ndarray]:
    single, index = os.path.join(path, WEIGHTS_FILE), os.path.join(path, INDEX_FILE)
    if os.path.isfile(single):
        return read_safetensors(single)
    if os.path.isfile(index):
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise FileNotFoundError(f"{INDEX_FILE} in {path!r} names shard {shard!r}, which is missing.")
            tensors.update(read_safetensors(shard_path))
        return tensors
    found = sorted(os.listdir(path))
    raise FileNotFoundError(f"{path!r} has no {WEIGHTS_FILE} or {INDEX_FILE} (found: {found}); only "
                            "safetensors checkpoints are supported.")


def read_safetensors(filename: str) -> dict[str, np.ndarray]:
    """Memory-mapped, read-only numpy views of every tensor in a .safetensors file.

    The format is an 8-byte little-endian header size, a JSON header of
    {name: {dtype, shape, data_offsets}}, then the raw little-endian data.
    """
    size = os.path.getsize(filename)
    with open(filename, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > size - 8:
            raise ValueError(f"{filename!r} is not a safetensors file (header size {n} > file size).")
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    data = np.zeros(0, np.uint8)  # np.memmap refuses an empty region
    if size > 8 + n:
        data = np.memmap(filename, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"Tensor {name} in {filename!r} has unsupported dtype {info['dtype']}.")
        start, end = info["data_offsets"]
        dt = _ST_DTYPES[info["dtype"]]
        if end > data.size or end - start != math.prod(info["shape"]) * dt.itemsize:
            raise ValueError(f"Tensor {name} in {filename!r}: data offsets {start}..{end} do not fit "
                             f"shape {info['shape']} {info['dtype']} (file truncated?).")
        out[name] = data[start:end].view(dt).reshape(info["shape"])
    return out


# ----------------------------------------------------------------------------- save


def save_hf(path: str | os.PathLike, config: ModelConfig, params: Mapping,
            max_shard_bytes: int | None = None, *, tokenizer=None, overwrite: bool = False) -> None:
    """Writes a checkpoint directory that `transformers.AutoModelForCausalLM` loads.

    Tensors are stored in `config.param_dtype`. With `max_shard_bytes`, weights are split
    into `model-0000i-of-0000n.safetensors` shards plus an index (a tensor larger than
    the limit gets a shard of its own). `tokenizer` (anything with `save_pretrained`)
    is written alongside. Everything is written to a hidden temporary directory next
    to `path` and renamed into place, so `path` is either absent, the old checkpoint,
    or the complete new one. Collective under multi-host: every process must call it
    (sharded params are gathered); process 0 writes.
    """
    path = os.fspath(path)
    hf_config = config_to_hf(config)
    np_dtype = np.dtype(config.jnp_param_dtype)
    tensors = _tensor_map(config)
    _check_param_shapes(config, params, tensors)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path!r} exists; pass overwrite=True to replace it.")
    host = jax.tree.map(sharding.to_host, dict(params))
    if jax.process_index() == 0:
        _write_checkpoint(path, hf_config, config, host, tensors, np_dtype, max_shard_bytes, tokenizer)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(f"save_hf:{path}")


def _check_param_shapes(c, params, tensors):
    expected = {t.path: ((c.num_layers,) if t.layer is not None else ()) + t.shape for t in tensors}
    found = dict(_flatten(params))
    for path, shape in expected.items():
        if path not in found:
            raise ValueError(f"params lack {'/'.join(path)} (expected shape {shape}).")
        if tuple(found[path].shape) != shape:
            raise ValueError(f"params {'/'.join(path)}: expected shape {shape}, "
                             f"found {tuple(found[path].shape)}.")
    unexpected = sorted("/".join(p) for p in found if p not in expected)
    if unexpected:
        raise ValueError(f"params {', '.join(unexpected)} have no place in a checkpoint of this config "
                         f"(qkv_bias={c.qkv_bias}, tie_embeddings={c.tie_embeddings}).")


def _flatten(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _write_checkpoint(path, hf_config, config, host, tensors, np_dtype, max_shard_bytes, tokenizer):
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        _write_json(os.path.join(tmp, CONFIG_FILE), hf_config)
        if config.bos_token_id is not None or config.eos_token_id is not None:
            _write_json(os.path.join(tmp, GENERATION_CONFIG_FILE),
                        {"bos_token_id": config.bos_token_id, "eos_token_id": _hf_token_ids(config.eos_token_id)})

        def producer(t: _Tensor) -> Callable[[], np.ndarray]:
            def make():
                value = host[t.path[0]] if len(t.path) == 1 else host[t.path[0]][t.path[1]][t.layer]
                return t.to_hf(np.asarray(value).astype(np_dtype))
            return make

        entries = [(t.hf_name, math.prod(t.hf_shape) * np_dtype.itemsize, producer(t)) for t in tensors]
        entries += [(n, config.hidden_size * np_dtype.itemsize,
                     lambda: np.zeros((config.hidden_size,), np_dtype)) for n in _zero_o_bias_names(config)]
        _write_shards(tmp, entries, max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _fsync_dir(tmp)
        faults.maybe_kill("hf_export")
        _swap_into_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_into_place(tmp, path):
    """Renames the finished directory tmp to path; an existing path is moved aside first
    and restored if the rename fails."""
    parent, name = os.path.split(path)
    if not os.path.exists(path):
        os.rename(tmp, path)
        _fsync_dir(parent)
        return
    old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
    os.rename(path, os.path.join(old, name))
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(os.path.join(old, name), path)
        raise
    finally:
        _fsync_dir(parent)
    shutil.rmtree(old)


def _write_shards(directory, entries, max_shard_bytes):
    """entries: (hf_name, nbytes, make_array) in file order; each shard is materialised
    only while it is written."""
    shards, current, current_bytes = [], [], 0
    for entry in entries:
        if current and max_shard_bytes is not None and current_bytes + entry[1] > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(entry)
        current_bytes += entry[1]
    shards.append(current)

    if len(shards) == 1:
        names = [WEIGHTS_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for filename, shard in zip(names, shards):
        target = os.path.join(directory, filename)
        save_file({n: make() for n, _, make in shard}, target, metadata={"format": "pt"})
        _fsync_file(target)
    if len(shards) > 1:
        _write_json(os.path.join(directory, INDEX_FILE), {
            "metadata": {"total_size": sum(e[1] for e in entries)},
            "weight_map": {n: filename for filename, shard in zip(names, shards) for n, _, _ in shard},
        })


def _write_json(filename, obj):
    with open(filename, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_file(filename):
    fd = os.open(filename, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory):
    _fsync_file(directory)
