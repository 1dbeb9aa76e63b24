"""What the tests read from jaxprs: the cuDNN backward equations a function traces to."""
import jax
import pytest


def cudnn_bwd_eqns(fn, *args) -> list:
    """(operand avals, params) of every cuDNN backward equation in `fn`'s jaxpr, nested
    jaxprs included; skips the test where this jax cannot trace cuDNN attention."""
    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if "bwd_wrapper" in str(e.primitive):
                found.append(([str(x.aval) for x in e.invars], e.params))
            for p in e.params.values():
                inner = getattr(p, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))
    try:
        walk(jax.make_jaxpr(fn)(*args).jaxpr)
    except Exception as e:  # this jax cannot trace cuDNN attention off GPU
        pytest.skip(f"cannot trace cuDNN attention here: {e}")
    return found
