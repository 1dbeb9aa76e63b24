"""Start-up checks of the models a run reads beside the policy (registered through
`lrl.preflight.MODULES`): the reward model of `reward.model` (`lrl.rewards.model`).

Each reads headers, config.json and the tokenizer, never weights, and raises `UserError`
naming the file or config key.
"""
from __future__ import annotations

import os

from lrl.errors import UserError
from lrl.preflight import _MAX_LISTED, check, expected_hf_shapes, safetensors_shapes

_RM_TODO = ("point reward.model.hf_path at a *ForSequenceClassification checkpoint with one "
            "label (config.json, safetensors, tokenizer with a chat template), or set it to "
            "'' and drop the 'rm' term of reward.spec")


@check("reward_model", after="model")
def _reward_model(ctx):
    o = ctx.opts
    m = o.reward.model
    if not o.rl_steps or not m.hf_path:
        return None
    from lrl.models import config as config_lib
    from lrl.models.score import body_config
    from lrl.rewards import model as rm_lib
    try:
        hf = rm_lib.check(m)
        cfg = body_config(config_lib.from_hf_dict(hf))
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e), f"reward.model.hf_path={m.hf_path}", _RM_TODO) from e
    have = safetensors_shapes(m.hf_path, "reward.model.hf_path")
    want = expected_hf_shapes(cfg)
    bad = [k for k in want if k not in have] + [
        f"{k}: weights {list(have[k])}, config.json {list(w)}" for k, w in want.items()
        if k in have and have[k] != w]
    if bad:
        raise UserError(f"{len(bad)} tensor(s) of the reward model are missing or do not have "
                        "the shape its config.json implies",
                        os.path.join(m.hf_path, "config.json"),
                        "copy the whole checkpoint with the config.json that came with it",
                        details=bad[:_MAX_LISTED])
    tok_path = m.tokenizer_path or m.hf_path
    key = "reward.model.tokenizer_path" if m.tokenizer_path else "reward.model.hf_path"
    from lrl.data import tokenizer as tok_lib
    try:
        tok = tok_lib.load_tokenizer(tok_path)
    except Exception as e:  # noqa: BLE001 -- any failure to load a user's files is theirs
        raise UserError(f"the reward model's tokenizer does not load: {e}",
                        f"{key}={tok_path}", "point it at the reward model's tokenizer") from e
    if not getattr(tok, "chat_template", None):
        raise UserError("the reward model's tokenizer has no chat template: each response is "
                        "scored in the reward model's own template", f"{key}={tok_path}",
                        "use the reward model's own tokenizer (its tokenizer_config.json)")
    if len(tok) > cfg.vocab_size:
        raise UserError(f"the reward model's tokenizer has {len(tok)} tokens, more than its "
                        f"vocabulary ({cfg.vocab_size})", f"{key}={tok_path}",
                        "use the tokenizer that came with the reward model")
    import jax
    if jax.process_count() > 1:
        raise UserError(f"a reward model in a run of {jax.process_count()} processes: it scores "
                        "in one-process runs only for now", "config key reward.model.hf_path",
                        "run on one host, or score with rule terms only")
    if ctx.mesh is not None:
        shards = ctx.mesh.shape["data"] * ctx.mesh.shape["fsdp"]
        if m.batch_rows % shards:
            raise UserError(f"reward.model.batch_rows={m.batch_rows} does not divide over the "
                            f"mesh's data x fsdp = {shards} devices",
                            "config key reward.model.batch_rows",
                            f"make it a multiple of {shards}")
        seq = ctx.mesh.shape["seq"]
        if m.max_len % (2 * seq):
            raise UserError(f"reward.model.max_len={m.max_len} is not a multiple of 2 x seq = "
                            f"{2 * seq}", "config key reward.model.max_len",
                            f"make it a multiple of {2 * seq}")
    return (f"reward model: {hf['architectures'][0]}, {len(want) + 1} tensors, "
            f"tokenizer {len(tok)} tokens")
