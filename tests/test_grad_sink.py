"""The scanned layers' weight gradients added into the accumulator inside the backward
(`lrl.models.grad_sink`): the accumulator jax's stacked gradient gives, unsharded, sharded over
fsdp x tensor and with ring attention over seq; the stacked buffer gone from the compiled
program; jax's way where the loss's decoder reads other weights; the 'auto' rule."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrl import mesh as mesh_lib
from lrl import models
from lrl.models import grad_sink
from lrl.rl import optim
from lrl.rl import update as upd
from lrl.rl.losses import LossConfig
from lrl.rl.train import Accumulator

from tests.test_update import CFG, LOSS, _batch

TX = optim.make_optimizer(lr=1e-2, warmup_steps=0, total_steps=10, clip_norm=None)


@pytest.fixture
def taken(monkeypatch):
    """How many times a decoder ran its layers through the sink."""
    calls = []
    layers = grad_sink.layers

    def counted(*args, **kw):
        calls.append(1)
        return layers(*args, **kw)
    monkeypatch.setattr(grad_sink, "layers", counted)
    return calls


def _accumulated(cfg, sink, mesh=None, micro_loss=None, batch=None, loss=LOSS):
    """Two micro-batches accumulated from zero -> the accumulator (on the host)."""
    u = upd.make_update_programs(cfg, loss, TX, mesh, chunk=8, grad_sink=sink)
    if micro_loss is not None:
        from lrl.rl import train
        u = u._replace(programs=train.make_accumulate_programs(
            micro_loss(u), cfg, TX, mesh, grad_sink=sink))
    params = models.init_params(cfg, jax.random.key(0))
    batch = _batch(seed=0, rows=8) if batch is None else batch
    mbs = [jax.tree.map(lambda x: x[j::2], batch) for j in range(2)]
    denoms = upd.host_denominators(mbs, loss.max_len)
    if mesh is not None:
        mbs = [jax.device_put(m, mesh_lib.batch_sharding(mesh, 2)) for m in mbs]
        params = jax.device_put(params, upd.train_state_shardings(cfg, TX, mesh).params)
    acc = u.programs.start(params, mbs[0], denoms, None)
    for mb in mbs:
        acc = u.programs.accumulate(params, acc, mb, denoms, None)
    return jax.device_get(acc)


def _close(a: Accumulator, b: Accumulator, rtol, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.parametrize("remat", ["full", "dots_attn"])
def test_sink_accumulates_the_stacked_gradient(remat, taken):
    """Every gradient and metric as jax's stacked path gives them, whatever remat the model
    names (the sink recomputes each layer whole)."""
    cfg = CFG.replace(remat=remat)
    want = _accumulated(cfg, sink=False)
    assert not taken
    got = _accumulated(cfg, sink=True)
    assert taken, "the decoder did not take the sink"
    _close(got, want, rtol=1e-5, atol=1e-7)
    assert float(np.abs(got.grads["layers"]["q_proj"]["kernel"]).max()) > 0


@pytest.mark.parametrize("axes,attention", [
    ({"fsdp": 2, "tensor": 2, "data": 2}, "dense"),
    pytest.param({"fsdp": 2, "seq": 4}, "ring", marks=pytest.mark.slow),
])
def test_sink_on_a_mesh_is_the_unsharded_stacked_gradient(axes, attention, taken):
    """Sharded (parameters and accumulator over fsdp x tensor; or the ring over seq, whose
    shard_map runs inside the sink's loops) against the unsharded stacked path."""
    cfg = CFG.replace(attention=attention)
    want = _accumulated(CFG, sink=False)
    got = _accumulated(cfg, sink=True, mesh=mesh_lib.make_mesh(axes))
    assert taken
    _close(got, want, rtol=2e-4, atol=2e-6)


def test_sink_with_shared_prompts(taken):
    """Rows in the shared-prompt layout (a group's prompt once, its prefix ids passed to every
    layer's attention): the sink's accumulator is the stacked path's."""
    from tests.test_shared_prompt import LOSSES, _update_batches
    _, (batch, _) = _update_batches(3, 4, 48, 4, 32)
    assert batch["prefix_ids"].any()
    loss = LossConfig(**LOSSES["token_mean"])
    want = _accumulated(CFG, sink=False, batch=batch, loss=loss)
    got = _accumulated(CFG, sink=True, batch=batch, loss=loss)
    assert taken
    _close(got, want, rtol=1e-5, atol=1e-7)


def test_a_loss_reading_other_weights_differentiates_as_usual(taken):
    """A loss that hands the decoder other arrays than the accumulated weights (here a copy
    of them) leaves the sink untaken, and the step differentiates the stacked way."""
    def copying(u):
        def loss(params, mb, *args):
            return upd.micro_loss(jax.tree.map(lambda x: x * 1.0, params), mb, *args,
                                  objective=u.objective)
        return loss
    want = _accumulated(CFG, sink=False, micro_loss=copying)
    got = _accumulated(CFG, sink=True, micro_loss=copying)
    assert not taken
    _close(got, want, rtol=1e-6, atol=1e-8)


def test_a_loss_reading_the_layers_twice_differentiates_as_usual(taken):
    """A second pass over the same weights in one loss (its gradient would be lost, the
    weights not being differentiated) makes the step take jax's way: the gradient of both
    passes."""
    def twice(u):
        def loss(params, mb, *args):
            (l1, m), (l2, _) = (upd.micro_loss(params, mb, *args, objective=u.objective)
                                for _ in range(2))
            return l1 + 0.5 * l2, m
        return loss
    want = _accumulated(CFG, sink=False, micro_loss=twice)
    got = _accumulated(CFG, sink=True, micro_loss=twice)
    assert taken   # the first pass took it; the second found it taken
    _close(got, want, rtol=1e-6, atol=1e-8)


def test_the_stacked_gradient_leaves_the_program():
    """The accumulating program (bf16 weights, an fp32 accumulator: the offloaded optimizer's
    case) compiled both ways: the sink's temporaries are smaller by at least the stacked
    gradient (one bf16 copy of the layers' weights, less one layer's gradient the sink
    holds), and the accumulator stays in place."""
    cfg = models.tiny_config(vocab_size=256, d_model=256, n_layers=16, n_heads=4, n_kv_heads=2,
                             head_dim=64, mlp_dim=1024, dtype="bfloat16",
                             param_dtype="bfloat16", remat="full")
    params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
    T = 256
    mb = {k: jax.ShapeDtypeStruct((1, T), jnp.int32)
          for k in ("tokens", "positions", "segment_ids", "targets")}
    mb.update({k: jax.ShapeDtypeStruct((1, T), jnp.float32)
               for k in ("loss_mask", "advantages")})
    denoms = upd._DENOMS
    out = {}
    for sink in (False, True):
        u = upd.make_update_programs(cfg, LossConfig(), TX, None, chunk=128,
                                     grad_sink=sink)
        acc = jax.eval_shape(lambda p: u.programs.start(p, mb, denoms, None), params)
        acc = Accumulator(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32),
                                       acc.grads), acc.metrics)
        out[sink] = u.programs.accumulate.lower(params, acc, mb, denoms,
                                                None).compile().memory_analysis()
    layer_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params["layers"]))
    saved = out[False].temp_size_in_bytes - out[True].temp_size_in_bytes
    # less what the sink holds of one layer at a time: its gradient, in bf16 and in fp32
    assert saved >= layer_bytes * (1 - 3 / cfg.n_layers), (saved, layer_bytes)
    acc_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))   # fp32
    assert out[True].alias_size_in_bytes >= acc_bytes, out[True].alias_size_in_bytes


def test_auto_rule():
    assert grad_sink.decide("auto", offloaded=True, remat="dots_attn")[0]
    assert grad_sink.decide("auto", offloaded=False, remat="full")[0]
    assert not grad_sink.decide("auto", offloaded=False, remat="save_attn")[0]
    assert grad_sink.decide("on", offloaded=False, remat="none")[0]
    assert not grad_sink.decide("off", offloaded=True, remat="full")[0]
    with pytest.raises(ValueError, match="grad_sink"):
        grad_sink.decide("yes", offloaded=False, remat="full")


def test_the_critics_setting_is_refused_on():
    """The critic's update stacks its gradients: `critic.optim.grad_sink='on'` names itself."""
    from lrl import build, config_util
    c = config_util.load(os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "configs", "default.py"), "runlocal")
    c.critic.optim.grad_sink = "on"
    with pytest.raises(ValueError, match="critic.optim.grad_sink"):
        build.options(c, check_files=False)
