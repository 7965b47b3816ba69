"""Forward results agree across mesh shapes; parameters land where the rules say."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.support import tiny
from tlt_jax import sharding
from tlt_jax.models import transformer as tfm

CFG = tiny.config(vocab_size=64, qkv_bias=True)


def test_eight_devices_present():
    assert jax.device_count() == 8


@pytest.fixture(scope="module")
def unsharded():
    """(params, tokens, the unsharded forward), the same for every mesh: computed once,
    jitted (op by op, each operation compiles a program of its own)."""
    params = jax.jit(tfm.init_params, static_argnums=(0, 2))(CFG, jax.random.PRNGKey(0), 0.1)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 6), 0, CFG.vocab_size)
    return params, tokens, jax.jit(tfm.forward, static_argnums=1)(params, CFG, tokens)


@pytest.mark.parametrize("shape", [(1, 1, 1), (8, 1, 1), (2, 2, 2), (1, 2, 4)])
def test_forward_equal_across_meshes(shape, unsharded):
    params, tokens, ref = unsharded
    devices = jax.devices()[: int(np.prod(shape))]
    mesh = sharding.make_mesh(dict(zip(sharding.MESH_AXES, shape)), devices)
    p_sh = tfm.param_shardings(CFG, params, mesh)
    x_sh = sharding.batch_sharding(mesh, 2)
    fwd = sharding.jit_sharded(lambda p, t: tfm.forward(p, CFG, t), in_shardings=(p_sh, x_sh),
                               out_shardings=sharding.batch_sharding(mesh, 3))
    placed = tfm.shard_params(CFG, params, mesh)
    out = fwd(placed, jax.device_put(tokens, x_sh))
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    if shape == (1, 2, 4):
        assert placed["layers"]["wq"].sharding.spec == P(None, "fsdp", "tensor", None)
        # 2 KV heads cannot split 4 ways: replicated on tensor, still split on fsdp.
        assert placed["layers"]["wk"].sharding.spec == P(None, "fsdp", None, None)
        assert placed["layers"]["w_down"].sharding.spec == P(None, "tensor", "fsdp")
        assert placed["lm_head"].sharding.spec == P("fsdp", "tensor")
        assert placed["embed"].sharding.spec == P("tensor", "fsdp")
        assert out.sharding.spec == P(("data", "fsdp"), None, None)
        assert len(placed["layers"]["wq"].addressable_shards) == 8
        assert placed["layers"]["wq"].addressable_shards[0].data.shape == (2, 16, 1, 8)


def test_mesh_errors_are_clear():
    with pytest.raises(ValueError, match="has 4 devices but 8 are available"):
        sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 1})
    with pytest.raises(ValueError, match="Unknown mesh axes"):
        sharding.make_mesh({"model": 8})
    mesh = sharding.make_mesh({"data": -1, "tensor": 2})
    assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    with pytest.raises(ValueError, match="No sharding rule"):
        sharding.logical_to_spec(("bogus",), (4,), mesh)
