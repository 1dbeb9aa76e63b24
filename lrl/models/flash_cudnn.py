"""The one place that touches jax's private cuDNN attention
(`jax._src.cudnn.fused_attention_stablehlo`): forward with log-sum-exp, the backward
primitive bound directly (so a ring can hand it the *global* output and log-sum-exp),
packed-segment dense attention, and the packed layout's runs with their per-run
log-sum-exp: `PackedRuns` (the same runs for queries and keys: causal within segments) and
`CrossRuns` (a run of queries against a run of keys: the shared prompt's prefix block).
The import is guarded; `unavailable_reason` says why cuDNN cannot run, and callers
(lrl.models.flash) then take the XLA path.

B batch rows · T query positions · S key/value positions · N query heads · K key/value heads ·
H head dim · E segments per row (cuDNN's runs).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

try:
    from jax._src.cudnn import fused_attention_stablehlo as _cudnn
except Exception:  # pragma: no cover - depends on the jax build
    _cudnn = None


def _cudnn_bwd_binder():
    """Binds cuDNN's backward primitive by parameter name, so the call survives the
    argument lists of different jax versions; None when this jax has no such primitive."""
    try:
        impl = _cudnn._dot_product_attention_bwd_impl
        wrapper = _cudnn._dot_product_attention_bwd_p_wrapper
        names = list(inspect.signature(impl).parameters)
        split = names.index("grad_output") + 1
    except Exception:
        return None
    known_operands = {"query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets",
                      "kv_offsets", "page_table_k", "page_table_v", "activation",
                      "fwd_output", "grad_output"}
    known_params = {"scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
                    "sliding_window_length"}
    if not (set(names[:split]) <= known_operands and set(names[split:]) <= known_params):
        return None

    def bind_bwd(q, k, v, o, lse, do, *, mask_type, scale, q_len=None, kv_len=None,
                 q_off=None, kv_off=None):
        empty = jnp.zeros(0, q.dtype)
        operands = dict(query=q, key=k, value=v, activation=lse, fwd_output=o, grad_output=do,
                        q_seqlen=q_len, kv_seqlen=kv_len, q_offsets=q_off, kv_offsets=kv_off)
        params = dict(scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False),
                      mask_type=mask_type, layout=_cudnn.AttentionLayout.BTNH.value,
                      sliding_window_length=None)
        args = [empty if operands.get(n) is None else operands[n] for n in names[:split]]
        return wrapper.bind(*args, **{n: params[n] for n in names[split:]})[:3]
    return bind_bwd


_CUDNN_BWD = None if _cudnn is None else _cudnn_bwd_binder()


def _mask_type(causal, padded):
    kind = _cudnn.MaskType
    return ((kind.PADDING_CAUSAL if causal else kind.PADDING) if padded
            else (kind.CAUSAL if causal else kind.NO_MASK))


def fwd(q, k, v, *, causal, scale, q_len=None, kv_len=None, q_off=None, kv_off=None):
    """cuDNN flash attention -> (o, lse [B,N,T] f32); q_len / kv_len [B] mask the rows and
    keys beyond them (cuDNN's padding mask: what it leaves there is undefined); with
    q_off / kv_off [B, E+1] and lengths [B, E] the rows are packed segments."""
    o, lse = _cudnn.dot_product_attention(
        q, k, v, None, None, q_len, kv_len, q_off, kv_off, scale=scale,
        mask_type=_mask_type(causal, q_len is not None), qkv_layout="BTNH",
        return_residual=True)
    return o, lse.astype(jnp.float32)


def bwd(q, k, v, o, lse, do, *, causal, scale, q_len=None, kv_len=None, q_off=None,
        kv_off=None):
    """cuDNN's backward given any (o, lse): a ring passes the merged ones -> (dq, dk, dv)."""
    dt = q.dtype
    return _CUDNN_BWD(q, k, v, o.astype(dt), lse.astype(jnp.float32), do.astype(dt),
                      mask_type=_mask_type(causal, q_len is not None), scale=scale,
                      q_len=q_len, kv_len=kv_len, q_off=q_off, kv_off=kv_off)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _trainable(q, k, v, scale, causal, segs):
    return fwd(q, k, v, causal=causal, scale=scale, **segs)[0]


def _trainable_fwd(q, k, v, scale, causal, segs):
    o, lse = fwd(q, k, v, causal=causal, scale=scale, **segs)
    # Named, so a remat policy can keep them: the backward then needs no second forward.
    o, lse = checkpoint_name(o, "attn_out"), checkpoint_name(lse, "attn_lse")
    return o, (q, k, v, o, lse, segs)


def _trainable_bwd(scale, causal, res, do):
    q, k, v, o, lse, segs = res
    dq, dk, dv = bwd(q, k, v, o, lse, do, causal=causal, scale=scale, **segs)
    return dq, dk, dv, jax.tree.map(lambda _: None, segs)


_trainable.defvjp(_trainable_fwd, _trainable_bwd)


def unavailable_reason(q, k, *, need_bwd=False) -> str | None:
    """None when cuDNN flash attention can run these shapes here, else why not."""
    if _cudnn is None:
        return "this jax has no jax._src.cudnn.fused_attention_stablehlo"
    if need_bwd and _CUDNN_BWD is None:
        return "this jax's cuDNN backward primitive has an unknown signature"
    if jax.default_backend() != "gpu":
        return f"backend is {jax.default_backend()}, not gpu"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
        return f"cuDNN needs bf16/fp16, got q {q.dtype}, k {k.dtype}"
    H = q.shape[-1]
    if H % 8 or H > 128:
        return f"head dim {H} (cuDNN here: a multiple of 8, at most 128)"
    return None


def _run_starts(segment_ids_BT):
    """True where a run of equal ids begins (every row's first token included)."""
    seg = segment_ids_BT.astype(jnp.int32)
    return jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], 1)


