"""Checkpoints: sharded save on an fsdp×tensor mesh, restore on other meshes, keep-last-N,
cadence, corrupt/partial checkpoints, and the SIGTERM guard."""
import json
import logging
import os
import shutil
import signal
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import lrl.models as models
from lrl import checkpoint as ck
from lrl import mesh as mesh_lib

class State(NamedTuple):  # the shape of lrl.rl.update.TrainState, plus an rng key
    step: jax.Array
    params: dict
    opt_state: tuple
    rng: jax.Array


# orbax's reader may leave an asyncio callback behind when tensorstore fails mid-read.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

CFG = models.tiny_config(n_layers=2, d_model=32, mlp_dim=64, vocab_size=96, head_dim=8)
TX = optax.adamw(1e-2)


def make_state(mesh, seed=0):
    """step, params, adamw state (moments made non-zero), an rng key; all on `mesh`."""
    params = models.init_params(CFG, jax.random.key(seed), mesh)
    opt = jax.jit(lambda p: jax.tree.map(lambda x: x + 3 if x.dtype == jnp.int32 else
                                         x + 0.25 * jnp.cos(x), TX.init(p)))(params)
    rng = jax.device_put(jax.random.key(seed + 7), NamedSharding(mesh, P()))
    return State(jnp.int32(2), params, opt, rng)


def target_for(mesh):
    """The abstract state on `mesh`, from shapes only (as a resuming loop builds it)."""
    shapes = models.abstract_params(CFG)
    psh = models.param_shardings(CFG, mesh, shapes)
    rep = NamedSharding(mesh, P())
    sds = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)  # noqa: E731
    params = jax.tree.map(sds, shapes, psh)
    adam, *rest = jax.eval_shape(TX.init, shapes)
    adam = adam._replace(count=sds(adam.count, rep), mu=jax.tree.map(sds, adam.mu, psh),
                         nu=jax.tree.map(sds, adam.nu, psh))
    key = jax.eval_shape(lambda: jax.random.key(0))
    return State(sds(jax.ShapeDtypeStruct((), jnp.int32), rep), params, (adam, *rest),
                 sds(key, rep))


def leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("run") / "ckpt"
    mesh = mesh_lib.make_mesh({"fsdp": 4, "tensor": 2})
    state = make_state(mesh)
    q = state.params["layers"]["q_proj"]["kernel"]
    assert len({s.device for s in q.addressable_shards}) == 8 and q.sharding.spec[1] == "fsdp"
    with ck.CheckpointManager(d, keep=3) as mgr:
        mgr.save(7, state, data_state={"epoch": 1, "position": 1234}, model_config=CFG,
                 config={"lr": 1e-2, "mesh": {"fsdp": 4, "tensor": 2}, "name": "t"})
    host = jax.tree.map(lambda x: np.asarray(jax.random.key_data(x) if
                                             jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
                                             else x), state)
    return d, host


@pytest.mark.parametrize("where", ["mesh2", "one"])
def test_restore_on_fewer_devices(saved, where):
    d, host = saved
    if where == "mesh2":
        target = target_for(mesh_lib.make_mesh({"tensor": 2}, devices=jax.devices()[:2]))
        shardings = None
    else:
        target = target_for(mesh_lib.make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))
        shardings = SingleDeviceSharding(jax.devices()[3])
    got = ck.restore_latest(d, target, shardings)
    assert got.step == 7 and got.skipped == []
    assert got.data_state == {"epoch": 1, "position": 1234}
    assert got.config == {"lr": 1e-2, "mesh": {"fsdp": 4, "tensor": 2}, "name": "t"}
    assert got.model_config == CFG
    state = got.state
    assert isinstance(state, State)
    assert jax.dtypes.issubdtype(state.rng.dtype, jax.dtypes.prng_key)
    leaves_equal(jax.tree.map(np.asarray, jax.tree.map(
        lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
            x.dtype, jax.dtypes.prng_key) else x, state)), host)
    flat_t = jax.tree.leaves(target)
    for got_leaf, want in zip(jax.tree.leaves(state), flat_t):
        want_sharding = shardings or want.sharding
        assert got_leaf.sharding == want_sharding, (got_leaf.sharding, want_sharding)
    if where == "mesh2":
        q = state.params["layers"]["q_proj"]["kernel"]
        assert q.sharding.spec[2] == "tensor"
        assert len(q.addressable_shards) == 2
    # The restored state continues training: one more update runs on it.
    jax.block_until_ready(jax.jit(TX.update)(state.params, state.opt_state, state.params))


