"""The public API's type hints as a user's type checker sees them.

`.ci/wheel` checks this file with `mypy --strict` against the installed
wheel, whose `py.typed` makes mypy read keras_mp's hints: a call to an
unannotated public function, a wrong argument type or a return type other
than the one asserted below fails there. pytest runs it on every backend,
so each type asserted is also the type at run time.
"""

import sys
from typing import Any

import keras

import keras_mp

if sys.version_info >= (3, 11):
    from typing import assert_type
else:  # Python 3.10: a no-op at run time; mypy reads typing's.

    def assert_type(value: Any, expected: Any, /) -> Any:
        return value


def test_policy_and_its_loss_scale() -> None:
    policy = keras_mp.Policy("mixed_float16")
    scale = assert_type(policy.loss_scale, keras_mp.LossScale | None)
    assert isinstance(scale, keras_mp.DynamicLossScale)
    assert assert_type(policy.output_dtype, str) == "float16"
    assert assert_type(policy.fp8, keras_mp.fp8.Recipe | None) is None
    config = assert_type(policy.get_config(), dict[str, Any])
    restored = assert_type(keras_mp.Policy.from_config(config), keras_mp.Policy)
    assert restored.name == "mixed_float16"


def test_global_policy_and_scope() -> None:
    with keras_mp.policy_scope("mixed_bfloat16"):
        assert keras_mp.global_policy().name == "mixed_bfloat16"
    keras_mp.set_global_policy("float32", float32_islands=None, fp8=None)
    assert keras_mp.global_policy().name == "float32"
    keras_mp.set_global_policy(None)


def test_loss_scales() -> None:
    dynamic = keras_mp.DynamicLossScale(initial_loss_scale=1024, hysteresis=2)
    assert assert_type(dynamic.is_dynamic, bool)
    fixed = keras_mp.FixedLossScale.from_config({"loss_scale_value": 8.0})
    assert assert_type(fixed, keras_mp.FixedLossScale).loss_scale_value == 8.0
    state = {
        "scale": 512.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 100,
        "_growth_tracker": 3,
    }
    imported = keras_mp.DynamicLossScale.from_torch(state)
    assert_type(imported, keras_mp.DynamicLossScale)
    assert imported.initial_loss_scale == 512.0


def test_optimizers_rules_and_explain() -> None:
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), loss_scale=keras_mp.FixedLossScale(4.0)
    )
    assert_type(optimizer.loss_scale, keras_mp.LossScale)
    assert not optimizer.dynamic
    wrapper = keras_mp.OptimizerWrapper(keras.optimizers.Adam())
    assert_type(wrapper.get_config(), dict[str, Any])
    rules = keras_mp.precision_rules(
        {keras.layers.Softmax: "float32"}, base="default"
    )
    assert_type(rules, keras_mp.PrecisionRules)
    assert rules.rules[0] == "precision_rules: Softmax -> float32"
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    rows = keras_mp.explain_precision(model, rules=rules, print_fn=None)
    assert assert_type(rows, list[dict[str, Any]])[0]["variable_dtype"] == (
        "float32"
    )