def segment_runs(segment_ids_BT, max_segments):
    """Contiguous runs of equal ids -> (offsets [B, E+1], lengths [B, E], count [B]) in the
    form of cuDNN's packed layout (unused slots -1). Ids must form one run per segment."""
    T = segment_ids_BT.shape[1]
    start_BT = _run_starts(segment_ids_BT)
    count_B = start_BT.sum(1).astype(jnp.int32)
    starts = jax.vmap(lambda s: jnp.nonzero(s, size=max_segments + 1, fill_value=T)[0])(start_BT)
    starts = starts.astype(jnp.int32)
    slot = jnp.arange(max_segments + 1)[None]
    # As many offsets as lengths, also in a row of more runs than max_segments: jax pairs the
    # runs' offsets and lengths over all rows in order, so one more offset would shift the
    # runs of every row after it (that row is NaN; the others must stay right).
    used_B = jnp.minimum(count_B, max_segments)[:, None]
    offsets = jnp.where(slot < used_B, starts, -1)
    lengths = jnp.where(slot[:, :-1] < used_B, starts[:, 1:] - starts[:, :-1], -1)
    return offsets, lengths.astype(jnp.int32), count_B


def dense_causal(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, *, scale, max_segments):
    """Causal attention within segments: cuDNN's forward and backward kernels, with the
    output and log-sum-exp named "attn_out" / "attn_lse" for the remat policies.
    With segment ids: cuDNN's packed layout (Hopper or newer, cuDNN >= 9.6), at most
    `max_segments` runs per row; a row with more gives NaN rather than a wrong answer."""
    if segment_ids_BT is None:
        return _trainable(q_BTNH, k_BSKH, v_BSKH, scale, True, {})
    if max_segments < 2:
        raise ValueError(f"dense_attention: max_segments={max_segments}; cuDNN's packed layout "
                         "needs at least 2")
    runs = PackedRuns.of(segment_ids_BT, max_segments)
    o = _trainable(q_BTNH, k_BSKH, v_BSKH, scale, True, runs.kwargs)
    return runs.nan_where_too_many(o).astype(q_BTNH.dtype)


