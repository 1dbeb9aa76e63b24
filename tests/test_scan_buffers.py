"""Layer scans lowered with uninitialised stacked outputs (lrl.models.scan_buffers) compute what
the zero-filled ones compute, and the change stays inside its context."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lrl import mesh as mesh_lib
from lrl.models.scan_buffers import UninitialisedScanJit, uninitialised_scan_outputs
from lrl.rl import update as upd
from tests.test_update import CFG, LOSS, _batch, _params, _state


def _loss(w, x):
    def body(c, w_l):
        return jnp.tanh(c @ w_l), jnp.sin(c)     # a stacked output beside the carry
    c, ys = jax.lax.scan(jax.checkpoint(body), x, w)
    return c.sum() + ys.sum()


def _cuda_text(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_scan_outputs_are_allocated_not_zero_filled_inside_the_context_only():
    w = jnp.asarray(np.random.RandomState(0).randn(4, 8, 8) * 0.3, jnp.float32)
    x = jnp.ones((3, 8))
    grad = jax.value_and_grad(_loss)
    want = jax.jit(grad)(w, x)
    with uninitialised_scan_outputs() as applied:
        assert applied
        # forward stacks and the backward scan's weight gradients: three stacked outputs
        assert _cuda_text(grad, w, x).count("AllocateBuffer") == 3
        got = jax.jit(grad)(w, x)
    # a new function: jax caches the lowering of the one above
    assert "AllocateBuffer" not in _cuda_text(jax.value_and_grad(lambda *a: _loss(*a)), w, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    loops = importlib.import_module("jax._src.lax.control_flow.loops")
    original = loops._empty_array
    with pytest.raises(RuntimeError), uninitialised_scan_outputs():
        raise RuntimeError("restored on the way out")
    assert loops._empty_array is original
    with uninitialised_scan_outputs(enabled=False) as applied:
        assert not applied and loops._empty_array is original
    with uninitialised_scan_outputs(), uninitialised_scan_outputs() as nested:   # no deadlock
        assert nested
    assert loops._empty_array is original


def test_the_change_holds_only_in_the_thread_inside_the_context():
    """The update's shapes compile on a thread while the rollout lowers its programs on the
    main one (`lrl.compiles.Background`): the rollout's must keep jax's lowering."""
    import threading
    w, x = jnp.ones((4, 8, 8)), jnp.ones((3, 8))
    inside, go, done, text = threading.Event(), threading.Event(), threading.Event(), {}

    def other():   # enters the context, then holds it open while the main thread lowers
        with uninitialised_scan_outputs():
            text["inside"] = _cuda_text(jax.value_and_grad(lambda *a: _loss(*a)), w, x)
            inside.set()
            go.wait(30)
        done.set()
    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(60)
    outside = _cuda_text(jax.value_and_grad(lambda *a: _loss(*a)), w, x)
    go.set()
    t.join(60)
    assert done.is_set()
    assert text["inside"].count("AllocateBuffer") == 3 and "AllocateBuffer" not in outside
    loops = importlib.import_module("jax._src.lax.control_flow.loops")
    assert loops._empty_array.__name__ != "empty_array"   # jax's own again


def test_update_fn_lowered_with_uninitialised_scans_equals_zero_filled():
    tx = optax.adamw(1e-3)
    fn = upd.make_update_fn(CFG, LOSS, tx, chunk=4)
    assert isinstance(fn, UninitialisedScanJit)
    # Off by default on a mesh of several devices (measured slower there, with more memory).
    mesh = mesh_lib.make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
    assert not isinstance(upd.make_update_fn(CFG, LOSS, tx, mesh, chunk=4), UninitialisedScanJit)
    got = fn.lower(_state(_params(), tx), _batch()).compile()(_state(_params(), tx), _batch())
    called = fn(_state(_params(), tx), _batch())
    want = upd.make_update_fn(CFG, LOSS, tx, chunk=4, uninit_scan=False)(
        _state(_params(), tx), _batch())
    for out in (got, called):
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="AllocateBuffer is GPU and TPU only")
def test_gpu_uninitialised_scan_outputs_read_nothing_unwritten():
    """Freed device memory is first filled with NaN, so the step would turn NaN if it read an
    element of an uninitialised buffer that the scan had not written."""
    tx = optax.adamw(1e-3)
    want = upd.make_update_fn(CFG, LOSS, tx, chunk=4, uninit_scan=False)(
        _state(_params(), tx), _batch())
    junk = jnp.full((1 << 28,), jnp.nan, jnp.float32).block_until_ready()
    del junk
    got = upd.make_update_fn(CFG, LOSS, tx, chunk=4)(_state(_params(), tx), _batch())
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.isfinite(np.asarray(a, np.float32)).all()
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
