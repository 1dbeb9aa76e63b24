"""Orbax checkpoints of the train state: asynchronous sharded saves, resume on any mesh.

The state is any pytree of arrays (lrl's `TrainState`: step, params, optimizer state, RNG key);
nothing here knows its class. Typed PRNG keys are stored as their raw `key_data` and wrapped
again on restore. Restoring takes the abstract state (`jax.ShapeDtypeStruct` leaves carrying
the *target* shardings), so a run saved on one mesh resumes on another: orbax reads each
target shard from the stored arrays (resharding on restore).

Checkpoint directory layout (one directory per run, e.g. `<workdir>/checkpoints`):

    DIR/<step>/state/         orbax PyTree (OCDBT): the train state; the model parameters
                              are its top-level `params` entry (`export` reads only those)
    DIR/<step>/meta/          JSON {"format": 1, "step", "time", "prng_impls": {leaf path: impl},
                              "checksums": {leaf path: [sum, weighted sum] of the raw bits},
                              "items": [the item names saved in this step]}
    DIR/<step>/<tree>/        orbax PyTree: a further state saved beside it (optional; e.g.
                              `critic`, PPO's critic TrainState, `lrl.rl.critic`), its
                              checksums in meta's "tree_checksums": {tree: {leaf: sums}}
    DIR/<step>/data/          JSON: the data-iterator state (optional)
    DIR/<step>/config/        JSON: the experiment config (optional)
    DIR/<step>/model_config/  JSON: lrl `ModelConfig` fields (optional; `export` needs it)
    DIR/tokenizer/            HF tokenizer files, written once by `save_tokenizer` (optional)
    DIR/quarantine/           steps found unreadable on resume, moved aside, never deleted
    DIR/<step>.orbax-checkpoint-tmp-*   a save that never committed (reported, left alone)

Restoring tries the newest step first. A step that fails to read (missing or truncated
files, an item it was saved with that is gone — known from `meta` and from orbax's
`_CHECKPOINT_METADATA` —, bad JSON, data that no longer matches its checksums) is reported with
a warning naming it, and the previous step is tried; none readable is a `CheckpointError`. A
state of another structure or shape than the saved one is a `StateMismatchError` at once (a
caller error, not damage). The checksums are modular integer sums, identical for any sharding
of the same values.

The loop's side:

    with PreemptionGuard() as guard, CheckpointManager(dir, keep=3, every_steps=100,
                                                       every_minutes=30) as ckpt:
        got = ckpt.restore(abstract_state)       # None on a fresh run
        ...
        for step in ...:
            state = update(state, batch)
            stop = guard.should_stop(step)
            if stop or ckpt.should_save(step):
                ckpt.save(step, state, data_state=it.get_state(), config=config,
                          model_config=model_cfg)
            if stop:
                break
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp
from etils import epath

from lrl import checkpoint_items as ci
from lrl import checkpoint_space
from lrl import xla_env
from lrl.checkpoint_items import (  # noqa: F401  (the public names, re-exported)
    CheckpointError, StateMismatchError, abstract_state, checksums, model_config_from_dict,
    model_config_to_dict, weights_only)
from lrl.models.config import ModelConfig
from lrl.preemption import PreemptionGuard, agree_any  # noqa: F401  (PreemptionGuard re-exported)

log = logging.getLogger(__name__)

FORMAT = 1
QUARANTINE = "quarantine"
_TMP_MARK = ".orbax-checkpoint-tmp"
_ORBAX_METADATA = "_CHECKPOINT_METADATA"


def _read_only():
    return ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)


@dataclasses.dataclass
class Restored:
    step: int
    state: Any
    data_state: Any             # as given to save (dict, or bytes), None if none was saved
    config: Optional[dict]
    model_config: Optional[ModelConfig]
    path: str                   # the step directory that was read
    trees: dict = dataclasses.field(default_factory=dict)   # further states asked for and saved
    skipped: list = dataclasses.field(default_factory=list)  # [(step, path, reason)] newer, bad
    weights_only: bool = False  # saved with checkpoint.contents="weights": no optimizer state


def _saved_tree(step_dir: epath.Path):
    """The stored state's tree of array metadata (custom classes come back as dicts)."""
    saved = ocp.PyTreeCheckpointHandler().metadata(step_dir / "state")
    return getattr(saved, "tree", saved)


