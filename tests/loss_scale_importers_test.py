"""Tests of DynamicLossScale.from_torch and DynamicLossScale.from_deepspeed.

The imported scale must continue the other library's sequence of scales
step for step where the algorithms agree, and the tests below show exactly
where DeepSpeed's differ. Where torch is installed (it is on every backend
in CI), a real `torch.amp.GradScaler` on CPU is the reference for torch.
DeepSpeed is not installed: its two update rules are re-typed below from
its source.
"""

import random

import keras
import pytest

import keras_mp
from keras_mp.testing import to_numpy


def _state(loss_scale):
    return (
        float(to_numpy(loss_scale.loss_scale)),
        int(to_numpy(loss_scale.num_good_steps)),
    )


def _run(loss_scale, flags):
    """The scale after each `update(is_finite)`, driven through keras ops."""
    scales = []
    for is_finite in flags:
        loss_scale.update(keras.ops.convert_to_tensor(is_finite))
        scales.append(float(to_numpy(loss_scale.loss_scale)))
    return scales


def _flags(seed, count, finite_fraction):
    rng = random.Random(seed)
    return [rng.random() < finite_fraction for _ in range(count)]


def _grad_scaler_state(**overrides):
    state = {
        "scale": 2.0**12,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 5,
        "_growth_tracker": 3,
    }
    state.update(overrides)
    return state


# ----------------------------------------------------------- a real GradScaler


class _TorchScaler:
    """A real `torch.amp.GradScaler` on CPU, stepped with finite or inf
    gradients, so that its own `update()` decides the next scale."""

    def __init__(self, **kwargs):
        self.torch = pytest.importorskip(
            "torch",
            reason="the comparison with a real GradScaler needs torch",
        )
        self.scaler = self.torch.amp.GradScaler("cpu", **kwargs)
        self.weight = self.torch.nn.Parameter(self.torch.zeros(1))
        self.optimizer = self.torch.optim.SGD([self.weight], lr=0.0)

    def step(self, is_finite):
        x = self.torch.tensor([1.0 if is_finite else float("inf")])
        loss = (self.weight * x).sum()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()
        return self.scaler.get_scale()

    def run(self, flags):
        return [self.step(is_finite) for is_finite in flags]