@dataclasses.dataclass(frozen=True)
class PackedRuns:
    """A causal block's segments in cuDNN's packed layout (E = max_segments runs a row).
    cuDNN keeps the log-sum-exp per run: [B·E, N, T], the runs of all rows numbered one after
    another (row b's run m is slot m + the run count of rows 0..b-1; measured on an H200),
    each from position 0, the slots past the last run unused. A ring merges and passes it per
    token, [B, N, T]."""
    offsets_BE: jax.Array     # [B, E+1], -1 past the row's runs
    lengths_BE: jax.Array     # [B, E]
    slot_BT: jax.Array        # each token's stats slot x T + its position in its run
    too_many_B: jax.Array     # rows with more than E runs (their output is NaN)

    @classmethod
    def of(cls, seg_BT, max_segments):
        E = int(max_segments)
        offsets_BE, lengths_BE, count_B = segment_runs(seg_BT, E)
        T = seg_BT.shape[1]
        run_BT = jnp.minimum(jnp.cumsum(_run_starts(seg_BT), axis=1) - 1, E - 1)
        used_B = jnp.minimum(count_B, E)                         # cuDNN sees E runs at most
        first_B = jnp.cumsum(used_B) - used_B                    # runs of the rows before
        pos_BT = jnp.arange(T)[None] - jnp.take_along_axis(offsets_BE, run_BT, axis=1)
        slot_BT = (first_B[:, None] + run_BT) * T + pos_BT
        return cls(offsets_BE, lengths_BE, slot_BT, count_B > E)

    @property
    def kwargs(self):
        return dict(q_len=self.lengths_BE, kv_len=self.lengths_BE, q_off=self.offsets_BE,
                    kv_off=self.offsets_BE)

    def nan_where_too_many(self, o_BTNH):
        """A row with more runs than cuDNN was given: NaN rather than a wrong answer."""
        return jnp.where(self.too_many_B[:, None, None, None], jnp.nan, o_BTNH)

    def stats_to_tokens(self, stats):
        BE, N, T = stats.shape
        flat = stats.transpose(1, 0, 2).reshape(N, BE * T)              # [N, B·E·T]
        # a row past the E runs reads a clipped slot: its output is NaN anyway
        return jnp.take(flat, jnp.minimum(self.slot_BT, BE * T - 1), axis=1).transpose(1, 0, 2)

    def tokens_to_stats(self, lse_BNT):
        B, N, T = lse_BNT.shape
        E = self.lengths_BE.shape[1]
        flat = jnp.zeros((B * E * T, N), jnp.float32)                   # [B·E·T, N]
        flat = flat.at[self.slot_BT.reshape(-1)].set(
            lse_BNT.transpose(0, 2, 1).reshape(B * T, N), mode="drop")
        return flat.reshape(B * E, T, N).transpose(0, 2, 1)


def _table(rows_B1, ids_BT, values_BT, fill, n_ids, how):
    """[B, n_ids]: per row and id, `how` ("min", "max" or "add") of `values` over the tokens
    with that id (id 0: no id, left at `fill`)."""
    t = jnp.full((ids_BT.shape[0], n_ids), fill, jnp.int32)
    t = getattr(t.at[rows_B1, ids_BT], how)(values_BT.astype(jnp.int32))
    return t.at[:, 0].set(fill)


def _row_take(table_BI, idx_BJ):
    return jnp.take_along_axis(table_BI, idx_BJ, axis=1)


