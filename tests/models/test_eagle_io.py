"""The EAGLE format SGLang and vLLM load (`tlt_jax.models.eagle_io`): our exported drafter's
logits equal those of a torch forward written to the engines' definitions, a checkpoint
written from torch in their layout imports to the same logits, export -> import is exact to
the bit, and what does not map exactly is refused."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as save_torch_file
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from experiments.make_random_hf import hf_config
from tests.support import tiny
from tlt_jax.drafter_training import io
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import eagle_io, hf_io
from tlt_jax.models import transformer as tfm

CASES = {  # make_random_hf.hf_config arguments of the target
    "llama_llama3rope": dict(family="llama", llama3_rope=True, rope_theta=500.0),  # T=24 > original context 16
    "llama_attention_bias": dict(family="llama", attention_bias=True),
    "qwen2": dict(family="qwen2", num_kv_heads=1, head_dim=16),  # head_dim != D / H
}
T = 24
EAGLE = drafter_lib.DrafterConfig(layout="eagle")


def _hf(name, num_layers):
    case = dict(CASES[name])
    return hf_config(case.pop("family"), **{**tiny.HF_SHAPES, **case, "num_layers": num_layers})


def _target(name, dtype="float32"):
    """(target ModelConfig, random embed and head), read through transformers' own config."""
    cfg = hf_io.config_from_hf(_hf(name, 2).to_dict(), dtype=dtype)
    rng = np.random.default_rng(1)
    params = {"embed": rng.standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32),
              "lm_head": (0.3 * rng.standard_normal((cfg.hidden_size, cfg.vocab_size))).astype(np.float32),
              "final_norm": (1 + 0.1 * rng.standard_normal(cfg.hidden_size)).astype(np.float32)}
    return cfg, params


