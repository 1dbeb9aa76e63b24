"""Video and image input: patches equal transformers' Qwen2-VL processor on the same frames,
PyAV decoding samples the right frames, bad files are reported by path, and the synthetic
video task's answers can be read back from its decoded videos."""

import numpy as np
import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from lrl.data import video, video_task


def _smooth_frames(n, h, w, seed):
    """Natural-ish frames: smooth gradients plus noise (resizing them is a real test)."""
    rng = np.random.RandomState(seed)
    yy, xx = np.mgrid[:h, :w] / max(h, w)
    out = []
    for i in range(n):
        base = np.stack([np.sin(3 * xx + i + c) + np.cos(5 * yy - c) for c in range(3)], -1)
        out.append(np.clip(127 + 60 * base + rng.randint(-20, 20, (h, w, 3)), 0, 255))
    return np.asarray(out, np.uint8)


def _processor(min_pixels, max_pixels):
    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)


@pytest.mark.parametrize("hw", [(100, 150), (300, 200), (28, 28)])
def test_image_patches_match_transformers(hw):
    s = video.VisionSettings(image_max_pixels=96 * 28 * 28)
    img = _smooth_frames(1, *hw, seed=hw[0])[0]
    item = video.process_image(img, s)
    want = _processor(s.image_min_pixels, s.image_max_pixels)(images=[img], return_tensors="np")
    assert item.grid_thw == tuple(want["image_grid_thw"][0])
    np.testing.assert_allclose(item.patches, want["pixel_values"], rtol=0, atol=1e-6)


def test_video_patches_match_processor_frame_by_frame():
    """Video rows hold frame 2i in temporal slot 0 and frame 2i+1 in slot 1; each slot equals
    transformers' image processing of that frame (same resize, rescale, normalisation, merge
    order). transformers' video processor itself needs torchvision, which is not installed."""
    s = video.VisionSettings(video_min_pixels=16 * 28 * 28, video_max_pixels=40 * 28 * 28)
    frames = _smooth_frames(5, 90, 160, seed=3)
    item = video.process_video_frames(frames, 2.0, s)
    t, gh, gw = item.grid_thw
    assert t == 3 and item.kind == "video" and item.seconds_per_grid == 1.0
    proc = _processor(s.video_min_pixels, s.video_max_pixels)
    rows = item.patches.reshape(t, gh * gw, 3, 2, 14, 14)
    for f in range(6):
        one = proc(images=[frames[min(f, 4)]], return_tensors="np")  # frame 5 repeats frame 4
        assert tuple(one["image_grid_thw"][0]) == (1, gh, gw)
        want = one["pixel_values"].reshape(gh * gw, 3, 2, 14, 14)[:, :, 0]
        np.testing.assert_allclose(rows[f // 2, :, :, f % 2], want, rtol=0, atol=1e-6)


def test_smart_resize_and_placeholders():
    assert video.smart_resize(100, 150) == (112, 140)
    h, w = video.smart_resize(2000, 3000, max_pixels=768 * 28 * 28)
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 768 * 28 * 28
    with pytest.raises(ValueError, match="aspect ratio"):
        video.smart_resize(10, 3000)
    toks = video.expand_placeholders([1, 7, 2, 7, 3], 7, [3, 2])
    np.testing.assert_array_equal(toks, [1, 7, 7, 7, 2, 7, 7, 3])
    with pytest.raises(ValueError, match="2 placeholders"):
        video.expand_placeholders([1, 7, 2, 7], 7, [3])
    np.testing.assert_array_equal(video.sample_indices(12, 4), [0, 3, 6, 9])
    np.testing.assert_array_equal(video.sample_indices(3, 6), [0, 0, 1, 1, 2, 2])


def _numbered_video(path, n, faststart=False):
    """Frame i is grey level 8 i + 20 under noise, so decoded frames say which frame they are."""
    import av
    noise = np.random.RandomState(0).randint(-10, 11, (n, 64, 64, 1))
    frames = np.broadcast_to(8 * np.arange(n)[:, None, None, None] + 20 + noise,
                             (n, 64, 64, 3)).astype(np.uint8)
    opts = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), mode="w", options=opts) as c:
        st = c.add_stream("libx264", rate=6)
        st.height = st.width = 64
        st.pix_fmt = "yuv420p"
        st.options = {"crf": "0"}
        for f in frames:
            for pk in st.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(pk)
        for pk in st.encode():
            c.mux(pk)


