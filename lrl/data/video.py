"""Images and videos -> the patch rows and grids that Qwen2.5-VL's vision tower reads.

Decoding uses PyAV (FFmpeg). A video is sampled uniformly to `num_frames` frames (frame i of n
is ⌊i · total / n⌋, so the count, and with it the token count, is fixed for any length), each
frame is resized as the Qwen2-VL processor does (`smart_resize`: sides multiples of
patch × merge, pixel count within [min_pixels, max_pixels], PIL bicubic on uint8), rescaled
to [0, 1], normalised with the CLIP mean / std and patched: rows ordered
(temporal patch, merged-token row, merged-token column, row in token, column in token) and
each row flattened as (channel, temporal, patch row, patch column). An image is one frame
repeated `temporal_patch_size` times, exactly as transformers' image processor does.

A video that cannot be opened, has no video stream, or ends before the frames its header
promises raises `VideoDecodeError` naming the file; `load_videos` reports and skips such
files and never substitutes another video.

Pixel arrays are written in words (uint8 `frames` [frames, height, width, 3]); patch rows are
[t·h·w, A], A a patch row's pixel values (channels × temporal patch × patch²).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import math
import os
from typing import NamedTuple, Sequence

import numpy as np

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class VideoDecodeError(Exception):
    """A video that cannot be used; `path` names it and `reason` says why."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


@dataclasses.dataclass(frozen=True)
class VisionSettings:
    """How pixels become patches. Defaults are Qwen2.5-VL's (videos: 128-768 tokens a frame)."""
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    num_frames: int = 16                    # frames sampled from every video
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    image_min_pixels: int = 56 * 56
    image_max_pixels: int = 1280 * 28 * 28
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD

    def __post_init__(self):
        if self.num_frames < 1:
            raise ValueError(f"VisionSettings: num_frames={self.num_frames} must be positive")

    def fingerprint(self) -> str:
        return hashlib.sha256(repr(dataclasses.astuple(self)).encode()).hexdigest()[:16]


