"""Start-up checks: everything a run will read is opened and checked before the first step and
before anything is written to the workdir, so bad input stops the run in seconds with one
message (`lrl.errors.UserError`) instead of after a training phase.

    opts = preflight.options(config)        # the typed options; a bad value is a UserError
    preflight.run(opts, workdir, mesh)      # every check below, in order; the first failure raises
    opts, mesh, rollout_mesh = preflight.start(config, workdir)   # both, and the meshes

What is checked, in this order (each cheap: only enough rows to find usable ones, headers not
weights; the data's and the checkpoint's own faults come before the tokenizer, whose import
(transformers) is the slow part):
  config     what needs the mesh: prompts per step and eval prompts over the data shards
  data       the training rows: at least one usable (the fields the config names), with the
             malformed rows met on the way counted and the first listed
  eval_data  (when `eval.every`) enough usable held-out rows for one eval batch
  sft_data   (when there is an SFT phase on files) at least one usable prompt/response row
  rewards    every `reward.spec` name is registered
  checkpoint `model.hf_path`: config.json parses and is supported, every safetensors header
             reads, each tensor's shape is what config.json implies
  tokenizer  loads (a file that does not parse is named), has a chat template, an EOS token
  model      the tokenizer's ids fit the vocabulary (config.json's, or `model.vocab_size`)
  resume     a workdir that holds a checkpoint: its model has this run's shapes
  prompt_lengths  the data and eval checks again, counting only prompts within
             `data.max_prompt_len` tokens once rendered through the chat template
(the four data checks are in `lrl.preflight_data`).

Adding a check (a reward model, a critic, an environment): write `fn(ctx) -> str | None` that
raises `UserError(what, culprit, todo)` naming the file or config key and returns a few words
for the log, and register it, in this module or in a module listed in `MODULES` (imported by
`run`, so registration never costs `--help` an import):

    @preflight.check("critic", after="model")
    def _critic(ctx):
        if not ctx.opts.critic.hf_path: return None
        shapes = preflight.safetensors_shapes(ctx.opts.critic.hf_path, "critic.hf_path")
        ...
        return "critic: 7 tensors, shapes match"

`ctx` holds `opts`, `workdir`, `mesh` (None when the caller has none) and loads shared
things once: `ctx.tokenizer()`, `ctx.model_config()`. Keep a check under a second on CPU
for a real model (read headers and a few rows, never weights); its time is logged.
"""
from __future__ import annotations

import dataclasses
import glob
import importlib
import json
import logging
import os
import time
from typing import Callable, Optional

from lrl.errors import UserError, from_config_error

log = logging.getLogger(__name__)

# Modules that register more checks (imported by `run`): the data checks live apart.
MODULES: tuple[str, ...] = ("lrl.preflight_data", "lrl.preflight_models")
_MAX_LISTED = 5                 # malformed rows / mismatched tensors listed in a message


# ----------------------------------------------------------------------------- the registry

@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    fn: Callable[["Context"], Optional[str]]
    after: Optional[str] = None


CHECKS: list[Check] = []


def check(name: str, after: str | None = None):
    """Registers `fn(ctx)` as the start-up check `name`: it runs right after the check
    `after` (which may be registered later), or at the end."""
    def deco(fn):
        CHECKS[:] = [c for c in CHECKS if c.name != name]
        CHECKS.append(Check(name, fn, after))
        return fn
    return deco


def ordered() -> list[Check]:
    """The checks in the order they run: each right after its `after`."""
    out = [c for c in CHECKS if c.after is None]
    pending = [c for c in CHECKS if c.after is not None]
    while pending:
        placed = [c for c in pending if c.after in [x.name for x in out]]
        if not placed:   # an `after` that names no check: at the end
            return out + pending
        for c in placed:
            out.insert([x.name for x in out].index(c.after) + 1, c)
            pending.remove(c)
    return out


