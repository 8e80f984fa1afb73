"""Delayed scaling that saves its pass (issue 32, item 4).

In a compiled delayed step, a cast to FP8 depends on the stored scales
alone: this step's amax is a side output no cast waits for, so XLA may
compute it from the same read as the cast. The first step's current scale
comes from a branch taken only then (`keras.ops.cond`). Checked on the
jaxpr of a delayed `fp8.dot`, forward and backward, following the branch
of a step with a history. The numbers themselves (the first step equals
current scaling bit for bit, later steps take the history's scales) are
`tests/fp8_delayed_test.py`'s.
"""

import numpy as np
import pytest

from keras_mp import fp8
from keras_mp._fp8 import delayed

pytestmark = pytest.mark.backends("jax")

_CALLS = ("pjit", "jit", "closed_call", "custom_vjp_call", "custom_jvp_call")


def _inner(eqn):
    """(the sub-jaxpr an equation runs, the offset of its operands in the
    equation's inputs); for a `cond`, the branch of a step with a history
    (branch 0: `first` is false); (None, 0) for a plain primitive."""
    import jax.extend.core as core

    name = eqn.primitive.name
    if name == "cond":
        return eqn.params["branches"][0].jaxpr, 1
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if isinstance(sub, core.ClosedJaxpr):
            sub = sub.jaxpr
        if isinstance(sub, core.Jaxpr) and name in _CALLS:
            return sub, 0
    return None, 0


def _reduces(jaxpr, var):
    """(whether `var` depends on a max reduction within `jaxpr` and the
    calls it makes, the positions of `jaxpr`'s inputs it depends on)."""
    import jax.extend.core as core

    producers = {id(o): e for e in jaxpr.eqns for o in e.outvars}
    inputs = {id(v): i for i, v in enumerate(jaxpr.invars)}
    reduces, reached, stack, seen = False, set(), [var], set()
    while stack:
        v = stack.pop()
        if isinstance(v, core.Literal) or id(v) in seen:
            continue
        seen.add(id(v))
        if id(v) in inputs:
            reached.add(inputs[id(v)])
            continue
        eqn = producers.get(id(v))
        if eqn is None:
            continue
        if eqn.primitive.name in ("reduce_max", "argmax", "reduce_precision"):
            reduces = reduces or eqn.primitive.name == "reduce_max"
        sub, offset = _inner(eqn)
        if sub is None:
            if any(_has_reduction(s) for s in _subjaxprs(eqn)):
                reduces = True  # a loop or other body: conservatively
            stack.extend(eqn.invars)
            continue
        index = [id(o) for o in eqn.outvars].index(id(v))
        inner, positions = _reduces(sub, sub.outvars[index])
        reduces = reduces or inner
        stack.extend(eqn.invars[offset + p] for p in positions)
    return reduces, reached


def _subjaxprs(eqn):
    import jax.extend.core as core

    for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(sub, core.ClosedJaxpr):
                yield sub.jaxpr
            elif isinstance(sub, core.Jaxpr):
                yield sub


def _has_reduction(jaxpr):
    return any(
        e.primitive.name == "reduce_max"
        or any(_has_reduction(s) for s in _subjaxprs(e))
        for e in jaxpr.eqns
    )


def _casts(jaxpr):
    """(jaxpr, cast equation) of every cast to an FP8 dtype, at every
    level."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type" and "float8" in str(
            eqn.params["new_dtype"]
        ):
            yield jaxpr, eqn
        for sub in _subjaxprs(eqn):
            yield from _casts(sub)


def _delayed_step_jaxpr():
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(32, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
    carrier = jnp.zeros(delayed.CARRIER_SHAPE, jnp.float32)
    recipe = fp8.Recipe(scaling="delayed")

    def step(x, w, carrier, scales, first):
        scaling = delayed.Scaling(
            scales=scales,
            first=first,
            parity=jnp.asarray([1.0, 0.0]),
            loss_scale=jnp.float32(1.0),
        )

        def call(x, w, carrier):
            return fp8.dot(x, w, recipe, stats=carrier, delayed=scaling)

        out, vjp = jax.vjp(call, x, w, carrier)
        return out, vjp(out)

    scales = jnp.ones((3,), jnp.float32)
    return jax.make_jaxpr(step)(x, w, carrier, scales, jnp.bool_(False))


def test_no_cast_of_a_delayed_step_waits_for_a_reduction():
    jaxpr = _delayed_step_jaxpr().jaxpr
    casts = list(_casts(jaxpr))
    # x and the kernel (E4M3), the output gradient (E5M2).
    dtypes = sorted(str(e.params["new_dtype"]) for _, e in casts)
    assert dtypes == ["float8_e4m3fn", "float8_e4m3fn", "float8_e5m2"], dtypes
    for level, cast in casts:
        reduces, _ = _reduces(level, cast.invars[0])
        assert not reduces, cast
    # The amaxes are still computed: the side output for the history.
    assert _has_reduction(jaxpr)


def test_the_first_step_takes_its_scales_from_a_reduction():
    """The check above can see a reduction: on the first step's branch
    every cast depends on one (the current scale)."""
    jaxpr = _delayed_step_jaxpr().jaxpr
    conds = [e for level, e in _all_eqns(jaxpr) if e.primitive.name == "cond"]
    # One branch for the forward's two scales, one for the gradient's.
    assert [len(cond.outvars) for cond in conds] == [2, 1]
    for cond in conds:
        first = cond.params["branches"][1].jaxpr
        for outvar in first.outvars:
            assert _reduces(first, outvar)[0]


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield jaxpr, eqn
        for sub in _subjaxprs(eqn):
            yield from _all_eqns(sub)
