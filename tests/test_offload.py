"""Optimizer host offload (`lrl.rl.offload`): the streamed, layer-by-layer update with masters
and moments in pinned host memory is the on-device update's arithmetic; its state saves and
restores in host memory; the "auto" rule offloads exactly when the device cannot hold the
state (fake memory numbers, and Qwen2.5-7B's shapes on a 141 GB H200).

On CPU the "pinned_host" memory kind exists (jax 0.10: CPU devices list it), so the arrays
really carry it and the program really moves slices between the two spaces, but both are
the same RAM: what these tests show is the math and the bookkeeping, not the saving."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrl import checkpoint as ck
from lrl import build, config_util, models
from lrl.rl import optim as optim_lib
from lrl import mesh as mesh_lib
from lrl.rl import offload, optim
from lrl.rl import train as train_lib
from lrl.rl import update as upd

from tests.test_update import CFG, LOSS, _batch, _params

_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs/")
MESH = {"fsdp": 2, "tensor": 2, "data": 2}


def _txs(cfg, clip=0.05, lr=1e-2):
    kw = dict(lr=lr, warmup_steps=2, total_steps=10, weight_decay=0.1)
    on_device = optim.make_optimizer(**kw, clip_norm=clip)
    off = offload.Offload(optim.make_optimizer(**kw, clip_norm=None), clip,
                          compute_dtype=cfg.dtype, master_dtype=cfg.param_dtype)
    return on_device, off


def _run(cfg, tx, mesh, steps=3, host_driven=False, params=None):
    """`steps` updates from the same params and batches -> (state, metrics per step)."""
    sh = upd.train_state_shardings(cfg, tx, mesh)
    params = jax.tree.map(jnp.array, _params() if params is None else params)
    state = train_lib.place_train_state(params, tx, sh)
    out = []
    if host_driven:   # the loop's path: accumulate per micro-batch, then apply
        u = upd.make_update_programs(cfg, LOSS, tx, mesh, chunk=8)
    else:
        fn = upd.make_update_fn(cfg, LOSS, tx, mesh, num_micro=2, chunk=8)
    for i in range(steps):
        batch = jax.device_put(_batch(seed=i), mesh_lib.batch_sharding(mesh, 2))
        if host_driven:
            mbs = [jax.tree.map(lambda x: x[j::2], batch) for j in range(2)]
            denoms = upd.host_denominators([jax.device_get(m) for m in mbs], LOSS.max_len)
            state, m = upd.run_update(u, state, mbs, denoms)
        else:
            state, m = fn(state, batch)
        out.append(jax.device_get(m))
    return state, out


def _close(a, b, rtol, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _moments(opt_state):
    return [x for x in jax.tree.leaves(opt_state) if x.ndim >= 1]


@pytest.mark.parametrize("host_driven", [pytest.param(False, marks=pytest.mark.slow), True])
def test_offloaded_update_is_the_on_device_update(host_driven):
    """fp32 compute, so the device copy is the masters: three AdamW steps (warm-up, weight
    decay with the norm mask, a clip that bites) give the same masters, moments and metrics
    to fp32 rounding, and the state is where it should be."""
    mesh = mesh_lib.make_mesh(MESH)
    on_device, off = _txs(CFG)
    want, wm = _run(CFG, on_device, mesh, host_driven=host_driven)
    got, gm = _run(CFG, off, mesh, host_driven=host_driven)
    masters, inner = got.opt_state
    for leaf in jax.tree.leaves(masters) + _moments(inner):
        assert leaf.sharding.memory_kind == "pinned_host"
    for leaf in jax.tree.leaves(got.params):
        assert leaf.sharding.memory_kind == "device"
    q = masters["layers"]["q_proj"]["kernel"]
    assert q.sharding.spec == got.params["layers"]["q_proj"]["kernel"].sharding.spec
    # The two programs fuse differently, so their gradients' sums round in another order: a
    # gradient that nearly cancels differs by a rounding of the leaf's larger terms, and Adam
    # divides each by its own root mean square, which lifts that to a visible step. Adam moves
    # an element by about lr a step: a thousandth of that (1e-5) is far below a real error (a
    # missed clip or decay moves elements by a sizeable part of lr) and above the rounding
    # seen (4e-6 at most, jaxlib 0.10.2 with the CPU's elemental emitter). The moments: to
    # 1e-4 of each leaf's largest (the clip alone scales them by ~0.02; 1.6e-5 seen).
    _close(masters, want.params, rtol=2e-6, atol=1e-5)
    _close(got.params, want.params, rtol=2e-6, atol=1e-5)
    for x, y in zip(_moments(inner), _moments(want.opt_state)):
        y = np.asarray(y)
        np.testing.assert_allclose(np.asarray(x), y, rtol=2e-6, atol=1e-4 * np.abs(y).max())
    assert int(got.step) == int(want.step) == 3
    for w, g in zip(wm, gm):
        assert w["grad_norm"] > 0.05   # the clip acted
        for k in ("grad_norm", "update_norm", "learning_rate", "loss"):
            np.testing.assert_allclose(g[k], w[k], rtol=1e-5, err_msg=k)
    assert not np.allclose(np.asarray(masters["final_norm"]["scale"]), 1.0)


def test_unscanned_layers_update_in_one_block():
    """With `model.scan_layers=False` no parameter has a layer axis: the whole model is the
    block outside the layers, and the step is still the on-device one."""
    cfg = dataclasses.replace(CFG, scan_layers=False)
    params = models.init_params(cfg, jax.random.key(0))
    assert not any(k == offload.LAYERS for k in params)
    mesh = mesh_lib.make_mesh(MESH)
    on_device, off = _txs(cfg)
    want, _ = _run(cfg, on_device, mesh, steps=2, host_driven=True, params=params)
    got, _ = _run(cfg, off, mesh, steps=2, host_driven=True, params=params)
    _close(got.opt_state.masters, want.params, rtol=2e-6, atol=1e-5)
    _close(got.params, want.params, rtol=2e-6, atol=1e-5)


def test_parameters_larger_than_a_layer_update_a_block_of_rows_at_a_time():
    """`split_rest` (one device): the embedding and the head, each larger than a layer here,
    are updated a block of rows at a time (the embedding's 512 rows in blocks that hold no
    more than a layer), and the step is still the on-device one, the clip and the weight
    decay's mask included."""
    cfg = dataclasses.replace(CFG, vocab_size=512)
    params = models.init_params(cfg, jax.random.key(0))
    mesh = mesh_lib.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    on_device, off = _txs(cfg)
    off = off._replace(split_rest=True)
    kinds, _, layer = offload._kinds(off, params)
    split = [path for (path, _), k in zip(jax.tree_util.tree_flatten_with_path(params)[0], kinds)
             if k == "B"]
    assert sorted(jax.tree_util.keystr(p) for p in split) == ["['embed']['embedding']",
                                                              "['lm_head']"], split
    rows = offload._rows_per_block(params["embed"]["embedding"], layer)
    assert 1 < 512 // rows and rows * cfg.d_model <= layer and 512 % rows == 0
    want, wm = _run(cfg, on_device, mesh, steps=3, host_driven=True, params=params)
    got, gm = _run(cfg, off, mesh, steps=3, host_driven=True, params=params)
    _close(got.opt_state.masters, want.params, rtol=2e-6, atol=1e-5)
    _close(got.params, want.params, rtol=2e-6, atol=1e-5)
    for x, y in zip(_moments(got.opt_state.inner), _moments(want.opt_state)):
        y = np.asarray(y)
        np.testing.assert_allclose(np.asarray(x), y, rtol=2e-6, atol=1e-4 * np.abs(y).max())
    for w, g in zip(wm, gm):
        for k in ("grad_norm", "update_norm", "learning_rate"):
            np.testing.assert_allclose(g[k], w[k], rtol=1e-5, err_msg=k)