def _noisy_drafter(cfg, dcfg=EAGLE, seed=0):
    """init_drafter's tree with every weight random (norms 1 + N(0, 0.1)), so a mis-mapped
    tensor moves the logits."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: drafter_lib.init_drafter(cfg, dcfg, jax.random.PRNGKey(0)))

    def draw(path, s):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            return (1 + 0.1 * rng.standard_normal(s.shape)).astype(np.float32)
        scale = 1 / np.sqrt(s.shape[-2]) if name in ("['fc']", "['fuse']") else 0.2
        return (scale * rng.standard_normal(s.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def _inputs(cfg, seed=2):
    rng = np.random.default_rng(seed)
    tokens_T = rng.integers(0, cfg.vocab_size, T)
    hidden_TD = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)  # the target's features
    return tokens_T, hidden_TD


def _logits(dparams, tparams, tokens_T, hidden_TD, cfg, dcfg):
    g = drafter_lib.forward(dparams, tparams, cfg, dcfg, tokens_T[None], hidden_TD[None])
    return tfm.logits_from_hidden(tparams, cfg, g)[0]


_jit_logits = jax.jit(_logits, static_argnums=(4, 5))


def _our_logits(cfg, dcfg, dparams, tparams, tokens_T, hidden_TD):
    # Jitted, as the engine runs it (op by op, each operation compiles a program of its own).
    return np.asarray(_jit_logits(dparams, tparams, jnp.asarray(tokens_T), jnp.asarray(hidden_TD), cfg, dcfg))


# Jitted, as the engine runs it (op by op, each operation compiles a program of its own).
_decode = jax.jit(drafter_lib.decode, static_argnums=(2, 3))


# ----------------------------------------------------------------------------- the engines' forward


class EngineEagle(torch.nn.Module):
    """An EAGLE-1/2 drafter as SGLang and vLLM define it, on transformers' decoder layer
    (both engines' LlamaDecoderLayer / Qwen2DecoderLayer compute Hugging Face's).

    SGLang python/sglang/srt/models/llama_eagle.py (qwen2_eagle.py alike):
      LlamaDecoderLayer.__init__: `if layer_id == 0: del self.input_layernorm;
        setattr(self, "input_layernorm", lambda x: x)`  (vLLM: `nn.Identity()`)
      LlamaModel.__init__: `self.fc = torch.nn.Linear(config.hidden_size * 2, config.hidden_size)`
        (a bias; vLLM llama_eagle.py: `bias=False`)
      LlamaModel.forward: `hidden_states = self.embed_tokens(input_ids)`;
        `self.fc(torch.cat((hidden_states, forward_batch.spec_info.hidden_states), dim=-1))`
        (vLLM: `torch.cat((input_embeds, hidden_states), dim=-1)`); the layers; `return
        hidden_states + residual` (no final norm)
      LlamaForCausalLMEagle.load_weights: `if "lm_head" not in name: name = "model." + name`,
        then LlamaForCausalLM.load_weights (a name with no parameter is skipped with a
        warning, a parameter with no tensor keeps its init); the embedding and head are the
        target's (EAGLEWorker: `set_embed_and_head`; vLLM shares them).
    """

    def __init__(self, config, engine):
        super().__init__()
        d = config.hidden_size
        config._attn_implementation = "eager"
        self.model = torch.nn.Module()
        self.model.fc = torch.nn.Linear(2 * d, d, bias=engine == "sglang")
        modeling = modeling_qwen2 if config.model_type == "qwen2" else modeling_llama
        layer_cls = modeling.Qwen2DecoderLayer if config.model_type == "qwen2" else modeling.LlamaDecoderLayer
        self.model.layers = torch.nn.ModuleList([layer_cls(config, 0)])
        del self.model.layers[0].input_layernorm
        self.model.layers[0].input_layernorm = torch.nn.Identity()
        rotary = modeling.Qwen2RotaryEmbedding if config.model_type == "qwen2" else modeling.LlamaRotaryEmbedding
        self.rotary = rotary(config)
        self.eval()

    def load_weights(self, tensors):
        """The engines' loading: every parameter must come from the file (else it would keep
        its random init); returns the names the engine would skip."""
        params = dict(self.named_parameters())
        loaded, skipped = set(), []
        for name, value in tensors.items():
            if "lm_head" in name:
                continue
            name = "model." + name
            if name not in params:  # SGLang: "Parameter ... not found in params_dict"; vLLM: skipped
                skipped.append(name)
                continue
            with torch.no_grad():
                params[name].copy_(torch.as_tensor(np.asarray(value)))
            loaded.add(name)
        assert loaded == set(params) - {"rotary.inv_freq"}, f"left at init: {set(params) - loaded}"
        return skipped

    def forward(self, embed_VD, head_DV, tokens_T, hidden_TD):
        """logits [T, V] and the layer output y [T, D] (the next step's hidden state)."""
        with torch.no_grad():
            e = torch.as_tensor(embed_VD)[torch.as_tensor(tokens_T)][None]
            u = self.model.fc(torch.cat((e, torch.as_tensor(hidden_TD)[None]), dim=-1))
            positions = torch.arange(u.shape[1])[None]
            mask = torch.full((u.shape[1], u.shape[1]), float("-inf")).triu(1)[None, None]
            y = self.model.layers[0](u, attention_mask=mask, position_ids=positions,
                                     position_embeddings=self.rotary(u, positions))
            y = y[0] if isinstance(y, tuple) else y
            return (y @ torch.as_tensor(head_DV))[0].numpy(), y[0].numpy()


def _engine(path, engine):
    model = EngineEagle(transformers.AutoConfig.from_pretrained(path), engine)
    model.load_weights(load_file(os.path.join(path, hf_io.WEIGHTS_FILE)))
    return model


def _close(ours, theirs):
    """Equal to float32 rounding: a few ulps of the largest logit."""
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-6 * np.abs(theirs).max())


# ----------------------------------------------------------------------------- (1) export -> engines


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("name", list(CASES))
def test_export_computes_what_the_engines_compute(tmp_path, name, engine):
    cfg, tparams = _target(name)
    dparams = _noisy_drafter(cfg)
    io.save_drafter(tmp_path, dparams, EAGLE, cfg, "sha256:abc", step=3)
    path = tmp_path / io.EAGLE_DIR
    hf = json.loads((path / hf_io.CONFIG_FILE).read_text())
    assert hf["architectures"] == [eagle_io.ARCHITECTURES[cfg.model_type]] and hf["num_hidden_layers"] == 1
    assert hf["rope_theta"] == hf["rope_parameters"]["rope_theta"] == cfg.rope_theta  # transformers 4 and 5
    names = set(load_file(path / hf_io.WEIGHTS_FILE))
    assert "fc.weight" in names and not any(n.startswith("model.") or "embed" in n or "lm_head" in n for n in names)

    tokens, hidden = _inputs(cfg)
    theirs, y = _engine(path, engine)(tparams["embed"], tparams["lm_head"], tokens, hidden)
    _close(_our_logits(cfg, EAGLE, dparams, tparams, tokens, hidden), theirs)

    # Decoding against the KV cache (two chunks), then one drafted entry whose feature is
    # the drafter's own output, as the engines feed y back.
    cache = drafter_lib.init_cache(cfg, EAGLE, 1, T + 1)
    logits = []
    for lo, hi in ((0, 10), (10, T)):
        out, g, cache = _decode(dparams, tparams, cfg, EAGLE, cache, jnp.asarray(tokens[lo:hi])[None],
                                           jnp.asarray(hidden[lo:hi])[None], jnp.arange(lo, hi)[None])
        logits.append(np.asarray(out[0]))
    _close(np.concatenate(logits), theirs)
    drafted = int(np.argmax(theirs[-1]))
    np.testing.assert_allclose(np.asarray(g[0, -1]), y[-1], rtol=0, atol=2e-6 * np.abs(y).max())
    out, _, _ = _decode(dparams, tparams, cfg, EAGLE, cache, jnp.asarray([[drafted]]), g[:, -1:],
                                   jnp.asarray([[T]]))
    theirs_next, _ = _engine(path, engine)(tparams["embed"], tparams["lm_head"], np.append(tokens, drafted),
                                           np.concatenate([hidden, y[-1:]]))
    _close(np.asarray(out[0, 0]), theirs_next[-1])