def _check_against_saved(abstract, step_dir: epath.Path):
    """Caller errors (a state of another shape or structure) are not corruption: raise."""
    saved = _saved_tree(step_dir)
    have = {ci.path_str(p): m for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]}
    want = {ci.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        raise StateMismatchError(f"state structure differs from the checkpoint in {step_dir}: "
                                 f"not in checkpoint {missing[:8]}, not in state {extra[:8]}")
    for k, x in want.items():
        shape = tuple(getattr(have[k], "shape", ()) or ())
        if shape != tuple(x.shape):
            raise StateMismatchError(f"state leaf {k!r} has shape {tuple(x.shape)}, the "
                                     f"checkpoint in {step_dir} has {shape}")


def _orbax_items(step_dir: epath.Path) -> set[str]:
    """The items orbax recorded for a step (its _CHECKPOINT_METADATA); empty if unreadable."""
    try:
        handlers = json.loads((step_dir / _ORBAX_METADATA).read_text()).get("item_handlers")
    except Exception:  # noqa: BLE001 -- lrl's meta lists the items too
        return set()
    return set(handlers) if isinstance(handlers, dict) else set()


def _check_items(step: int, step_dir: epath.Path, names) -> None:
    # An item that was saved but is gone would otherwise come back as None (a data state
    # of None, say) and fail later, outside the fallback to the previous step.
    for name in sorted(names):
        if not (step_dir / name).exists():
            raise CheckpointError(f"step {step} lacks its {name!r} item: {step_dir / name} is "
                                  "missing, and the step was saved with it")


def _restore_step(mgr, step: int, step_dir: epath.Path, abstract, partial=False,
                  trees=None):
    """One step's items. `abstract` may hold typed-key leaves (restored via key data)."""
    # A partial restore (export's parameters) needs no data position or experiment config.
    needed = (lambda names: set(names) & {"meta", "state", "model_config"}) if partial else set
    _check_items(step, step_dir, needed({"meta", "state"} | _orbax_items(step_dir)))
    meta_only = ocp.args.Composite(meta=ocp.args.JsonRestore())
    meta = mgr.restore(step, args=meta_only)["meta"]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"meta of step {step} is {meta!r}, expected format {FORMAT}")
    _check_items(step, step_dir, needed(meta.get("items", ())))
    weights = meta.get("contents") == "weights"
    if weights:   # the optimizer starts afresh on these weights (the caller makes its state)
        abstract = ci.weights_only(abstract)
        trees = {n: ci.weights_only(t) for n, t in (trees or {}).items()}
    impls = {}

    def raw(path, x):
        if ci.is_key(x):
            impls[ci.path_str(path)] = x.dtype
            data = jax.eval_shape(jax.random.key_data, x)
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=x.sharding)
        return x
    abstract = jax.tree_util.tree_map_with_path(raw, abstract)
    if not partial:
        _check_against_saved(abstract, step_dir)
    items = {"state": ocp.args.PyTreeRestore(
        item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
        partial_restore=partial)}
    for name in ("data", "config", "model_config"):
        if (step_dir / name).exists():
            items[name] = ocp.args.JsonRestore()
    # Further trees (a critic) are read where the step has them: an SFT step has none.
    extra = {n: t for n, t in (trees or {}).items() if (step_dir / n).exists()}
    for name, t in extra.items():
        items[name] = ocp.args.PyTreeRestore(
            item=t, restore_args=ocp.checkpoint_utils.construct_restore_args(t))
    got = mgr.restore(step, args=ocp.args.Composite(**items))
    tree_sums = meta.get("tree_checksums", {})
    for name, saved_sums in [("state", meta.get("checksums", {}))] + [
            (n, tree_sums.get(n, {})) for n in extra]:
        for key, sums in ci.checksums(got[name]).items():
            where = key if name == "state" else f"{name}/{key}"
            if key not in saved_sums:
                raise CheckpointError(f"step {step} stores no checksum for leaf {where!r}")
            if saved_sums[key] != sums:
                raise CheckpointError(f"leaf {where!r} of step {step} does not match its "
                                      "checksum (garbled data)")

    def wrap(path, x):
        key = ci.path_str(path)
        if key not in impls:
            return x
        impl = meta.get("prng_impls", {}).get(key)
        if impl is None:
            raise CheckpointError(f"state leaf {key!r} is a PRNG key but step {step} stored "
                                  "plain data there")
        return jax.random.wrap_key_data(x, impl=impl)
    state = jax.tree_util.tree_map_with_path(wrap, got["state"])
    mc = got.get("model_config") if "model_config" in items else None
    return Restored(step=step, state=state,
                    data_state=ci.decode_data(got["data"]) if "data" in items else None,
                    config=got["config"] if "config" in items else None,
                    model_config=ci.model_config_from_dict(mc) if mc is not None else None,
                    path=str(step_dir), trees={n: got[n] for n in extra},
                    weights_only=weights)