class TestFromTorch:
    def test_state_dict_maps_onto_the_arguments_and_the_counter(self):
        state = _grad_scaler_state(
            scale=2.0**20, growth_factor=4.0, backoff_factor=0.25
        )
        loss_scale = keras_mp.DynamicLossScale.from_torch(state)
        assert loss_scale.initial_loss_scale == 2.0**20
        assert loss_scale.increment_period == 5
        assert loss_scale.multiplier == 4.0
        assert loss_scale.hysteresis == 1
        assert loss_scale.min_loss_scale == 1.0
        assert loss_scale.max_loss_scale is None
        assert float(to_numpy(loss_scale())) == 2.0**20
        assert _state(loss_scale) == (2.0**20, 3)

    def test_config_round_trip_keeps_the_imported_non_default_values(self):
        loss_scale = keras_mp.DynamicLossScale.from_torch(
            _grad_scaler_state(
                scale=2.0**-3, growth_factor=8.0, backoff_factor=0.125
            ),
            min_loss_scale=2.0**-6,
            max_loss_scale=2.0**30,
            on_min_scale="raise",
        )
        config = loss_scale.get_config()
        assert config == {
            "initial_loss_scale": 2.0**-3,
            "increment_period": 5,
            "multiplier": 8.0,
            "min_loss_scale": 2.0**-6,
            "max_loss_scale": 2.0**30,
            "hysteresis": 1,
            "on_min_scale": "raise",
        }
        restored = keras_mp.DynamicLossScale.from_config(config)
        assert restored.get_config() == config
        # The counter is state, not config: a copy starts at 0.
        assert _state(restored) == (2.0**-3, 0)

    def test_tracker_one_short_of_the_interval_grows_at_the_next_step(self):
        torch_scaler = _TorchScaler(
            init_scale=2.0**10, growth_factor=2.0, growth_interval=4
        )
        torch_scaler.run([True] * 3)
        state = torch_scaler.scaler.state_dict()
        assert state["_growth_tracker"] == 3
        loss_scale = keras_mp.DynamicLossScale.from_torch(state)
        assert torch_scaler.step(True) == 2.0**11
        assert _run(loss_scale, [True]) == [2.0**11]
        assert _state(loss_scale) == (2.0**11, 0)

    @pytest.mark.parametrize(
        "kwargs",
        [
            dict(init_scale=2.0**16, growth_interval=3),
            dict(
                init_scale=2.0**14,
                growth_factor=4.0,
                backoff_factor=0.25,
                growth_interval=5,
            ),
        ],
        ids=["defaults_interval_3", "factor_4_interval_5"],
    )
    def test_continues_a_real_grad_scaler_step_for_step(self, kwargs):
        torch_scaler = _TorchScaler(**kwargs)
        torch_scaler.run(_flags(seed=1, count=21, finite_fraction=0.9))
        state = torch_scaler.scaler.state_dict()
        assert state["_growth_tracker"] == 2
        loss_scale = keras_mp.DynamicLossScale.from_torch(state)
        assert _state(loss_scale) == (
            state["scale"],
            state["_growth_tracker"],
        )
        # Finite steps mostly, so the scale stays above keras_mp's floor of 1
        # (GradScaler has none).
        flags = _flags(seed=2, count=120, finite_fraction=0.9)
        expected = torch_scaler.run(flags)
        assert min(expected) >= 1.0
        assert len(set(expected)) > 5
        assert _run(loss_scale, flags) == expected
        assert int(to_numpy(loss_scale.num_good_steps)) == (
            torch_scaler.scaler._get_growth_tracker()
        )

    def test_lightning_checkpoint_keys_hold_the_grad_scaler_state(self):
        state = _grad_scaler_state()
        expected = _state(keras_mp.DynamicLossScale.from_torch(state))
        for key in (
            "MixedPrecision",
            "MixedPrecisionPlugin",
            "native_amp_scaling_state",
        ):
            checkpoint = {"epoch": 3, "state_dict": {}, key: state}
            loss_scale = keras_mp.DynamicLossScale.from_torch(checkpoint)
            assert _state(loss_scale) == expected
            assert loss_scale.increment_period == 5

    def test_apex_state_uses_apex_defaults_and_its_cap(self):
        state = {"loss_scaler0": {"loss_scale": 2.0**23, "unskipped": 1999}}
        loss_scale = keras_mp.DynamicLossScale.from_torch(state)
        assert loss_scale.increment_period == 2000
        assert loss_scale.multiplier == 2.0
        assert loss_scale.max_loss_scale == 2.0**24
        assert _state(loss_scale) == (2.0**23, 1999)
        # apex: min(2**24, scale * 2) at the 2000th finite step in a row.
        assert _run(loss_scale, [True]) == [2.0**24]
        assert _state(loss_scale) == (2.0**24, 0)
        # At the cap the scale stays and the count restarts.
        at_cap = {"loss_scaler0": {"loss_scale": 2.0**24, "unskipped": 1999}}
        loss_scale = keras_mp.DynamicLossScale.from_torch(at_cap)
        assert _run(loss_scale, [True, False]) == [2.0**24, 2.0**23]

    def test_min_loss_scale_lets_a_scale_below_one_continue(self):
        state = _grad_scaler_state(scale=0.25, _growth_tracker=0)
        loss_scale = keras_mp.DynamicLossScale.from_torch(
            state, min_loss_scale=2.0**-4
        )
        assert _run(loss_scale, [False, False, False]) == [
            0.125,
            2.0**-4,
            2.0**-4,
        ]

    def test_state_is_what_the_optimizer_builds(self):
        loss_scale = keras_mp.DynamicLossScale.from_torch(
            _grad_scaler_state(scale=2.0**9, _growth_tracker=4)
        )
        optimizer = keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(0.1), loss_scale=loss_scale
        )
        optimizer.build([keras.Variable([1.0, 2.0])])
        assert optimizer.loss_scale is loss_scale
        assert _state(loss_scale) == (2.0**9, 4)
        assert float(to_numpy(optimizer.loss_scale())) == 2.0**9


