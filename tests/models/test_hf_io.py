"""Hugging Face checkpoints: logits parity with transformers' torch forward, exact save/load
round trips (single file, sharded, bf16), clear errors, and the check_hf CLI."""
import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import save_file

from configs import models
from experiments.make_random_hf import hf_config, random_model, write_random_checkpoint
from tests.support import REPO, tiny
from tlt_jax.models import hf_io
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig, RopeScaling, from_config_dict

TINY = tiny.HF_SHAPES
# 24 positions > the Llama-3 scaling's original context of 16.
IDS_T = np.random.default_rng(0).integers(0, TINY["vocab_size"], 24)


def _save(model, path, dtype=torch.float32):
    model.to(dtype).save_pretrained(path)
    return str(path)


@functools.partial(jax.jit, static_argnums=0)
def _logits(config, params, ids_T):
    return tfm.logits_from_hidden(params, config, tfm.forward(params, config, ids_T[None]))[0]


def _our_logits(config, params, ids_T=IDS_T):
    # Jitted, as the library's callers run it (op by op, each operation compiles a program of its own).
    return np.asarray(_logits(config, params, jnp.asarray(ids_T, jnp.int32)))


def _torch_logits(model, ids_T=IDS_T):
    with torch.no_grad():
        return model(torch.as_tensor(ids_T, dtype=torch.long)[None]).logits[0].float().numpy()


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def _random_params(config, seed=0):
    """N(0, 0.2) host params with init_params' layout (its CPU compile is slow, numpy is instant)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: tfm.init_params(config, jax.random.PRNGKey(0)))
    return jax.tree.map(lambda s: (0.2 * rng.standard_normal(s.shape)).astype(np.float32), shapes)


CASES = {
    "llama_gqa_untied_llama3rope": dict(family="llama", llama3_rope=True, rope_theta=500.0),
    "llama_tied_attention_bias": dict(family="llama", tie_embeddings=True, attention_bias=True),
    "qwen2_tied": dict(family="qwen2", tie_embeddings=True),
    "qwen2_untied": dict(family="qwen2", num_kv_heads=1, head_dim=16),  # head_dim != D / H
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, torch model) for every case."""
    out = {}
    for name, case in CASES.items():
        case = dict(case)
        model = random_model(hf_config(case.pop("family"), **{**TINY, **case}), seed=len(out))
        out[name] = (_save(model, tmp_path_factory.mktemp(name)), model)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(checkpoints, name):
    path, model = checkpoints[name]
    config, params = hf_io.load_hf(path)
    case = CASES[name]
    assert config.model_type == case["family"]
    assert config.tie_embeddings == case.get("tie_embeddings", False)
    assert config.qkv_bias == (case["family"] == "qwen2" or case.get("attention_bias", False))
    assert (config.rope_scaling is not None) == case.get("llama3_rope", False)
    o_bias = sum(p.numel() for n, p in model.named_parameters() if n.endswith("o_proj.bias"))  # kept zero
    assert config.param_dtype == "float32" and config.num_params() == model.num_parameters() - o_bias
    np.testing.assert_allclose(_our_logits(config, params), _torch_logits(model), atol=1e-4, rtol=0)


def test_save_load_round_trip_is_exact_and_transformers_loads_it(checkpoints, tmp_path):
    path, model = checkpoints["llama_tied_attention_bias"]
    config, params = hf_io.load_hf(path)
    hf_io.save_hf(tmp_path / "out", config, params)
    config2, params2 = hf_io.load_hf(tmp_path / "out")
    assert config2 == config
    _assert_trees_equal(params, params2)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    np.testing.assert_array_equal(_torch_logits(reloaded), _torch_logits(model))