def _uncommitted(root: epath.Path, after: int) -> list[epath.Path]:
    out = []
    for p in root.iterdir() if root.exists() else ():
        head = p.name.split(_TMP_MARK)[0]
        if _TMP_MARK in p.name and head.isdigit() and int(head) > after:
            out.append(p)
    return sorted(out, key=lambda p: p.name)


def _restore_newest_good(mgr, root: epath.Path, abstract, step=None, partial=False,
                         trees=None):
    """Newest step that restores; newer bad ones are warned about and listed in `skipped`."""
    steps = sorted(mgr.all_steps(), reverse=True)
    if step is not None:
        steps = [s for s in steps if s == step] or _no_step(root, step, steps)
    skipped = []
    for s in steps:
        step_dir = root / str(s)
        try:
            got = _restore_step(mgr, s, step_dir, abstract, partial, trees)
        except StateMismatchError:
            raise
        except Exception as e:  # noqa: BLE001 -- any read failure marks the step bad
            reason = f"{type(e).__name__}: {e}"
        else:
            for p in _uncommitted(root, s):
                log.warning("checkpoint: %s is an uncommitted (partial) save, newer than the "
                            "restored step %d; ignored and left in place", p, s)
            got.skipped = skipped
            return got
        reason = reason if len(reason) < 300 else reason[:300] + "..."
        log.warning("checkpoint: step %d at %s is unreadable (%s); trying the previous one",
                    s, step_dir, reason)
        skipped.append((s, str(step_dir), reason))
    if not steps:
        return None
    raise CheckpointError(f"no readable checkpoint in {root}: " + "; ".join(
        f"step {s} ({p}): {r}" for s, p, r in skipped))


def restore_latest(directory, abstract, shardings=None, step=None) -> Optional[Restored]:
    """Restores the newest good checkpoint in `directory` onto the target shardings; read-only.

    `abstract`: the state's tree of arrays / ShapeDtypeStructs; `shardings` as in
    `abstract_state`. Returns None when the directory holds no checkpoint at all.
    """
    root = epath.Path(directory)
    if not root.exists():
        return None
    target = ci.abstract_state(abstract, shardings)
    with ocp.CheckpointManager(root, options=_read_only()) as m:
        return _restore_newest_good(m, root, target, step)


def restore_params(directory, step=None, device=None, params_key="params") -> Restored:
    """The parameters only (`Restored.state`), each whole on one device (default: CPU 0).

    For export: the optimizer state is not read, and shapes and dtypes come from the
    checkpoint itself. `params_key=""` means the whole state is the parameters.
    """
    root = epath.Path(directory)
    one = jax.sharding.SingleDeviceSharding(device or jax.devices("cpu")[0])
    with ocp.CheckpointManager(root, options=_read_only()) as m:
        steps = sorted(m.all_steps(), reverse=True)
        if step is not None:
            steps = [s for s in steps if s == step] or _no_step(root, step, steps)
        unread = []
        for s in steps:  # the newest step whose tree metadata reads gives shapes and dtypes
            try:
                saved = _saved_tree(root / str(s))
                break
            except Exception as e:  # noqa: BLE001 -- a newer step's is said by _restore_newest_good
                unread.append(f"step {s} ({root / str(s)}): {type(e).__name__}: {e}"[:400])
        else:
            raise CheckpointError(f"no checkpoint in {root} has a readable state: "
                                  + "; ".join(unread))
        if params_key and params_key not in saved:
            raise CheckpointError(f"the state in {root / str(s)} has no top-level "
                                  f"{params_key!r} entry (has {sorted(saved)})")
        sub = saved[params_key] if params_key else saved
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                                sub)
        want = {params_key: abstract} if params_key else abstract
        got = _restore_newest_good(m, root, want, step, partial=bool(params_key))
    if params_key:
        got.state = got.state[params_key]
    return got


def _no_step(root, step, steps):
    raise CheckpointError(f"no checkpoint for step {step} in {root} (have {sorted(steps)})")


