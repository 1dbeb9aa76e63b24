"""A synthetic video task with verifiable answers: coloured squares and circles on black, some
moving, written to mp4 with PyAV (H.264).

Every example is a pure function of `(seed, index)` (the file is written once, then reused):

* ``direction`` — 2 to 4 shapes, each a distinct colour; exactly one moves in the asked
  direction (left / right / up / down), the others are still or move along other directions.
  "Which colour is the shape that moves left?"  Answer: the colour name, e.g. ``red``.
* ``count`` — 2 to 5 shapes, some moving; "How many squares are in the video?"  Answer: the
  number in decimal, e.g. ``3``.

Shapes never overlap in any frame and stay inside it, so both answers can be read back from
the decoded pixels (the tests do). Records look like `lrl.data.synthetic`'s, plus the video:

    {"messages": [{"role": "user", "content": prompt}], "prompt": prompt, "answer": "red",
     "task": "video_direction", "video": "/dir/video_direction_0_7.mp4", "metadata": {...}}

The prompt starts with Qwen2.5-VL's ``<|vision_start|><|video_pad|><|vision_end|>``; the single
pad is expanded to the video's token count at tokenisation (`lrl.data.video.expand_placeholders`).
Answers are checked on the last ``\\boxed{...}`` of a completion, as for the text tasks.
"""
from __future__ import annotations

import os
import zlib
from typing import Any

import numpy as np

COLOURS = {"red": (230, 30, 30), "green": (30, 200, 40), "blue": (40, 70, 240),
           "yellow": (240, 230, 40), "magenta": (225, 40, 225), "cyan": (40, 220, 225),
           "white": (245, 245, 245), "orange": (250, 140, 10)}
DIRECTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
TASKS = ("direction", "count")
VIDEO_PROMPT = "<|vision_start|><|video_pad|><|vision_end|>"


def _rng(task: str, seed: int, index: int) -> np.random.Generator:
    if index < 0:
        raise IndexError(f"video task {task}: index {index} is negative")
    return np.random.default_rng([zlib.crc32(task.encode()), seed, index])


def _boxes(obj: dict, num_frames: int) -> np.ndarray:
    """[frames, 4] (top, left, bottom, right) of one shape in every frame."""
    t = np.arange(num_frames)[:, None]
    top_left = np.asarray(obj["start"])[None] + t * np.asarray(obj["velocity"])[None]
    return np.concatenate([top_left, top_left + obj["size"]], axis=1)


def _overlap(a: np.ndarray, b: np.ndarray, margin: int) -> bool:
    return bool(np.any((a[:, 0] < b[:, 2] + margin) & (b[:, 0] < a[:, 2] + margin)
                       & (a[:, 1] < b[:, 3] + margin) & (b[:, 1] < a[:, 3] + margin)))


def _place(rng, velocities, shapes, colours, size_px, num_frames, frame, attempts=200):
    """Start points so that every shape stays in frame and none ever touch."""
    for _ in range(attempts):
        objs, boxes = [], []
        for v, shape, colour in zip(velocities, shapes, colours):
            span = np.asarray(v) * (num_frames - 1)
            lo = np.maximum(0, -span) + 1
            hi = frame - size_px - np.maximum(0, span) - 1
            if np.any(hi < lo):
                raise ValueError(f"video task: frame {frame} too small for size {size_px} and "
                                 f"{num_frames} frames of motion")
            start = [int(rng.integers(lo[i], hi[i] + 1)) for i in range(2)]
            obj = {"shape": shape, "colour": colour, "start": start,
                   "velocity": [int(x) for x in v],
                   "size": size_px}
            box = _boxes(obj, num_frames)
            if any(_overlap(box, other, margin=3) for other in boxes):
                break
            objs.append(obj)
            boxes.append(box)
        else:
            return objs
    raise RuntimeError("video task: could not place non-overlapping shapes; use a larger frame")


