"""The Qwen2.5-VL policy against transformers (vision tower, M-RoPE, logits), the embedding
cache (cached == uncached, one tower run per prompt whatever G), the sharded ring forward."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from lrl import mesh as mesh_lib
from lrl.models import embed_cache, vision, vl, vl_io
from lrl.models.hf_io import SafetensorsDir, write_safetensors
from lrl.models.layers import rope_angles
from tests.hf_util import rel_err

IMG_GRID, VID_GRID = (1, 6, 10), (2, 4, 6)   # 6x10 patches: windows of 2x2 tokens, partial ones


def _hf_config():
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [2, 3, 3]},
                         bos_token_id=None, eos_token_id=159, initializer_range=0.1),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                           out_hidden_size=64, window_size=56, fullatt_block_indexes=[1],
                           tokens_per_second=2, initializer_range=0.1),
        image_token_id=150, video_token_id=151, vision_start_token_id=152,
        vision_end_token_id=153)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    torch.manual_seed(0)
    hf = transformers.Qwen2_5_VLForConditionalGeneration(_hf_config()).float().eval()
    with torch.no_grad():  # zero biases and unit norms would hide mistakes in them
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(str(path))
    vl_cfg, params = vl_io.load_hf_vl(str(path), jnp.float32)
    return path, hf, vl_cfg, params


def _pixels(grid, seed):
    c = _hf_config().vision_config
    n = grid[0] * grid[1] * grid[2]
    return np.random.RandomState(seed).randn(n, 3 * c.temporal_patch_size * c.patch_size ** 2
                                             ).astype(np.float32)


def _sequence(c, seed=0):
    rng = np.random.RandomState(seed)
    vs, ve = c.vision_start_token_id, c.vision_end_token_id
    return np.concatenate([
        rng.randint(0, 140, 5), [vs], [c.image_token_id] * c.tokens_per_item(IMG_GRID), [ve],
        rng.randint(0, 140, 4), [vs], [c.video_token_id] * c.tokens_per_item(VID_GRID), [ve],
        rng.randint(0, 140, 6)])


def test_config_and_tree(model):
    _, _, c, params = model
    assert c.text.mrope_section == (2, 3, 3) and c.text.qkv_bias and not c.text.o_bias
    assert c.vision.fullatt_block_indexes == (1,) and c.vision.window_units == 2
    from lrl.models import abstract_params
    want = jax.tree.map(lambda s: s.shape, abstract_params(c.text))
    assert jax.tree.map(lambda a: a.shape, params["text"]) == want
    rand = vision.init_vision_params(c.vision, jax.random.key(0))
    assert jax.tree.map(lambda a: a.shape, rand) == jax.tree.map(lambda a: a.shape,
                                                                  params["vision"])


def test_vision_tower_matches_transformers(model):
    _, hf, c, params = model
    pv = [_pixels(IMG_GRID, 1), _pixels(VID_GRID, 2), _pixels((3, 8, 8), 3)]
    grids = [IMG_GRID, VID_GRID, (3, 8, 8)]
    with torch.no_grad():
        want = hf.model.visual(torch.tensor(np.concatenate(pv)),
                               grid_thw=torch.tensor(grids)).pooler_output.numpy()
    items = [vision_item(p, g) for p, g in zip(pv, grids)]
    got = embed_cache.encode_items(c.vision, params["vision"], items,
                                   embed_cache.make_encoder(c.vision))
    assert rel_err(np.concatenate([np.asarray(g) for g in got]), want) < 1e-4
    one = vision.encode(c.vision, params["vision"], pv[1], VID_GRID)
    assert rel_err(one, np.asarray(got[1])) < 1e-6


def vision_item(patches, grid, source=""):
    from lrl.data.video import VisualItem
    return VisualItem(patches, tuple(grid), "video" if grid[0] > 1 else "image", 1.0, source)


def test_logits_and_positions_match_transformers(model):
    _, hf, c, params = model
    tokens = _sequence(c)[None]
    types = np.where(tokens == c.image_token_id, 1, np.where(tokens == c.video_token_id, 2, 0))
    pv_img, pv_vid = _pixels(IMG_GRID, 4), _pixels(VID_GRID, 5)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pv_img),
                  image_grid_thw=torch.tensor([IMG_GRID]), pixel_values_videos=torch.tensor(pv_vid),
                  video_grid_thw=torch.tensor([VID_GRID]), second_per_grid_ts=torch.tensor([1.0]),
                  mm_token_type_ids=torch.tensor(types)).logits.numpy()
        hf_pos, hf_delta = hf.model.get_rope_index(
            torch.tensor(tokens), torch.tensor(types), torch.tensor([IMG_GRID]),
            torch.tensor([VID_GRID]), torch.tensor([1.0]))
    pos, delta = vl.mrope_positions(c, tokens[0], [IMG_GRID], [VID_GRID], [1.0])
    np.testing.assert_array_equal(pos, hf_pos[:, 0].numpy())
    assert delta == int(hf_delta) and delta < 0
    emb_i = vision.encode(c.vision, params["vision"], pv_img, IMG_GRID)
    emb_v = vision.encode(c.vision, params["vision"], pv_vid, VID_GRID)
    table, index = vl.visual_table_hf_order(c, tokens, [emb_i], [emb_v])
    got = vl.vl_forward(c.text, params["text"], tokens, pos[:, None], None, table, index)
    assert rel_err(got, want) < 1e-4
    with pytest.raises(ValueError, match="do not match"):
        vl.visual_table_hf_order(c, tokens, [emb_i], [emb_v[:-1]])


def test_mrope_original_rule_and_plain_rope(model):
    _, hf, c, _ = model
    # A video whose temporal span is the longest axis: text resumes one past its last time
    # position (Qwen2.5-VL / vLLM; transformers >= 5.3 would resume at st + max(h, w)).
    n = c.tokens_per_item((4, 4, 4))
    tokens = np.array([1, 2, c.vision_start_token_id] + [c.video_token_id] * n
                      + [c.vision_end_token_id, 5])
    pos, delta = vl.mrope_positions(c, tokens, video_grids=[(4, 4, 4)],
                                    video_seconds_per_grid=[1.5])
    interval = 1.5 * c.vision.tokens_per_second
    t_want = np.repeat(3 + np.floor(np.arange(4) * interval), 4)
    np.testing.assert_array_equal(pos[0, 3:3 + n], t_want)
    np.testing.assert_array_equal(pos[1, 3:3 + n], 3 + np.tile(np.repeat([0, 1], 2), 4))
    np.testing.assert_array_equal(pos[2, 3:3 + n], 3 + np.tile([0, 1], 8))
    np.testing.assert_array_equal(pos[:, -2:], [[13, 14]] * 3)
    assert delta == 15 - len(tokens)
    with pytest.raises(ValueError, match="consecutive placeholder"):
        vl.mrope_positions(c, tokens[:-4], video_grids=[(4, 4, 4)])
    # M-RoPE angles equal transformers' rotary; equal components reduce to plain RoPE.
    rot = hf.model.language_model.rotary_emb
    p3 = np.random.RandomState(0).randint(0, 50, size=(3, 2, 7))
    with torch.no_grad():
        cos_hf, sin_hf = rot(torch.zeros(1, dtype=torch.float32), torch.tensor(p3))
    cos, sin = rope_angles(c.text, jnp.asarray(p3))
    assert rel_err(cos, cos_hf.numpy()) < 1e-6 and rel_err(sin, sin_hf.numpy()) < 1e-6
    flat = jnp.asarray(p3[0])
    for a, b in zip(rope_angles(c.text, jnp.broadcast_to(flat, (3, 2, 7))),
                    rope_angles(c.text, flat)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _group_batch(c, prompts, G):
    """P prompts × G samples, prompt-major rows, each prompt + a random completion; the last
    sample of each prompt 'generates' a video placeholder id, which must stay a text token."""
    rows, pos, items, counts = [], [], [], []
    rng = np.random.RandomState(7)
    for grid, pv in prompts:
        n = c.tokens_per_item(grid)
        prompt = np.array([3, c.vision_start_token_id] + [c.video_token_id] * n
                          + [c.vision_end_token_id, 9])
        p, delta = vl.mrope_positions(c, prompt, video_grids=[grid])
        items.append([vision_item(pv, grid)])
        counts.append(n)
        for g in range(G):
            comp = rng.randint(0, 140, 6)
            comp[2] = c.video_token_id if g == G - 1 else comp[2]
            rows.append(np.concatenate([prompt, comp]))
            pos.append(vl.extend_positions(p, delta, len(rows[-1])))
    T = max(len(r) for r in rows)
    seg = np.array([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    tokens = np.array([np.pad(r, (0, T - len(r))) for r in rows])
    positions = np.stack([np.pad(p, ((0, 0), (0, T - p.shape[1]))) for p in pos], axis=1)
    return tokens, positions, seg, items, counts


def test_cached_embeddings_equal_uncached_and_encode_once_per_prompt(model, tmp_path):
    _, _, c, params = model
    prompts = [(VID_GRID, _pixels(VID_GRID, 10)), ((2, 6, 10), _pixels((2, 6, 10), 11)),
               (VID_GRID, _pixels(VID_GRID, 12))]
    base = embed_cache.make_encoder(c.vision)
    calls = {"frames": 0, "calls": 0}

    def counting(p, patches, grid):
        calls["calls"] += 1
        calls["frames"] += patches.shape[0]
        return base(p, patches, grid)

    for G in (1, 4):
        calls.update(frames=0, calls=0)
        tokens, positions, seg, items, counts = _group_batch(c, prompts, G)
        per_prompt = embed_cache.prompt_embeddings(c.vision, params["vision"], items, counting)
        table, offsets = embed_cache.build_table(per_prompt, c.text.d_model, pad_to=16)
        index = vl.visual_index(c, tokens, seg, *embed_cache.group_offsets(offsets, G, counts))
        sampled_pad = (tokens == c.video_token_id) & (np.arange(tokens.shape[1]) >= 4 + counts[0])
        assert sampled_pad[G - 1].any() and (index[:G][sampled_pad[:G]] == -1).all()
        got = vl.vl_forward(c.text, params["text"], tokens, positions, seg, table, index)
        # Each prompt's frames went through the tower once: 2 + 2 + 2 temporal patches.
        assert calls["frames"] == 6 and calls["calls"] == 2
        # Uncached: every row encodes its own video; transformers' order fills the rows.
        encode = jax.jit(vision.encode, static_argnums=(0, 3))
        own = [encode(c.vision, params["vision"], prompts[r // G][1], prompts[r // G][0])
               for r in range(len(tokens))]
        t_u, i_u = vl.visual_table_hf_order(c, np.where(index >= 0, tokens, 0),
                                            video_embeds=own)
        want = vl.vl_forward(c.text, params["text"], tokens, positions, seg, t_u, i_u)
        mask = seg > 0
        assert rel_err(np.asarray(got)[mask], np.asarray(want)[mask]) < 1e-5
    # On-disk cache: a fresh cache on the same directory encodes nothing; a changed file does.
    video = tmp_path / "clip.bin"
    video.write_bytes(b"x")
    items = [[vision_item(prompts[0][1], VID_GRID, str(video))]]
    first = embed_cache.EmbeddingCache(str(tmp_path / "cache"))
    e1 = embed_cache.prompt_embeddings(c.vision, params["vision"], items, counting, first,
                                       "s", "m")[0]
    calls.update(frames=0, calls=0)
    again = embed_cache.EmbeddingCache(str(tmp_path / "cache"))
    e2 = embed_cache.prompt_embeddings(c.vision, params["vision"], items, counting, again,
                                       "s", "m")[0]
    assert calls["calls"] == 0 and again.hits == 1
    np.testing.assert_array_equal(np.asarray(e1), np.asarray(e2))
    os.utime(video, ns=(0, 123))
    embed_cache.prompt_embeddings(c.vision, params["vision"], items, counting, again, "s", "m")
    assert calls["calls"] == 1


def test_sharded_ring_forward_and_frame_split(model):
    _, _, c, params = model
    tokens, positions, seg, items, counts = _group_batch(
        c, [(VID_GRID, _pixels(VID_GRID, 20)), (VID_GRID, _pixels(VID_GRID, 21))], 2)
    T = -(-tokens.shape[1] // 8) * 8
    pad = ((0, 0), (0, T - tokens.shape[1]))
    tokens, seg = np.pad(tokens, pad), np.pad(seg, pad)
    positions = np.pad(positions, ((0, 0),) + pad)
    mesh = mesh_lib.make_mesh({"fsdp": 2, "seq": 2, "tensor": 2})
    _, params_s = vl_io.load_hf_vl(str(model[0]), jnp.float32, mesh=mesh)
    enc = embed_cache.make_encoder(c.vision, mesh, frame_chunk=1)
    per_prompt = embed_cache.prompt_embeddings(c.vision, params_s["vision"], items, enc)
    assert len(per_prompt[0].sharding.device_set) == 8
    table, offsets = embed_cache.build_table(per_prompt, c.text.d_model)
    ref = embed_cache.prompt_embeddings(c.vision, params["vision"], items,
                                        embed_cache.make_encoder(c.vision))
    assert rel_err(np.asarray(per_prompt[0]), np.asarray(ref[0])) < 1e-5
    index = vl.visual_index(c, tokens, seg, *embed_cache.group_offsets(offsets, 2, counts))
    ref_table, _ = embed_cache.build_table(ref, c.text.d_model)
    want = vl.vl_forward(c.text, params["text"], tokens, positions, seg, ref_table, index)
    ring = c.text.replace(attention="ring")
    got = jax.jit(lambda p, tb: vl.vl_forward(ring, p, tokens, positions, seg, tb, index,
                                              mesh=mesh))(params_s["text"], table)
    mask = seg > 0
    assert rel_err(np.asarray(got)[mask], np.asarray(want)[mask]) < 1e-5


def test_load_transformers_4_names(model, tmp_path):
    path, _, c, params = model
    st = SafetensorsDir(str(path))
    renamed = {}
    for k in st.keys():
        new = ("model.language_model." + k[len("model."):] if k.startswith("model.")
               else "model." + k if k.startswith("visual.") else k)
        renamed[new] = np.asarray(st.get(k))
    write_safetensors(str(tmp_path / "model.safetensors"), renamed)
    with open(path / "config.json") as f:
        cfg = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    c2, p2 = vl_io.load_hf_vl(str(tmp_path))
    assert c2 == c
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    cfg["model_type"] = "qwen2_vl"
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="qwen2_vl"):
        vl_io.load_hf_vl(str(tmp_path))


def test_the_in_memory_embedding_cache_is_bounded_by_bytes():
    """`video.cache_gib`: the least recently used tables leave device memory first; what is
    on disk stays readable."""
    import jax.numpy as jnp
    cache = embed_cache.EmbeddingCache(max_bytes=3 * 4 * 10)   # three [10] float32 tables
    for k in "abc":
        cache.put(k, jnp.zeros(10, jnp.float32))
    assert cache.get("a") is not None and cache.bytes == 120   # "a" is now the newest
    cache.put("d", jnp.zeros(10, jnp.float32))                  # drops "b", the oldest
    assert not cache.contains("b") and all(cache.contains(k) for k in "acd")
    cache.put("e", jnp.zeros(20, jnp.float32))                  # twice the size: two leave
    assert [k for k in "acde" if cache.contains(k)] == ["d", "e"] and cache.bytes == 120
    none = embed_cache.EmbeddingCache(max_bytes=0)
    none.put("a", jnp.zeros(10, jnp.float32))
    assert not none.contains("a") and none.bytes == 0