def test_params_of_ours_saved_for_transformers(tmp_path):
    """Our own init (Llama-3 RoPE, q/k/v biases, GQA, untied) through save_hf into torch."""
    config = ModelConfig(**TINY, head_dim=8, qkv_bias=True, rope_theta=500.0,
                         rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16), rms_norm_eps=1e-5,
                         bos_token_id=1, eos_token_id=2)
    params = _random_params(config)
    hf_io.save_hf(tmp_path / "ckpt", config, params)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    np.testing.assert_allclose(_torch_logits(model), _our_logits(config, params), atol=1e-4, rtol=0)
    assert hf_io.load_hf(tmp_path / "ckpt")[0] == config


def test_sharded_checkpoint(checkpoints, tmp_path):
    path, model = checkpoints["qwen2_untied"]
    config, params = hf_io.load_hf(path)
    hf_io.save_hf(tmp_path / "sharded", config, params, max_shard_bytes=16_000)
    files = sorted(os.listdir(tmp_path / "sharded"))
    shards = [f for f in files if f.startswith("model-")]
    assert hf_io.INDEX_FILE in files and hf_io.WEIGHTS_FILE not in files and len(shards) > 2
    with open(tmp_path / "sharded" / hf_io.INDEX_FILE) as fh:
        assert set(json.load(fh)["weight_map"].values()) == set(shards)
    _assert_trees_equal(params, hf_io.load_hf(tmp_path / "sharded")[1])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.float32)
    np.testing.assert_array_equal(_torch_logits(reloaded), _torch_logits(model))