# ----------------------------------------------------------------------------- (2) engines' files -> ours


def _torch_checkpoint(path, name, style, seed=3):
    """A drafter written from torch in a released spelling: "sglang" (SGLang's architecture,
    bare names, a zero fc.bias) or "fastrl" (the target's architecture and transformers-4
    config keys as fastrl's eagle-train configs, "model."-prefixed names without fc.bias as
    its trainer's state dict, plus the embedding and head, which are the target's)."""
    config = _hf(name, 1)
    model = EngineEagle(config, "sglang" if style == "sglang" else "vllm")
    torch.manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("o_proj.bias") or pname.endswith("fc.bias"):
                p.zero_()
            elif "norm" in pname:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    hf = config.to_dict()
    if style == "sglang":
        hf["architectures"] = [eagle_io.ARCHITECTURES[config.model_type]]
        tensors = {n.removeprefix("model."): p for n, p in model.state_dict().items() if n.startswith("model.")}
    else:
        hf["architectures"] = [hf_io._FAMILIES[config.model_type].architecture]
        rope = hf.pop("rope_parameters")
        hf.update(rope_theta=rope.pop("rope_theta"), torch_dtype=hf.pop("dtype", "float32"),
                  rope_scaling=rope if rope["rope_type"] != "default" else None)
        tensors = {n: p for n, p in model.state_dict().items() if n.startswith("model.")}
        rng = torch.Generator().manual_seed(0)
        tensors.update({"model.embed_tokens.weight": torch.randn(config.vocab_size, config.hidden_size, generator=rng),
                        "lm_head.weight": torch.randn(config.vocab_size, config.hidden_size, generator=rng)})
    os.makedirs(path)
    with open(os.path.join(path, hf_io.CONFIG_FILE), "w") as fh:
        json.dump(hf, fh)
    save_torch_file({n: p.contiguous() for n, p in tensors.items()}, os.path.join(path, hf_io.WEIGHTS_FILE))
    return model


@pytest.mark.parametrize("style", ["sglang", "fastrl"])
@pytest.mark.parametrize("name", list(CASES))
def test_import_of_a_torch_checkpoint_matches_its_logits(tmp_path, name, style):
    cfg, tparams = _target(name)
    model = _torch_checkpoint(tmp_path / "eagle", name, style)
    assert eagle_io.is_eagle_checkpoint(tmp_path / "eagle")
    dcfg, dparams = io.load_drafter(tmp_path / "eagle", cfg, target_fingerprint="sha256:abc")
    assert dcfg == EAGLE
    tokens, hidden = _inputs(cfg)
    theirs, _ = model(tparams["embed"], tparams["lm_head"], tokens, hidden)
    _close(_our_logits(cfg, dcfg, dparams, tparams, tokens, hidden), theirs)


# ----------------------------------------------------------------------------- (3) round trips


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_export_import_round_trip_is_exact(tmp_path, name, dtype):
    cfg, _ = _target(name, dtype)
    dparams = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, cfg.jnp_param_dtype)), _noisy_drafter(cfg))
    for step in (1, 2, 3):  # later exports replace the EAGLE copy; orbax keeps 2 steps beside it
        io.save_drafter(tmp_path, dparams if step == 3 else jax.tree.map(np.zeros_like, dparams), EAGLE, cfg,
                        "sha256:abc", step=step)
    assert sorted(os.listdir(tmp_path)) == ["2", "3", io.EAGLE_DIR]
    dcfg, loaded = io.load_drafter(tmp_path / io.EAGLE_DIR, cfg)
    assert dcfg == EAGLE
    _assert_trees_equal(loaded, dparams)
    _assert_trees_equal(io.load_drafter(tmp_path, cfg)[1], dparams)  # the orbax export beside it
    own_cfg, own = eagle_io.load_eagle_drafter(tmp_path / io.EAGLE_DIR)  # no target given: the file's config
    assert own_cfg == EAGLE
    _assert_trees_equal(own, dparams)


