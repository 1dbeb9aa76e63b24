"""The host's share of a video step: decoding a step's videos and turning their frames into
patch rows (`lrl.data.video.load_videos`), by how many videos are decoded at once. No
accelerator: it times what the host does before the vision tower runs.

    python experiments/bench/video_decode.py              # configs/video_qa.py's sizes:
                                                           # 16 videos of 64 frames, 448 px
    python experiments/bench/video_decode.py --workers 1,2,4,8,16 --repeats 3

The videos are the synthetic video task's (`lrl.data.video_task`, written once under --dir),
32 frames in the file sampled 64 times, at --frame pixels square: 16 x 16 merged tokens a
temporal patch, 8,192 visual tokens a video, 154 MB of float32 patches.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--videos", type=int, default=16, help="a step's videos (prompts)")
    ap.add_argument("--frames", type=int, default=64, help="frames sampled a video")
    ap.add_argument("--frame", type=int, default=448, help="pixels a side")
    ap.add_argument("--workers", default="1,2", help="videos decoded at once, each timed")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/lrl-bench-video-decode")
    a = ap.parse_args()
    from lrl.data import video, video_task
    recs = video_task.video_dataset("direction", 0, a.videos, a.dir,
                                    num_frames=min(a.frames, 32), frame=a.frame)
    tokens = (a.frame // 28) ** 2
    s = video.VisionSettings(num_frames=a.frames, video_min_pixels=4 * 28 * 28,
                             video_max_pixels=tokens * 28 * 28)
    paths = [r["video"] for r in recs]
    print(f"{a.videos} videos of {a.frames} frames at {a.frame} px ({tokens} merged tokens a "
          f"frame pair), {os.cpu_count()} CPU cores")
    print("| workers | s (median) | s a video | runs |")
    print("|---|---|---|---|")
    for w in (int(x) for x in a.workers.split(",")):
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            items, failures = video.load_videos(paths, s, workers=w)
            times.append(time.perf_counter() - t0)
            assert len(items) == a.videos and not failures, failures
            del items
        t = statistics.median(times)
        print(f"| {w} | {t:.2f} | {t / a.videos:.3f} | {', '.join(f'{x:.2f}' for x in times)} |",
              flush=True)


if __name__ == "__main__":
    main()