class TestFromTorchErrors:
    def test_empty_state_dict_of_a_disabled_scaler(self):
        with pytest.raises(ValueError, match="empty") as info:
            keras_mp.DynamicLossScale.from_torch({})
        message = str(info.value)
        assert "GradScaler(enabled=False)" in message
        assert "Received: state_dict={}" in message
        assert "bfloat16" in message

    def test_missing_keys_are_named(self):
        state = _grad_scaler_state()
        del state["_growth_tracker"], state["backoff_factor"]
        with pytest.raises(ValueError, match="lacks the keys") as info:
            keras_mp.DynamicLossScale.from_torch(state)
        message = str(info.value)
        assert "['backoff_factor', '_growth_tracker']" in message
        assert "Received: {" in message
        assert "GradScaler.state_dict()" in message

    def test_mismatched_backoff_says_what_was_expected_and_the_fix(self):
        state = _grad_scaler_state(growth_factor=2.0, backoff_factor=0.25)
        with pytest.raises(ValueError, match="one `multiplier`") as info:
            keras_mp.DynamicLossScale.from_torch(state)
        message = str(info.value)
        assert "`1 / growth_factor` = 0.5" in message
        assert "Received: growth_factor=2.0, backoff_factor=0.25" in message
        assert "keras_mp.DynamicLossScale(initial_loss_scale=" in message

    @pytest.mark.parametrize(
        "overrides, error, match",
        [
            (dict(scale="65536"), TypeError, "`scale`.*must be a number"),
            (dict(scale=float("inf")), ValueError, "finite and positive"),
            (dict(scale=0.0), ValueError, "finite and positive"),
            (dict(growth_interval=2.0), TypeError, "must be an integer"),
            (dict(growth_interval=0), ValueError, "at least 1"),
            (dict(_growth_tracker=True), TypeError, "must be an integer"),
            (dict(_growth_tracker=-1), ValueError, "at least 0"),
            (dict(_growth_tracker=5), ValueError, "stays below"),
            (
                dict(growth_factor=1.0, backoff_factor=1.0),
                ValueError,
                "greater than 1",
            ),
        ],
    )
    def test_wrong_values_and_types(self, overrides, error, match):
        with pytest.raises(error, match=match) as info:
            keras_mp.DynamicLossScale.from_torch(
                _grad_scaler_state(**overrides)
            )
        assert "Received: " in str(info.value)

    def test_tensor_values_name_item_as_the_fix(self):
        torch = pytest.importorskip("torch", reason="needs a torch tensor")
        state = _grad_scaler_state(scale=torch.tensor(1024.0))
        with pytest.raises(TypeError, match=r"\.item\(\)"):
            keras_mp.DynamicLossScale.from_torch(state)

    def test_scale_below_the_floor_names_min_loss_scale(self):
        with pytest.raises(ValueError, match="below `min_loss_scale`") as info:
            keras_mp.DynamicLossScale.from_torch(_grad_scaler_state(scale=0.5))
        message = str(info.value)
        assert "Received: scale=0.5, min_loss_scale=1.0" in message
        assert "min_loss_scale=0.5" in message

    def test_not_a_dict(self):
        with pytest.raises(TypeError, match="must be a dict"):
            keras_mp.DynamicLossScale.from_torch([("scale", 1.0)])

    def test_apex_state_with_two_losses_names_the_fix(self):
        scaler = {"loss_scale": 1024.0, "unskipped": 0}
        state = {"loss_scaler0": scaler, "loss_scaler1": scaler}
        with pytest.raises(
            ValueError, match="one loss scaler per loss"
        ) as info:
            keras_mp.DynamicLossScale.from_torch(state)
        assert "['loss_scaler0', 'loss_scaler1']" in str(info.value)

    def test_apex_state_missing_unskipped(self):
        with pytest.raises(ValueError, match=r"lacks the keys \['unskipped'\]"):
            keras_mp.DynamicLossScale.from_torch(
                {"loss_scaler0": {"loss_scale": 1024.0}}
            )


# ------------------------------------------------------------------ DeepSpeed
#
# Reference implementations re-typed from DeepSpeed's source (not imported:
# DeepSpeed is not a dependency), as plain Python on a dict of its
# attributes. Both are called once per step with whether it overflowed.


def _deepspeed_scaler(config):
    """A fresh DeepSpeed scaler's attributes for an fp16 block."""
    return {
        "cur_scale": 2.0 ** config.get("initial_scale_power", 16),
        "cur_iter": 0,
        "last_overflow_iter": -1,
        "scale_factor": 2.0,
        "scale_window": config.get("loss_scale_window", 1000),
        "min_scale": config.get("min_loss_scale", 1),
        "delayed_shift": config.get("hysteresis", 2),
        "cur_hysteresis": config.get("hysteresis", 2),
        "consecutive_hysteresis": config.get("consecutive_hysteresis", False),
    }