# ----------------------------------------------------------------------------- the manager

# Orbax lets up to 96 GB of a save be in the writers' hands at once, and the writes hold their
# compressed copies in host memory meanwhile: on 2 CPU cores a save of 3 and 6 GiB of random
# fp32 (checksums aside) raised the process's high-water mark by 1.0 and 2.1-2.3 GiB, about a
# third of the state, with 2 GB in flight by 0.3 GiB and with 1 GB by nothing (thirty-third
# session). A 7B run with its masters and moments offloaded has 85 GiB pinned and its 14 GiB of
# staged weights besides on a 128 GiB host: a third of its 100 GiB save would not fit there
# (what killed that run's final save on an H100 was not seen).
WRITE_SHARE = 0.05


def write_window_gb() -> Optional[int]:
    """The GB of a save in flight at once: `WRITE_SHARE` of the host's memory, 1 to orbax's 96
    (None, orbax's default, where the OS does not say)."""
    host = xla_env.host_memory()
    return None if host is None else int(min(96, max(1, WRITE_SHARE * host / 1e9)))


class _PageableStaging(ocp.PyTreeCheckpointHandler):
    """Orbax's PyTree handler, its copies of the arrays to the host made into ordinary memory.

    On a GPU orbax otherwise stages every array of a save in pinned host memory at once (jax's
    host allocator, capped by XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB), and that allocator keeps what
    it grew to. With the optimizer offloaded (`lrl.rl.offload`) the masters and moments already
    fill most of that cap: Qwen2.5-7B's 85 GiB of them left no room for its 14 GiB of bf16
    weights, and the run stopped at its first checkpoint (H100, 128 GiB host, BENCHMARKS.md
    "The whole GRPO step"). Ordinary memory is freed once the arrays are written. What it costs a
    save's blocking copy of device arrays (pageable, against pinned, transfers) is not measured."""

    def __init__(self, **kwargs):
        kwargs.setdefault("save_concurrent_gb", write_window_gb())
        super().__init__(enable_pinned_host_transfer=False, **kwargs)

    @classmethod
    def typestr(cls) -> str:
        # What a step's metadata names as its handler: orbax's own, whose format this is, so
        # orbax alone reads the checkpoint back (and a rename here strands no old checkpoint).
        return ocp.PyTreeCheckpointHandler.typestr()


def _handlers():
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for args in (ocp.args.PyTreeSave, ocp.args.PyTreeRestore):
        reg.add(None, args, _PageableStaging)
    return reg


