"""Checkpoints against the disk: the start-up warning's arithmetic, and a save that runs out of
space (a real one, on a 1 MiB tmpfs where the machine lets a user namespace mount one) reported
as a user error naming the disk, the newest checkpoint and the save cut short."""
import errno
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from lrl import checkpoint as ck
from lrl import checkpoint_space as space
from lrl import errors

MiB = 2 ** 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tree_bytes_counts_arrays_and_abstract_leaves_at_global_shapes():
    tree = {"w": jnp.zeros((4, 8), jnp.float32), "b": jax.ShapeDtypeStruct((3,), jnp.bfloat16),
            "key": jax.random.key(0), "step": 7}
    assert space.tree_bytes(tree) == 4 * 8 * 4 + 3 * 2 + 8
    assert space.tree_bytes(tree, {"c": tree}) == 2 * space.tree_bytes(tree)


@pytest.fixture
def disk(monkeypatch):
    """Sets the free bytes the checks see."""
    free = {"n": 0}
    monkeypatch.setattr(space.shutil, "disk_usage",
                        lambda p: shutil._ntuple_diskusage(1 << 50, 0, free["n"]))
    return free


def test_warning_before_the_first_save_uses_the_state_bytes(tmp_path, disk):
    d = tmp_path / "run" / "checkpoints"      # not made yet: the check reads its parent's disk
    disk["n"] = 5 * MiB
    msg = space.warning(d, keep=3, steps=[], state_bytes=10 * MiB)
    assert "the next save cannot fit" in msg and "5.0 MiB free" in msg
    assert "before orbax's compression) 10.0 MiB" in msg and "checkpoint.keep=3" in msg
    disk["n"] = 25 * MiB          # one fits, the four that keep=3 holds while saving do not
    assert "keeping 3 needs room for 4" in space.warning(d, 3, [], 10 * MiB)
    disk["n"] = 40 * MiB
    assert space.warning(d, 3, [], 10 * MiB) is None
    assert space.warning(d, 1, [], 20 * MiB) is None        # keep=1: two while saving
    assert space.warning("gs://bucket/run", 1, [], 1 << 60) is None   # not a local disk


def test_warning_after_a_save_uses_its_size_on_disk(tmp_path, disk):
    d = tmp_path / "checkpoints"
    (d / "4" / "state").mkdir(parents=True)
    (d / "4" / "state" / "blob").write_bytes(b"x" * (3 * MiB))
    (d / "8").mkdir()
    (d / "8" / "blob").write_bytes(b"x" * (2 * MiB))
    disk["n"] = 3 * MiB
    # keep=2 with two saved: each save needs room for one more, the size of step 8 (the newest)
    assert space.warning(d, 2, [4, 8], state_bytes=100 * MiB) is None
    disk["n"] = 1 * MiB
    msg = space.warning(d, 2, [4, 8], state_bytes=100 * MiB)
    assert "step 8 takes 2.0 MiB" in msg and "the next save cannot fit" in msg


def test_the_manager_warns_with_its_keep_and_steps(tmp_path, disk):
    state = {"w": jax.random.normal(jax.random.key(0), (256, 256))}
    with ck.CheckpointManager(tmp_path / "c", keep=2) as m:
        disk["n"] = 1 << 40
        assert m.space_warning(space.tree_bytes(state)) is None
        m.save(1, state)
        m.wait()
        disk["n"] = 1000
        msg = m.space_warning(space.tree_bytes(state))
        assert "step 1 takes" in msg and "checkpoint.keep=2" in msg
        assert "contents=weights" not in msg     # not offered: no size of it given