def test_bf16_checkpoint(tmp_path):
    model = random_model(hf_config("qwen2", **TINY))
    path = _save(model, tmp_path / "bf16", torch.bfloat16)
    config, params = hf_io.load_hf(path)
    assert config.param_dtype == config.dtype == "bfloat16"
    assert params["embed"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(params["embed"].astype(np.float32),
                                  model.model.embed_tokens.weight.detach().float().numpy())
    config32, params32 = hf_io.load_hf(path, dtype="float32")
    assert config32.param_dtype == "float32" and params32["layers"]["wq"].dtype == np.float32
    np.testing.assert_array_equal(params32["layers"]["wq"], params["layers"]["wq"].astype(np.float32))
    # bf16 written by us is bf16 for transformers too.
    hf_io.save_hf(tmp_path / "again", config, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert reloaded.dtype == torch.bfloat16
    assert torch.equal(reloaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_config_from_transformers4_spelling_matches_v5():
    v5 = hf_io.config_to_hf(ModelConfig(**TINY, head_dim=16, rope_theta=5e5,
                                        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192)))
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "dtype")}
    v4.update(rope_theta=5e5, torch_dtype="float32",
              rope_scaling={"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    assert hf_io.config_from_hf(v4) == hf_io.config_from_hf(v5)


def test_model_config_end_tokens_in_one_canonical_form():
    """An id, a list or a tuple, from a config dict or JSON, as HF spells them: one
    canonical form (hashable, so still a static jit argument), every id in end_token_ids."""
    base = dict(**TINY, head_dim=8)
    assert ModelConfig(**base).end_token_ids == () and ModelConfig(**base, eos_token_id=[]).eos_token_id is None
    one = ModelConfig(**base, eos_token_id=np.int64(7))
    assert one.eos_token_id == 7 and type(one.eos_token_id) is int and one.end_token_ids == (7,)
    assert ModelConfig(**base, eos_token_id=(7,)) == one
    several = ModelConfig(**base, eos_token_id=[7, 3, 7, 9])
    assert several.eos_token_id == several.end_token_ids == (7, 3, 9)
    assert hash(several) == hash(ModelConfig(**base, eos_token_id=(7, 3, 9)))
    assert several.replace(eos_token_id=3).end_token_ids == (3,)
    tiny = models.model_config("tiny")
    assert from_config_dict(tiny).eos_token_id is None
    tiny.eos_token_id = (5, 6)  # as --config.model.eos_token_id='(5, 6)' sets it
    assert from_config_dict(tiny).end_token_ids == (5, 6)
    from_json = json.loads(json.dumps({**tiny.to_dict(), "eos_token_id": [5, 6]}))
    assert from_config_dict(from_json) == from_config_dict(tiny)
    for bad in ("2", 1.5, [-1], [2, None], True):
        with pytest.raises(ValueError, match="eos_token_id must be"):
            ModelConfig(**base, eos_token_id=bad)


def test_end_tokens_of_config_and_generation_config():
    """Llama-3-Instruct's three end tokens: config.json lists two, generation_config.json
    all three; the union keeps config.json's order. Written back: a list in both files."""
    hf = hf_io.config_to_hf(ModelConfig(**TINY, head_dim=8))
    assert hf_io.config_from_hf({**hf, "eos_token_id": [7, 8, 9]}).eos_token_id == (7, 8, 9)
    llama3 = hf_io.config_from_hf({**hf, "eos_token_id": [9, 7]}, generation_config={"eos_token_id": [7, 9, 8]})
    assert llama3.end_token_ids == (9, 7, 8)
    assert hf_io.config_from_hf({**hf, "eos_token_id": 9}, generation_config={"eos_token_id": 9}).eos_token_id == 9
    assert hf_io.config_from_hf({**hf, "eos_token_id": None}, generation_config={}).eos_token_id is None
    assert hf_io.config_to_hf(llama3)["eos_token_id"] == [9, 7, 8]
    assert hf_io.config_to_hf(llama3.replace(eos_token_id=9))["eos_token_id"] == 9


def test_chat_checkpoint_with_two_end_tokens_in_bfloat16(tmp_path):
    """A Qwen2.5-Instruct-like checkpoint written by transformers in bfloat16: config.json
    names <|im_end|> (5), generation_config.json <|im_end|> and <|endoftext|> (5, 3). It
    loads with both end tokens and its bfloat16 weights as they are; save_hf writes both
    back where transformers reads them, and the round trip is exact."""
    model = random_model(hf_config("qwen2", **TINY, bos_token_id=None, eos_token_id=5))
    model.generation_config = transformers.GenerationConfig(eos_token_id=[5, 3])
    path = _save(model, tmp_path / "chat", torch.bfloat16)
    with open(os.path.join(path, hf_io.CONFIG_FILE)) as fh:
        assert json.load(fh)["eos_token_id"] == 5
    config, params = hf_io.load_hf(path)
    assert config.eos_token_id == config.end_token_ids == (5, 3)
    assert config.param_dtype == config.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(ml_dtypes.bfloat16)}
    np.testing.assert_array_equal(params["layers"]["wq"][1].reshape(TINY["hidden_size"], -1).T.view(np.uint16),
                                  model.model.layers[1].self_attn.q_proj.weight.detach().view(torch.int16).numpy()
                                  .view(np.uint16))

    hf_io.save_hf(tmp_path / "out", config, params)
    with open(tmp_path / "out" / hf_io.CONFIG_FILE) as fh:
        assert json.load(fh)["eos_token_id"] == [5, 3]
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == [5, 3]
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").eos_token_id == [5, 3]
    config2, params2 = hf_io.load_hf(tmp_path / "out")
    assert config2 == config
    _assert_trees_equal(params, params2)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.dtype == torch.bfloat16
    assert reloaded.generation_config.eos_token_id == [5, 3]
    assert torch.equal(reloaded.model.layers[1].self_attn.q_proj.weight, model.model.layers[1].self_attn.q_proj.weight)


@pytest.mark.parametrize("change, message", [
    (dict(model_type="mistral"), "Unsupported model_type 'mistral'.*LlamaForCausalLM.*Qwen2ForCausalLM"),
    (dict(architectures=["LlamaForSequenceClassification"]),
     "Unsupported architecture 'LlamaForSequenceClassification'.*LlamaForCausalLM"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn'.*default, llama3"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
          sliding_window=64, max_window_layers=1), "Sliding-window"),
])
def test_unsupported_configs(change, message):
    hf = {**hf_io.config_to_hf(ModelConfig(**TINY, head_dim=8)), **change}
    hf.pop("layer_types", None)
    with pytest.raises(ValueError, match=message):
        hf_io.config_from_hf(hf)


