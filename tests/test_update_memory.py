"""What the update's programs ask of a device's memory, as the budget counts it
(`lrl.rl.update.need_bytes` and `apply_bytes`, compiled and not run): the gradient accumulator
is kept in the masters' dtype (bf16 masters: 2 bytes a parameter, not an fp32 copy's 4) and is
donated to `accumulate`, so the program counts it once; the optimizer step's need counts the
accumulator beside its own temporaries, with the train state donated."""
import jax
import jax.numpy as jnp
import optax
import pytest

from lrl import models
from lrl.rl import update as upd
from lrl.rl.losses import LossConfig

T = 64


def _cfg(param_dtype):
    return models.ModelConfig(model_type="qwen2", vocab_size=256, d_model=64, n_layers=2,
                              n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128, qkv_bias=True,
                              remat="full", dtype=jnp.bfloat16, param_dtype=param_dtype)


def _spec():
    ints = {k: jax.ShapeDtypeStruct((1, T), jnp.int32)
            for k in ("tokens", "positions", "segment_ids", "targets")}
    return {**ints, **{k: jax.ShapeDtypeStruct((1, T), jnp.float32)
                       for k in ("loss_mask", "advantages", "old_logp")}}


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float32])
def test_the_accumulator_is_in_the_masters_dtype_donated_and_counted_once(param_dtype):
    cfg, tx = _cfg(param_dtype), optax.adam(1e-3)
    u = upd.make_update_programs(cfg, LossConfig(aggregation="token_mean", max_len=T), tx)
    params, spec = models.abstract_params(cfg), _spec()
    acc = upd._abstract_accumulator(u, params, spec, None)
    assert {x.dtype for x in jax.tree.leaves(acc.grads)} == {jnp.dtype(param_dtype)}
    assert _bytes(acc.grads) == _bytes(params)
    m = u.programs.accumulate.lower(params, acc, spec, upd._DENOMS, None).compile(
    ).memory_analysis()
    # In: the params, the accumulator, the micro-batch and the scalar denominators (those
    # the loss reads); the accumulator comes back in its own buffers.
    inputs = _bytes(params) + _bytes(acc) + _bytes(spec)
    assert inputs <= m.argument_size_in_bytes <= inputs + 12
    assert m.alias_size_in_bytes >= _bytes(acc.grads)
    need = upd.need_bytes(u, params, spec)
    assert need == (m.argument_size_in_bytes - _bytes(params) + m.output_size_in_bytes
                    - m.alias_size_in_bytes + m.temp_size_in_bytes)

    state = upd.TrainState(jax.ShapeDtypeStruct((), jnp.int32), params,
                           jax.eval_shape(tx.init, params))
    m = u.programs.apply.lower(state, acc).compile().memory_analysis()
    assert m.alias_size_in_bytes >= _bytes(state) - 4   # the state is updated in place
    # Beyond the state: at least the accumulator it reads, and what the step adds.
    assert upd.apply_bytes(u, state, spec) >= _bytes(acc.grads) + m.temp_size_in_bytes


MLP = 1024   # wide against d_model 64, so keeping the MLP's activations would stand out


def _accumulate_temp(n_layers: int, T: int) -> int:
    cfg = models.ModelConfig(model_type="qwen2", vocab_size=256, d_model=64, n_layers=n_layers,
                             n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=MLP, qkv_bias=True,
                             remat="full", dtype=jnp.bfloat16, param_dtype=jnp.float32)
    u = upd.make_update_programs(cfg, LossConfig(aggregation="token_mean", max_len=T),
                                 optax.sgd(1e-3), chunk=256)
    params = models.abstract_params(cfg)
    ints = {k: jax.ShapeDtypeStruct((1, T), jnp.int32)
            for k in ("tokens", "positions", "segment_ids", "targets")}
    spec = {**ints, **{k: jax.ShapeDtypeStruct((1, T), jnp.float32)
                       for k in ("loss_mask", "advantages", "old_logp")}}
    acc = upd._abstract_accumulator(u, params, spec, None)
    return u.programs.accumulate.lower(params, acc, spec, upd._DENOMS, None).compile(
    ).memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_full_remat_keeps_about_one_layer_input_a_token_a_layer():
    """With full remat the accumulate program's temporaries grow, per token and per layer, by
    about the layer's input (d_model values), not by its MLP activations (2 x mlp_dim values,
    what the scanned layers keep without remat). Measured as the slope in both tokens and
    layers (a second difference, so the lm head's chunk, attention's workspace and the
    weights' gradients, which grow in one of them only, drop out): about 250 bytes here,
    76 KB with remat "none". On the XLA path only: the CPU compile has no cuDNN, whose
    packed backward holds E x T x N x H x 8 bytes (`flash.segments_for`)."""
    t = {(L, T): _accumulate_temp(L, T) for L in (2, 4) for T in (512, 1024)}
    slope = ((t[4, 1024] - t[4, 512]) - (t[2, 1024] - t[2, 512])) / (2 * 512)
    assert 0 < slope < MLP, t   # bytes a token a layer: under half of one bf16 MLP activation
