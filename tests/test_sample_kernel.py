"""The sampler's Pallas kernel (per-block max and sum of exp in one read of the logits)
against XLA: the kernel alone in the Pallas interpreter (and compiled, on a GPU), and whole
draws through `sampling.sample` with either impl."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrl.rollout import sample_kernel, sampling
from lrl.rollout.steps import EngineConfig


def _xla_stats(x_BV, block, temperature):
    x = (x_BV / temperature).reshape(x_BV.shape[0], -1, block)
    m = x.max(-1)
    return m, jnp.exp(x - jnp.where(m == -jnp.inf, 0.0, m)[..., None]).sum(-1)


def _logits(rows, V, seed=0):
    rng = np.random.RandomState(seed)
    x = (rng.randn(rows, V) * 4).astype(np.float32)
    x[1, :3 * 64] = -np.inf                  # whole blocks without mass
    x[2, ::3] = -np.inf                      # as after a top-k cut
    return jnp.asarray(x)


@pytest.mark.parametrize("per_program", [4, 8, 64])   # 37 blocks: the last program overlaps
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_block_stats_match_xla(per_program, temperature):
    x = _logits(3, 37 * 64)
    m, s = sample_kernel.block_stats(x, block=64, temperature=temperature,
                                     per_program=per_program, interpret=True)
    m_want, s_want = _xla_stats(x, 64, temperature)
    np.testing.assert_array_equal(np.asarray(m), np.asarray(m_want))
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_want), rtol=1e-6)
    assert (np.asarray(s)[1, :3] == 0).all() and np.isfinite(np.asarray(s)).all()


def test_block_stats_reject_a_block_that_does_not_tile():
    with pytest.raises(ValueError, match="power of two dividing V=100"):
        sample_kernel.block_stats(jnp.zeros((2, 100)), block=64)
    with pytest.raises(ValueError, match="power of two"):
        sample_kernel.block_stats(jnp.zeros((2, 96)), block=48)
    with pytest.raises(ValueError, match="per_program must be a power of two, got 12"):
        sample_kernel.block_stats(jnp.zeros((2, 128)), block=64, per_program=12)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (50, 1.0), (0, 0.8)])
def test_sample_with_the_kernel_draws_what_xla_draws(top_k, top_p):
    """The same keys give the same tokens and log-probs through the kernel (the Pallas
    interpreter) as through XLA's two reductions, filtered or not."""
    x = _logits(6, 40 * 64, seed=1)
    sp = sampling.SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)
    for step in range(3):
        keys = sampling.sample_keys(jax.random.key(2), jnp.arange(6), jnp.full(6, step))
        tok_x, logp_x = sampling.sample(x, keys, sp, impl="xla")
        tok_p, logp_p = sampling.sample(x, keys, sp, impl="pallas_interpret")
        np.testing.assert_array_equal(np.asarray(tok_p), np.asarray(tok_x))
        np.testing.assert_allclose(np.asarray(logp_p), np.asarray(logp_x), atol=1e-5)
    with pytest.raises(ValueError, match="sampling impl 'triton'"):
        sampling.sample(x, keys, sp, impl="triton")


def test_engine_config_rejects_an_unknown_sampling_impl():
    with pytest.raises(ValueError, match="sampling_impl='triton'"):
        EngineConfig(sampling_impl="triton")


def test_kernel_block_sizes():
    assert sampling._kernel_block(151936) == 128     # Qwen2.5 and Qwen3: 1,187 blocks
    assert sampling._kernel_block(128256) == 256     # Llama 3: 501 blocks
    assert sampling._kernel_block(152064) == 512     # Qwen2.5-VL: 297 blocks
    assert sampling._kernel_block(1 << 20) == 1024
    assert sampling._kernel_block(100003) == 0       # no power-of-two block: the XLA path


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Triton kernel")
def test_gpu_block_stats_match_xla():
    x = _logits(256, 151936)
    m, s = jax.jit(lambda x: sample_kernel.block_stats(x, block=128, temperature=0.8))(x)
    m_want, s_want = jax.jit(lambda x: _xla_stats(x, 128, 0.8))(x)
    np.testing.assert_array_equal(np.asarray(m), np.asarray(m_want))
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_want), rtol=1e-5)