def test_the_weights_only_save_is_offered_where_it_fits(tmp_path, disk):
    d = tmp_path / "c"
    disk["n"] = 3 * MiB
    # 10 MiB a full save, 1 MiB the weights alone: keep=2 needs room for 3 of them.
    msg = space.warning(d, 2, [], state_bytes=10 * MiB, weights_bytes=MiB)
    assert "the next save cannot fit" in msg
    assert "checkpoint.contents=weights: 1.0 MiB a save" in msg
    msg = space.warning(d, 2, [], state_bytes=10 * MiB, weights_bytes=2 * MiB)
    assert "contents=weights" not in msg     # 3 saves of 2 MiB do not fit 3 MiB either
    with ck.CheckpointManager(d, keep=2, contents="weights") as m:
        assert m.space_warning(10 * MiB, MiB) is not None      # its own size is the first
        assert "contents=weights" not in m.space_warning(10 * MiB, MiB)


def test_no_space_follows_the_chain_and_the_text():
    inner = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise inner
        except OSError as e:
            raise RuntimeError("save failed") from e
    except RuntimeError as e:
        assert space.no_space(e)
    assert space.no_space(ValueError('Failed to write 10 bytes to file 8: No space left on '
                                     "device [os_error_code='28']"))
    assert not space.no_space(OSError(errno.EACCES, "Permission denied"))
    assert not space.no_space(ValueError("RESOURCE_EXHAUSTED: out of memory"))


def test_a_full_disk_is_a_user_error_naming_the_newest_step_and_the_cut_save(tmp_path):
    ckdir = tmp_path / "checkpoints"
    (ckdir / "3").mkdir(parents=True)
    (ckdir / "3" / "blob").write_bytes(b"x" * MiB)
    (ckdir / "5.orbax-checkpoint-tmp").mkdir()
    (ckdir / "5.orbax-checkpoint-tmp" / "part").write_bytes(b"x" * (MiB // 2))
    e = ValueError("RESOURCE_EXHAUSTED: Error writing \"w/0.0\": No space left on device "
                   "[os_error_code='28']")
    u = errors.user_error(e, {"checkpoint": {"keep": 2}}, str(tmp_path))
    text = u.message()
    assert text.startswith("out of disk space — the disk of " + str(tmp_path))
    assert "checkpoint.keep, now 2" in text
    assert "takes 1.0 MiB (step 3, the newest committed" in text
    assert f"{ckdir / '5.orbax-checkpoint-tmp'} is a save cut short (0.5 MiB)" in text
    assert errors.user_error(ValueError("bad"), None, str(tmp_path)) is None


_FULL = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp
    from lrl import checkpoint as ck, errors
    wd = sys.argv[1]
    state = {"w": jax.random.normal(jax.random.key(0), (1024, 1024))}   # 4 MiB, incompressible
    try:
        with ck.CheckpointManager(wd + "/checkpoints", keep=1) as m:
            print("WARNING", m.space_warning(4 << 20))
            m.save(1, state)
        print("SAVED")
    except Exception as e:
        u = errors.user_error(e, {"checkpoint": {"keep": 1}}, wd)
        print("USER", u.message() if u else f"NONE {type(e).__name__}: {e}")
""")


def test_a_real_save_on_a_full_disk(tmp_path):
    """orbax's tensorstore raises a ValueError that carries only ENOSPC's text: the check must
    read it. A 1 MiB tmpfs, mounted in a user namespace of the child alone."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m none {mnt}"],
            capture_output=True).returncode:
        pytest.skip("this machine lets no user namespace mount a tmpfs")
    script = tmp_path / "full.py"
    script.write_text(_FULL)
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c",
         f'mount -t tmpfs -o size=1m none {mnt} && exec "$0" "$1" "$2"',
         sys.executable, str(script), str(mnt / "wd")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})
    lines = {ln.split(" ", 1)[0]: ln for ln in out.stdout.splitlines() if " " in ln}
    assert "the next save cannot fit" in lines.get("WARNING", ""), out.stdout + out.stderr
    user = out.stdout[out.stdout.find("USER"):]
    assert user.startswith("USER out of disk space — the disk of " + str(mnt / "wd")), \
        out.stdout + out.stderr[-3000:]
    assert "No space left on device" in user
    assert "1.orbax-checkpoint-tmp is a save cut short" in user
