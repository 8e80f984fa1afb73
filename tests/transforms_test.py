"""Tests of keras_mp.transforms: math, composition, serialization, state."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_mp import transforms
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import assert_close
from keras_mp.testing import to_numpy


@transforms.register_transform("momentum_for_tests", package="keras_mp_tests")
class MomentumForTests(transforms.Transform):
    """A user transform with per-variable state: heavy-ball momentum."""

    def __init__(self, momentum=0.5, name=None):
        super().__init__(name=name)
        self.momentum = momentum

    def build(self, var_list):
        self.moments = {
            v.path: self.add_variable_from_reference(v, "moment")
            for v in var_list
        }

    def call(self, grads_and_vars):
        result = []
        for g, v in grads_and_vars:
            if g is not None:
                moment = self.moments[v.path]
                g = self.momentum * moment + g
                moment.assign(g)
            result.append((g, v))
        return result

    def get_config(self):
        config = super().get_config()
        config["momentum"] = self.momentum
        return config


# Every built-in with non-default values for every argument.
_BUILTINS = {
    "clip_by_value": transforms.ClipByValue(0.25, name="my_clip_by_value"),
    "clip_by_norm": transforms.ClipByNorm(2.5, name="my_clip_by_norm"),
    "clip_by_global_norm": transforms.ClipByGlobalNorm(3.5, name="my_global"),
    "adaptive_clip_by_global_norm": transforms.AdaptiveClipByGlobalNorm(
        multiplier=3.0, decay=0.5, name="my_adaptive"
    ),
    "gradient_centralization": transforms.GradientCentralization(name="my_gc"),
    "gaussian_noise": transforms.GaussianNoise(0.3, seed=11, name="my_noise"),
    "decoupled_weight_decay": transforms.DecoupledWeightDecay(
        0.01, exclude_from_weight_decay=["bias"], name="my_decay"
    ),
    "replace_non_finite": transforms.ReplaceNonFinite(-1.0, name="my_replace"),
}

_BUILTIN_CLASSES = {
    "clip_by_value": transforms.ClipByValue,
    "clip_by_norm": transforms.ClipByNorm,
    "clip_by_global_norm": transforms.ClipByGlobalNorm,
    "adaptive_clip_by_global_norm": transforms.AdaptiveClipByGlobalNorm,
    "gradient_centralization": transforms.GradientCentralization,
    "gaussian_noise": transforms.GaussianNoise,
    "decoupled_weight_decay": transforms.DecoupledWeightDecay,
    "replace_non_finite": transforms.ReplaceNonFinite,
}


def _fresh(name):
    """A new instance of the built-in `name` with its non-default config."""
    return _BUILTIN_CLASSES[name].from_config(_BUILTINS[name].get_config())


def _variables(*arrays):
    return [
        keras.Variable(np.asarray(a, "float32"), name=f"v{i}")
        for i, a in enumerate(arrays)
    ]


def _run(transform, grads, variables):
    pairs = [
        (
            None
            if g is None
            else ops.convert_to_tensor(np.asarray(g, "float32")),
            v,
        )
        for g, v in zip(grads, variables)
    ]
    return [None if g is None else to_numpy(g) for g, _ in transform(pairs)]


# ------------------------------------------------------------------- math
def test_clip_by_value_matches_numpy():
    grads = [np.array([-2.0, -0.1, 0.0, 0.3, 5.0]), np.array([[1.0, -1.0]])]
    out = _run(transforms.ClipByValue(0.25), grads, _variables(*grads))
    for actual, g in zip(out, grads):
        assert_close(actual, np.clip(g, -0.25, 0.25))


def test_clip_by_norm_matches_numpy_per_gradient_and_keeps_zero_gradients():
    grads = [np.array([3.0, 4.0]), np.array([[0.1, 0.2]]), np.zeros(3)]
    out = _run(transforms.ClipByNorm(1.0), grads, _variables(*grads))
    for actual, g in zip(out, grads):
        norm = np.linalg.norm(g)
        expected = g if norm <= 1.0 else g / norm
        assert_close(actual, expected)
    assert not np.isnan(out[2]).any()


def test_clip_by_global_norm_matches_numpy_and_keras_global_clipnorm():
    grads = [np.array([3.0, 0.0]), np.array([[4.0], [12.0]])]
    variables = _variables(*grads)
    out = _run(transforms.ClipByGlobalNorm(max_norm=2.0), grads, variables)
    norm = np.sqrt(sum(np.sum(g**2) for g in grads))
    for actual, g in zip(out, grads):
        assert_close(actual, g * 2.0 / norm)
    # Keras's own global_clipnorm: SGD(1.0) from zeros moves by -clipped.
    keras_variables = _variables(*[np.zeros_like(g) for g in grads])
    sgd = keras.optimizers.SGD(1.0, global_clipnorm=2.0)
    sgd.apply(
        [ops.convert_to_tensor(g.astype("float32")) for g in grads],
        keras_variables,
    )
    for actual, v in zip(out, keras_variables):
        assert_close(actual, -to_numpy(v))


def test_clip_by_global_norm_below_max_norm_leaves_gradients_unchanged():
    grads = [np.array([0.3, 0.4])]
    out = _run(transforms.ClipByGlobalNorm(), grads, _variables(*grads))
    assert_close(out[0], grads[0])


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_clip_by_global_norm_makes_every_gradient_nan_on_non_finite_norm(bad):
    grads = [np.array([1.0, bad]), np.array([2.0, 3.0])]
    out = _run(transforms.ClipByGlobalNorm(1.0), grads, _variables(*grads))
    for actual in out:
        assert np.isnan(actual).all()


def test_clip_by_global_norm_of_float16_gradients_does_not_overflow():
    # 300**2 + 400**2 overflows float16; the norm (500) does not.
    v = keras.Variable(np.zeros(2, "float16"))
    g = ops.convert_to_tensor(np.array([300.0, 400.0], "float16"))
    [(out, _)] = transforms.ClipByGlobalNorm(5.0)([(g, v)])
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    assert_close(out, np.array([3.0, 4.0]), dtype="float16")


def test_adaptive_clip_by_global_norm_matches_numpy_reference():
    multiplier, decay = 2.0, 0.5
    steps = [
        [np.array([3.0, 4.0]), np.array([0.0])],
        [np.array([30.0, 40.0]), np.array([0.0])],
        [np.array([0.6, 0.8]), np.array([0.0])],
        [np.array([np.nan, 1.0]), np.array([1.0])],
        [np.array([9.0, 12.0]), np.array([0.0])],
    ]
    clip = transforms.AdaptiveClipByGlobalNorm(multiplier, decay)
    variables = _variables(*steps[0])
    average = 0.0
    for grads in steps:
        out = _run(clip, grads, variables)
        norm = np.sqrt(sum(np.sum(g**2) for g in grads))
        if not np.isfinite(norm):
            assert all(np.isnan(actual).all() for actual in out)
        else:
            threshold = multiplier * average if average > 0 else norm
            scale = threshold / norm if norm > threshold else 1.0
            for actual, g in zip(out, grads):
                assert_close(actual, g * scale)
            clipped = min(norm, threshold)
            average = (
                decay * average + (1 - decay) * clipped if average else norm
            )
        assert_close(clip.norm_average, np.float32(average))


def test_gradient_centralization_centers_all_axes_but_the_last():
    rng = np.random.default_rng(0)
    kernel = rng.normal(size=(2, 3, 2, 4))
    dense = rng.normal(size=(3, 2))
    bias = rng.normal(size=(4,))
    grads = [kernel, dense, bias]
    out = _run(transforms.GradientCentralization(), grads, _variables(*grads))
    assert_close(out[0], kernel - kernel.mean(axis=(0, 1, 2), keepdims=True))
    assert_close(out[1], dense - dense.mean(axis=0, keepdims=True))
    assert_close(out[2], bias)


def test_gaussian_noise_has_the_requested_spread():
    v = _variables(np.zeros((40, 50)))
    [out] = _run(transforms.GaussianNoise(0.5, seed=3), [np.ones((40, 50))], v)
    assert abs(out.mean() - 1.0) < 0.05
    assert 0.45 < out.std() < 0.55


def test_gaussian_noise_with_the_same_seed_reproduces_the_sequence():
    def sequence(seed):
        noise = transforms.GaussianNoise(0.1, seed=seed)
        v = _variables(np.zeros(4))
        return [_run(noise, [np.zeros(4)], v)[0] for _ in range(3)]

    first, again, other = sequence(5), sequence(5), sequence(6)
    for a, b in zip(first, again):
        assert_bitwise_equal(a, b)
    assert not np.array_equal(first[0], first[1])
    assert not np.array_equal(first[0], other[0])


def test_decoupled_weight_decay_equals_keras_weight_decay_bitwise():
    initial = np.array([1.0, -2.0, 3.5], "float32")
    zeros = ops.zeros((3,))
    keras_variable = keras.Variable(initial)
    keras.optimizers.SGD(0.1, weight_decay=0.2).apply([zeros], [keras_variable])
    variable = keras.Variable(initial)
    decay = transforms.DecoupledWeightDecay(0.2)
    decay.optimizer = keras.optimizers.SGD(0.1)
    decay([(zeros, variable)])
    assert_bitwise_equal(variable, keras_variable)


def test_decoupled_weight_decay_passes_gradients_and_skips_excluded_and_none():
    kernel, bias, unused = (
        keras.Variable([4.0], name="kernel"),
        keras.Variable([4.0], name="bias"),
        keras.Variable([4.0], name="unused_kernel"),
    )
    decay = transforms.DecoupledWeightDecay(
        0.25, exclude_from_weight_decay=["bias"]
    )
    decay.optimizer = keras.optimizers.SGD(0.5)
    grad = ops.convert_to_tensor([7.0])
    out = decay([(grad, kernel), (grad, bias), (None, unused)])
    assert out[0][0] is grad and out[1][0] is grad and out[2][0] is None
    assert to_numpy(kernel).tolist() == [3.5]
    assert to_numpy(bias).tolist() == [4.0]
    assert to_numpy(unused).tolist() == [4.0]


def test_decoupled_weight_decay_reads_a_schedule_at_the_current_step():
    schedule = keras.optimizers.schedules.ExponentialDecay(
        0.5, decay_steps=1, decay_rate=0.5
    )
    optimizer = keras.optimizers.SGD(schedule)
    optimizer.iterations.assign(2)
    decay = transforms.DecoupledWeightDecay(0.5)
    decay.optimizer = optimizer
    variable = keras.Variable([8.0])
    decay([(ops.ones((1,)), variable)])
    # learning rate 0.5 * 0.5**2 = 0.125: 8 - 8 * 0.5 * 0.125.
    assert to_numpy(variable).tolist() == [7.5]


def test_decoupled_weight_decay_without_optimizer_raises_value_error():
    decay = transforms.DecoupledWeightDecay(0.1)
    with pytest.raises(ValueError, match="optimizer=None"):
        decay([(ops.ones((1,)), keras.Variable([1.0]))])


def test_replace_non_finite_matches_numpy():
    grads = [np.array([1.0, np.nan, np.inf, -np.inf, -2.0])]
    out = _run(transforms.ReplaceNonFinite(-1.0), grads, _variables(*grads))
    assert out[0].tolist() == [1.0, -1.0, -1.0, -1.0, -2.0]


@pytest.mark.parametrize("name", sorted(_BUILTINS))
def test_every_builtin_passes_none_gradients_through(name):
    transform = _fresh(name)
    transform.optimizer = keras.optimizers.SGD(0.1)
    variables = _variables(np.ones((2, 3)), np.ones(3), np.ones(2))
    out = _run(transform, [np.ones((2, 3)), None, np.ones(2)], variables)
    assert out[1] is None
    assert out[0].shape == (2, 3) and out[2].shape == (2,)


def test_all_none_gradients_pass_through_global_clipping():
    v = _variables(np.ones(2))
    for transform in (
        transforms.ClipByGlobalNorm(),
        transforms.AdaptiveClipByGlobalNorm(),
    ):
        assert _run(transform, [None], v) == [None]


# ------------------------------------------------------------ composition
def test_chain_order_matters_clip_then_noise_differs_from_noise_then_clip():
    grads, v = [np.zeros(16)], _variables(np.zeros(16))
    clip_then_noise = transforms.Chain(
        [transforms.ClipByValue(0.5), transforms.GaussianNoise(1.0, seed=3)]
    )
    noise_then_clip = transforms.Chain(
        [transforms.GaussianNoise(1.0, seed=3), transforms.ClipByValue(0.5)]
    )
    noisy = _run(clip_then_noise, grads, v)[0]
    clipped = _run(noise_then_clip, grads, v)[0]
    assert np.abs(noisy).max() > 0.5
    assert_close(clipped, np.clip(noisy, -0.5, 0.5))


def _halve(grads_and_vars):
    return [(None if g is None else g / 2, v) for g, v in grads_and_vars]


def test_chain_accepts_instance_name_tuple_dict_class_and_callable_specs():
    chain = transforms.Chain(
        [
            transforms.ClipByValue(4.0),
            "clip_by_global_norm",
            ("clip_by_norm", {"clip_norm": 0.5}),
            transforms.serialize(transforms.ReplaceNonFinite(2.0)),
            transforms.GradientCentralization,
            _halve,
        ]
    )
    kinds = [type(t).__name__ for t in chain.transforms]
    assert kinds == [
        "ClipByValue",
        "ClipByGlobalNorm",
        "ClipByNorm",
        "ReplaceNonFinite",
        "GradientCentralization",
        "CallableTransform",
    ]
    assert chain.transforms[1].max_norm == 1.0
    assert chain.transforms[2].clip_norm == 0.5
    assert chain.transforms[3].value == 2.0
    v = _variables(np.zeros(3))
    out = _run(chain, [np.array([-30.0, 30.0, 40.0])], v)[0]
    # [-4, 4, 4] -> global norm 1 -> norm 0.5 -> unchanged twice -> halved.
    assert_close(out, np.array([-4.0, 4.0, 4.0]) / np.sqrt(48.0) * 0.5 / 2)
    # A NaN makes the global clip turn everything NaN; then 2.0, halved.
    out = _run(chain, [np.array([np.nan, 30.0, 40.0])], v)[0]
    assert out.tolist() == [1.0, 1.0, 1.0]


def test_chain_takes_a_single_spec_as_a_one_member_chain():
    chain = transforms.Chain(("clip_by_value", {"clip_value": 2.0}))
    assert [type(t).__name__ for t in chain.transforms] == ["ClipByValue"]


def test_chain_variables_concatenate_members_in_order_and_share_optimizer():
    chain = transforms.Chain(
        [
            transforms.GaussianNoise(0.1, seed=1),
            transforms.ClipByValue(1.0),
            transforms.AdaptiveClipByGlobalNorm(),
        ]
    )
    optimizer = keras.optimizers.SGD(0.1)
    chain.optimizer = optimizer
    variables = _variables(np.zeros(2))
    chain.build(variables)
    noise, clip, adaptive = chain.transforms
    assert chain.variables == noise.variables + adaptive.variables
    assert len(chain.variables) == 2
    assert all(t.optimizer is optimizer for t in chain.transforms)
    assert sorted(chain.get_state()) == [
        "adaptive_clip_by_global_norm/norm_average",
        "gaussian_noise/seed_generator_state",
    ]


def test_build_is_idempotent_and_call_builds_from_its_variables():
    clip = transforms.AdaptiveClipByGlobalNorm()
    variables = _variables(np.zeros(2))
    assert not clip.built and clip.variables == []
    _run(clip, [np.ones(2)], variables)
    assert clip.built
    first = clip.variables
    clip.build(variables)
    assert clip.variables == first and len(first) == 1


class _CountingClip(transforms.AdaptiveClipByGlobalNorm):
    def build(self, var_list):
        super().build(var_list)
        self.count = self.add_variable((), dtype="int32", name="count")

    def call(self, grads_and_vars):
        self.count.assign(self.count + 1)
        return super().call(grads_and_vars)


def test_subclass_build_calling_super_creates_each_variable_once():
    clip = _CountingClip()
    variables = _variables(np.zeros(2))
    _run(clip, [np.ones(2)], variables)
    clip.build(variables)
    assert [v.name for v in clip.variables] == ["norm_average", "count"]
    assert clip.variables[0].path == "counting_clip/norm_average"
    assert int(to_numpy(clip.count)) == 1


def test_get_accepts_a_config_dict_under_the_snake_case_name():
    clip = transforms.get(
        {"class_name": "clip_by_value", "config": {"clip_value": 0.5}}
    )
    assert isinstance(clip, transforms.ClipByValue) and clip.clip_value == 0.5
    with pytest.raises(ValueError, match="\\(name, config\\) tuple"):
        transforms.get({"clip_value": 0.5})


def test_per_variable_state_is_named_after_model_variables():
    momentum = MomentumForTests(0.5)
    kernel, bias = _variables(np.zeros((2, 2)), np.zeros(2))
    out = [_run(momentum, [np.ones((2, 2)), np.ones(2)], [kernel, bias])]
    out.append(_run(momentum, [np.ones((2, 2)), np.ones(2)], [kernel, bias]))
    assert_close(out[1][1], np.full(2, 1.5))
    assert sorted(momentum.get_state()) == [
        "momentum_for_tests/moment_0",
        "momentum_for_tests/moment_1",
    ]


def test_chain_rejects_two_stateful_members_with_the_same_name():
    chain = transforms.Chain(
        [transforms.GaussianNoise(0.1), transforms.GaussianNoise(0.2)]
    )
    with pytest.raises(ValueError, match="distinct `name=`"):
        chain.build(_variables(np.zeros(2)))
    renamed = transforms.Chain(
        [transforms.GaussianNoise(0.1), transforms.GaussianNoise(0.2, name="b")]
    )
    renamed.build(_variables(np.zeros(2)))
    assert len(renamed.get_state()) == 2


def test_transform_returning_wrong_pairs_raises_value_error():
    chain = transforms.Chain([lambda pairs: pairs[:1]])
    with pytest.raises(ValueError, match="one \\(gradient, variable\\) pair"):
        _run(
            chain, [np.ones(1), np.ones(1)], _variables(np.ones(1), np.ones(1))
        )


# ---------------------------------------------------------- serialization
@pytest.mark.parametrize("name", sorted(_BUILTINS))
def test_every_builtin_round_trips_config_with_non_default_values(name):
    transform = _BUILTINS[name]
    cls = _BUILTIN_CLASSES[name]
    config = transform.get_config()
    restored = cls.from_config(config)
    assert type(restored) is cls
    assert restored.get_config() == config
    assert config["name"].startswith("my_")
    serialized = keras.saving.serialize_keras_object(transform)
    assert serialized["registered_name"] == f"keras_mp>{cls.__name__}"
    deserialized = keras.saving.deserialize_keras_object(serialized)
    assert type(deserialized) is cls
    assert deserialized.get_config() == config
    by_tuple = transforms.get((name, config))
    assert by_tuple.get_config() == config


@pytest.mark.parametrize("name", sorted(_BUILTINS))
def test_every_builtin_is_registered_under_its_snake_case_name(name):
    config = _BUILTINS[name].get_config()
    del config["name"]
    transform = transforms.get((name, config))
    assert type(transform) is _BUILTIN_CLASSES[name]
    # The default name is the registered name.
    assert transform.name == name


def test_names_without_required_arguments_build_with_defaults():
    assert transforms.get("clip_by_global_norm").max_norm == 1.0
    assert transforms.get("replace_non_finite").value == 0.0
    assert transforms.get("adaptive_clip_by_global_norm").get_config() == {
        "name": "adaptive_clip_by_global_norm",
        "multiplier": 2.0,
        "decay": 0.99,
    }
    with pytest.raises(TypeError, match="clip_value.*\\(name, config\\)"):
        transforms.get("clip_by_value")


@pytest.mark.parametrize(
    "cls",
    [
        *_BUILTIN_CLASSES.values(),
        transforms.Chain,
        transforms.Transform,
        transforms.CallableTransform,
    ],
)
def test_registered_names_are_keras_mp_class_name(cls):
    expected = f"keras_mp>{cls.__name__}"
    assert keras.saving.get_registered_name(cls) == expected
    assert keras.saving.get_registered_object(expected) is cls


def test_chain_round_trips_with_nested_member_configs():
    chain = transforms.Chain(
        [
            transforms.ClipByGlobalNorm(2.0, name="outer_clip"),
            transforms.Chain(
                [
                    "gradient_centralization",
                    ("gaussian_noise", {"stddev": 0.5}),
                ],
                name="inner",
            ),
            MomentumForTests(0.9),
        ],
        name="pipeline",
    )
    config = chain.get_config()
    assert [c["registered_name"] for c in config["transforms"]] == [
        "keras_mp>ClipByGlobalNorm",
        "keras_mp>Chain",
        "keras_mp_tests>MomentumForTests",
    ]
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(chain)
    )
    assert type(restored) is transforms.Chain
    assert restored.get_config() == config
    assert restored.transforms[1].transforms[1].stddev == 0.5


def test_user_transform_registered_with_the_decorator_works_by_name():
    momentum = transforms.get(("momentum_for_tests", {"momentum": 0.25}))
    assert isinstance(momentum, MomentumForTests)
    assert momentum.momentum == 0.25
    assert keras.saving.get_registered_name(MomentumForTests) == (
        "keras_mp_tests>MomentumForTests"
    )
    chain = transforms.Chain(["momentum_for_tests"])
    out = _run(chain, [np.ones(2)], _variables(np.zeros(2)))
    assert_close(out[0], np.ones(2))


def test_register_transform_refuses_a_name_held_by_another_class():
    with pytest.raises(ValueError, match="already registered"):

        @transforms.register_transform("clip_by_value")
        class ClipByValue(transforms.Transform):
            def call(self, grads_and_vars):
                return grads_and_vars

    assert (
        transforms.get(("clip_by_value", {"clip_value": 1.0})).__class__
        is (_BUILTIN_CLASSES["clip_by_value"])
    )


def test_register_transform_refuses_non_transforms():
    with pytest.raises(TypeError, match="subclasses"):
        transforms.register_transform("not_a_transform")(object)


def test_callable_transform_get_config_says_it_cannot_be_serialized():
    chain = transforms.Chain([_halve])
    with pytest.raises(
        TypeError, match="cannot be serialized.*register_transform"
    ):
        chain.get_config()
    with pytest.raises(TypeError, match="cannot be serialized"):
        keras.saving.serialize_keras_object(
            transforms.CallableTransform(_halve)
        )


def test_unknown_name_raises_value_error_listing_registered_names():
    with pytest.raises(ValueError, match="clip_by_global_norm") as info:
        transforms.get("clip_by_globl_norm")
    assert "'clip_by_globl_norm'" in str(info.value)
    assert "gaussian_noise" in str(info.value)


@pytest.mark.parametrize("bad", [None, 3, 1.5, ["clip_by_value"], object()])
def test_get_rejects_other_types_with_type_error(bad):
    with pytest.raises(TypeError, match="Received"):
        transforms.get(bad)


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: transforms.ClipByValue(0.0), ValueError),
        (lambda: transforms.ClipByValue("1"), TypeError),
        (lambda: transforms.ClipByNorm(-1.0), ValueError),
        (lambda: transforms.ClipByGlobalNorm(np.inf), ValueError),
        (lambda: transforms.AdaptiveClipByGlobalNorm(decay=1.0), ValueError),
        (lambda: transforms.AdaptiveClipByGlobalNorm(multiplier=0), ValueError),
        (lambda: transforms.GaussianNoise(-0.1), ValueError),
        (lambda: transforms.GaussianNoise(0.1, seed=1.5), TypeError),
        (lambda: transforms.DecoupledWeightDecay(-0.1), ValueError),
        (lambda: transforms.DecoupledWeightDecay(0.1, "bias"), TypeError),
        (lambda: transforms.ReplaceNonFinite(np.nan), ValueError),
        (lambda: transforms.ClipByValue(1.0, name="a/b"), ValueError),
        (lambda: transforms.CallableTransform(3), TypeError),
        (lambda: transforms.Chain(3), TypeError),
    ],
)
def test_invalid_arguments_raise_with_the_received_value(make, error):
    with pytest.raises(error, match="Received"):
        make()


# ------------------------------------------------------------------ state
def _stateful_chain():
    return transforms.Chain(
        [
            transforms.AdaptiveClipByGlobalNorm(decay=0.5),
            transforms.GaussianNoise(0.1, seed=4),
            MomentumForTests(0.5),
        ]
    )


def test_get_state_set_state_round_trip_replays_the_same_steps():
    chain = _stateful_chain()
    variables = _variables(np.zeros(3))
    _run(chain, [np.array([1.0, 2.0, 2.0])], variables)
    state = chain.get_state()
    assert sorted(state) == [
        "adaptive_clip_by_global_norm/norm_average",
        "gaussian_noise/seed_generator_state",
        "momentum_for_tests/moment_0",
    ]
    assert all(isinstance(value, np.ndarray) for value in state.values())
    first = _run(chain, [np.array([10.0, 0.0, 0.0])], variables)[0]
    chain.set_state(state)
    again = _run(chain, [np.array([10.0, 0.0, 0.0])], variables)[0]
    assert_bitwise_equal(first, again)
    # A fresh chain restored from the state replays it too.
    fresh = _stateful_chain()
    fresh.build(variables)
    fresh.set_state(state)
    assert_bitwise_equal(
        _run(fresh, [np.array([10.0, 0.0, 0.0])], variables)[0], first
    )


@pytest.mark.parametrize(
    "mismatch", ["extra key", "missing key", "shape", "dtype"]
)
def test_mismatched_state_raises_and_leaves_state_bit_identical(mismatch):
    chain = _stateful_chain()
    variables = _variables(np.zeros(3))
    _run(chain, [np.array([1.0, 2.0, 2.0])], variables)
    before = chain.get_state()
    bad = {key: np.copy(value) for key, value in before.items()}
    # A valid change to the first key, so that a partial assign would show.
    bad["adaptive_clip_by_global_norm/norm_average"] = np.array(7.0, "float32")
    last = "momentum_for_tests/moment_0"
    if mismatch == "extra key":
        bad["unknown/variable"] = np.zeros(1, "float32")
        match = "unknown/variable"
    elif mismatch == "missing key":
        del bad[last]
        match = last
    elif mismatch == "shape":
        bad[last] = np.zeros(4, "float32")
        match = f"{last}.*shape"
    else:
        bad[last] = np.zeros(3, "float64")
        match = f"{last}.*dtype"
    with pytest.raises(ValueError, match=match):
        chain.set_state(bad)
    after = chain.get_state()
    assert sorted(after) == sorted(before)
    for key in before:
        assert_bitwise_equal(after[key], before[key], msg=key)


def test_set_state_on_an_unbuilt_transform_says_to_build_it():
    clip = transforms.AdaptiveClipByGlobalNorm()
    assert clip.get_state() == {}
    with pytest.raises(ValueError, match="not built"):
        clip.set_state(
            {"adaptive_clip_by_global_norm/norm_average": np.zeros(())}
        )


# --------------------------------------------------------- compiled steps
def _compiled_pipeline():
    chain = transforms.Chain(
        [
            transforms.GradientCentralization(),
            transforms.AdaptiveClipByGlobalNorm(decay=0.5),
            transforms.GaussianNoise(0.01, seed=9),
            transforms.DecoupledWeightDecay(
                0.1, exclude_from_weight_decay=["v1"]
            ),
            MomentumForTests(0.5),
            transforms.ClipByValue(2.0),
        ]
    )
    variables = _variables(np.ones((2, 3)), np.ones(3))
    chain.optimizer = keras.optimizers.SGD(0.5)
    chain.build(variables)
    return chain, variables


_STEPS = [
    [np.arange(6.0).reshape(2, 3), np.array([1.0, -1.0, 0.5])],
    [np.full((2, 3), 40.0), np.array([3.0, 0.0, 0.0])],
    [np.ones((2, 3)), np.array([0.1, 0.2, 0.3])],
]


def _eager_results():
    chain, variables = _compiled_pipeline()
    outputs = [_run(chain, grads, variables) for grads in _STEPS]
    return outputs, chain.get_state(), [to_numpy(v) for v in variables]


def _assert_same_results(outputs, state, variables, expected):
    expected_outputs, expected_state, expected_variables = expected
    for step, expected_step in zip(outputs, expected_outputs):
        for actual, want in zip(step, expected_step):
            assert_close(actual, want)
    for key in expected_state:
        assert_close(state[key], expected_state[key], msg=key)
    assert_bitwise_equal(
        state["gaussian_noise/seed_generator_state"],
        expected_state["gaussian_noise/seed_generator_state"],
    )
    for actual, want in zip(variables, expected_variables):
        assert_close(actual, want)


@pytest.mark.backends("jax")
def test_transforms_in_jax_jit_under_stateless_scope_match_eager():
    import jax

    expected = _eager_results()
    chain, variables = _compiled_pipeline()
    carried = chain.variables + variables

    @jax.jit
    def step(values, grads):
        mapping = list(zip(carried, values))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            out = chain(list(zip(grads, variables)))
        return [g for g, _ in out], [
            scope.get_current_value(v) for v in carried
        ]

    values = [v.value for v in carried]
    outputs = []
    for grads in _STEPS:
        out, values = step(values, [np.asarray(g, "float32") for g in grads])
        outputs.append([to_numpy(g) for g in out])
    # Nothing was assigned outside the scope: the variables kept their values.
    assert chain.get_state()["adaptive_clip_by_global_norm/norm_average"] == 0
    for variable, value in zip(carried, values):
        variable.assign(value)
    _assert_same_results(
        outputs, chain.get_state(), [to_numpy(v) for v in variables], expected
    )


@pytest.mark.backends("tensorflow")
def test_transforms_in_tf_function_match_eager():
    import tensorflow as tf

    expected = _eager_results()
    chain, variables = _compiled_pipeline()

    @tf.function(jit_compile=False)
    def step(grads):
        return [g for g, _ in chain(list(zip(grads, variables)))]

    outputs = []
    for grads in _STEPS:
        out = step([tf.constant(g, tf.float32) for g in grads])
        outputs.append([to_numpy(g) for g in out])
    _assert_same_results(
        outputs, chain.get_state(), [to_numpy(v) for v in variables], expected
    )