def _deepspeed_zero_update(s, overflow):
    """Re-typed `DynamicLossScaler.update_scale`
    (deepspeed/runtime/fp16/loss_scaler.py), which ZeRO stages 1-3 use;
    its raise at the minimum scale is left out (the tests stay above it)."""
    if overflow:
        if s["delayed_shift"] == 1 or s["cur_hysteresis"] == 1:
            s["cur_scale"] = max(
                s["cur_scale"] / s["scale_factor"], s["min_scale"]
            )
        else:
            s["cur_hysteresis"] -= 1
        s["last_overflow_iter"] = s["cur_iter"]
    else:
        if s["consecutive_hysteresis"]:
            s["cur_hysteresis"] = s["delayed_shift"]
        if (s["cur_iter"] - s["last_overflow_iter"]) % s["scale_window"] == 0:
            if not s["consecutive_hysteresis"]:
                s["cur_hysteresis"] = s["delayed_shift"]
            s["cur_scale"] *= s["scale_factor"]
    s["cur_iter"] += 1


def _deepspeed_fp16_optimizer_update(s, overflow):
    """Re-typed `FP16_Optimizer._update_scale`
    (deepspeed/runtime/fp16/fused_optimizer.py; `FP16_UnfusedOptimizer` has
    the same), used without ZeRO. It has no hysteresis."""
    if overflow:
        s["cur_scale"] = max(s["cur_scale"] / s["scale_factor"], s["min_scale"])
        s["last_overflow_iter"] = s["cur_iter"]
    else:
        stable_interval = (s["cur_iter"] - s["last_overflow_iter"]) - 1
        if stable_interval > 0 and stable_interval % s["scale_window"] == 0:
            s["cur_scale"] *= s["scale_factor"]
    s["cur_iter"] += 1


def _run_deepspeed(update, scaler, flags):
    scales = []
    for is_finite in flags:
        update(scaler, not is_finite)
        scales.append(scaler["cur_scale"])
    return scales


def _growth_steps(scales, start):
    """1-based steps at which the scale grew."""
    previous = [start, *scales[:-1]]
    return [i + 1 for i, (a, b) in enumerate(zip(previous, scales)) if b > a]


_FP16 = {
    "enabled": True,
    "loss_scale": 0,
    "initial_scale_power": 10,
    "loss_scale_window": 4,
    "hysteresis": 1,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}


def _fp16(**overrides):
    return {**_FP16, **overrides}