def test_decode_samples_uniformly(tmp_path):
    path = tmp_path / "numbers.mp4"
    _numbered_video(path, 12)
    frames, duration = video.decode_frames(str(path), 4)
    assert frames.shape == (4, 64, 64, 3) and duration == pytest.approx(2.0)
    np.testing.assert_allclose(frames.reshape(4, -1).mean(1), 20 + 8 * np.array([0, 3, 6, 9]),
                               atol=2)
    item = video.load_video(str(path), video.VisionSettings(num_frames=4))
    assert item.source == str(path) and item.grid_thw[0] == 2
    assert item.seconds_per_grid == pytest.approx(2 * 2.0 / 4)


def test_bad_videos_are_reported_by_path(tmp_path):
    good = tmp_path / "good.mp4"
    _numbered_video(good, 12)
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(np.random.RandomState(0).bytes(5000))
    cut = tmp_path / "cut.mp4"                       # moov at the end: the index is lost
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    fast = tmp_path / "fast.mp4"                     # index first: frames run out early
    _numbered_video(fast, 24, faststart=True)
    fast_cut = tmp_path / "fast_cut.mp4"
    fast_cut.write_bytes(fast.read_bytes()[: int(fast.stat().st_size * 0.6)])
    missing = tmp_path / "missing.mp4"
    for bad in (garbage, cut, fast_cut, missing):
        with pytest.raises(video.VideoDecodeError) as e:
            video.decode_frames(str(bad), 8)
        assert e.value.path == str(bad) and str(bad) in str(e.value)
    with pytest.raises(video.VideoDecodeError, match="truncated"):
        video.decode_frames(str(fast_cut), 24)
    paths = [str(p) for p in (garbage, good, cut, fast, fast_cut, missing)]
    s = video.VisionSettings(num_frames=24)
    items, failures = video.load_videos(paths, s, workers=1)
    assert [it.source for it in items] == [str(good), str(fast)]
    assert [p for p, _ in failures] == [str(garbage), str(cut), str(fast_cut), str(missing)]
    # Decoded a few at a time: the same items and failures, in the same order.
    many, failed = video.load_videos(paths, s, workers=3)
    assert [it.source for it in many] == [str(good), str(fast)] and failed == failures
    for a, b in zip(items, many):
        assert a.grid_thw == b.grid_thw and np.array_equal(a.patches, b.patches)
    with pytest.raises(video.VideoDecodeError, match="garbage.mp4"):
        video.load_image(str(garbage))


def _blobs(frame, tol=70):
    """colour -> (pixel mask) for every palette colour present in a decoded frame."""
    out = {}
    for name, rgb in video_task.COLOURS.items():
        mask = np.abs(frame.astype(int) - np.asarray(rgb)).max(-1) < tol
        if mask.sum() > 40:
            out[name] = mask
    return out


def _centroid(mask):
    ys, xs = np.nonzero(mask)
    return np.array([ys.mean(), xs.mean()])


def _is_square(mask):
    """A square fills the corners of its bounding box; a disc leaves them empty."""
    ys, xs = np.nonzero(mask)
    return bool(mask[ys.min(), xs.min()] and mask[ys.min(), xs.max()]
                and mask[ys.max(), xs.min()] and mask[ys.max(), xs.max()])


@pytest.mark.parametrize("task", video_task.TASKS)
def test_synthetic_video_task_answers_are_in_the_pixels(task, tmp_path):
    records = video_task.video_dataset(task, seed=1, num_examples=10, out_dir=str(tmp_path))
    for rec in records:
        assert rec["prompt"].startswith(video_task.VIDEO_PROMPT) and "\\boxed" in rec["prompt"]
        frames, _ = video.decode_frames(rec["video"], rec["metadata"]["num_frames"])
        first, last = _blobs(frames[0]), _blobs(frames[-1])
        assert set(first) == set(last) == {o["colour"] for o in rec["metadata"]["objects"]}
        if task == "direction":
            dy, dx = video_task.DIRECTIONS[rec["metadata"]["asked"]]
            movers = [c for c in first
                      if np.dot(_centroid(last[c]) - _centroid(first[c]), (dy, dx)) > 10]
            assert movers == [rec["answer"]]
        else:
            assert str(sum(_is_square(m) for m in first.values())) == rec["answer"]
    again = video_task.make_video_example(task, 1, 0, str(tmp_path))
    assert again == records[0]
    with pytest.raises(ValueError, match="unknown video task"):
        video_task.make_video_example("colour", 1, 0, str(tmp_path))
