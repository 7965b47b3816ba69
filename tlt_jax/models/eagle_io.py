"""Drafters in the EAGLE format that SGLang and vLLM load <-> our drafter (`drafter.py`).

What the engines compute, as their model definitions read (SGLang
`python/sglang/srt/models/llama_eagle.py` LlamaForCausalLMEagle and `qwen2_eagle.py`
Qwen2ForCausalLMEagle; vLLM `vllm/model_executor/models/llama_eagle.py`
EagleLlamaForCausalLM; all three adapted from SafeAILab/EAGLE `eagle/model/cnets.py`):

    u_t = fc(cat(embed(x_{t+1}), h_t))   h_t: the target's final-normed last hidden state (what
                                         its logits processor hands on); fc: Linear(2D -> D)
    y_t = decoder layer 0 on u            its input_layernorm replaced by an identity
    logits_t = lm_head(y_t)               the model returns hidden_states + residual: no final norm

embed_tokens and lm_head are the target's (SGLang `set_embed_and_head`; vLLM shares both), and
y_t is the next draft step's h. That is our drafter with `layout="eagle"` (one layer, no
feature fusion) exactly, and nothing else is: a "tlt" drafter normalises the layer input and
output, a fused (EAGLE-3) one reads three target layers. Those are refused, never written as
a file an engine would load and compute something else with.

A directory holds config.json (the target's, num_hidden_layers 1, architectures
LlamaForCausalLMEagle / Qwen2ForCausalLMEagle) and model.safetensors with

    fc.weight [D, 2D] = our fc.T          fc.bias [D] = 0: SGLang's fc has a bias (nn.Linear's
                                          default), left at its random init if not in the file;
                                          vLLM's has none and skips the name
    layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.post_attention_layernorm.weight,
    layers.0.mlp.{gate,up,down}_proj.weight (and q/k/v biases): `hf_io`'s layout

and no embedding, head or norms. Names carry no "model." prefix: both engines' load_weights
prepend it. vLLM reads the same weights under architectures ["LlamaForCausalLM"] (its
EAGLEConfig turns it into EagleLlamaForCausalLM; it would turn ours into an unknown
EagleLlamaForCausalLMEagle). The importer also reads the spellings of released drafters:
names with "model." (fastrl's, transformers' save_pretrained), the target's plain
architecture (vLLM's, fastrl's eagle-train), embed_tokens / lm_head / norm tensors in the file
(ignored: the engines ignore or replace them), fc.bias absent or zero.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import numpy as np

from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import hf_io
from tlt_jax.models.config import ModelConfig

# SGLang's class names, by model type; the importer also takes vLLM's.
ARCHITECTURES = {"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}
_READ_ARCHITECTURES = {**{a: t for t, a in ARCHITECTURES.items()}, "EagleLlamaForCausalLM": "llama"}
# The target's own class names, which vLLM's and fastrl's configs give (with fc.weight in the file).
_PLAIN_ARCHITECTURES = {f.architecture: t for t, f in hf_io._FAMILIES.items()}
_EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# Target fields a drafter does not depend on: depth, precision, the tied head (the target's
# own), context length and special tokens.
IGNORED_TARGET_FIELDS = ("num_layers", "param_dtype", "dtype", "tie_embeddings", "max_position_embeddings",
                         "bos_token_id", "eos_token_id")
_IGNORED_TENSORS = ("embed_tokens.weight", "lm_head.weight", "norm.weight", "layers.0.input_layernorm.weight")


def export_problem(drafter_config: drafter_lib.DrafterConfig, target_config: ModelConfig) -> str | None:
    """Why this drafter has no EAGLE-format equivalent, or None when it maps exactly."""
    if drafter_config.feature_layers:
        return (f"it fuses target layers {drafter_config.feature_layers} (EAGLE-3); SGLang's and vLLM's EAGLE "
                "drafters read the target's last hidden state alone")
    if drafter_config.layout != "eagle":
        return (f"its layout is {drafter_config.layout!r}: it normalises the fc output before attention "
                "(layers/attn_norm) and its output with the target's final norm, while the engines' EAGLE "
                "layer has no input_layernorm and their head reads its output unnormalised "
                "(train it with DrafterConfig(layout='eagle'))")
    if target_config.model_type == "qwen2" and not target_config.qkv_bias:
        return "its target is a qwen2 model without q/k/v biases, which Qwen2ForCausalLMEagle always has"
    return None


def save_eagle_drafter(path: str | os.PathLike, drafter_params, drafter_config: drafter_lib.DrafterConfig,
                       target_config: ModelConfig) -> None:
    """Writes the drafter (host arrays) as an EAGLE-format directory at `path`, replacing
    what is there (written beside it and renamed into place). Raises ValueError naming the
    difference when the drafter does not map exactly."""
    problem = export_problem(drafter_config, target_config)
    if problem:
        raise ValueError(f"This drafter cannot be written in the EAGLE format SGLang and vLLM load: {problem}.")
    drafter_lib.check_drafter_params(drafter_params, target_config, drafter_config)
    layer_config = drafter_config.layer_config(target_config)
    np_dtype = np.dtype(target_config.jnp_param_dtype)
    d = target_config.hidden_size
    entries = []  # (name, nbytes, make_array), as hf_io._write_shards takes them
    for t in _tensor_map(layer_config):
        value = np.asarray(drafter_params[t.path[0]] if t.layer is None else drafter_params["layers"][t.path[1]][0])
        entries.append((t.hf_name, value.size * np_dtype.itemsize, lambda t=t, v=value: t.to_hf(v.astype(np_dtype))))
    for name in ["fc.bias"] + [_engine_name(n) for n in hf_io._zero_o_bias_names(layer_config)]:
        entries.append((name, d * np_dtype.itemsize, lambda: np.zeros((d,), np_dtype)))

    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        hf_io._write_json(os.path.join(tmp, hf_io.CONFIG_FILE), _config_json(layer_config))
        hf_io._write_shards(tmp, entries, None)
        hf_io._fsync_dir(tmp)
        hf_io._swap_into_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_eagle_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory of an EAGLE drafter: config.json naming an EAGLE
    architecture, or the target's plain one with an `fc` among the weights."""
    path = os.fspath(path)
    config_path = os.path.join(path, hf_io.CONFIG_FILE)
    if not os.path.isfile(config_path):
        return False
    with open(config_path) as fh:
        architectures = json.load(fh).get("architectures") or []
    if any(a in _READ_ARCHITECTURES or a in _EAGLE3_ARCHITECTURES for a in architectures):
        return True
    if not any(a in _PLAIN_ARCHITECTURES for a in architectures):
        return False
    try:
        names = hf_io._read_weights(path)
    except FileNotFoundError:
        return False
    return any(_engine_name(n) == "fc.weight" for n in names)