# ----------------------------------------------------------------------------- (4) refused


def test_drafters_the_engines_do_not_compute_are_refused(tmp_path, caplog):
    cfg, _ = _target("llama_llama3rope")
    tlt = drafter_lib.DrafterConfig()
    with pytest.raises(ValueError, match="layout is 'tlt'.*attn_norm.*final norm"):
        eagle_io.save_eagle_drafter(tmp_path / "x", _noisy_drafter(cfg, tlt), tlt, cfg)
    fused = drafter_lib.DrafterConfig(feature_layers=(0, 1), layout="eagle")
    with pytest.raises(ValueError, match=r"fuses target layers \(0, 1\) \(EAGLE-3\)"):
        eagle_io.save_eagle_drafter(tmp_path / "x", _noisy_drafter(cfg, fused), fused, cfg)
    with pytest.raises(ValueError, match="layout='eagle'.*one layer"):
        drafter_lib.DrafterConfig(num_layers=2, layout="eagle")
    # "auto", the configs' default: EAGLE's layout where the engines load it, else "tlt".
    auto = lambda **kw: drafter_lib.DrafterConfig(layout="auto", **kw).layout
    assert (auto(), auto(num_layers=2), auto(feature_layers=(0, 1))) == ("eagle", "tlt", "tlt")
    assert not (tmp_path / "x").exists()

    # The export itself is written; only its EAGLE copy is left out, with the reason.
    io.save_drafter(tmp_path / "export", _noisy_drafter(cfg, tlt), tlt, cfg, "sha256:abc")
    assert os.listdir(tmp_path / "export") == ["0"] and io.load_drafter(tmp_path / "export", cfg)[0] == tlt
    assert any("No EAGLE-format copy" in r.getMessage() and "layout is 'tlt'" in r.getMessage()
               for r in caplog.records)


def _rewrite(path, *, tensors=None, config=None):
    """Edits the checkpoint at path: tensors(dict) and config(dict) change them in place."""
    if tensors is not None:
        t = dict(load_file(os.path.join(path, hf_io.WEIGHTS_FILE)))
        tensors(t)
        save_file(t, os.path.join(path, hf_io.WEIGHTS_FILE))
    if config is not None:
        hf = json.loads(open(os.path.join(path, hf_io.CONFIG_FILE)).read())
        config(hf)
        with open(os.path.join(path, hf_io.CONFIG_FILE), "w") as fh:
            json.dump(hf, fh)


REFUSED_IMPORTS = {
    "nonzero fc bias": (dict(tensors=lambda t: t.update({"fc.bias": np.ones_like(t["fc.bias"])})),
                        "fc.bias is non-zero"),
    "nonzero o_proj bias": (dict(tensors=lambda t: t.update({"layers.0.self_attn.o_proj.bias": np.ones(32)})),
                            "o_proj.bias is non-zero"),
    "two layers": (dict(config=lambda hf: hf.update(num_hidden_layers=2)), "num_hidden_layers=2"),
    "another target": (dict(config=lambda hf: hf.update(rope_theta=1e4, rope_parameters=dict(
        hf["rope_parameters"], rope_theta=1e4))), "another target model.*rope_theta: trained for 10000.0, given 500.0"),
    "EAGLE-3": (dict(config=lambda hf: hf.update(architectures=["LlamaForCausalLMEagle3"])), "EAGLE-3 drafter"),
    "missing tensor": (dict(tensors=lambda t: t.pop("layers.0.mlp.up_proj.weight")),
                       "missing layers.0.mlp.up_proj.weight"),
    "unknown tensor": (dict(tensors=lambda t: t.update({"hidden_norm.weight": np.ones(32, np.float32)})),
                       "no place for hidden_norm.weight"),
}


@pytest.mark.parametrize("case", list(REFUSED_IMPORTS))
def test_checkpoints_our_drafter_does_not_compute_are_refused(tmp_path, case):
    cfg, _ = _target("llama_llama3rope")
    cfg = cfg.replace(qkv_bias=True)  # llama's attention_bias: a zero o_proj bias in the file
    eagle_io.save_eagle_drafter(tmp_path, _noisy_drafter(cfg), EAGLE, cfg)
    edit, message = REFUSED_IMPORTS[case]
    _rewrite(tmp_path, **edit)
    with pytest.raises(ValueError, match=message):
        io.load_drafter(tmp_path, cfg)