@dataclasses.dataclass(frozen=True)
class CrossRuns:
    """A block whose query runs each read one run of keys: cuDNN's packed layout with
    distinct query and key runs, mask PADDING (each run's queries see all its keys). Ids > 0
    name runs, ids <= 0 none: a query run is a maximal run of equal query ids, and it reads
    the keys whose key id is the same, matched by id (not by order). Queries and keys index
    the same row (T == S). At most E = max_segments runs a row.

    What cuDNN would get wrong or leave undefined is masked here: queries in no run (or whose
    id no key has) come out as o = 0, lse = -inf and get dq = 0; keys no run reads get
    dk = dv = 0. A row cuDNN cannot give exactly is NaN, output and gradients (`bad_B`): more
    than E runs, or a run's keys not one contiguous run wholly before its queries (the
    blockwise kernel's causal index would hide the later ones), or two query runs reading
    the same keys (cuDNN writes dk per run, it does not add them).

    cuDNN keeps the log-sum-exp per run as for `PackedRuns`: [B·E, N, T], slots numbered
    across rows, each from position 0 of its QUERY run (assumed from `PackedRuns`'s layout,
    measured on an H200 for equal runs only)."""
    q_offsets_BE: jax.Array    # [B, E+1], -1 past the row's runs
    q_lengths_BE: jax.Array    # [B, E]
    kv_offsets_BE: jax.Array   # [B, E+1]
    kv_lengths_BE: jax.Array   # [B, E]
    count_B: jax.Array         # runs in the row, uncapped
    slot_BT: jax.Array         # stats slot x T + position in the query run; B·E·T outside
    q_in_BT: jax.Array         # queries in a run cuDNN is given
    kv_in_BS: jax.Array        # keys that such a run reads
    bad_B: jax.Array           # rows that come out NaN

    @classmethod
    def of(cls, q_ids_BT, kv_ids_BT, max_segments):
        E = int(max_segments)
        q, kv = jnp.asarray(q_ids_BT, jnp.int32), jnp.asarray(kv_ids_BT, jnp.int32)
        (B, T), S = q.shape, kv.shape[1]
        if S != T or kv.shape[0] != B:
            raise ValueError(f"CrossRuns: query ids {q.shape} and key ids {kv.shape} must "
                             "index the same rows")
        n_ids = T + 1                            # a row of T tokens has ids 1..T at most
        out_of_table_B = (q >= n_ids).any(1) | (kv >= n_ids).any(1)
        iq = jnp.where((q > 0) & (q < n_ids), q, 0)
        ik = jnp.where((kv > 0) & (kv < n_ids), kv, 0)
        rows, pos = jnp.arange(B)[:, None], jnp.broadcast_to(jnp.arange(T), (B, T))
        kv_first = _table(rows, ik, pos, T, n_ids, "min")
        kv_last = _table(rows, ik, pos, -1, n_ids, "max")
        kv_count = _table(rows, ik, jnp.ones_like(pos), 0, n_ids, "add")

        q_in = (iq > 0) & (_row_take(kv_count, iq) > 0)           # its id has keys
        start = q_in & _run_starts(iq)
        end = q_in & jnp.concatenate([iq[:, 1:] != iq[:, :-1], jnp.ones((B, 1), bool)], 1)
        count_B = start.sum(1).astype(jnp.int32)
        first = lambda m: jax.vmap(lambda r: jnp.nonzero(r, size=E, fill_value=0)[0])(m)
        starts, ends = first(start).astype(jnp.int32), first(end).astype(jnp.int32)
        used_B = jnp.minimum(count_B, E)
        valid = jnp.arange(E)[None] < used_B[:, None]
        run_id = _row_take(iq, starts)
        k_first, k_last = _row_take(kv_first, run_id), _row_take(kv_last, run_id)
        k_len = _row_take(kv_count, run_id)
        readers = _table(rows, iq, start, 0, n_ids, "add")         # query runs per id
        bad_B = (out_of_table_B | (count_B > E) | (readers > 1).any(1)
                 | (valid & ((k_last - k_first + 1 != k_len) | (k_last >= starts))).any(1))

        pad = lambda x: jnp.concatenate([x, jnp.full((B, 1), -1, jnp.int32)], 1)
        run_BT = jnp.cumsum(start, axis=1) - 1
        q_in = q_in & (run_BT < E)
        run_BT = jnp.clip(run_BT, 0, E - 1)
        first_B = jnp.cumsum(used_B) - used_B                      # runs of the rows before
        slot_BT = (first_B[:, None] + run_BT) * T + pos - _row_take(starts, run_BT)
        kv_in = (ik > 0) & (_row_take(readers, ik) > 0)
        return cls(pad(jnp.where(valid, starts, -1)), jnp.where(valid, ends - starts + 1, -1),
                   pad(jnp.where(valid, k_first, -1)), jnp.where(valid, k_len, -1), count_B,
                   jnp.where(q_in, slot_BT, B * E * T), q_in, kv_in, bad_B)

    @property
    def kwargs(self):
        return dict(q_len=self.q_lengths_BE, kv_len=self.kv_lengths_BE,
                    q_off=self.q_offsets_BE, kv_off=self.kv_offsets_BE)

    @property
    def any_run(self):
        """Whether any row has a run: with none, the block is empty and cuDNN not called."""
        return (self.count_B > 0).any()

    def outputs(self, o_BTNH, stats):
        """cuDNN's (o, per-run stats) -> (o float32, lse [B, N, T]), defined everywhere."""
        BE, N, T = stats.shape
        flat = stats.transpose(1, 0, 2).reshape(N, BE * T)
        lse = jnp.take(flat, self.slot_BT, axis=1, mode="fill",
                       fill_value=-jnp.inf).transpose(1, 0, 2)
        q_in = self.q_in_BT[:, None]
        o = jnp.where(self.q_in_BT[:, :, None, None], o_BTNH.astype(jnp.float32), 0.0)
        return self._nan_rows(o), jnp.where(q_in, lse, -jnp.inf)

    def stats_of(self, lse_BNT):
        """A per-token log-sum-exp (the merged one, for the backward) -> cuDNN's per-run."""
        B, N, T = lse_BNT.shape
        E = self.q_lengths_BE.shape[1]
        lse = jnp.where(jnp.isfinite(lse_BNT), lse_BNT, 0.0).astype(jnp.float32)
        flat = jnp.zeros((B * E * T, N), jnp.float32).at[self.slot_BT.reshape(-1)].set(
            lse.transpose(0, 2, 1).reshape(B * T, N), mode="drop")
        return flat.reshape(B * E, T, N).transpose(0, 2, 1)

    def grads(self, dq, dk, dv):
        """cuDNN's gradients -> float32, zero for queries and keys outside every run."""
        keep = lambda m, g: self._nan_rows(jnp.where(m[:, :, None, None],
                                                     g.astype(jnp.float32), 0.0))
        return keep(self.q_in_BT, dq), keep(self.kv_in_BS, dk), keep(self.kv_in_BS, dv)

    def _nan_rows(self, x):
        return jnp.where(self.bad_B[:, None, None, None], jnp.nan, x)