def test_rows_per_block():
    x = jax.ShapeDtypeStruct((12, 10), jnp.float32)
    assert offload._rows_per_block(x, 60) == 6
    assert offload._rows_per_block(x, 45) == 4
    assert offload._rows_per_block(x, 5) == 1      # a row alone is more: one row a block
    assert offload._rows_per_block(x, 10**6) == 12


def test_decode_weights_dropped_between_rollouts_are_laid_out_again():
    """keep=False (the offloaded run's): `release` drops the decode-layout copy, the next
    `refresh` lays it out anew, equal to the kept copy; keep=True ignores `release`."""
    from lrl.rollout.weights import DecodeWeights
    params = jax.tree.map(jnp.array, _params())
    kept, dropped = DecodeWeights(CFG), DecodeWeights(CFG, keep=False)
    want = kept.refresh(params)
    got = dropped.refresh(params)
    device = jax.devices()[0]
    assert dropped.device_bytes(device) == kept.device_bytes(device) > 0
    dropped.release()
    kept.release()
    assert dropped.params is None and dropped.device_bytes(device) == 0
    assert kept.params is want
    again = dropped.refresh(params)
    _close(again, want, rtol=0, atol=0)
    _close(got, want, rtol=0, atol=0)


def test_pool_takes_its_share_beside_the_larger_of_decode_weights_and_the_update():
    from lrl.build import pool_free
    # 100 usable, 40 in use of which the decode weights 15, the update reserves 30
    assert pool_free(100, 40, 30, 15, keep_decode=True) == 30
    assert pool_free(100, 40, 30, 15, keep_decode=False) == 45    # 100 - 25 - max(15, 30)
    assert pool_free(100, 40, 10, 15, keep_decode=False) == 60    # 100 - 25 - max(15, 10)


