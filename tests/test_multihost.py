"""Multi-process runs on one machine: two processes (2 virtual CPU devices each, gloo
collectives, a localhost coordinator) take the same update steps as one process with the
same global batch and reach the same parameters; a process whose peer died or hangs exits
with a clear error within a bounded time instead of waiting forever.

The workers are this file run as a script (`python tests/test_multihost.py MODE ...`), each
in a fresh interpreter whose device count is set before jax loads; every subprocess has a
hard timeout (SIGKILL), so the test itself can never hang.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES_PER_PROCESS = 2
STEPS = 3
ROWS, ROW_LEN = 8, 16


# ----------------------------------------------------------------------------- the workers

def _start(process_id: int, num_processes: int, port: int, **extra) -> None:
    from lrl import distributed
    if num_processes > 1:
        distributed.initialize(dict(enabled=True, coordinator_address=f"localhost:{port}",
                                    num_processes=num_processes, process_id=process_id,
                                    initialization_timeout_s=60, heartbeat_timeout_s=5,
                                    shutdown_timeout_s=10, **extra))


def _global_batch(step: int):
    """The same global batch on every process: packed random prompts and completions."""
    import numpy as np
    from lrl.data.packing import pack
    rng = np.random.default_rng(100 + step)
    n = 12
    prompts = [rng.integers(1, 32, rng.integers(2, 5)) for _ in range(n)]
    comps = [rng.integers(1, 32, rng.integers(2, 6)) for _ in range(n)]
    batch, _ = pack(prompts, comps, ROW_LEN, seq_values={"advantages": rng.normal(size=n)},
                    token_values={"old_logp": [rng.normal(-3.4, 0.2, len(c)) for c in comps]},
                    min_rows=ROWS, rows_multiple=ROWS)
    assert batch["tokens"].shape == (ROWS, ROW_LEN), batch["tokens"].shape
    return batch


def worker_update(process_id: int, num_processes: int, port: int, out: str) -> None:
    """A few AdamW update steps of a tiny model over a (data=2, fsdp) mesh spanning every
    process; this process feeds only its own rows. Writes the final params (process 0)."""
    _start(process_id, num_processes, port)
    import jax
    import numpy as np
    from lrl import distributed
    from lrl import mesh as mesh_lib
    from lrl import models
    from lrl.rl import LossConfig
    from lrl.rl import update as upd
    from lrl.rl.optim import make_optimizer

    jax.config.update("jax_default_matmul_precision", "highest")
    assert jax.process_count() == num_processes
    assert jax.device_count() == DEVICES_PER_PROCESS * 2, jax.devices()
    cfg = models.tiny_config(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=8, mlp_dim=64)
    mesh = mesh_lib.make_mesh({"data": 2, "fsdp": -1})
    tx = make_optimizer(lr=1e-2, warmup_steps=1, total_steps=STEPS, clip_norm=1.0)
    loss_cfg = LossConfig(clip_low=0.2, clip_high=0.28, aggregation="token_mean")
    state = upd.make_init_fn(cfg, tx, mesh)(jax.random.key(0))
    step_fn = upd.make_update_fn(cfg, loss_cfg, tx, mesh, num_micro=2, chunk=16)
    sharding = mesh_lib.batch_sharding(mesh, 2)
    per = ROWS // num_processes
    losses = []
    for step in range(STEPS):
        batch = _global_batch(step)
        if num_processes == 1:
            arrays = {k: jax.device_put(v, sharding) for k, v in batch.items()}
        else:  # this process's contiguous block of rows, as a data loader would give it
            mine = slice(process_id * per, (process_id + 1) * per)
            arrays = {k: jax.make_array_from_process_local_data(sharding, v[mine])
                      for k, v in batch.items()}
        state, metrics = step_fn(state, arrays)
        losses.append(float(jax.device_get(metrics["loss"])))
        distributed.beat(f"update step {step}")
    params = jax.jit(lambda p: p, out_shardings=mesh_lib.replicated(mesh))(state.params)
    flat = {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(params)}
    agreed = distributed.allgather_objects({"process": process_id, "rows": per})
    most = distributed.max_over_processes(10 + process_id)
    if process_id == 0:
        np.savez(os.path.join(out, f"params_{num_processes}.npz"), **flat)
        with open(os.path.join(out, f"info_{num_processes}.json"), "w") as f:
            json.dump({"losses": losses, "agreed": agreed, "max": most,
                       "step": int(jax.device_get(state.step))}, f)


def worker_peer_fails(process_id: int, num_processes: int, port: int, how: str,
                      watchdog_s: float) -> None:
    """Sums over a mesh spanning both processes, step after step; process 1 dies ("die")
    or stops answering while alive ("hang") after two steps. Process 0 must not wait
    forever."""
    _start(process_id, num_processes, port, watchdog_s=watchdog_s)
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from lrl import distributed
    from lrl import mesh as mesh_lib

    mesh = mesh_lib.make_mesh({"data": -1})
    total = jax.jit(lambda x: x.sum(), out_shardings=mesh_lib.replicated(mesh))
    local = np.ones((DEVICES_PER_PROCESS, 4), np.float32)
    for step in range(1000):
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)
        value = float(total(x))
        assert value == 4.0 * jax.device_count(), value
        print(f"process {process_id} step {step}", flush=True)
        distributed.beat(f"sum step {step}")
        if process_id == 1 and step == 1:
            if how == "die":
                os._exit(3)  # no goodbye: like a node that lost power
            time.sleep(3600)  # alive, heartbeating, but never reaching the next collective
        time.sleep(0.2)


# ----------------------------------------------------------------------------- the tests

def _env():
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS} "
                         f"{xla_env.SPEED_FLAGS}",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def _launch(args, env, log_path):
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *map(str, args)],
                            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log


def _wait(procs, timeout_s: float):
    """Waits for every process; kills any still running at the deadline. -> exit codes and
    seconds each took (None when it had to be killed)."""
    t0 = time.monotonic()
    codes, took = [], []
    for p, log in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0))))
            took.append(time.monotonic() - t0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(None)
            took.append(None)
        log.close()
    return codes, took


def _read(path):
    with open(path) as f:
        return f.read()


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    import numpy as np
    import portpicker
    port = portpicker.pick_unused_port()
    env = _env()
    one_env = dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count="
                                  f"{2 * DEVICES_PER_PROCESS} {xla_env.SPEED_FLAGS}")
    procs = [_launch(["update", i, 2, port, tmp_path], env, tmp_path / f"p{i}.log")
             for i in range(2)]
    procs.append(_launch(["update", 0, 1, 0, tmp_path], one_env, tmp_path / "single.log"))
    codes, _ = _wait(procs, timeout_s=170)
    logs = {n: _read(tmp_path / n)[-3000:] for n in ("p0.log", "p1.log", "single.log")}
    assert codes == [0, 0, 0], f"exit codes {codes}\n" + "\n".join(
        f"--- {n}\n{t}" for n, t in logs.items())

    two, one = np.load(tmp_path / "params_2.npz"), np.load(tmp_path / "params_1.npz")
    assert sorted(two.files) == sorted(one.files) and len(one.files) > 5
    info2 = json.loads(_read(tmp_path / "info_2.json"))
    info1 = json.loads(_read(tmp_path / "info_1.json"))
    assert info2["step"] == info1["step"] == STEPS
    np.testing.assert_allclose(info2["losses"], info1["losses"], rtol=1e-5, atol=1e-6)
    moved = 0.0
    init = _init_params()
    for name in one.files:
        np.testing.assert_allclose(two[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)
        moved = max(moved, float(np.abs(one[name] - init[name]).max()))
    assert moved > 1e-3  # the steps really changed the parameters
    # Host agreement helpers: every process's object in process order; the max over them.
    assert info2["agreed"] == [{"process": 0, "rows": ROWS // 2},
                               {"process": 1, "rows": ROWS // 2}]
    assert info2["max"] == 11 and info1["max"] == 10


def _init_params():
    import jax
    import numpy as np
    from lrl import models
    cfg = models.tiny_config(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=8, mlp_dim=64)
    params = models.init_params(cfg, jax.random.key(0))
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(params)}


@pytest.mark.slow
def test_peer_death_and_hang_end_the_survivor(tmp_path):
    """"die": process 1 exits without a word mid-run; "hang": it stays alive but stops
    taking part. Either way process 0 ends, non-zero and with a message that says why,
    well before the deadline (heartbeat 5 s, watchdog 8 s); no process is left behind."""
    import portpicker
    from lrl.distributed import WATCHDOG_EXIT_CODE
    env = _env()
    runs = {}
    for how in ("die", "hang"):
        port = portpicker.pick_unused_port()
        # Only the survivor runs a watchdog: the hung process must be ended by JAX once its
        # coordinator (process 0) is gone, not by its own watchdog racing the survivor's.
        runs[how] = [_launch(["peer", i, 2, port, how, 8.0 if i == 0 else 0.0], env,
                             tmp_path / f"{how}{i}.log") for i in range(2)]
    results = {how: _wait(procs, timeout_s=150) for how, procs in runs.items()}

    for how, (codes, took) in results.items():
        logs = [_read(tmp_path / f"{how}{i}.log") for i in range(2)]
        dump = f"{how}: exit codes {codes}, seconds {took}\n" + "\n".join(
            f"--- process {i}\n{t[-3000:]}" for i, t in enumerate(logs))
        assert "process 0 step 1" in logs[0] and "process 1 step 1" in logs[1], dump
        assert None not in codes, "a process had to be killed: " + dump
        assert codes[0] != 0, dump
        if how == "die":
            assert codes[1] == 3, dump
            # Either gloo saw the closed connection (and the fail-fast hook ended the process)
            # or JAX's coordination service saw the missing heartbeats.
            assert ("lrl.distributed: process 0 of 2 failed" in logs[0]
                    or "another task died" in logs[0]), dump
        else:
            assert codes[0] == WATCHDOG_EXIT_CODE, dump
            assert "no progress for" in logs[0] and "after 'sum step 1'" in logs[0], dump
            # The hung process loses its coordinator (process 0) and is ended by JAX.
            assert codes[1] != 0 and "Terminating process" in logs[1], dump


def test_settings_and_watchdog_in_process():
    import threading
    import pytest
    from lrl import distributed
    s = distributed.settings({"enabled": True, "coordinator_address": "h:1234",
                              "num_processes": 4, "process_id": 2,
                              "local_device_ids": "0, 1", "heartbeat_timeout_s": 7})
    kw = distributed.initialize_kwargs(s)
    assert kw == dict(coordinator_address="h:1234", num_processes=4, process_id=2,
                      local_device_ids=[0, 1], initialization_timeout=300,
                      heartbeat_timeout_seconds=7, shutdown_timeout_seconds=300)
    # Empty values are left to JAX's cluster detection (SLURM, Open MPI, TPU).
    assert set(distributed.initialize_kwargs(distributed.settings({}))) == {
        "initialization_timeout", "heartbeat_timeout_seconds", "shutdown_timeout_seconds"}
    assert distributed.initialize({"enabled": False}) is False
    with pytest.raises(ValueError, match="heartbeat_timeot_s"):
        distributed.settings({"heartbeat_timeot_s": 5})
    with pytest.raises(ValueError, match="cpu_collectives"):
        distributed.settings({"cpu_collectives": "nccl"})
    with pytest.raises(ValueError, match="local_device_ids"):
        distributed.initialize_kwargs(distributed.settings({"local_device_ids": "gpu0"}))
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        distributed.settings({"heartbeat_timeout_s": 0})

    fired = []
    done = threading.Event()
    dog = distributed.Watchdog(1.0, on_timeout=lambda m: (fired.append(m), done.set()),
                               poll_s=0.05)
    try:
        time.sleep(1.5)
        assert not fired  # not armed before the first beat (start-up, first compile)
        for i in range(6):  # steady beats keep it quiet
            dog.beat(f"step {i}")
            time.sleep(0.2)
        assert not fired
        assert done.wait(5.0)
        assert "no progress for" in fired[0] and "after 'step 5'" in fired[0]
    finally:
        dog.stop()


LAUNCH = os.path.join(ROOT, "experiments", "launch")


def _script(path, text):
    path.write_text(text)
    path.chmod(0o755)


def test_multinode_launcher_computes_process_ids(tmp_path):
    """Each node starts PROCS_PER_NODE processes with global ids and the GPUs they own; one
    failing process stops its node's others and sets the script's exit code."""
    run = lambda env, *extra: subprocess.run(  # noqa: E731
        ["bash", os.path.join(LAUNCH, "multinode.sh"), "configs/default.py", str(tmp_path / "w"),
         *extra], env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    out = run(dict(DRY_RUN="1", NUM_NODES="2", NODE_RANK="1", PROCS_PER_NODE="2",
                   GPUS_PER_NODE="2", COORDINATOR="10.0.0.1:1234"), "--config.rl.steps=5")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2
    for local, line in enumerate(lines):
        assert line.startswith(f"JAX_LOCAL_DEVICE_IDS={local} ")
        assert f"--config.distributed.process_id={2 + local}" in line
        for flag in ("--config.distributed.enabled=True", "--config.distributed.num_processes=4",
                     "--config.distributed.coordinator_address=10.0.0.1:1234",
                     "-m lrl.main --config=configs/default.py", "--config.rl.steps=5"):
            assert flag in line, (flag, line)
    out = run(dict(DRY_RUN="1", NUM_NODES="2", NODE_RANK="0", GPUS_PER_NODE="4",
                   COORDINATOR="h:1"))
    assert out.stdout.startswith("JAX_LOCAL_DEVICE_IDS=0,1,2,3 ") and "process_id=0" in out.stdout
    bad = run(dict(NUM_NODES="2", NODE_RANK="2", COORDINATOR="h:1"))
    assert bad.returncode == 2 and "NODE_RANK=2" in bad.stderr
    bad = run(dict(NUM_NODES="1", NODE_RANK="0", COORDINATOR="no-port"))
    assert bad.returncode == 2 and "host:port" in bad.stderr

    # A stand-in interpreter: process 1 fails, process 0 would run for minutes.
    _script(tmp_path / "py", """#!/bin/bash
