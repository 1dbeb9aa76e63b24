"""The scanned layers' weight gradients added into the gradient accumulator inside the backward
loop, a layer at a time (Megatron's `main_grad`), instead of stacked first.

jax's transpose of the layer scan writes every layer's weight gradient into one stacked buffer
`[L, ...]` in the weights' dtype, which the accumulating step then casts and adds to its
accumulator: at the end of the backward both exist, an extra copy of the layers' weights (12.2
GiB at 7B in bf16; docs/benchmark-history.md, "Twenty-ninth session"). Here the layer stack is
one `jax.custom_vjp`: the forward keeps each layer's input, the backward walks the layers in
reverse, recomputes each one whole (the compute of `remat="full"`, whatever `cfg.remat` says)
and adds its gradient into the accumulator's slice in place, the accumulator being the
backward loop's carry.

The accumulator enters as the argument differentiated: under `into(acc_L, params_L)`, a
`Decoder` whose scanned weights are `params_L` runs its layers through `layers`, and the
gradient with respect to `acc_L` comes back as `acc_L` plus the layers' gradients
(`lrl.rl.train._accumulate`). The rule is not linear in its cotangent, so it is for that use
alone: the sink is taken once, by the decoder that reads those very weights.

L layers.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Optional

import jax
from jax import lax

_LOCAL = threading.local()


class Sink:
    """One accumulating call's sink: the accumulator's layer tree, the weights it is for, and
    whether a decoder took it and its backward was traced."""

    def __init__(self, acc_L, params_L):
        self.acc_L, self.params_L = acc_L, params_L
        self.taken = False
        self.backward_traced = False
        self.read_again = False   # a second pass over the same weights: its gradient would
        #                           be lost (they are not differentiated), so not usable

    @property
    def used(self) -> bool:
        """Whether the accumulating step may take the sink's result as the gradient."""
        return self.taken and self.backward_traced and not self.read_again


@contextlib.contextmanager
def into(acc_L, params_L):
    """While inside, the decoder reading `params_L` (the very arrays: the scanned layers'
    weights) adds their gradient into `acc_L`; yields the `Sink` to check afterwards."""
    sink = Sink(acc_L, params_L)
    prev = getattr(_LOCAL, "sink", None)
    _LOCAL.sink = sink
    try:
        yield sink
    finally:
        _LOCAL.sink = prev


def take(params_L) -> Optional[Sink]:
    """The active sink when `params_L` are its weights and it is not taken yet, else None
    (taken: the pass is marked, and the step differentiates the usual way)."""
    sink = getattr(_LOCAL, "sink", None)
    if sink is None:
        return None
    mine, theirs = jax.tree.leaves(params_L), jax.tree.leaves(sink.params_L)
    if (jax.tree.structure(params_L) != jax.tree.structure(sink.params_L)
            or any(a is not b for a, b in zip(mine, theirs))):
        return None
    if sink.taken:
        sink.read_again = True
        return None
    sink.taken = True
    return sink


def layers(sink: Sink, block_fn: Callable, params_L, x, consts: tuple):
    """`x` through the scanned layers: `block_fn(params_l, x, *consts) -> x` for each layer
    of `params_L`; the weights' gradient goes into `sink.acc_L`."""
    return _layers(functools.partial(_mark, sink), block_fn, sink.acc_L, params_L, x, consts)


def _mark(sink: Sink):
    sink.backward_traced = True


def _at(a, l):
    return lax.dynamic_index_in_dim(a, l, keepdims=False)


def _layers_fwd(mark, block_fn, acc_L, params_L, x, consts):
    del mark
    y, inputs_L = lax.scan(lambda h, p: (block_fn(p, h, *consts), h), x, params_L)
    return y, (acc_L, params_L, inputs_L, consts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _layers(mark, block_fn, acc_L, params_L, x, consts):
    return _layers_fwd(mark, block_fn, acc_L, params_L, x, consts)[0]   # inputs unused: DCE


def _layers_bwd(mark, block_fn, res, ct_y):
    mark()
    acc_L, params_L, inputs_L, consts = res
    n = inputs_L.shape[0]

    def body(i, carry):
        ct, acc = carry
        l = n - 1 - i
        _, vjp = jax.vjp(lambda p, h: block_fn(p, h, *consts),
                         jax.tree.map(lambda a: _at(a, l), params_L), _at(inputs_L, l))
        g, ct = vjp(ct)
        # In place: the slice read, added to and written back is the loop carry's own.
        acc = jax.tree.map(lambda a, d: lax.dynamic_update_index_in_dim(
            a, _at(a, l) + d.astype(a.dtype), l, 0), acc, g)
        return ct, acc

    ct_x, acc = lax.fori_loop(0, n, body, (ct_y, acc_L))
    # The accumulator's "cotangent" is the accumulator with the gradient added (see above);
    # the weights get none: their gradient is in it.
    return acc, None, ct_x, None


_layers.defvjp(_layers_fwd, _layers_bwd)


def decide(setting: str, *, offloaded: bool, remat: str) -> tuple[bool, str]:
    """`optim.grad_sink` -> (on, why). 'auto': on where it costs no compute (`remat="full"`
    recomputes each layer whole anyway) or where memory binds (the optimizer offloaded)."""
    if setting == "on":
        return True, "optim.grad_sink='on'"
    if setting == "off":
        return False, "optim.grad_sink='off'"
    if setting != "auto":
        raise ValueError(f"optim.grad_sink={setting!r}: 'auto', 'on' or 'off'")
    if offloaded:
        return True, "the optimizer is offloaded"
    if remat == "full":
        return True, "model.remat='full' recomputes each layer whole anyway"
    return False, f"model.remat={remat!r} keeps more than each layer's input"