def _rewrite_weights(path, edit):
    filename = os.path.join(path, hf_io.WEIGHTS_FILE)
    tensors = {k: np.array(v) for k, v in hf_io.read_safetensors(filename).items()}
    edit(tensors)
    save_file(tensors, filename, metadata={"format": "pt"})


def test_bad_checkpoints(checkpoints, tmp_path):
    config, params = hf_io.load_hf(checkpoints["llama_gqa_untied_llama3rope"][0])

    def fresh(name):
        hf_io.save_hf(tmp_path / name, config, params)
        return str(tmp_path / name)

    path = fresh("shape")
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite_weights(path, lambda t: t.update({name: np.zeros((48, 30), np.float32)}))
    with pytest.raises(ValueError, match=re.escape(f"{name}: expected shape (48, 32), found (48, 30)")):
        hf_io.load_hf(path)

    path = fresh("missing")
    _rewrite_weights(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"lacks tensor\(s\) lm_head\.weight"):
        hf_io.load_hf(path)

    path = fresh("extra")
    _rewrite_weights(path, lambda t: t.update({"model.layers.0.mlp.up_proj.bias": np.zeros(48, np.float32)}))
    with pytest.raises(ValueError, match=r"no place for: model\.layers\.0\.mlp\.up_proj\.bias"):
        hf_io.load_hf(path)

    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf_io.load_hf(str(tmp_path / "nowhere"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="not a Hugging Face checkpoint: no config.json"):
        hf_io.load_hf(str(tmp_path / "empty"))
    path = fresh("no_weights")
    os.remove(os.path.join(path, hf_io.WEIGHTS_FILE))
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        hf_io.load_hf(path)


def test_nonzero_llama_output_bias_is_refused(checkpoints, tmp_path):
    path, model = checkpoints["llama_tied_attention_bias"]
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.bias.fill_(0.5)
    try:
        _save(model, tmp_path / "obias")
    finally:
        with torch.no_grad():
            model.model.layers[1].self_attn.o_proj.bias.zero_()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.o_proj\.bias is non-zero"):
        hf_io.load_hf(tmp_path / "obias")


def test_save_is_atomic(checkpoints, tmp_path):
    config, params = hf_io.load_hf(checkpoints["qwen2_tied"][0])
    target = tmp_path / "ckpt"
    hf_io.save_hf(target, config, params)
    with pytest.raises(FileExistsError):
        hf_io.save_hf(target, config, params)

    class FailingTokenizer:
        def save_pretrained(self, path):
            raise RuntimeError("disk full")

    doubled = jax.tree.map(lambda x: x * 2, params)
    with pytest.raises(RuntimeError, match="disk full"):
        hf_io.save_hf(target, config, doubled, tokenizer=FailingTokenizer(), overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary left behind
    _assert_trees_equal(params, hf_io.load_hf(target)[1])  # the old checkpoint, intact
    hf_io.save_hf(target, config, doubled, overwrite=True)
    _assert_trees_equal(doubled, hf_io.load_hf(target)[1])
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_save_rejects_misshapen_params():
    config = ModelConfig(**TINY, head_dim=8)
    params = _random_params(config)
    params["layers"]["wo"] = params["layers"]["wo"][:, :3]
    with pytest.raises(ValueError, match=re.escape("params layers/wo: expected shape (2, 4, 8, 32), "
                                                   "found (2, 3, 8, 32)")):
        hf_io.save_hf("/nonexistent/never_written", config, params)


def test_check_hf_cli(tmp_path):
    path = write_random_checkpoint(str(tmp_path / "tiny"), "llama", llama3_rope=True)
    proc = subprocess.run([sys.executable, "-m", "experiments.check_hf", f"--hf_dir={path}",
                           "--prompt=Hi, 42!"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["max_abs_diff"] <= result["tol"] == 1e-4
    assert result["model_type"] == "llama" and result["num_tokens"] == len("Hi, 42!") + 1  # + <bos>
    assert result["argmax_agreement"] == 1.0