def test_wrong_state_is_a_caller_error(saved):
    d, _ = saved
    one = SingleDeviceSharding(jax.devices()[0])
    bad = jax.eval_shape(lambda: {"step": jnp.int32(0), "params": models.init_params(
        CFG.replace(mlp_dim=32), jax.random.key(0))})
    with pytest.raises(ck.StateMismatchError, match="not in state"):
        ck.restore_latest(d, bad, one)
    bigger = target_for(mesh_lib.make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))
    bigger.params["final_norm"]["scale"] = jax.ShapeDtypeStruct((CFG.d_model + 1,), jnp.float32)
    with pytest.raises(ck.StateMismatchError, match="final_norm/scale"):
        ck.restore_latest(d, bigger, one)


def small_state(i):
    return {"w": jnp.full((4, 3), float(i)), "n": jnp.int32(i), "rng": jax.random.key(i)}


def test_keep_last_n_and_cadence(tmp_path):
    mgr = ck.CheckpointManager(tmp_path, keep=2, every_steps=3)
    assert [s for s in range(1, 11) if mgr.should_save(s)] == [3, 6, 9]
    for s in (3, 6, 9, 12):
        mgr.save(s, small_state(s))
    mgr.wait()
    assert mgr.all_steps() == [9, 12]
    assert sorted(p for p in os.listdir(tmp_path) if p.isdigit()) == ["12", "9"]
    assert not mgr.should_save(12)
    mgr.close()
    timed = ck.CheckpointManager(tmp_path, keep=2, every_minutes=0.002)  # 0.12 s
    assert timed.latest_step() == 12 and not timed.should_save(12)
    assert not timed.should_save(13)
    time.sleep(0.2)
    assert timed.should_save(13)
    assert timed.save(13, small_state(13)) and not timed.save(13, small_state(99))
    assert not timed.should_save(14)
    timed.close()
    one = SingleDeviceSharding(jax.devices()[0])
    got = ck.restore_latest(tmp_path, jax.eval_shape(lambda: small_state(0)), one)
    assert got.step == 13 and float(got.state["w"][0, 0]) == 13.0 and got.data_state is None
    leaves_equal(got.state["rng"], jax.random.key(13))


def _garble(step_dir):
    for root, _, files in os.walk(step_dir / "state"):
        for f in files:
            if os.path.basename(root) == "d":  # the array data files
                path = os.path.join(root, f)
                b = bytearray(open(path, "rb").read())
                mid = len(b) // 2
                b[mid:mid + 8] = bytes(x ^ 0xFF for x in b[mid:mid + 8])
                open(path, "wb").write(bytes(b))


@pytest.mark.parametrize("damage", ["garbled", "missing", "bad_json"])
def test_corrupt_latest_falls_back(tmp_path, caplog, damage):
    with ck.CheckpointManager(tmp_path, keep=5) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, small_state(s), data_state=b'{"pos": %d}' % s)
    latest = tmp_path / "3"
    if damage == "garbled":
        _garble(latest)
    elif damage == "missing":
        for f in os.listdir(latest / "state"):
            if f.startswith("ocdbt") or f == "d":
                os.rename(latest / "state" / f, tmp_path / f"moved-{f}")
    else:
        (latest / "data" / "metadata").write_text("{not json")
    (tmp_path / "4.orbax-checkpoint-tmp-17").mkdir()
    one = SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(lambda: small_state(0))
    with caplog.at_level(logging.WARNING, logger="lrl.checkpoint"):
        got = ck.restore_latest(tmp_path, abstract, one)
    assert got.step == 2 and got.data_state == b'{"pos": 2}'
    assert float(got.state["w"][0, 0]) == 2.0
    assert [s for s, _, _ in got.skipped] == [3]
    text = caplog.text
    assert f"step 3 at {latest}" in text and "unreadable" in text
    assert "4.orbax-checkpoint-tmp-17" in text and "uncommitted" in text
    assert latest.exists()  # the read-only restore leaves everything in place
    # The manager's restore moves the bad step aside (never deletes it) and saves on.
    with ck.CheckpointManager(tmp_path, keep=5) as mgr:
        assert mgr.restore(abstract, one).step == 2
        assert mgr.all_steps() == [1, 2] and not latest.exists()
        moved = os.listdir(tmp_path / "quarantine")
        assert len(moved) == 1 and moved[0].startswith("3-")
        assert os.listdir(tmp_path / "quarantine" / moved[0])
        mgr.save(3, small_state(33))
    assert ck.restore_latest(tmp_path, abstract, one).state["n"] == 33
    assert (tmp_path / "4.orbax-checkpoint-tmp-17").exists()