def render(objects: list[dict], num_frames: int, frame: int) -> np.ndarray:
    """uint8 frames [frames, frame, frame, 3] (`frame` pixels a side)."""
    out = np.zeros((num_frames, frame, frame, 3), np.uint8)
    yy, xx = np.mgrid[:frame, :frame]
    for f in range(num_frames):
        for obj in objects:
            top, left, bottom, right = _boxes(obj, num_frames)[f]
            if obj["shape"] == "square":
                mask = (yy >= top) & (yy < bottom) & (xx >= left) & (xx < right)
            else:
                r = obj["size"] / 2
                mask = (yy + 0.5 - top - r) ** 2 + (xx + 0.5 - left - r) ** 2 <= r * r
            out[f][mask] = COLOURS[obj["colour"]]
    return out


def write_mp4(path: str, frames: np.ndarray, fps: int = 4, crf: int = 12) -> None:
    """H.264 (yuv420p) mp4 via PyAV; written to a temporary name, then renamed."""
    import av
    tmp = f"{path}.tmp{os.getpid()}.mp4"
    with av.open(tmp, mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf)}
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    os.replace(tmp, path)


def _direction(rng, speed):
    n = int(rng.integers(2, 5))
    colours = [str(x) for x in rng.choice(list(COLOURS), size=n, replace=False)]
    asked = str(rng.choice(list(DIRECTIONS)))
    others = [d for d in DIRECTIONS if d != asked] + ["still"]
    moves = [asked] + [str(rng.choice(others)) for _ in range(n - 1)]
    velocities = [(0, 0) if d == "still" else tuple(speed * np.asarray(DIRECTIONS[d]))
                  for d in moves]
    shapes = [str(rng.choice(["square", "circle"])) for _ in range(n)]
    question = f"Which colour is the shape that moves {asked}?"
    return velocities, shapes, colours, question, str(colours[0]), {"asked": asked,
                                                                    "moves": moves}


def _count(rng, speed):
    n = int(rng.integers(2, 6))
    colours = [str(x) for x in rng.choice(list(COLOURS), size=n, replace=False)]
    shapes = [str(rng.choice(["square", "circle"])) for _ in range(n)]
    moves = [str(rng.choice(list(DIRECTIONS) + ["still"])) for _ in range(n)]
    velocities = [(0, 0) if d == "still" else tuple(speed * np.asarray(DIRECTIONS[d]))
                  for d in moves]
    question = "How many squares are in the video?"
    return velocities, shapes, colours, question, str(shapes.count("square")), {"moves": moves}


def make_video_example(task: str, seed: int, index: int, out_dir: str, *, num_frames: int = 8,
                       frame: int = 112, size_px: int = 16, speed: int = 4,
                       fps: int = 4) -> dict[str, Any]:
    """One record; its mp4 is written under `out_dir` unless already there."""
    if task not in TASKS:
        raise ValueError(f"unknown video task {task!r}; choose one of {TASKS}")
    rng = _rng(task, seed, index)
    velocities, shapes, colours, question, answer, meta = (
        _direction if task == "direction" else _count)(rng, speed)
    order = rng.permutation(len(shapes))  # the answer's shape is not always drawn first
    objects = _place(rng, [velocities[i] for i in order], [shapes[i] for i in order],
                     [colours[i] for i in order], size_px, num_frames, frame)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"video_{task}_{seed}_{index}_{num_frames}x{frame}.mp4")
    if not os.path.isfile(path):
        write_mp4(path, render(objects, num_frames, frame), fps=fps)
    prompt = f"{VIDEO_PROMPT}{question} Answer with \\boxed{{...}}."
    return {"messages": [{"role": "user", "content": prompt}], "prompt": prompt,
            "answer": answer, "task": f"video_{task}", "video": path,
            "metadata": {"objects": objects, "num_frames": num_frames, "frame": frame,
                         "fps": fps, **{k: v if isinstance(v, str) else [v[i] for i in order]
                                        for k, v in meta.items()}}}


def video_dataset(task: str, seed: int, num_examples: int, out_dir: str, **kwargs):
    """The first `num_examples` records of one task (writing any missing videos)."""
    return [make_video_example(task, seed, i, out_dir, **kwargs) for i in range(num_examples)]