@pytest.mark.slow
def test_bf16_compute_copy_with_fp32_masters_moves_at_a_small_lr():
    """bf16 compute: the offloaded masters follow the on-device fp32 masters (the gradients
    differ only in the bf16 rounding of the weights the forward reads), and at lr 1e-6 the
    masters move where bf16 weights could not: most steps of 1e-6 round away in bf16."""
    cfg = CFG.replace(dtype=jnp.bfloat16)
    mesh = mesh_lib.make_mesh(MESH)
    on_device, off = _txs(cfg, lr=1e-6)
    want, _ = _run(cfg, on_device, mesh, steps=2)
    got, _ = _run(cfg, off, mesh, steps=2)
    masters = got.opt_state.masters
    for leaf in jax.tree.leaves(got.params):
        assert leaf.dtype == jnp.bfloat16
    _close(masters, want.params, rtol=1e-5, atol=1e-7)
    start = _params()["layers"]["up_proj"]["kernel"]
    moved = np.asarray(masters["layers"]["up_proj"]["kernel"]) != np.asarray(start)
    assert moved.mean() > 0.9
    # The bf16 copy is the masters rounded: the steps of 1e-6 vanish in most weights.
    np.testing.assert_array_equal(
        np.asarray(got.params["layers"]["up_proj"]["kernel"]),
        np.asarray(masters["layers"]["up_proj"]["kernel"].astype(jnp.bfloat16)))


@pytest.mark.slow
def test_offloaded_state_saves_and_resumes(tmp_path):
    """Orbax writes the host-resident masters and moments and reads them back into host
    memory; a step from the restored state is the step from the original."""
    mesh = mesh_lib.make_mesh(MESH)
    _, off = _txs(CFG)
    state, _ = _run(CFG, off, mesh, steps=1)
    with ck.CheckpointManager(str(tmp_path / "ckpt"), every_steps=1) as mgr:
        mgr.save(1, state, data_state={"phase": "grpo"})
    abstract = train_lib.abstract_train_state(CFG, off, mesh)
    with ck.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        restored = mgr.restore(abstract).state
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert a.sharding.memory_kind == b.sharding.memory_kind
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(restored))
    fn = upd.make_update_fn(CFG, LOSS, off, mesh, num_micro=2, chunk=8)
    batch = jax.device_put(_batch(seed=5), mesh_lib.batch_sharding(mesh, 2))
    a, _ = fn(restored, batch)
    b, _ = fn(state, batch)
    _close(a, b, rtol=0, atol=0)


GIB = 2**30


@pytest.mark.parametrize("mode,platform,device,on_dev,host_need,host,want", [
    ("auto", "gpu", 80 * GIB, 30 * GIB, 22 * GIB, 256 * GIB, False),   # fits half the device
    ("auto", "gpu", 80 * GIB, 41 * GIB, 30 * GIB, 256 * GIB, True),    # more than half
    ("auto", "gpu", 80 * GIB, 41 * GIB, 230 * GIB, 256 * GIB, False),  # the host cannot either
    ("auto", "gpu", None, 900 * GIB, 1, 256 * GIB, False),             # no memory reported
    ("auto", "cpu", 8 * GIB, 900 * GIB, 1, 256 * GIB, False),          # CPU: never by itself
    ("on", "cpu", None, 1, 1, None, True),
    ("off", "gpu", 80 * GIB, 900 * GIB, 1, 256 * GIB, False),
])
def test_auto_rule_on_fake_memory(mode, platform, device, on_dev, host_need, host, want):
    got, why = offload.decide(mode, platform=platform, device_limit=device,
                              on_device=on_dev, offloaded_host=host_need, host_limit=host)
    assert got is want, why