def load_eagle_drafter(path: str | os.PathLike, target_config: ModelConfig | None = None):
    """(DrafterConfig(layout="eagle"), drafter params as host numpy arrays) of an EAGLE-format
    directory, in `target_config`'s parameter dtype (by default the checkpoint's own config).

    Raises ValueError when the checkpoint is not one our drafter computes exactly (an
    EAGLE-3 drafter, more than one layer, a non-zero fc or o_proj bias, unknown tensors) or
    was made for a target other than `target_config` (the differing fields named).
    """
    path = os.fspath(path)
    with open(os.path.join(path, hf_io.CONFIG_FILE)) as fh:
        hf = json.load(fh)
    architectures = hf.get("architectures") or []
    if any(a in _EAGLE3_ARCHITECTURES for a in architectures):
        raise ValueError(f"{path!r} is an EAGLE-3 drafter ({', '.join(architectures)}): it fuses three target "
                         "layers and drafts over a vocabulary of its own, which our drafter does not; only "
                         "EAGLE-1/2 drafters (LlamaForCausalLMEagle, Qwen2ForCausalLMEagle) are read.")
    model_type = next((_READ_ARCHITECTURES.get(a) or _PLAIN_ARCHITECTURES.get(a) for a in architectures
                       if a in _READ_ARCHITECTURES or a in _PLAIN_ARCHITECTURES), hf.get("model_type"))
    if hf.get("num_hidden_layers") != 1:
        raise ValueError(f"{path!r} has num_hidden_layers={hf.get('num_hidden_layers')}; our EAGLE-layout "
                         "drafter has one layer (the engines skip the input norm of layer 0 only).")
    own = hf_io.config_from_hf({**hf, "model_type": model_type, "architectures": None},  # checked above
                               dtype=None if target_config is None else target_config.param_dtype)
    target_config = target_config or own
    differ = config_differences(own, target_config, IGNORED_TARGET_FIELDS)
    if differ:
        raise ValueError(f"The EAGLE drafter at {path!r} was made for another target model ({'; '.join(differ)}).")

    config = drafter_lib.DrafterConfig(num_layers=1, layout="eagle")
    layer_config = config.layer_config(target_config)
    tensors = {_engine_name(n): a for n, a in hf_io._read_weights(path).items()}
    expected = {t.hf_name: t for t in _tensor_map(layer_config)}
    zero = {"fc.bias"} | {_engine_name(n) for n in hf_io._zero_o_bias_names(layer_config)}
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(n for n in tensors if n not in expected and n not in zero and n not in _IGNORED_TENSORS
                     and not n.endswith("rotary_emb.inv_freq"))
    if missing or unknown:
        raise ValueError(f"{path!r} is not an EAGLE drafter of this target: "
                         + "; ".join(f"{what} {', '.join(names)}" for what, names in
                                     (("missing", missing), ("no place for", unknown)) if names))
    for name in sorted(zero & set(tensors)):
        if np.any(np.asarray(tensors[name], np.float32) != 0):
            raise ValueError(f"{path!r}: {name} is non-zero, and our drafter has no such bias (neither have "
                             "vLLM's fc nor the target's o_proj); it cannot be read without changing outputs.")
    np_dtype = np.dtype(target_config.jnp_param_dtype)
    params = {"fc": None, "layers": {}}
    for name, t in expected.items():
        a = tensors[name]
        if tuple(a.shape) != t.hf_shape:
            raise ValueError(f"{path!r}: tensor {name} has shape {tuple(a.shape)}, expected {t.hf_shape}.")
        value = np.array(t.to_ours(a), dtype=np_dtype, order="C")
        if t.layer is None:
            params["fc"] = value
        else:
            params["layers"][t.path[1]] = value[None]
    drafter_lib.check_drafter_params(params, target_config, config)
    return config, params