class VisualItem(NamedTuple):
    patches: np.ndarray           # float32 [t·h·w, A], A = channels · temporal · patch²
    grid_thw: tuple[int, int, int]
    kind: str                     # "image" | "video"
    seconds_per_grid: float       # seconds one temporal patch spans (0 for images)
    source: str                   # file path, or "" for in-memory pixels


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """Sides that are multiples of `factor`, area within [min_pixels, max_pixels], aspect kept
    as closely as possible (the Qwen2-VL rule)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got "
                         f"{max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _resize(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """One uint8 frame [height, width, 3] resized to (height, width)."""
    from PIL import Image
    return np.asarray(Image.fromarray(frame).resize((width, height), Image.BICUBIC))


def _check_frames(frames: np.ndarray, what: str) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"{what}: expected uint8 RGB frames [frames, height, width, 3], got "
                         f"{frames.dtype} {frames.shape}")
    return frames


def _normalised(mean: tuple, std: tuple) -> np.ndarray:
    """[channels, 256] float32: each uint8 value rescaled to [0, 1] and normalised, computed
    as transformers' processor computes it (rescale in float64, then float32 arithmetic), so
    a lookup gives its values to the bit."""
    v = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
    return np.stack([(v - np.float32(m)) / np.float32(d) for m, d in zip(mean, std)])


def patchify(frames: np.ndarray, s: VisionSettings, min_pixels: int, max_pixels: int):
    """uint8 frames [frames, height, width, 3] -> (float32 patch rows [t·h·w, A], (t, h, w)
    grid in patches). The pixels are put in patch order as uint8 and normalised by one lookup
    a channel at the end: rescaling a video's frames in float64 and moving float32 patches
    took most of a 64-frame video's 0.5-1 s on one core (a step decodes 16 such videos)."""
    frames = _check_frames(frames, "patchify")
    n_frames, height, width, channels = frames.shape
    p, m, tp = s.patch_size, s.merge_size, s.temporal_patch_size
    rh, rw = smart_resize(height, width, p * m, min_pixels, max_pixels)
    x = np.stack([_resize(f, rh, rw) for f in frames])   # [frames, height, width, channels]
    if n_frames % tp:  # the last frame repeats up to a whole temporal patch
        x = np.concatenate([x, np.repeat(x[-1:], tp - n_frames % tp, axis=0)])
    gt, gh, gw = x.shape[0] // tp, rh // p, rw // p
    x = x.reshape(gt, tp, gh // m, m, p, gw // m, m, p, channels)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7).reshape(gt * gh * gw, channels, tp * p * p)
    lut = _normalised(s.mean, s.std)
    out = np.empty(x.shape, np.float32)
    for c in range(channels):
        out[:, c] = lut[c][x[:, c]]
    return out.reshape(gt * gh * gw, channels * tp * p * p), (gt, gh, gw)


def process_image(image: np.ndarray, s: VisionSettings = VisionSettings(),
                  source: str = "") -> VisualItem:
    """One uint8 RGB image [height, width, 3]."""
    image = np.asarray(image)
    frames = np.repeat(image[None], s.temporal_patch_size, axis=0)
    patches, grid = patchify(frames, s, s.image_min_pixels, s.image_max_pixels)
    return VisualItem(patches, grid, "image", 0.0, source)


def process_video_frames(frames: np.ndarray, fps: float, s: VisionSettings = VisionSettings(),
                         source: str = "") -> VisualItem:
    """Already-sampled uint8 frames [frames, height, width, 3] at `fps` sampled frames per
    second."""
    if fps <= 0:
        raise ValueError(f"process_video_frames: fps={fps} must be positive ({source or 'frames'})")
    patches, grid = patchify(frames, s, s.video_min_pixels, s.video_max_pixels)
    return VisualItem(patches, grid, "video", s.temporal_patch_size / fps, source)


def load_image(path: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError
    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB"))
    except (OSError, UnidentifiedImageError) as e:
        raise VideoDecodeError(path, f"cannot read image: {e}") from e


def sample_indices(total: int, n: int) -> np.ndarray:
    """n uniformly spaced frame indices out of `total` (repeats when the video is shorter)."""
    if total < 1:
        raise ValueError(f"sample_indices: a video with {total} frames")
    return (np.arange(n, dtype=np.int64) * total) // n


def decode_frames(path: str, num_frames: int):
    """PyAV decode -> (uint8 frames [num_frames, height, width, 3], duration in seconds).

    Frames are decoded in order and the sampled ones kept, so memory holds only those.
    """
    import av
    if not os.path.isfile(path):
        raise VideoDecodeError(path, "no such file")
    try:
        container = av.open(path)
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise VideoDecodeError(path, f"cannot open: {e}") from e
    with container:
        if not container.streams.video:
            raise VideoDecodeError(path, "no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        total = int(stream.frames or 0)
        kept, decoded = {}, 0
        try:
            if total <= 0:  # header without a count: count the packets, then rewind
                total = sum(1 for pk in container.demux(stream) if pk.size)
                container.seek(0, stream=stream)
            if total <= 0:
                raise VideoDecodeError(path, "the video stream has no frames")
            indices = sample_indices(total, num_frames)
            targets = iter(np.unique(indices).tolist())
            target = next(targets)
            for frame in container.decode(stream):
                if decoded == target:
                    kept[decoded] = frame.to_ndarray(format="rgb24")
                    target = next(targets, None)
                decoded += 1
                if target is None:
                    break
        except av.error.FFmpegError as e:
            raise VideoDecodeError(path, f"decode error at frame {decoded}: {e}") from e
        if target is not None:
            raise VideoDecodeError(path, f"truncated: the header promises {total} frames, only "
                                         f"{decoded} decode (frame {target} was sampled)")
        rate = float(stream.average_rate or stream.guessed_rate or 0) or None
        if stream.duration is not None and stream.time_base is not None:
            duration = float(stream.duration * stream.time_base)
        else:
            duration = total / rate if rate else float(total)
    shapes = {a.shape for a in kept.values()}
    if len(shapes) != 1:
        raise VideoDecodeError(path, f"frames change size mid-stream: {sorted(shapes)}")
    return np.stack([kept[int(i)] for i in indices]), duration


def load_video(path: str, s: VisionSettings = VisionSettings()) -> VisualItem:
    frames, duration = decode_frames(path, s.num_frames)
    fps = s.num_frames / duration if duration > 0 else 1.0
    return process_video_frames(frames, fps, s, source=path)


def load_videos(paths: Sequence[str], s: VisionSettings = VisionSettings(),
                workers: int | None = None):
    """-> (items, failures): one item per decodable path, in order; `failures` lists
    (path, reason) for the rest, each also logged as a warning. Videos are decoded and
    patched `workers` at a time (None: one a CPU core, at most 16): FFmpeg, PIL and numpy's
    copies let go of the GIL, and a step's 16 videos of 64 frames took 12-15 s one after
    another on the H200 machine's host (docs/benchmark-history.md, "Seventeenth session")."""
    def one(path):
        try:
            return load_video(path, s)
        except VideoDecodeError as e:
            logging.warning("skipping video %s: %s", e.path, e.reason)
            return e
    n = min(len(paths), workers or min(16, os.cpu_count() or 1))
    if n > 1:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            results = list(pool.map(one, paths))
    else:
        results = [one(p) for p in paths]
    items = [r for r in results if not isinstance(r, VideoDecodeError)]
    failures = [(r.path, r.reason) for r in results if isinstance(r, VideoDecodeError)]
    return items, failures


def expand_placeholders(tokens, pad_id: int, counts: Sequence[int]) -> np.ndarray:
    """Each occurrence of `pad_id` becomes `counts[i]` copies (the i-th item's token count,
    `VLConfig.tokens_per_item(grid_thw)`), as the Qwen2.5-VL processor expands its pads."""
    tokens = np.asarray(tokens)
    where = np.nonzero(tokens == pad_id)[0]
    if len(where) != len(counts):
        raise ValueError(f"expand_placeholders: {len(where)} placeholders of id {pad_id} for "
                         f"{len(counts)} visual items")
    reps = np.ones(len(tokens), np.int64)
    reps[where] = counts
    return np.repeat(tokens, reps)