for a in "$@"; do case $a in --config.distributed.process_id=*) id=${a#*=};; esac; done
trap 'echo "process $id stopped"; exit 143' TERM
if [[ $id == 1 ]]; then exit 7; fi
for i in $(seq 600); do sleep 0.1; done
""")
    t0 = time.monotonic()
    out = run(dict(NUM_NODES="1", NODE_RANK="0", PROCS_PER_NODE="2", GPUS_PER_NODE="2",
                   COORDINATOR="h:1", PYTHON=str(tmp_path / "py")))
    assert out.returncode == 7, (out.stdout, out.stderr)
    assert time.monotonic() - t0 < 30
    assert "process 0 stopped" in (tmp_path / "w" / "logs" / "process_0.log").read_text()


def test_slurm_script_runs_one_process_per_gpu_or_node(tmp_path):
    """The sbatch script under a stand-in srun: the task layout per mode, NVLS off, the
    device each task keeps, and the lrl.main command."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "srun", """#!/bin/bash
opts=(); while [[ $1 == --* ]]; do opts+=("$1"); shift; done
echo "srun ${opts[*]}"
for id in 0 1; do SLURM_LOCALID=$id SLURM_PROCID=$id "$@"; done
""")
    _script(bin_dir / "py", """#!/bin/bash
echo "task $SLURM_PROCID ids=${JAX_LOCAL_DEVICE_IDS:-auto} nvls=$NCCL_NVLS_ENABLE args: $*"
""")

    def run(**env):
        full = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                "PYTHON": "py", "SLURM_JOB_NUM_NODES": "2", "SLURM_CPUS_ON_NODE": "96", **env}
        full.pop("CUDA_VISIBLE_DEVICES", None) if "CUDA_VISIBLE_DEVICES" not in env else None
        out = subprocess.run(["bash", os.path.join(LAUNCH, "slurm.sbatch"), "configs/default.py",
                              str(tmp_path / "w"), "--config.rl.steps=3"], env=full,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    per_gpu = run()
    assert per_gpu[0].startswith("srun --nodes=2 --ntasks-per-node=8 --cpus-per-task=12 ")
    assert "--kill-on-bad-exit=1" in per_gpu[0]
    for i, line in enumerate(per_gpu[1:]):
        assert line == (f"task {i} ids=auto nvls=0 args: -m lrl.main --config=configs/default.py "
                        f"--workdir={tmp_path / 'w'} --config.distributed.enabled=True "
                        "--config.rl.steps=3")
    per_node = run(MODE="per-node")
    assert per_node[0].startswith("srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=96 ")
    assert all("ids=0,1,2,3,4,5,6,7 " in line for line in per_node[1:])
    bound = run(CUDA_VISIBLE_DEVICES="5")  # a cluster that binds one GPU per task
    assert all("ids=0 " in line for line in bound[1:])

if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "update":
        worker_update(int(args[0]), int(args[1]), int(args[2]), args[3])
    elif mode == "peer":
        worker_peer_fails(int(args[0]), int(args[1]), int(args[2]), args[3], float(args[4]))
    else:
        raise SystemExit(f"unknown worker mode {mode!r}")
