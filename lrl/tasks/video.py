"""The video task: a Qwen2.5-VL policy (text decoder trained, vision tower frozen) on videos,
as Long-RL's MR-SP does it.

Stage 1, once per batch (`prepare`): decode each prompt's video unless its embedding is
cached, encode each distinct video once with its frames split over the mesh, and build each
prompt's input embeddings (visual rows spliced in) and M-RoPE positions, which the rollout
prefills from. Stage 2 (`update_inputs`): the packed rows carry `visual_index` and [B, 3, T]
positions, and the forward reads one visual table [R, D] of the kept prompts' embeddings,
replicated, with `lrl.models.vl.batch_hidden_states` as the update's `hidden`; with ring or
Ulysses attention each long row is split along T over `seq` like a text row.

The policy is a tiny random Qwen2.5-VL, or a local HF Qwen2.5-VL directory. One process
drives all local devices; multi-process video runs are not supported.

P prompts · G samples per prompt · B packed rows · T positions · D model width ·
R visual table rows.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Optional

import jax
import numpy as np

from lrl import mesh as mesh_lib
from lrl import models
from lrl.data import video as video_lib
from lrl.models import embed_cache, vision, vl, vl_io
from lrl.models.config import dtype
from lrl.rollout import sp_prefill
from lrl.tasks import Prompt
from lrl.tasks import video_data
from lrl.tasks.video_data import VISION_TOKENS

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class VisualRows:
    """What a prompt's update rows need: its visual embedding rows and rotary positions."""
    embedding: object          # [n, D] the prompt's visual rows (one video)
    count: int                 # n
    positions: np.ndarray      # [3, T] M-RoPE positions of the prompt
    delta: int                 # rotary position minus index after the prompt