class TestFromDeepSpeed:
    def test_config_maps_onto_the_arguments(self):
        block = _fp16(
            initial_scale_power=20,
            loss_scale_window=250,
            hysteresis=3,
            consecutive_hysteresis=True,
            min_loss_scale=0.25,
        )
        for config in ({"train_batch_size": 8, "fp16": block}, block):
            loss_scale = keras_mp.DynamicLossScale.from_deepspeed(
                config, max_loss_scale=2.0**24, on_min_scale="raise"
            )
            assert loss_scale.get_config() == {
                "initial_loss_scale": 2.0**20,
                "increment_period": 250,
                "multiplier": 2.0,
                "min_loss_scale": 0.25,
                "max_loss_scale": 2.0**24,
                "hysteresis": 3,
                "on_min_scale": "raise",
            }
            assert _state(loss_scale) == (2.0**20, 0)

    def test_missing_keys_take_deepspeeds_defaults(self):
        loss_scale = keras_mp.DynamicLossScale.from_deepspeed(
            {"fp16": {"enabled": True}}
        )
        assert loss_scale.initial_loss_scale == 2.0**16
        assert loss_scale.increment_period == 1000
        assert loss_scale.hysteresis == 2
        assert loss_scale.min_loss_scale == 1.0

    def test_state_gives_scale_counter_and_overflows_in_a_row(self):
        config = _fp16(hysteresis=3, consecutive_hysteresis=True)
        state = {
            "cur_scale": 2.0**7,
            "cur_iter": 30,
            "last_overflow_iter": 29,
            "cur_hysteresis": 2,
        }
        loss_scale = keras_mp.DynamicLossScale.from_deepspeed(config, state)
        assert _state(loss_scale) == (2.0**7, 0)
        # One overflow so far in the hysteresis count: the next two
        # overflows in a row lower the scale at the second, in both.
        assert int(to_numpy(loss_scale._overflows_in_a_row)) == 1
        assert _run(loss_scale, [False, False]) == [2.0**7, 2.0**6]

    def test_counter_is_the_finite_steps_since_the_window_started(self):
        state = {"cur_scale": 2.0**7, "cur_iter": 30, "last_overflow_iter": 20}
        loss_scale = keras_mp.DynamicLossScale.from_deepspeed(_fp16(), state)
        # Nine finite steps (iterations 21 to 29) since the overflow at 20:
        # growths at the 4th and the 8th, then one step into the window.
        assert _state(loss_scale) == (2.0**7, 1)

    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_zero_scaler_without_hysteresis_agrees_step_for_step(self, seed):
        config = _fp16(initial_scale_power=12)
        flags = _flags(seed=seed, count=200, finite_fraction=0.9)
        expected = _run_deepspeed(
            _deepspeed_zero_update, _deepspeed_scaler(config), flags
        )
        loss_scale = keras_mp.DynamicLossScale.from_deepspeed(config)
        assert min(expected) > 1.0
        assert _run(loss_scale, flags) == expected

    def test_zero_scaler_state_continues_step_for_step(self):
        config = _fp16(initial_scale_power=12)
        scaler = _deepspeed_scaler(config)
        _run_deepspeed(
            _deepspeed_zero_update, scaler, _flags(3, 37, finite_fraction=0.9)
        )
        loss_scale = keras_mp.DynamicLossScale.from_deepspeed(
            config, dict(scaler)
        )
        assert int(to_numpy(loss_scale.num_good_steps)) == 1
        flags = _flags(seed=4, count=150, finite_fraction=0.9)
        expected = _run_deepspeed(_deepspeed_zero_update, scaler, flags)
        assert min(expected) > 1.0
        assert _run(loss_scale, flags) == expected

    def test_first_growth_without_zero_comes_one_step_later(self):
        # The window is 4. keras_mp (and ZeRO's DynamicLossScaler) grow at
        # the 4th finite step from the start, and at the 4th after an
        # overflow; FP16_Optimizer at the 5th each time, and every 4 steps
        # after that first growth in both.
        config = _fp16()
        flags = [True] * 12 + [False] + [True] * 9
        keras_mp_scales = _run(
            keras_mp.DynamicLossScale.from_deepspeed(config), flags
        )
        zero_scales = _run_deepspeed(
            _deepspeed_zero_update, _deepspeed_scaler(config), flags
        )
        fp16_optimizer_scales = _run_deepspeed(
            _deepspeed_fp16_optimizer_update, _deepspeed_scaler(config), flags
        )
        assert keras_mp_scales == zero_scales
        start = 2.0**10
        assert _growth_steps(keras_mp_scales, start) == [4, 8, 12, 17, 21]
        assert _growth_steps(fp16_optimizer_scales, start) == [5, 9, 18, 22]
        assert keras_mp_scales[:4] == [start] * 3 + [2 * start]
        assert fp16_optimizer_scales[:5] == [start] * 4 + [2 * start]
        assert keras_mp_scales[12] == 2.0**12  # after the overflow at 13
        assert fp16_optimizer_scales[12] == 2.0**11

    def test_consecutive_hysteresis_lowers_again_one_overflow_sooner(self):
        config = _fp16(hysteresis=2, consecutive_hysteresis=True)
        flags = [False] * 4 + [True] + [False] * 2
        deepspeed = _run_deepspeed(
            _deepspeed_zero_update, _deepspeed_scaler(config), flags
        )
        keras_mp_scales = _run(
            keras_mp.DynamicLossScale.from_deepspeed(config), flags
        )
        # Both keep the scale at the 1st overflow and lower it at the 2nd;
        # DeepSpeed lowers at every further one in a row, keras_mp counts
        # two again. A finite step resets both.
        assert deepspeed == [2.0**10, 2.0**9, 2.0**8, 2.0**7, 2.0**7] + [
            2.0**7,
            2.0**6,
        ]
        assert keras_mp_scales == [2.0**10, 2.0**9, 2.0**9, 2.0**8, 2.0**8] + [
            2.0**8,
            2.0**7,
        ]

    def test_non_consecutive_hysteresis_forgives_one_overflow_per_growth(self):
        config = _fp16(
            hysteresis=2, consecutive_hysteresis=False, loss_scale_window=100
        )
        # Isolated overflows, finite steps between them.
        flags = [False, True, True, False, True, False, True]
        deepspeed = _run_deepspeed(
            _deepspeed_zero_update, _deepspeed_scaler(config), flags
        )
        keras_mp_scales = _run(
            keras_mp.DynamicLossScale.from_deepspeed(config), flags
        )
        assert deepspeed == [2.0**10] * 3 + [2.0**9] * 2 + [2.0**8] * 2
        assert keras_mp_scales == [2.0**10] * 7