def test_the_pinned_cap_bounds_the_offload():
    """The state must fit what jax's GPU client may pin (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB), not
    only the host: 7B's 85 GiB against jax's own 64 GB stays on the device under "auto" and is
    refused under "on", each naming the variable."""
    from lrl import xla_env
    kw = dict(platform="gpu", device_limit=80 * GIB, on_device=113 * GIB,
              offloaded_host=85 * GIB, host_limit=256 * GIB)
    assert xla_env.pinned_limit({}) == 64 * 10**9
    assert xla_env.pinned_limit({"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "200"}) == 200 * 10**9
    got, why = offload.decide("auto", **kw, pinned_limit=xla_env.pinned_limit({}))
    assert not got and "pin" in why
    with pytest.raises(ValueError, match="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"):
        offload.decide("on", **kw, pinned_limit=64 * 10**9)
    assert offload.decide("auto", **kw, pinned_limit=200 * 10**9)[0]
    assert offload.decide("auto", **kw)[0]   # no cap (not a GPU)


def test_forced_offload_that_the_host_cannot_hold_names_the_setting():
    with pytest.raises(ValueError, match="optim.offload='on'.*host"):
        offload.decide("on", platform="gpu", device_limit=80 * GIB, on_device=100 * GIB,
                       offloaded_host=300 * GIB, host_limit=256 * GIB)
    with pytest.raises(ValueError, match="optim.offload='maybe'"):
        offload.decide("maybe", platform="gpu", device_limit=1, on_device=1,
                       offloaded_host=1, host_limit=1)


def _qwen(size):
    """Qwen2.5 shapes (HF config.json of Qwen2.5-1.5B / -7B), fp32 masters, bf16 compute."""
    shapes = {"1.5b": dict(vocab_size=151936, d_model=1536, n_layers=28, n_heads=12,
                           n_kv_heads=2, mlp_dim=8960, tie_embeddings=True),
              "7b": dict(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28,
                         n_kv_heads=4, mlp_dim=18944)}[size]
    return models.ModelConfig(model_type="qwen2", head_dim=128, qkv_bias=True,
                              dtype=jnp.bfloat16, param_dtype=jnp.float32, **shapes)


@pytest.mark.parametrize("size,want", [("7b", True), ("1.5b", False)])
def test_qwen2_5_math_7b_offloads_on_one_h200_and_1_5b_does_not(size, want):
    """configs/qwen2_5_math.py as shipped (optim.offload="auto", fp32 masters) on one H200
    (141 GB; a 128 GiB host): 7.6B parameters x 16 bytes (masters, two moments, gradients)
    are 122 GB on the device, so 7B offloads its 91 GB of masters and moments; 1.5B's 25 GB
    stay."""
    c = config_util.load(_CONFIGS + "qwen2_5_math.py", size)
    assert c.optim.offload == "auto" and c.model.param_dtype == "float32"
    shapes = models.abstract_params(_qwen(size))
    n = sum(x.size for x in jax.tree.leaves(shapes))
    assert (7.5e9 < n < 7.7e9) if size == "7b" else (1.5e9 < n < 1.6e9)
    got, why = offload.decide(c.optim.offload, platform="gpu", device_limit=141 * 10**9,
                              on_device=offload.state_bytes(shapes),
                              offloaded_host=offload.state_bytes(shapes, bytes_per_param=12),
                              host_limit=128 * GIB)
    assert got is want, why


def test_config_field_builds_the_offloaded_optimizer():
    """optim.offload reaches the optimizer the loop builds; on CPU "auto" stays off."""
    c = config_util.load(_CONFIGS + "default.py", "runlocal")
    opts = build.options(c, check_files=False)
    assert opts.optim.offload == "auto"
    assert build.offload(opts.optim, CFG, None)[0] is None   # CPU: off
    c.optim.offload = "on"
    opts = build.options(c, check_files=False)
    cfg_, _ = build.offload(opts.optim, CFG, None)
    tx = optim_lib.for_phase(opts.optim, 10, offload_cfg=cfg_)
    assert offload.is_offload(tx) and tx.clip_norm == c.optim.clip_norm
    c.critic.optim.offload = "on"
    with pytest.raises(ValueError, match="critic.optim.offload"):
        build.options(c, check_files=False)


def test_placed_state_is_the_initial_state_leaf_by_leaf():
    """`place_train_state` builds the offloaded state a leaf at a time (moments as host zeros,
    the optimizer's scalars from an init on empty parameters): the same values, structure and
    shardings as `init_train_state` whole; and from host masters (an offloaded SFT phase handing
    on to GRPO) the same again."""
    mesh = mesh_lib.make_mesh(MESH)
    _, off = _txs(CFG.replace(dtype=jnp.bfloat16))
    sh = upd.train_state_shardings(CFG, off, mesh)
    params = jax.tree.map(jnp.array, _params())
    placed = train_lib.place_train_state(params, off, sh)
    whole = jax.device_put(train_lib.init_train_state(params, off), sh)
    again = train_lib.place_train_state(train_lib.masters(placed), off, sh)
    assert jax.tree.structure(placed) == jax.tree.structure(whole)
    for a, b, c, s in zip(*(jax.tree.leaves(t) for t in (placed, whole, again, sh))):
        assert a.dtype == b.dtype == c.dtype and a.sharding == s == c.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(c), np.asarray(b))


@pytest.mark.slow
def test_loop_with_offload_on_equals_off_and_resumes(tmp_path):
    """The whole loop (SFT, then GRPO) with optim.offload="on" learns what it learns with
    "off" (fp32 compute: the same numbers to rounding), hands the SFT masters on to GRPO,
    checkpoints the host-resident state and resumes from it."""
    from lrl import loop
    from tests.test_loop import tiny_config

    def cfg(offload_, steps=2):
        c = tiny_config()
        c.sft.steps, c.rl.steps, c.eval.every = 2, steps, 0
        c.optim.offload = offload_
        return c

    loop.run(cfg("off"), str(tmp_path / "off"))
    loop.run(cfg("on"), str(tmp_path / "on"))
    want = ck.restore_params(str(tmp_path / "off" / "checkpoints")).state
    got = ck.restore_params(str(tmp_path / "on" / "checkpoints")).state
    _close(got, want, rtol=1e-4, atol=1e-6)
    rows = [json.loads(x) for x in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
    out = loop.run(cfg("on", steps=3), str(tmp_path / "on"))   # resumes at GRPO step 2
    assert np.isfinite(out["grpo"]["loss"])
    steps = [json.loads(x)["step"] for x in (tmp_path / "on" / "metrics.jsonl").read_text()
             .splitlines()]
    assert steps[-1] == 5 and steps.count(5) == 1


@pytest.mark.slow
def test_offloaded_run_lays_the_decode_weights_out_for_each_rollout(tmp_path, monkeypatch):
    """optim.offload="on" with the device's memory faked (the live arrays against 256 MiB, so
    the pool is sized from it): the engine's note says so, the decode-layout copy is dropped
    at start-up and before every update and laid out anew for each rollout, and the run
    trains."""
    from lrl import loop
    from lrl.rl import budget as budget_lib
    from lrl.rollout import weights
    from tests.test_loop import tiny_config

    c = tiny_config()
    c.sft.steps, c.rl.steps, c.eval.every = 0, 2, 0
    c.optim.offload = "on"

    def memory(device):
        used = sum(sh.data.nbytes for a in jax.live_arrays() for sh in a.addressable_shards
                   if sh.device == device)
        return 256 << 20, used
    monkeypatch.setattr(budget_lib, "device_memory", memory)
    events, written = [], []
    release, refresh = weights.DecodeWeights.release, weights.DecodeWeights.refresh
    monkeypatch.setattr(weights.DecodeWeights, "release", lambda self: events.append(
        ("release", self.params is not None)) or release(self))
    monkeypatch.setattr(weights.DecodeWeights, "refresh", lambda self, p: events.append(
        ("refresh", self.params is None)) or refresh(self, p))
    note = loop.MetricsWriter.note
    monkeypatch.setattr(loop.MetricsWriter, "note",
                        lambda self, text: written.append(text) or note(self, text))
    out = loop.run(c, str(tmp_path))
    assert np.isfinite(out["grpo"]["loss"])
    assert any("decode-layout weights made for each rollout" in x for x in written), written
    # start-up, then each of the two steps: laid out (none was there), then dropped
    assert events.count(("refresh", True)) == 3, events
    assert events.count(("release", True)) == 3, events