class VideoTask:
    extra_keys = ("visual_index",)
    multimodal = True    # prompts carry input embeddings (visual rows spliced in)
    hidden = staticmethod(vl.batch_hidden_states)

    def __init__(self, opts, workdir: str, mesh):
        if jax.process_count() > 1:
            raise ValueError("task='video' runs in one process over its local devices; "
                             "multi-process video GRPO is not supported")
        unit = sp_prefill.length_unit(opts.model.attention, mesh.shape["seq"])
        if opts.rl.row_len % unit:
            raise ValueError(f"rl.row_len={opts.rl.row_len} must divide by {unit} for "
                             f"attention={opts.model.attention!r} over seq={mesh.shape['seq']}")
        self.opts, self.workdir, self.mesh = opts, workdir, mesh
        self.train = video_data.records(opts, workdir, "train")
        self.tokenizer = video_data.build_tokenizer(opts, workdir, self.train)
        self.vl_cfg, params = build_policy(opts, self.tokenizer, mesh)
        self.model_cfg = self.vl_cfg.text
        self._text_params, self.vision_params = params["text"], params["vision"]
        v = opts.video
        axes = tuple(a for a in v.frame_axes.split(",") if a) or None
        self.stage = VisionStage(
            self.vl_cfg, vision_settings(self.vl_cfg, v),
            embed_cache.make_encoder(self.vl_cfg.vision, mesh, frame_axes=axes),
            embed_cache.EmbeddingCache(v.cache_dir or None, max_bytes=int(v.cache_gib * 2**30)),
            opts.model.hf_path or f"random:{opts.seed}")

    # ---- model and data
    def initial_params(self):
        params, self._text_params = self._text_params, None   # held once, by the train state
        if params is None:
            raise RuntimeError("VideoTask.initial_params: the initial parameters were taken "
                               "already")
        return params

    def prompts(self, split: str = "train"):
        return video_data.RecordBatches(self.train, self.opts.rl.prompts_per_step,
                                        self.opts.seed,
                                        shuffle=self.opts.data.source != "synthetic")

    def eval_batches(self) -> list:
        held_out = video_data.records(self.opts, self.workdir, "eval")
        return [held_out] if held_out else []

    # ---- a step
    def prepare(self, params, recs: list[dict]):
        """Stage 1 for a batch of records -> ([Prompt], metrics). Videos that do not decode,
        and prompts that do not fit a packed row (`rl.row_len`) with their completions, are
        reported and dropped."""
        rl = self.opts.rl
        t0 = time.time()
        recs, items, embs, m = encode_batch(self.stage, self.vision_params, recs)
        prompts, too_long = [], 0
        for rec, item, emb in zip(recs, items, embs):
            p = visual_prompt(self.vl_cfg, params, self.tokenizer, rec, item, emb)
            if len(p.ids) + rl.max_new_tokens > rl.row_len:
                log.warning("skipping %s: its prompt has %d tokens; with %d new tokens it does "
                            "not fit rl.row_len=%d", rec["video"], len(p.ids), rl.max_new_tokens,
                            rl.row_len)
                too_long += 1
                continue
            prompts.append(p)
        if not prompts:
            raise RuntimeError("no prompt of this batch could be used (see the warnings above)")
        m["video/too_long"] = too_long
        m["time/vision_s"] = time.time() - t0
        return prompts, m

    def update_inputs(self, rows: dict, layout, sample_prompts):
        """Packed text rows (sequence i is a sample of `sample_prompts[i]`) -> the same rows
        with `visual_index` and M-RoPE positions, and the visual table they index, replicated
        on the mesh. The table holds each prompt's rows once, padded to the most a step can
        have (`table_rows`), so the update compiles once."""
        text = self.model_cfg
        unique = list({id(p): p for p in sample_prompts}.values())
        table, offsets = embed_cache.build_table([p.visual.embedding for p in unique],
                                                 text.d_model, text.dtype, pad_to=256)
        if table.shape[0] < self.table_rows:
            table = jax.numpy.pad(table, ((0, self.table_rows - table.shape[0]), (0, 0)))
        where = {id(p): int(o) for p, o in zip(unique, offsets)}
        rows = add_visual_rows(self.vl_cfg, rows, layout, sample_prompts,
                               [where[id(p)] for p in sample_prompts])
        return rows, jax.device_put(table, mesh_lib.replicated(self.mesh))

    def row_specs(self, rows: int, T: int) -> dict:
        """The update rows' arrays beyond (or instead of) the text ones: (shape, dtype)."""
        return {"positions": ((rows, 3, T), np.int32), "visual_index": ((rows, T), np.int32)}

    def extra_spec(self):
        """The forward's extra argument as the update is compiled for it: the padded table."""
        return jax.ShapeDtypeStruct((self.table_rows, self.model_cfg.d_model),
                                    self.model_cfg.dtype,
                                    sharding=mesh_lib.replicated(self.mesh))

    @property
    def table_rows(self) -> int:
        """The most visual rows one step's prompts can have: every prompt's video at the
        largest frame size, rounded up to 256."""
        v = self.opts.video
        per_video = (v.num_frames // self.vl_cfg.vision.temporal_patch_size) * \
            v.max_tokens_per_frame
        return -(-self.opts.rl.prompts_per_step * per_video // 256) * 256

    def state(self) -> dict:
        return {"bad_videos": dict(self.stage.bad)}

    def restore(self, state: dict) -> None:
        self.stage.bad.update(state.get("bad_videos", {}))


# ----------------------------------------------------------------------------- the policy

def build_policy(opts, tokenizer, mesh=None):
    """-> (VLConfig, {"text": ..., "vision": ...}): a local checkpoint or a random init, the
    text half sharded over `mesh` by lrl's rules, the vision half replicated."""
    m = opts.model
    if m.hf_path:
        run_kw = dict(attention=m.attention, attention_impl=m.attention_impl or None,
                      remat=m.remat, param_shard_axes=m.shard_axes)
        # load_hf_vl's dtype is the storage dtype (and its compute dtype): set compute after.
        vl_cfg, params = vl_io.load_hf_vl(m.hf_path, dtype(m.param_dtype), mesh=mesh, **run_kw)
        vl_cfg = vl_cfg.replace(text=vl_cfg.text.replace(dtype=dtype(m.dtype)))
        check_token_ids(vl_cfg, tokenizer, m.hf_path)
        return vl_cfg, params
    vl_cfg = policy_config(opts, tokenizer)
    k_text, k_vis = jax.random.split(jax.random.key(opts.seed))
    # One compiled init, created replicated: the vision tower is small and every device
    # encodes frames with all of it.
    vis = jax.jit(vision.init_vision_params, static_argnums=0,
                  out_shardings=None if mesh is None else mesh_lib.replicated(mesh))(
                      vl_cfg.vision, k_vis)
    return vl_cfg, {"text": models.init_params(vl_cfg.text, k_text, mesh), "vision": vis}


def policy_config(opts, tokenizer) -> vl.VLConfig:
    """The random policy's VLConfig from the options (no parameters made): the text decoder
    from `model.*`, the vision tower from `video.vision_*` (a checkpoint brings its own)."""
    m, v = opts.model, opts.video
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    from lrl.tasks.text import vocab_size
    text = models.ModelConfig(
        model_type="qwen2", vocab_size=vocab_size(m, tokenizer), d_model=m.d_model,
        n_layers=m.n_layers,
        n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim, mlp_dim=m.mlp_dim,
        rope_theta=m.rope_theta, qkv_bias=True, mrope_section=tuple(v.mrope_section),
        tie_embeddings=m.tie_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=(tokenizer.eos_token_id,), dtype=dtype(m.dtype),
        param_dtype=dtype(m.param_dtype), attention=m.attention,
        attention_impl=m.attention_impl or None, remat=m.remat, param_shard_axes=m.shard_axes)
    vcfg = vision.VisionConfig(depth=v.vision_depth, hidden_size=v.vision_width,
                               intermediate_size=v.vision_mlp_dim, num_heads=v.vision_heads,
                               out_hidden_size=m.d_model, fullatt_block_indexes=(0,))
    return vl.VLConfig(text, vcfg, image_token_id=ids["<|image_pad|>"],
                       video_token_id=ids["<|video_pad|>"],
                       vision_start_token_id=ids["<|vision_start|>"],
                       vision_end_token_id=ids["<|vision_end|>"])


def check_token_ids(vl_cfg, tokenizer, where: str) -> None:
    """The tokenizer's vision tokens must be the ids the checkpoint was trained with."""
    want = dict(zip(VISION_TOKENS, (vl_cfg.vision_start_token_id, vl_cfg.vision_end_token_id,
                                    vl_cfg.image_token_id, vl_cfg.video_token_id)))
    got = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    if got != want or len(tokenizer) > vl_cfg.text.vocab_size:
        raise ValueError(f"tokenizer does not fit the model in {where}: vision token ids "
                         f"{got} vs the model's {want}; {len(tokenizer)} tokens for a "
                         f"vocabulary of {vl_cfg.text.vocab_size}")


# ----------------------------------------------------------------------------- stage 1

def vision_settings(vl_cfg: vl.VLConfig, v) -> video_lib.VisionSettings:
    unit = (vl_cfg.vision.patch_size * vl_cfg.vision.spatial_merge_size) ** 2
    return video_lib.VisionSettings(
        patch_size=vl_cfg.vision.patch_size, temporal_patch_size=vl_cfg.vision.temporal_patch_size,
        merge_size=vl_cfg.vision.spatial_merge_size, num_frames=v.num_frames,
        video_min_pixels=v.min_tokens_per_frame * unit,
        video_max_pixels=v.max_tokens_per_frame * unit)


@dataclasses.dataclass
class VisionStage:
    """MR-SP stage 1's state across steps: the encoder (frames split over the mesh), the
    embedding cache, the patch grid of every video decoded so far (a cached video is not
    decoded again) and the videos that failed to decode (never tried again)."""
    vl_cfg: vl.VLConfig
    settings: video_lib.VisionSettings
    encoder: embed_cache.Encoder
    cache: embed_cache.EmbeddingCache
    model_id: str
    grids: dict = dataclasses.field(default_factory=dict)   # path -> (grid_thw, s per grid)
    bad: dict = dataclasses.field(default_factory=dict)     # path -> reason

    def known_item(self, path: str) -> Optional[video_lib.VisualItem]:
        """A patch-less item for a video whose embedding is cached (no decoding needed)."""
        if path not in self.grids:
            return None
        grid, seconds = self.grids[path]
        item = video_lib.VisualItem(np.zeros((0, 0), np.float32), grid, "video", seconds, path)
        key = embed_cache.item_key(item, self.settings.fingerprint(), self.model_id)
        return item if self.cache.contains(key) else None


def encode_batch(stage: VisionStage, vision_params, recs: list[dict]):
    """Stage 1 for one batch of records -> (kept records, items, per-prompt embeddings
    [n_p, D], stats). Videos are decoded unless cached, failures are reported by path and
    dropped, and each distinct video missing from the cache is encoded once."""
    stats = {"video/skipped": 0, "video/decoded": 0}
    items, kept, todo = [], [], []
    for r in recs:
        if r["video"] in stage.bad:
            stats["video/skipped"] += 1
            continue
        item = stage.known_item(r["video"])
        kept.append(r)
        items.append(item)
        if item is None:
            todo.append(len(items) - 1)
    paths = list(dict.fromkeys(kept[i]["video"] for i in todo))   # each video decoded once
    t0 = time.perf_counter()
    decoded, failures = video_lib.load_videos(paths, stage.settings)
    stats["time/video_decode_s"] = time.perf_counter() - t0   # host: decoding and patching
    for path, reason in failures:
        stage.bad[path] = reason
    by_path = {it.source: it for it in decoded}
    for i in todo:
        items[i] = by_path.get(kept[i]["video"])
    stats["video/skipped"] += sum(it is None for it in items)
    stats["video/decoded"] = len(decoded)
    kept = [r for r, it in zip(kept, items) if it is not None]
    items = [it for it in items if it is not None]
    for it in decoded:
        stage.grids[it.source] = (tuple(int(g) for g in it.grid_thw), it.seconds_per_grid)
    misses = stage.cache.misses
    embs = embed_cache.prompt_embeddings(stage.vl_cfg.vision, vision_params,
                                         [[it] for it in items], stage.encoder, stage.cache,
                                         stage.settings.fingerprint(), stage.model_id)
    stats["vision/encoded_items"] = stage.cache.misses - misses
    stats["vision/table_rows"] = int(sum(e.shape[0] for e in embs))
    return kept, items, embs, stats


# ----------------------------------------------------------------------------- prompts, rows

EMBED_BUCKET = 256   # a prompt's input embeddings are computed for a multiple of this many


@functools.partial(jax.jit, static_argnums=0)
def _embed_prompt(text_cfg, text_params, ids_T, emb_RD, index_T):
    return vl.embed_tokens(text_cfg, text_params, ids_T[None], emb_RD, index_T[None])[0]


def visual_prompt(vl_cfg, text_params, tokenizer, rec: dict, item, emb) -> Prompt:
    """A record -> its Prompt: token ids [T] (the video pad expanded), input embeddings
    [T', D] (its visual rows spliced in; T' is T rounded up to EMBED_BUCKET), M-RoPE
    positions [3, T]."""
    ids = tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    n = vl_cfg.tokens_per_item(item.grid_thw)
    ids = video_lib.expand_placeholders(np.asarray(ids, np.int32), vl_cfg.video_token_id,
                                        [n]).astype(np.int32)
    pos, delta = vl.mrope_positions(vl_cfg, ids, video_grids=[item.grid_thw],
                                    video_seconds_per_grid=[item.seconds_per_grid])
    index = vl.visual_index(vl_cfg, ids[None], None, np.array([[-1, 0]]), np.array([[0, n]]))
    # Padded to a bucket of EMBED_BUCKET tokens and embedded in one compiled call: eager ops
    # compiled again for every new prompt length, in every step. The rows past the prompt
    # are never read (`lrl.rollout.engine.embed_rows` reads [0, cached)).
    T = len(ids)
    Tb = -(-T // EMBED_BUCKET) * EMBED_BUCKET
    embeds = _embed_prompt(vl_cfg.text, text_params, np.pad(ids, (0, Tb - T)),
                           emb, np.pad(index[0], (0, Tb - T), constant_values=-1))
    return Prompt(ids, rec["answer"], dict(task=rec["task"]), rec["prompt"], embeds=embeds,
                  positions=pos, visual=VisualRows(emb, n, pos, delta))


def add_visual_rows(vl_cfg, batch, layout, sample_prompts, offsets):
    """Packed text rows (`lrl.grpo.pack`) -> the same rows with `visual_index` [B, T] and
    M-RoPE `positions` [B, 3, T]: sequence i is a sample of `sample_prompts[i]` and reads its
    prompt's table rows, from `offsets[i]`. In the shared-prompt layout
    (`lrl.data.shared_prompt`) the prompt's visual tokens lie once, in its prefix, and each
    response segment holds the prompt's last token and the completion, at the positions
    they have in the unshared sequence."""
    B, T = batch["tokens"].shape
    seg = batch["segment_ids"]
    S = int(seg.max()) + 1
    pos = np.zeros((B, 3, T), np.int32)
    offs, counts = np.full((B, S), -1, np.int32), np.zeros((B, S), np.int32)
    for i, (r, s) in enumerate(zip(layout["row"], layout["start"])):
        p = sample_prompts[i].visual
        P, c = int(layout["prompt_len"][i]), int(layout["completion_len"][i])
        full = vl.extend_positions(p.positions, p.delta, P + c)       # [3, P + c]
        ps = int(layout["prefix_start"][i])
        if ps < 0:
            pos[r, :, s:s + P + c] = full
            offs[r, seg[r, s]], counts[r, seg[r, s]] = offsets[i], p.count
            continue
        # the prefix (written by each of its responses alike), then this response's segment
        pos[r, :, ps:ps + P - 1] = full[:, :P - 1]
        offs[r, seg[r, ps]], counts[r, seg[r, ps]] = offsets[i], p.count
        pos[r, :, s:s + 1 + c] = full[:, P - 1:]
        if int(batch["tokens"][r, s]) in vl_cfg.vision_token_ids:   # the prompt ends visual
            offs[r, seg[r, s]], counts[r, seg[r, s]] = offsets[i] + p.count - 1, 1
    out = dict(batch)
    out["positions"] = pos
    out["visual_index"] = vl.visual_index(vl_cfg, batch["tokens"], seg, offs, counts)
    return out