class CheckpointManager:
    """Saves (asynchronously, keeping the last `keep`) and restores one run's checkpoints.

    `every_steps`: save when `step % every_steps == 0`; `every_minutes`: save when that much
    time has passed since the last save (or since start). Either may be 0 (off).
    `contents`: "full", or "weights": train states saved without their optimizer state (a
    third of a state with fp32 masters and Adam moments), restored with `weights_only` set.
    """

    def __init__(self, directory, keep: int = 3, every_steps: int = 0,
                 every_minutes: float = 0.0, async_save: bool = True, contents: str = "full"):
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least one checkpoint")
        if contents not in ("full", "weights"):
            raise ValueError(f"contents={contents!r}: 'full' or 'weights'")
        self.contents = contents
        if every_steps < 0 or every_minutes < 0:
            raise ValueError(f"every_steps={every_steps}, every_minutes={every_minutes} must "
                             "be >= 0")
        self.directory, self.keep = epath.Path(directory), keep
        self.every_steps, self.every_minutes = every_steps, every_minutes
        self._mgr = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save),
            handler_registry=_handlers())
        self._last_time = time.monotonic()
        self._last_step = self._mgr.latest_step()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def all_steps(self) -> list[int]:
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> Optional[int]:
        return self._mgr.latest_step()

    def space_warning(self, state_bytes: int, weights_bytes: int = 0) -> Optional[str]:
        """What to tell the user when the disk cannot hold the saves to come (the next, and
        `keep` of them), or None (`lrl.checkpoint_space`). `weights_bytes`: what a save of
        the weights only would hold, named as the way out where that fits."""
        return checkpoint_space.warning(self.directory, self.keep, self.all_steps(),
                                        state_bytes, weights_bytes
                                        if self.contents == "full" else 0)

    def should_save(self, step: int) -> bool:
        """The cadence, plus JAX's preemption sync point on multi-host runs."""
        if self._last_step is not None and step <= self._last_step:
            return False
        due = bool(self.every_steps) and step > 0 and step % self.every_steps == 0
        if self.every_minutes and not due:
            # Clocks differ between hosts: they must agree, or one host saves alone.
            due = agree_any(time.monotonic() - self._last_time >= 60.0 * self.every_minutes)
        return due or self._mgr.reached_preemption(step)

    def save(self, step: int, state, data_state=None, config=None,
             model_config: Optional[ModelConfig] = None, trees: Optional[dict] = None) -> bool:
        """Starts an asynchronous save of `step`; returns once the arrays are copied off the
        devices (so `state` may be donated afterwards). Any error of a previous asynchronous
        save is raised here. A step already saved is not saved again (returns False).
        `trees`: {name: a further tree of arrays (no PRNG keys)} saved as items of their own
        (PPO's `critic`)."""
        if step == self._last_step or step in self._mgr.all_steps():
            log.info("checkpoint: step %d is already saved", step)
            return False
        if self.contents == "weights":
            state = ci.weights_only(state)
            trees = {n: ci.weights_only(t) for n, t in (trees or {}).items()}
        raw, impls = ci.unwrap_keys(state)
        items = {"state": ocp.args.PyTreeSave(raw)}
        if data_state is not None:
            items["data"] = ocp.args.JsonSave(ci.encode_data(data_state))
        if config is not None:
            items["config"] = ocp.args.JsonSave(ci.jsonable(config))
        if model_config is not None:
            items["model_config"] = ocp.args.JsonSave(ci.model_config_to_dict(model_config))
        reserved = {"state", "data", "config", "model_config", "meta", "tokenizer", QUARANTINE}
        for name, tree in (trees or {}).items():
            if name in reserved:
                raise ValueError(f"checkpoint: a further tree cannot be named {name!r}")
            items[name] = ocp.args.PyTreeSave(tree)
        items["meta"] = ocp.args.JsonSave({"format": FORMAT, "step": int(step),
                                           "contents": self.contents,
                                           "time": time.time(), "prng_impls": impls,
                                           "checksums": ci.checksums(raw),
                                           "tree_checksums": {n: ci.checksums(t) for n, t in
                                                              (trees or {}).items()},
                                           "items": sorted([*items, "meta"])})
        self._mgr.save(int(step), args=ocp.args.Composite(**items), force=True)
        self._last_step, self._last_time = int(step), time.monotonic()
        return True

    def save_tokenizer(self, tokenizer) -> None:
        """Stores the run's tokenizer once (an object with `save_pretrained`, or a directory)."""
        dst = self.directory / "tokenizer"
        if jax.process_index() == 0:
            dst.mkdir(parents=True, exist_ok=True)
            if hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(str(dst))
            else:
                src = epath.Path(tokenizer)
                files = [p for p in src.iterdir() if p.is_file()] if src.is_dir() else []
                if not files:
                    raise FileNotFoundError(f"tokenizer directory {src} has no files")
                for p in files:
                    p.copy(dst / p.name, overwrite=True)
        _sync("lrl_checkpoint_tokenizer")

    def restore(self, abstract, shardings=None, step=None,
                trees: Optional[dict] = None) -> Optional[Restored]:
        """Like `restore_latest`; unreadable newer steps are moved to DIR/quarantine/ so that
        the resumed run's saves and keep-last-N never touch them. `trees`: {name: abstract
        tree with shardings} of further trees to read where the step saved them
        (`Restored.trees`)."""
        target = ci.abstract_state(abstract, shardings)
        trees = {n: ci.abstract_state(t) for n, t in (trees or {}).items()}
        got = _restore_newest_good(self._mgr, self.directory, target, step, trees=trees)
        if got is not None and got.skipped:
            if jax.process_index() == 0:
                qdir = self.directory / QUARANTINE
                qdir.mkdir(parents=True, exist_ok=True)
                for s, path, _ in got.skipped:
                    dst = qdir / f"{s}-{int(time.time())}"
                    epath.Path(path).rename(dst)
                    log.warning("checkpoint: moved unreadable step %d to %s", s, dst)
            _sync("lrl_checkpoint_quarantine")
            self._mgr.reload()
        if got is not None:
            self._last_step = got.step
        return got

    def wait(self) -> None:
        """Blocks until the pending asynchronous save is committed."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
