"""How many tokens one micro-batch of the update may hold: set by the config
(`rl.max_tokens_per_micro`, like verl's `ppo_max_token_len_per_gpu`) or derived once at
start-up from device memory, by asking the compiler what the update's accumulate program
needs at two sizes and fitting a line through them (the activations the remat policy keeps,
the logits chunk and the attention workspace all grow with the micro-batch's tokens; the
parameters, optimizer state and gradient accumulator do not), then checking the chosen size
by compiling it too (`_fit`: a line that was right costs three compiles). The two sizes are
one full row and one row of about half its length: the step compiles the second anyway, for
a minibatch's last rows, so where one row is all that fits the search costs no compile the
step would not make.

A micro-batch is `rows_per_shard` packed rows of `row_len` tokens on each data shard (a row
spans the shard's `seq` devices). With `rl.row_len=0` and a budget to derive, a row holds the
longest sample and at least `ROW_FLOOR` tokens, and memory sets how many rows a micro-batch
takes; with `rl.row_len=0` and a configured budget, a micro-batch is one row of the budget.
A minibatch's last rows go in micro-batches of one row a shard, each row as short as one of
`row_lengths` that holds its tokens (`packing.micro_batches`), so the update compiles for
five shapes at most. A shorter row needs less of the update's memory than a full one (fewer
activations, a smaller attention block), so the budget measured at full rows holds for all.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Optional

log = logging.getLogger(__name__)

# Of the memory the device reports, what a step may plan to use: the allocator's
# fragmentation and buffers the analysis does not see (host transfers, the sampler's
# leftovers) take the rest.
USABLE = 0.9
# The shortest row a derived budget uses: long enough that the update runs near its best rate
# (docs/benchmark-history.md, "Policy update (issue 4)": 41.6% MFU at 4K, 49% at 16K), short enough
# that a minibatch fills its rows.
ROW_FLOOR = 8192
# The shortest a minibatch's last rows are cut to: an eighth of a row (1K of 8K tokens). Each
# halving compiles one more shape of the update and the log-prob pass, and saves at most half
# what the one before did; with three a minibatch's tail wastes about half of 1K tokens.
SHORTEST = 8


@dataclasses.dataclass(frozen=True)
class Budget:
    row_len: int            # T of a packed row
    rows_per_shard: int     # rows a data shard holds in one micro-batch
    derived: bool           # from device memory (else from the config)
    need_bytes: Optional[int] = None    # what the compiled program was measured to need
    limit_bytes: Optional[int] = None   # what the device may give it

    @property
    def tokens(self) -> int:
        return self.row_len * self.rows_per_shard

    def describe(self) -> str:
        how = "derived from device memory" if self.derived else "as configured"
        out = (f"{self.tokens} tokens a data shard per micro-batch ({self.rows_per_shard} x "
               f"{self.row_len}), {how}")
        if self.need_bytes is not None:
            out += (f": the update needs {self.need_bytes / 2**30:.1f} of "
                    f"{self.limit_bytes / 2**30:.1f} GiB")
        return out


def device_memory(device) -> Optional[tuple[int, int]]:
    """(bytes the device may allocate, bytes in use now), or None where it does not say (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or not stats.get("bytes_limit"):
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def program_bytes(compiled) -> int:
    """What one device needs to run a compiled program: its arguments, outputs not aliased to
    (donated) arguments, and its temporaries."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
               + m.temp_size_in_bytes)


def _round_up(n: int, unit: int) -> int:
    return -(-int(n) // unit) * unit


def row_lengths(row_len: int, unit: int, align: int = 128,
                shortest: int = SHORTEST) -> tuple[int, ...]:
    """The row lengths a micro-batch may have: `row_len`, then about its half, quarter, ...
    down to 1/`shortest` of it, each rounded up to a multiple of `unit` (the ring's 2·seq
    chunks) and `align` (the kernels' tiles) and shorter than the one before."""
    step = math.lcm(unit, align)
    out = [int(row_len)]
    d = 2
    while d <= shortest:
        n = _round_up(-(-row_len // d), step)
        if n < out[-1]:
            out.append(n)
        d *= 2
    return tuple(out)


def smallest_shape(*, row_len: int, max_tokens: int, longest: Optional[int], unit: int,
                   align: int = 128, row_floor: int = ROW_FLOOR) -> tuple[int, int]:
    """(rows a shard, row length) of the smallest micro-batch `resolve` can choose: what the
    update needs at the least, whatever else (the rollout's pool) takes memory first."""
    import math
    if row_len:
        return (max_tokens // row_len if max_tokens else 1), row_len
    if max_tokens:
        return 1, max_tokens // unit * unit or unit
    return 1, _round_up(max(longest or 1, row_floor), math.lcm(unit, align))


# What a shape "needs" when compiling it ran out of memory: more than any device has.
NO_FIT = 1 << 62


def out_of_memory(e) -> bool:
    """Whether `e` (a compile's or a run's error, or its text) says the device ran out of
    memory."""
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def out_of_host_memory(e) -> bool:
    """Whether an out-of-memory (`out_of_memory`) is of the pinned host memory jax's GPU client
    allocates (offloaded optimizer state, transfers staged there), not of the device's."""
    text = str(e)
    return "Out of host memory" in text or "xla_gpu_host_bfc" in text


def resolve(*, row_len: int, max_tokens: int, longest: Optional[int], unit: int,
            need_bytes: Optional[Callable[[int, int], int]] = None,
            available: Optional[int] = None, max_rows: int = 64, align: int = 128,
            row_floor: int = ROW_FLOOR,
            floor_bytes: Optional[Callable[[int, int], int]] = None) -> Budget:
    """The micro-batch shape.

    `row_len` / `max_tokens`: the config's (0 = derive); `longest`: the most tokens a sample
    can have (None: unknown); `unit`: what a row length must divide by (the ring's 2·seq
    chunks); a derived length is also a multiple of `align` (the kernels' tiles).
    `need_bytes(rows, row_len)` compiles the update at that shape and returns the bytes it
    needs beyond what is already in use, `available` what the device can still give; either
    None means device memory cannot be read (a CPU), and a budget to derive becomes one row
    of the longest sample. `floor_bytes(rows, row_len)`: what that shape needs at the least,
    known without compiling (`logits_floor`); a shape whose floor exceeds `available` is never
    compiled, so the search stays below it.
    """
    import math
    derived_unit = math.lcm(unit, align)
    if row_len and row_len % unit:
        raise ValueError(f"rl.row_len={row_len} must divide by {unit} (the ring's 2 x seq "
                         "chunks)")
    if row_len and max_tokens:
        if max_tokens < row_len:
            raise ValueError(f"rl.max_tokens_per_micro={max_tokens} < rl.row_len={row_len}")
        return Budget(row_len, max_tokens // row_len, derived=False)
    if not row_len and max_tokens:
        return Budget(max_tokens // unit * unit or unit, 1, derived=False)
    measurable = need_bytes is not None and available is not None
    if not row_len:
        if longest is None:
            raise ValueError("rl.row_len=0 needs a bound on the sample length")
        if not measurable:
            base = _round_up(longest, derived_unit)
            log.info("device memory cannot be read: one row of the longest sample (%d tokens) "
                     "a micro-batch", base)
            return Budget(base, 1, derived=True)
        row_len = _round_up(max(longest, row_floor), derived_unit)
    if not measurable:
        return Budget(row_len, 1, derived=True)
    if floor_bytes is not None:
        # The largest row count whose floor fits (at least 1: its compile says the rest).
        top = max_rows
        while top > 1 and floor_bytes(top, row_len) > available:
            top -= 1
        if top < max_rows:
            log.info("update micro-batch: at most %d rows of %d tokens before compiling any "
                     "(%d rows need %.1f GiB at the least, %.1f GiB are free)", top, row_len,
                     top + 1, floor_bytes(top + 1, row_len) / 2**30, available / 2**30)
        max_rows = top
    # The second point of the first line: one row of the next shorter length a minibatch's
    # last rows take, a shape the step compiles anyway (`packing.Cut.shapes`), where two full
    # rows were compiled for the search alone (and, where they do not fit, thrown away).
    lengths = row_lengths(row_len, unit, align)
    seed = None
    if len(lengths) > 1 and max_rows > 1:
        seed = (lengths[1] / row_len, lambda: need_bytes(1, lengths[1]))
    return _fit(lambda k: need_bytes(k, row_len), 1, 1, available,
                lambda k: Budget(row_len, k, True), longest, max_scale=max_rows, seed=seed)


def logits_floor(vocab: int, seq: int = 1, tensor: int = 1) -> Callable[[int, int], int]:
    """`floor_bytes` for `resolve`: a micro-batch's logits in float32, [its tokens on one
    device, the vocabulary's slice]. The log-prob pass computes them a chunk at a time, but
    XLA's GPU autotuner, while compiling, runs the lm head's matmul on buffers of the whole
    micro-batch (a 157.7 GiB f32[278528, 151936] for 34 rows of 8K at Qwen2.5's vocabulary):
    a shape past this cannot compile, and asking prints the autotuner's errors."""
    def floor(rows: int, row_len: int) -> int:
        return rows * (-(-row_len // seq)) * (-(-vocab // tensor)) * 4
    return floor


def _fit(need: Callable[[int], int], base: int, step: int, available: int,
         make: Callable[[int], Budget], longest, max_scale: int, tries: int = 4,
         gain: float = 1 / 8,
         seed: Optional[tuple[float, Callable[[], int]]] = None) -> Budget:
    """The largest size (a multiple of `step`, from `base` up to `max_scale` x `base`) whose
    measured need fits `available`, in few compiles (each ~4-7 s for a 1.5B model's update on
    a GPU, most of a first start). The need grows about linearly with the micro-batch's
    tokens (remat's activations, the logits chunk, cuDNN's attention workspace; XLA's own
    attention grows faster, which makes a line optimistic), so each next size is where the
    line through two measured needs meets `available`: first the line through `base` and
    2 x `base`, then through the largest size seen to fit and the smallest seen not to
    (or, while none failed, the two largest that fit). The search stops when that line
    points nowhere new or promises less than `gain` more than the size that fits: a line
    that was right costs one compile beyond its two points, where bisecting up to the top
    cost four more that all failed. A size whose compile ran out of memory (`NO_FIT`) gives
    no line to draw: the next size halves the gap. `tries` compiles at most after the
    first two. `seed`: (a size below `base`, in units of it, and its need, measured on
    asking) for the first line's second point in place of 2 x `base`, where that size is
    one the caller compiles anyway (`resolve`: one row of half the length). Rows add
    memory linearly; a row's length may add it faster (XLA's own attention, its square),
    which makes the short point's slope the steeper: the line then errs short of the
    largest fit rather than past it, and a size it points to past `base` is compiled to
    check, as any other."""
    n1, n2 = base, 2 * base
    seen = {n1: need(n1)}
    if seen[n1] > available:
        raise ValueError(
            f"the derived micro-batch budget cannot hold one sample: the update needs "
            f"{seen[n1] / 2**30:.1f} GiB for {make(n1).tokens} tokens (a sample can have "
            f"{longest} tokens) and the device has {available / 2**30:.1f} GiB left; lower "
            "rl.max_new_tokens / data.max_prompt_len, use more devices (fsdp, seq) or a "
            "remat policy that keeps less")
    top = max_scale * base
    if seed is not None and top >= n2:
        x, need_x = seed
        below = need_x()
        if below < seen[n1]:   # else no slope to draw: measure 2 x base as without a seed
            seen[x * base] = below
    if top >= n2 and len(seen) == 1:
        seen[n2] = need(n2)
    for i in range(tries + 1):
        fits = sorted(n for n, b in seen.items() if b <= available)
        fails = sorted(n for n, b in seen.items() if b > available)
        lo, hi = fits[-1], (fails[0] if fails else top + step)
        if hi - lo <= step:
            break
        # The line through lo and the smallest size that failed, or (none failed, or its
        # compile ran out of memory, which measured nothing) the two largest that fit.
        unmeasured = bool(fails) and seen[hi] >= NO_FIT
        a = hi if fails and not unmeasured else fits[-2] if len(fits) > 1 else None
        n = hi
        if a is not None:
            slope = max((seen[a] - seen[lo]) / (a - lo), 1e-9)
            n = int(lo + (available - seen[lo]) / slope) // step * step
        if unmeasured:   # at most halfway to a size the compiler could not hold
            n = min(n, (lo + hi) // 2 // step * step)
        n = min(n, hi - step)
        if n - lo < max(step, gain * lo) or n in seen or i == tries:
            break
        seen[n] = need(n)
    lo = max(n for n, b in seen.items() if b <= available)
    return dataclasses.replace(make(lo), need_bytes=seen[lo], limit_bytes=available)