def config_differences(got: ModelConfig, want: ModelConfig, ignore=()) -> list[str]:
    """'field: trained for X, given Y' for each ModelConfig field outside `ignore` that differs."""
    return [f"{f.name}: trained for {getattr(got, f.name)!r}, given {getattr(want, f.name)!r}"
            for f in dataclasses.fields(ModelConfig)
            if f.name not in ignore and getattr(got, f.name) != getattr(want, f.name)]


def _tensor_map(layer_config: ModelConfig) -> list[hf_io._Tensor]:
    """fc and layer 0's tensors in the engines' names (no attention input norm)."""
    d = layer_config.hidden_size
    out = [hf_io._Tensor("fc.weight", (d, 2 * d), ("fc",), None, (2 * d, d), True)]
    for t in hf_io._tensor_map(layer_config):
        if t.path[0] == "layers" and t.path[1] != "attn_norm":
            out.append(dataclasses.replace(t, hf_name=_engine_name(t.hf_name)))
    return out


def _engine_name(hf_name: str) -> str:
    """A tensor's name in the engines' files: transformers' without its "model." prefix
    (files that have it, fastrl's among them, read the same)."""
    return hf_name.removeprefix("model.")


def _config_json(layer_config: ModelConfig) -> dict:
    """The target's config.json with one layer, SGLang's architecture and, beside the
    transformers-5 rope_parameters / dtype, their transformers-4 spellings (engines pinned
    to transformers 4 read rope_theta, rope_scaling and torch_dtype)."""
    hf = hf_io.config_to_hf(layer_config)
    rope = dict(hf["rope_parameters"])
    hf.update(architectures=[ARCHITECTURES[layer_config.model_type]], rope_theta=rope.pop("rope_theta"),
              rope_scaling=rope if rope["rope_type"] != "default" else None, torch_dtype=hf["dtype"])
    return hf