@dataclasses.dataclass
class Context:
    opts: object
    workdir: str
    mesh: object = None
    _cache: dict = dataclasses.field(default_factory=dict)

    def _once(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def tokenizer(self):
        """The tokenizer the run will use, loaded; None when the run trains one (synthetic
        data, nothing saved in the workdir yet)."""
        return self._once("tokenizer", lambda: _load_tokenizer(*_tokenizer_path(self)))

    def model_config(self):
        """The text decoder's ModelConfig as the run builds it; None when unknown before the
        run (the video task's)."""
        return self._once("model_config", lambda: _model_config(self))


def options(config):
    """The typed options (`lrl.options.from_config`, files included), every error a
    `UserError` naming the config key."""
    from lrl import options as options_lib
    try:
        return options_lib.from_config(config)
    except (ValueError, FileNotFoundError) as e:
        raise from_config_error(e) from e


def start(config, workdir: str):
    """What `lrl.loop.run` does first: (options, mesh, rollout mesh or None), every check
    passed, nothing written to `workdir` yet."""
    from lrl import mesh as mesh_lib
    opts = options(config)
    try:
        mesh, rollout_mesh = mesh_lib.build_meshes(opts)
    except ValueError as e:   # mesh sizes that do not fit the devices
        raise from_config_error(e) from e
    run(opts, workdir, mesh)
    return opts, mesh, rollout_mesh


def run(opts, workdir: str, mesh=None) -> dict[str, float]:
    """Runs every registered check; the first failure raises its UserError. Returns each
    check's seconds (also logged, with what each found)."""
    for name in MODULES:
        importlib.import_module(name)
    ctx = Context(opts, workdir, mesh)
    times, said = {}, []
    for c in ordered():
        t0 = time.perf_counter()
        note = c.fn(ctx)
        times[c.name] = time.perf_counter() - t0
        if note:
            said.append(f"{note} ({times[c.name]:.2f} s)")
    # DEBUG: a good run's console says nothing of its checks (tests/test_console.py).
    log.debug("start-up checks passed in %.1f s: %s", sum(times.values()), "; ".join(said))
    return times


# ----------------------------------------------------------------------------- config

@check("config")
def _config(ctx):
    if ctx.mesh is None:
        return None
    import jax
    o, procs = ctx.opts, jax.process_count()
    shards = max(ctx.mesh.shape["data"] * ctx.mesh.shape["fsdp"] // procs, 1)
    pairs = [("rl.prompts_per_step", o.rl.prompts_per_step)] if o.task == "text" else []
    if o.task == "text" and o.eval.every and (o.data.source == "synthetic" or o.data.eval_paths):
        pairs.append(("eval.num_prompts", o.eval.num_prompts))
    for key, n in pairs:
        if n % (procs * shards):
            raise UserError(f"{key}={n} does not divide over {procs} process(es) x {shards} "
                            "data shard(s) (mesh.data x mesh.fsdp)", f"config key {key}",
                            f"make it a multiple of {procs * shards}")
    return None


# ----------------------------------------------------------------------------- tokenizer

def _tokenizer_path(ctx) -> tuple[Optional[str], str]:
    """(the directory the run loads its tokenizer from or None, the config key naming it)."""
    o = ctx.opts
    if o.tokenizer.path:
        return o.tokenizer.path, "tokenizer.path"
    if o.task == "video" and o.model.hf_path:
        return o.model.hf_path, "model.hf_path"
    if o.task == "text" and o.data.source != "synthetic":
        hint = f" (the model's directory: {o.model.hf_path})" if o.model.hf_path else ""
        raise UserError("tokenizer.path is empty: a tokenizer is trained on the fly only for "
                        "data.source='synthetic'", "config key tokenizer.path",
                        f"set --config.tokenizer.path=DIR{hint}")
    saved = os.path.join(ctx.workdir, "tokenizer")
    if os.path.isfile(os.path.join(saved, "tokenizer.json")):
        return saved, "the workdir's tokenizer"
    return None, ""


def _unreadable_json(path: str) -> list[str]:
    """The JSON files of a directory that do not parse, each with why."""
    bad = []
    for f in sorted(glob.glob(os.path.join(path, "*.json"))):
        try:
            with open(f, encoding="utf-8") as fh:
                json.load(fh)
        except (ValueError, UnicodeDecodeError) as e:
            bad.append(f"{f}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return bad


def _load_tokenizer(path: Optional[str], key: str):
    if path is None:
        return None
    from lrl.data import tokenizer as tok_lib
    try:
        return tok_lib.load_tokenizer(path)
    except FileNotFoundError as e:
        raise UserError(str(e).removeprefix("load_tokenizer: "), f"{key}={path}",
                        "point it at a directory holding tokenizer.json (the model's own, "
                        "as a rule)") from e
    except Exception as e:  # noqa: BLE001 -- any failure to load a user's files is theirs
        bad = _unreadable_json(path)
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        raise UserError(
            f"the tokenizer does not load ({type(e).__name__}{': ' + first if first else ''})",
            bad[0].split(": ")[0] if bad else f"{key}={path}",
            "copy the tokenizer files again from the model's original (a cut or corrupted "
            "file?)", details=bad[:_MAX_LISTED]) from e


@check("tokenizer", after="checkpoint")
def _tokenizer(ctx):
    tok = ctx.tokenizer()
    if tok is None:
        return None
    path, key = _tokenizer_path(ctx)
    if not getattr(tok, "chat_template", None):
        raise UserError("the tokenizer has no chat template: lrl renders every prompt "
                        "through it", f"{key}={path}",
                        "use the instruct model's tokenizer (its tokenizer_config.json or "
                        "chat_template.jinja holds the template)")
    if ctx.opts.task == "video":
        from lrl.tasks.video_data import VISION_TOKENS
        lost = [t for t in VISION_TOKENS
                if tok.convert_tokens_to_ids(t) in (None, tok.unk_token_id)]
        if lost:
            raise UserError(f"the tokenizer has no ids for the vision tokens {lost}",
                            f"{key}={path}", "use Qwen2.5-VL's tokenizer")
    cfg = ctx.model_config()
    if tok.eos_token_id is None and not (cfg is not None and cfg.eos_token_ids):
        raise UserError("the tokenizer has no eos_token and the model config no "
                        "eos_token_id: a rollout would never stop", f"{key}={path}",
                        "set eos_token in tokenizer_config.json")
    return f"tokenizer: {len(tok)} tokens"


# ----------------------------------------------------------------------------- model

def _model_config(ctx):
    o = ctx.opts
    if o.task != "text":
        return None
    if o.model.hf_path:
        return hf_model_config(o.model.hf_path)
    tok = ctx.tokenizer()
    if tok is None:
        return None
    from lrl.tasks import text
    return text.model_config(o, tok) if not o.model.vocab_size or o.model.vocab_size >= len(
        tok) else None


def hf_model_config(path: str, key: str = "model.hf_path"):
    """`ModelConfig` of a HF directory's config.json, its faults as UserErrors naming it."""
    from lrl.models import config as config_lib
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise UserError(f"no config.json in the model directory (it holds "
                        f"{sorted(os.listdir(path))[:8]})", f"{key}={path}",
                        "point it at a Hugging Face checkpoint directory")
    try:
        hf = config_lib.read_json(cfg_path)
    except (ValueError, UnicodeDecodeError) as e:   # read_json's message names the file
        raise UserError(f"not valid JSON ({str(e).split(': ', 1)[-1]})", cfg_path,
                        "copy the model's config.json again") from e
    try:
        return config_lib.from_hf_dict(hf)
    except KeyError as e:
        raise UserError(f"config.json has no {e.args[0]!r} field", cfg_path,
                        "copy the model's config.json again") from e
    except (ValueError, TypeError) as e:
        raise UserError(str(e), cfg_path,
                        "use a Llama 3.x, Qwen2 / Qwen2.5 or Qwen3 checkpoint with its own "
                        "config.json") from e


def safetensors_shapes(path: str, key: str = "model.hf_path") -> dict[str, tuple]:
    """{tensor name: shape} from a HF directory's safetensors headers (no weights read)."""
    from lrl.models import hf_io
    try:
        st = hf_io.SafetensorsDir(path)
    except FileNotFoundError as e:
        raise UserError(str(e), f"{key}={path}", "point it at a directory with the "
                        "checkpoint's safetensors files") from e
    except ValueError as e:   # truncated or corrupt: the message names the file
        culprit = next((f for f in glob.glob(os.path.join(path, "*.safetensors"))
                        if f in str(e)), f"{key}={path}")
        raise UserError(str(e), culprit, "copy the file again (a download or copy cut "
                        "short?)") from e
    out = {}
    for name, header in st._headers.items():  # noqa: SLF001 -- the parsed headers
        for k, info in header.items():
            if k.startswith("__"):
                continue
            if info.get("dtype") not in hf_io._ST_DTYPES:  # noqa: SLF001
                raise UserError(f"tensor {k!r} has dtype {info.get('dtype')!r}, which lrl does "
                                "not read", os.path.join(path, name),
                                f"use a checkpoint in one of {sorted(hf_io._ST_DTYPES)}")
            out[k] = tuple(info["shape"])
    return out


def expected_hf_shapes(cfg) -> dict[str, tuple]:
    """{HF tensor name: shape} that `cfg` implies, from the same tables the loader uses."""
    import jax
    import jax.numpy as jnp
    from lrl.models import hf_io
    from lrl.models.params import abstract_params
    out = {}
    flat = jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]
    for path_keys, leaf in flat:
        names = tuple(getattr(k, "key", str(k)) for k in path_keys)
        if names[0] == "layers":
            suffix, (_, to_hf) = hf_io._LAYER_MAP[names[1:]]  # noqa: SLF001
            one = jax.ShapeDtypeStruct(leaf.shape[1:], jnp.float32)
            shape = tuple(jax.eval_shape(lambda w: to_hf(w, cfg), one).shape)
            out.update({f"model.layers.{i}.{suffix}": shape for i in range(cfg.n_layers)})
        else:
            name, (_, to_hf) = hf_io._TOP_MAP[names]  # noqa: SLF001
            one = jax.ShapeDtypeStruct(leaf.shape, jnp.float32)
            out[name] = tuple(jax.eval_shape(lambda w: to_hf(w, cfg), one).shape)
    return out


@check("checkpoint", after="rewards")
def _checkpoint(ctx):
    o = ctx.opts
    if not o.model.hf_path:
        return None
    if o.task != "text":   # Qwen2.5-VL: config.json and the weights are checked by its loader
        safetensors_shapes(o.model.hf_path)
        return "checkpoint: safetensors headers read"
    cfg = ctx.model_config()
    have = safetensors_shapes(o.model.hf_path)
    want = expected_hf_shapes(cfg)
    missing = [k for k in want if k not in have]
    wrong = [(k, want[k], have[k]) for k in want if k in have and have[k] != want[k]]
    cfg_path = os.path.join(o.model.hf_path, "config.json")
    if wrong:
        dims = (f"vocab_size={cfg.vocab_size}, hidden_size={cfg.d_model}, "
                f"intermediate_size={cfg.mlp_dim}, heads={cfg.n_heads}/{cfg.n_kv_heads}x"
                f"{cfg.head_dim}")
        raise UserError(f"{len(wrong)} tensor(s) of the weights do not have the shape "
                        f"config.json implies ({dims})", cfg_path,
                        "use the config.json that came with these weights",
                        details=[f"{k}: weights {list(h)}, config.json {list(w)}"
                                 for k, w, h in wrong[:_MAX_LISTED]])
    if missing:
        raise UserError(f"{len(missing)} tensor(s) that config.json implies are missing from "
                        "the weights", f"model.hf_path={o.model.hf_path}",
                        "copy the whole checkpoint (every shard and the index); "
                        "tie_word_embeddings in config.json says whether lm_head.weight is "
                        "needed", details=missing[:_MAX_LISTED])
    return f"checkpoint: {len(want)} tensors, shapes match config.json"


@check("model", after="tokenizer")
def _model(ctx):
    """The tokenizer's ids fit the model's vocabulary."""
    o, tok = ctx.opts, ctx.tokenizer()
    if o.task != "text" or tok is None:
        return None
    if not o.model.hf_path:
        if o.model.vocab_size and o.model.vocab_size < len(tok):
            raise UserError(f"model.vocab_size={o.model.vocab_size} is smaller than the "
                            f"tokenizer's {len(tok)} tokens", "config key model.vocab_size",
                            f"set it to 0 (the tokenizer's) or at least {len(tok)}")
        return None
    cfg = ctx.model_config()
    if len(tok) > cfg.vocab_size:
        tpath, tkey = _tokenizer_path(ctx)
        raise UserError(f"the tokenizer has {len(tok)} tokens, more than the model's "
                        f"vocabulary of {cfg.vocab_size} (config.json vocab_size): its ids "
                        "would index past the embedding", f"{tkey}={tpath}",
                        "use the model's own tokenizer")
    return None


_SHAPE_FIELDS = {"model_type": "model.model_type", "vocab_size": "model.vocab_size",
                 "d_model": "model.d_model", "n_layers": "model.n_layers",
                 "n_heads": "model.n_heads", "n_kv_heads": "model.n_kv_heads",
                 "head_dim": "model.head_dim", "mlp_dim": "model.mlp_dim",
                 "tie_embeddings": "model.tie_embeddings", "qkv_bias": "model.model_type",
                 "qk_norm": "model.model_type"}


def _latest_step_dir(root: str) -> Optional[str]:
    steps = [int(d) for d in (os.listdir(root) if os.path.isdir(root) else []) if d.isdigit()]
    return os.path.join(root, str(max(steps))) if steps else None


@check("resume", after="model")
def _resume(ctx):
    step_dir = _latest_step_dir(os.path.join(ctx.workdir, "checkpoints"))
    if step_dir is None or ctx.opts.task != "text":
        return None
    files = glob.glob(os.path.join(step_dir, "model_config", "*"))
    cfg = ctx.model_config()
    if not files or cfg is None:
        return None
    try:
        with open(files[0]) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None   # an unreadable step is the checkpoint restore's to report and skip
    diff = [(f, saved[f], getattr(cfg, f)) for f in _SHAPE_FIELDS
            if f in saved and saved[f] != getattr(cfg, f)]
    if diff:
        source = "model.hf_path's config.json" if ctx.opts.model.hf_path else "the config"
        raise UserError(
            f"the workdir holds a checkpoint of another model: {source} differs from the one "
            f"saved in {step_dir}", ", ".join(dict.fromkeys(_SHAPE_FIELDS[f] for f, _, _ in diff)),
            "resume with the settings the run started with, or start in a new --workdir",
            details=[f"{f}: checkpoint {a!r}, this run {b!r}" for f, a, b in diff])
    return f"resume: {step_dir} fits"


# ----------------------------------------------------------------------------- rewards

@check("rewards", after="sft_data")
def _rewards(ctx):
    o = ctx.opts
    if not o.rl_steps:
        return None
    from lrl import rewards
    try:
        terms = rewards.parse_spec(o.reward.spec)
    except ValueError as e:
        raise UserError(str(e), f"config key reward.spec={o.reward.spec!r}",
                        "name registered rewards as 'name:weight,name:weight' "
                        "(lrl/rewards/)") from e
    return "rewards: " + ", ".join(t.name for t in terms)
