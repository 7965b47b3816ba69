"""Model presets by name: the tiny test model and published shapes (random init is fine
for throughput; `load_hf` gives real weights). `get_config("name")` returns one preset,
so `--config=configs/models.py:qwen2.5-0.5b` works wherever a model config is taken."""
import ml_collections

_PRESETS = {
    "tiny": dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                 tie_embeddings=False, max_position_embeddings=1024),
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6,
                         qkv_bias=True, tie_embeddings=True, max_position_embeddings=32768,
                         param_dtype="bfloat16", dtype="bfloat16"),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6,
                         qkv_bias=True, tie_embeddings=True, max_position_embeddings=32768,
                         param_dtype="bfloat16", dtype="bfloat16"),
    "llama3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
                        rms_norm_eps=1e-5, tie_embeddings=True, max_position_embeddings=131072,
                        rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8192),
                        param_dtype="bfloat16", dtype="bfloat16"),
    "llama3.2-3b": dict(model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                        num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                        rms_norm_eps=1e-5, tie_embeddings=True, max_position_embeddings=131072,
                        rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8192),
                        param_dtype="bfloat16", dtype="bfloat16"),
    "llama3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                        rms_norm_eps=1e-5, tie_embeddings=False, max_position_embeddings=131072,
                        rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8192),
                        param_dtype="bfloat16", dtype="bfloat16"),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e6,
                       qkv_bias=True, tie_embeddings=False, max_position_embeddings=32768,
                       param_dtype="bfloat16", dtype="bfloat16"),
    "qwen2.5-32b": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                        num_layers=64, num_heads=40, num_kv_heads=8, head_dim=128, rope_theta=1e6,
                        qkv_bias=True, tie_embeddings=False, max_position_embeddings=32768,
                        param_dtype="bfloat16", dtype="bfloat16"),
    "llama3.3-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                         num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                         rms_norm_eps=1e-5, tie_embeddings=False, max_position_embeddings=131072,
                         rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192),
                         param_dtype="bfloat16", dtype="bfloat16"),
}

PRESET_NAMES = tuple(_PRESETS)

# Every field a model config may carry, so that any of them can be overridden from the
# command line (`--config.model.qkv_bias=True`) whatever the preset sets.
_DEFAULTS = dict(model_type="llama", rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6,
                 qkv_bias=False, tie_embeddings=False, max_position_embeddings=4096,
                 param_dtype="float32", dtype="float32", bos_token_id=None, eos_token_id=None)


def model_config(name: str) -> ml_collections.ConfigDict:
    if name not in _PRESETS:
        raise ValueError(f"Unknown model preset {name!r}; presets: {', '.join(PRESET_NAMES)}.")
    fields = {**_DEFAULTS, **_PRESETS[name]}
    # eos_token_id takes one id or several: --config.model.eos_token_id='(151645, 151643)'.
    placeholders = {"rope_scaling": ml_collections.config_dict.placeholder(dict),
                    "bos_token_id": ml_collections.config_dict.placeholder(int),
                    "eos_token_id": ml_collections.config_dict.placeholder(object)}
    for key, placeholder in placeholders.items():
        if fields[key] is None:
            fields[key] = placeholder
    return ml_collections.ConfigDict(fields)


def get_config(name: str = "tiny") -> ml_collections.ConfigDict:
    return model_config(name)