@pytest.mark.parametrize("item", ["data", "config", "model_config", "meta", "state"])
@pytest.mark.parametrize("record", ["both", "orbax_only", "meta_only"])
def test_step_missing_an_item_falls_back(tmp_path, caplog, item, record):
    """A step directory that lost one of the items it was saved with is unreadable, like a
    corrupt one: named with the item, quarantined, the previous step used. The saved items
    are known from lrl's meta and from orbax's _CHECKPOINT_METADATA, either one alone."""
    with ck.CheckpointManager(tmp_path, keep=5) as mgr:
        for s in (1, 2):
            mgr.save(s, small_state(s), data_state={"phase": "grpo", "step": s},
                     config={"lr": 0.1}, model_config=CFG)
    latest = tmp_path / "2"
    if record == "meta_only":
        os.remove(latest / "_CHECKPOINT_METADATA")
    elif record == "orbax_only" and item != "meta":  # as a step saved before meta listed them
        meta = json.loads((latest / "meta" / "metadata").read_text())
        del meta["items"]
        (latest / "meta" / "metadata").write_text(json.dumps(meta))
    shutil.rmtree(latest / item)
    one = SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(lambda: small_state(0))
    with caplog.at_level(logging.WARNING, logger="lrl.checkpoint"):
        got = ck.restore_latest(tmp_path, abstract, one)
    assert got.step == 1 and got.data_state == {"phase": "grpo", "step": 1}
    assert [s for s, _, _ in got.skipped] == [2]
    assert f"step 2 at {latest}" in caplog.text and repr(item) in got.skipped[0][2]
    with ck.CheckpointManager(tmp_path, keep=5) as mgr:
        assert mgr.restore(abstract, one).step == 1
        assert mgr.all_steps() == [1] and not latest.exists()
        assert [p[:2] for p in os.listdir(tmp_path / "quarantine")] == ["2-"]


def test_export_reads_a_step_that_lost_only_what_export_does_not_read(tmp_path):
    with ck.CheckpointManager(tmp_path, keep=5) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"params": small_state(s)["w"]}, data_state={"step": s},
                     config={"lr": 0.1}, model_config=CFG)
    shutil.rmtree(tmp_path / "3" / "data")  # the data position: the params are intact
    got = ck.restore_params(tmp_path)
    assert got.step == 3 and float(got.state[0, 0]) == 3.0 and not got.skipped
    shutil.rmtree(tmp_path / "3" / "model_config")  # export needs it: the step before
    got = ck.restore_params(tmp_path)
    assert got.step == 2 and "'model_config'" in got.skipped[0][2]


def test_no_good_checkpoint_is_an_error(tmp_path):
    one = SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(lambda: small_state(0))
    assert ck.restore_latest(tmp_path / "nothing", abstract, one) is None
    with ck.CheckpointManager(tmp_path, keep=5) as mgr:
        assert mgr.restore(abstract, one) is None  # a fresh run
        mgr.save(1, small_state(1))
    _garble(tmp_path / "1")
    with pytest.raises(ck.CheckpointError, match=r"no readable checkpoint.*step 1"):
        ck.restore_latest(tmp_path, abstract, one)
    with pytest.raises(ck.CheckpointError, match="step 5"):
        ck.restore_latest(tmp_path, abstract, one, step=5)
    with pytest.raises(ValueError, match="'n' has no target sharding"):
        ck.restore_latest(tmp_path, abstract)


def test_params_restore_names_each_step_whose_state_cannot_be_read(tmp_path):
    """Export reads the state's tree metadata first: when no step's reads, the error names
    each step, its folder and the reader's reason, not only the checkpoint folder."""
    with ck.CheckpointManager(tmp_path, keep=5) as mgr:
        for s in (1, 2):
            mgr.save(s, small_state(s))
    for s in (1, 2):
        (tmp_path / str(s) / "state" / "_sharding").write_text("{not json")
    with pytest.raises(ck.CheckpointError) as e:
        ck.restore_params(tmp_path, params_key="")
    text = str(e.value)
    for s in (1, 2):
        assert f"step {s} ({tmp_path / str(s)})" in text
    assert "_sharding" in text


