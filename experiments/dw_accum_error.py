r"""How much accuracy bf16 dW accumulation (`BlockSizes(dw_accum="param")`) costs.

  python -m experiments.dw_accum_error [--tokens_n=65536] [--out=dw_accum_error.json]

chunked_xla sums dW over token blocks; with bf16 w, `dw_accum="param"` keeps that sum
in bf16 (the gradient output is the accumulator: 1.47 GiB less memory at D=3072,
V=128256) and rounds once per block. This measures the relative error of dW against a
float64 reference for both accumulators at a few block counts, beside the error of
rounding the exact dW to bf16 once (what the f32 accumulator is bounded by), on the
top-K KL with a scalar reduction, bf16 h and w. Runs on any backend; CPU takes a minute.
"""
import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import machine
from tlt_jax import launch, losses
from tlt_jax.losses import BlockSizes

_N = flags.DEFINE_integer("tokens_n", 65536, "Tokens.")
_D = flags.DEFINE_integer("hidden", 64, "Hidden size.")
_V = flags.DEFINE_integer("vocab", 2048, "Vocabulary.")
_K = flags.DEFINE_integer("top_k", 16, "Teacher top-K.")
_TOKENS = flags.DEFINE_list("block_tokens", ["256", "1024"], "Token-block sizes (blocks = n / tokens).")
_OUT = flags.DEFINE_string("out", "", "Write the results as JSON here.")


def main(argv):
    del argv
    jax.config.update("jax_enable_x64", True)
    n, d, v, k = _N.value, _D.value, _V.value, _K.value
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((d, v)) / d**0.5, jnp.bfloat16)
    ids = jnp.asarray(np.argsort(rng.random((n, v)), axis=1)[:, :k].astype(np.int32))
    logp = jnp.asarray(np.log(0.9 * rng.dirichlet(np.ones(k), n)), jnp.float32)

    def dense_f64(w64):
        z = h.astype(jnp.float64) @ w64
        logq = jnp.take_along_axis(z, ids, 1) - jax.nn.logsumexp(z, axis=1)[:, None]
        p = jnp.exp(logp.astype(jnp.float64))
        return jnp.mean(jnp.sum(p * (logp - logq), 1))

    exact = np.asarray(jax.grad(dense_f64)(w.astype(jnp.float64)))

    def rel_error(dw):
        return float(np.linalg.norm(np.asarray(dw, np.float64) - exact) / np.linalg.norm(exact))

    rows = [dict(accumulator="exact, rounded to bf16 once", blocks=None,
                 rel_error=rel_error(exact.astype(jnp.bfloat16)))]
    for tokens in map(int, _TOKENS.value):
        for accum in ("float32", "param"):
            blocks = BlockSizes(tokens=tokens, dw_accum=accum)
            grad = jax.jit(jax.grad(lambda w_, blocks=blocks: losses.linear_topk_kl(h, w_, ids, logp, reduction="mean",
                                                                     impl="chunked_xla", block_sizes=blocks)))
            rows.append(dict(accumulator=accum, tokens=tokens, blocks=-(-n // tokens), rel_error=rel_error(grad(w))))
    print(f"N={n} D={d} V={v} K={k}, bf16 h and w; relative L2 error of dW against float64")
    for r in rows:
        print(f"{r['accumulator']:28} blocks {str(r['blocks']):>5}  {r['rel_error']:.2e}")
    if _OUT.value:
        machine.write_result(_OUT.value, dict(n=n, d=d, v=v, k=k, backend=jax.default_backend(), rows=rows))


if __name__ == "__main__":
    launch.run(main)
