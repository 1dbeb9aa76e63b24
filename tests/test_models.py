"""The decoder against transformers' PyTorch models, packed rows, sharded forwards, HF I/O."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lrl.models as models
from lrl import mesh as mesh_lib
from tests.hf_util import hf_logits, make_hf_model, rel_err


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    torch_model = make_hf_model(request.param, path)
    return request.param, path, torch_model


def test_logits_match_transformers(family_dir):
    family, path, torch_model = family_dir
    cfg, params = models.load_hf(str(path), dtype=jnp.float32)
    assert cfg.model_type == family
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, size=(2, 40))
    ours = models.forward(cfg, params, tokens)
    # Positions past the llama3 original context (16) exercise the scaled frequencies.
    assert rel_err(ours, hf_logits(torch_model, tokens)) < 1e-4


def test_unscanned_layers_and_bf16_match(family_dir):
    family, path, torch_model = family_dir
    tokens = np.random.RandomState(1).randint(0, 128, size=(1, 24))
    want = hf_logits(torch_model, tokens)
    cfg, params = models.load_hf(str(path), dtype=jnp.float32)
    unscanned = cfg.replace(scan_layers=False, remat="none")
    blocks = {f"blocks_{i}": jax.tree.map(lambda x: x[i], params["layers"])
              for i in range(cfg.n_layers)}
    flat = {**{k: v for k, v in params.items() if k != "layers"}, **blocks}
    assert rel_err(models.forward(unscanned, flat, tokens), want) < 1e-4
    cfg16, params16 = models.load_hf(str(path), dtype=jnp.bfloat16)
    assert jax.tree.leaves(params16)[0].dtype == jnp.bfloat16
    assert rel_err(models.forward(cfg16, params16, tokens), want) < 5e-2


def test_packed_rows_equal_segments_alone(family_dir):
    _, path, _ = family_dir
    cfg, params = models.load_hf(str(path))
    rng = np.random.RandomState(2)
    lengths = [7, 12, 5]
    segs = [rng.randint(0, cfg.vocab_size, size=n) for n in lengths]
    tokens = np.concatenate(segs + [np.zeros(32 - sum(lengths), int)])[None]
    segment_ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)]
                                 + [np.zeros(32 - sum(lengths), int)])[None]
    packed = np.asarray(models.forward(cfg, params, tokens, segment_ids_BT=segment_ids))
    start = 0
    for seg in segs:
        alone = np.asarray(models.forward(cfg, params, seg[None]))
        assert rel_err(packed[:, start:start + len(seg)], alone) < 1e-5
        start += len(seg)


@pytest.mark.parametrize("axes", [{"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": 2, "tensor": 2},
                                  {"fsdp": 2, "seq": 2, "tensor": 2}])
def test_sharded_forward_equals_single_device(family_dir, axes):
    _, path, _ = family_dir
    cfg, params = models.load_hf(str(path))
    mesh = mesh_lib.make_mesh(axes)
    cfg_s, params_s = models.load_hf(str(path), mesh=mesh)
    q = params_s["layers"]["q_proj"]["kernel"]
    assert q.sharding.spec[1] == "fsdp" and len(q.addressable_shards) == 8
    tokens = np.random.RandomState(3).randint(0, cfg.vocab_size, size=(4, 16))
    want = models.forward(cfg, params, tokens)
    got = jax.jit(lambda p, t: models.forward(cfg_s, p, t, mesh=mesh))(params_s, tokens)
    assert rel_err(got, want) < 1e-5


def test_forward_on_a_mesh_names_what_is_not_placed_for_it(tmp_path):
    make_hf_model("llama", tmp_path)
    mesh = mesh_lib.make_mesh({"fsdp": 4, "tensor": 2})
    cfg, params = models.load_hf(str(tmp_path))  # on one device, not on the mesh
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, size=(4, 16))
    # It failed inside jit: "Received incompatible devices for jitted computation".
    with pytest.raises(ValueError, match=r"params\['embed'\]\['embedding'\].*1 device.*8 "
                                         r"devices.*load_hf\(path, mesh=mesh\)"):
        models.forward(cfg, params, tokens, mesh=mesh)
    cfg_s, params_s = models.load_hf(str(tmp_path), mesh=mesh)
    want = models.forward(cfg, params, tokens)
    assert rel_err(models.forward(cfg_s, params_s, tokens, mesh=mesh), want) < 1e-5
    # It failed with jax's IndivisibleError from inside Flax.
    with pytest.raises(ValueError, match=r"tokens_BT has 3 rows.*data×fsdp = 4.*multiple of 4"):
        models.forward(cfg_s, params_s, tokens[:3], mesh=mesh)
    on_3 = jax.device_put(tokens, jax.devices()[3])
    with pytest.raises(ValueError, match=r"tokens_BT.*1 device.*8 devices"):
        models.forward(cfg_s, params_s, on_3, mesh=mesh)
    # Under jit the same batch is padded by the partitioner, and works.
    got = jax.jit(lambda p, t: models.forward(cfg_s, p, t, mesh=mesh))(params_s, tokens[:3])
    assert rel_err(got, want[:3]) < 1e-5


def test_sharded_multifile_checkpoint(tmp_path):
    torch_model = make_hf_model("qwen3", tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    cfg, params = models.load_hf(str(tmp_path), mesh=mesh_lib.make_mesh({"fsdp": 8}))
    tokens = np.arange(20)[None] % cfg.vocab_size
    assert rel_err(models.forward(cfg, params, tokens), hf_logits(torch_model, tokens)) < 1e-4


def test_save_hf_round_trip(family_dir, tmp_path):
    family, path, torch_model = family_dir
    cfg, params = models.load_hf(str(path))
    models.save_hf(cfg, params, str(tmp_path), max_shard_bytes=30_000)
    import transformers
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).float().eval()
    tokens = np.arange(30)[None] % cfg.vocab_size
    assert rel_err(hf_logits(back, tokens), hf_logits(torch_model, tokens)) < 1e-6


def test_bad_checkpoints_name_the_culprit(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        models.load_hf(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2"):
        models.load_hf(str(tmp_path))
    make_hf_model("llama", tmp_path / "m")
    from lrl.models.hf_io import SafetensorsDir, write_safetensors
    st = SafetensorsDir(str(tmp_path / "m"))
    kept = {k: np.array(st.get(k)) for k in st.keys() if "layers.1.mlp.up_proj" not in k}
    write_safetensors(str(tmp_path / "m" / "model.safetensors"), kept)
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        models.load_hf(str(tmp_path / "m"))
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(ValueError, match="truncated"):
        models.load_hf(str(tmp_path / "m"))


def test_truncated_safetensors_names_file_and_tensor(tmp_path):
    make_hf_model("llama", tmp_path)
    path = tmp_path / "model.safetensors"
    from lrl.models.hf_io import _read_header
    header = _read_header(str(path))
    ends = sorted((info["data_offsets"][1], k) for k, info in header.items()
                  if not k.startswith("__"))
    size = path.stat().st_size
    cut = header["__data_start__"] + ends[-2][0] + 3  # 3 bytes into the last tensor
    path.write_bytes(path.read_bytes()[:cut])
    last = ends[-1][1]
    # It was "cannot reshape array of size 0 into shape (32,)", naming nothing.
    with pytest.raises(ValueError, match=rf"{path}.*{cut} bytes.*{size}.*{last}"):
        models.load_hf(str(tmp_path))


def test_config_json_that_is_not_json_names_its_path(tmp_path):
    make_hf_model("qwen2", tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2",')
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'} is not valid JSON.*line 1"):
        models.load_hf(str(tmp_path))
    from lrl.models import vl_io
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'} is not valid JSON"):
        vl_io.load_hf_vl(str(tmp_path))