def test_sigterm_sets_the_flag_and_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with ck.PreemptionGuard() as guard:
        assert not guard.requested and not guard.should_stop(0)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 5
        while not guard.requested and time.time() < deadline:
            time.sleep(0.01)
        assert guard.requested and guard.should_stop(1)
    assert signal.getsignal(signal.SIGTERM) is before


def test_config_items_round_trip(tmp_path):
    import ml_collections
    cfg = ml_collections.ConfigDict({"lr": 3e-4, "axes": (1, 2), "dtype": jnp.bfloat16})
    mc = CFG.replace(eos_token_ids=(3, 4), bos_token_id=1, param_dtype=jnp.bfloat16,
                     attention="ring")
    with ck.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, small_state(1), config=cfg, model_config=mc,
                 data_state={"i": [1, 2], "grain": b"\x00\xffraw", "n": np.int64(5)})
        with pytest.raises(TypeError, match=r"data_state\['bad'\] is a object"):
            mgr.save(2, small_state(2), data_state={"bad": object()})
    got = ck.restore_latest(tmp_path, jax.eval_shape(lambda: small_state(0)),
                            SingleDeviceSharding(jax.devices()[0]))
    assert got.model_config == mc
    assert got.data_state == {"i": [1, 2], "grain": b"\x00\xffraw", "n": 5}
    assert got.config["lr"] == 3e-4 and got.config["axes"] == [1, 2]
    assert "bfloat16" in got.config["dtype"]
    with pytest.raises(ck.CheckpointError, match="flash"):
        ck.model_config_from_dict({**ck.model_config_to_dict(mc), "flash": True})


def test_saves_stage_arrays_in_ordinary_host_memory(tmp_path, monkeypatch):
    """On a GPU orbax's own default stages every array of a save in pinned host memory, under
    the cap jax puts on it, which an offloaded optimizer's masters and moments already fill
    (7B stopped at its first checkpoint): lrl's saves copy the arrays out into ordinary memory,
    the state and a further tree alike; orbax's default on the same backend would not. The
    checkpoint is orbax's own format, and says so."""
    from orbax.checkpoint._src.serialization import replica_slices
    seen = []
    real = replica_slices.transfer_arrays_to_host

    def spy(*a, **k):
        seen.append(k.get("enable_pinned_host_transfer"))
        return real(*a, **k)

    monkeypatch.setattr(replica_slices, "transfer_arrays_to_host", spy)
    # Orbax picks pinned staging by the backend when its handler is built: say "gpu".
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    state = {"w": jnp.arange(8.0), "b": jnp.ones(3)}
    with ck.CheckpointManager(tmp_path / "lrl", keep=1) as m:
        m.save(1, state, trees={"critic": {"v": jnp.zeros(2)}})
        m.wait()
        got = m.restore(jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
    assert seen and not any(seen), seen
    np.testing.assert_array_equal(got.state["w"], state["w"])
    # The step names orbax's own handler, so orbax alone reads it back.
    import orbax.checkpoint as ocp
    handlers = json.loads((tmp_path / "lrl" / "1" / "_CHECKPOINT_METADATA").read_text())[
        "item_handlers"]
    assert handlers["state"] == handlers["critic"] == ocp.PyTreeCheckpointHandler.typestr()
    seen.clear()
    monkeypatch.setattr(ck, "_handlers", lambda: None)   # orbax's own handlers
    with ck.CheckpointManager(tmp_path / "orbax", keep=1) as m:
        m.save(1, {"w": jnp.arange(8.0)})
        m.wait()
    assert seen and all(seen), seen


def test_a_save_keeps_a_bounded_share_of_the_host_in_flight(monkeypatch):
    """Orbax's default lets 96 GB of writes (and their compressed copies in host memory) be in
    flight: a third of a 7B offloaded state's save, on a host its pinned masters already fill."""
    from lrl import xla_env
    for host_gib, gb in ((24, 1), (128, 6), (512, 27), (4096, 96)):
        monkeypatch.setattr(xla_env, "host_memory", lambda h=host_gib: h * 2 ** 30)
        assert ck.write_window_gb() == gb
        assert ck._PageableStaging()._save_concurrent_bytes == gb * 10 ** 9
    monkeypatch.setattr(xla_env, "host_memory", lambda: None)
    assert ck.write_window_gb() is None      # orbax's own default
    assert ck._PageableStaging(save_concurrent_gb=3)._save_concurrent_bytes == 3 * 10 ** 9