class TestFromDeepSpeedErrors:
    def test_static_scale_names_fixed_loss_scale(self):
        with pytest.raises(ValueError, match="static loss scale") as info:
            keras_mp.DynamicLossScale.from_deepspeed(
                {"fp16": _fp16(loss_scale=128)}
            )
        message = str(info.value)
        assert "Received: loss_scale=128" in message
        assert "keras_mp.FixedLossScale(128)" in message

    def test_static_scaler_state_names_fixed_loss_scale(self):
        state = {
            "dynamic_loss_scale": False,
            "cur_scale": 64.0,
            "cur_iter": 3,
            "last_overflow_iter": -1,
        }
        with pytest.raises(ValueError, match=r"FixedLossScale\(64.0\)"):
            keras_mp.DynamicLossScale.from_deepspeed(_fp16(), state)

    @pytest.mark.parametrize(
        "config, match",
        [
            ({"bf16": {"enabled": True}}, "bfloat16 training needs no loss"),
            ({"train_batch_size": 8}, "an 'fp16' block"),
            ({"fp16": {"enabled": False}}, "not enabled"),
            ({"fp16": _fp16(loss_scale_windows=4)}, "Unknown keys"),
        ],
    )
    def test_configs_without_a_dynamic_fp16_scale(self, config, match):
        with pytest.raises(ValueError, match=match) as info:
            keras_mp.DynamicLossScale.from_deepspeed(config)
        assert "Received: " in str(info.value)

    @pytest.mark.parametrize(
        "overrides, error, match",
        [
            (dict(loss_scale="auto"), TypeError, "'auto' values"),
            (dict(loss_scale_window=0), ValueError, "at least 1"),
            (dict(hysteresis=1.5), TypeError, "must be an integer"),
            (dict(consecutive_hysteresis=1), TypeError, "must be a bool"),
            (dict(min_loss_scale=0), ValueError, "finite and positive"),
            (dict(min_loss_scale=2.0**11), ValueError, "below DeepSpeed's"),
        ],
    )
    def test_wrong_values_and_types(self, overrides, error, match):
        with pytest.raises(error, match=match) as info:
            keras_mp.DynamicLossScale.from_deepspeed(_fp16(**overrides))
        assert "Received: " in str(info.value)

    @pytest.mark.parametrize(
        "state, error, match",
        [
            ({"cur_scale": 8.0, "cur_iter": 3}, ValueError, "lacks the keys"),
            (
                {"cur_scale": 8.0, "cur_iter": 3, "last_overflow_iter": 3},
                ValueError,
                "below `cur_iter`",
            ),
            (
                {"cur_scale": 8.0, "cur_iter": "3", "last_overflow_iter": 1},
                TypeError,
                "must be an integer",
            ),
            (
                {
                    "cur_scale": 8.0,
                    "cur_iter": 3,
                    "last_overflow_iter": 1,
                    "scale_window": 1000,
                },
                ValueError,
                "saved with another config",
            ),
            (
                {
                    "cur_scale": 8.0,
                    "cur_iter": 3,
                    "last_overflow_iter": 1,
                    "cur_hysteresis": 2,
                },
                ValueError,
                "counts down",
            ),
            ([8.0, 3, 1], TypeError, "must be a dict"),
        ],
    )
    def test_bad_state(self, state, error, match):
        with pytest.raises(error, match=match) as info:
            keras_mp.DynamicLossScale.from_deepspeed(_fp16(), state)
        assert "Received" in str(info.value)
