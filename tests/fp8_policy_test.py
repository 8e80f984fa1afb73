"""FP8 in the policy and the layers: `Policy(fp8=...)`, `fp8.DEFAULT_RULES`
through `set_global_policy(..., fp8=...)`, `explain_precision`'s FP8 column,
and the errors of a recipe a layer cannot take."""

import keras
import pytest

import keras_mp
from keras_mp import fp8

_RECIPE = fp8.Recipe(granularity="rowwise", formats="e4m3", margin=1)


def _fp8_rows(model):
    rows = keras_mp.explain_precision(model, print_fn=None)
    return {row["layer"]: row["fp8"] for row in rows}


def _mlp(hidden=32, inputs=64, classes=16):
    x = keras.Input((inputs,))
    h = keras.layers.Dense(hidden, activation="relu", name="up")(x)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.Dense(hidden, name="mid")(h)
    return keras.Model(x, keras.layers.Dense(classes, name="logits")(h))


class TestPolicy:
    def test_fp8_true_is_the_default_recipe_and_quantization_mode_stays_none(
        self,
    ):
        policy = keras_mp.Policy("mixed_bfloat16", fp8=True)
        assert policy.fp8 == fp8.DEFAULT_RECIPE
        # Keras would call `layer.quantize(mode)` at build for a mode: its
        # own float8 path, which keras_mp does not use.
        assert policy.quantization_mode is None
        assert (policy.compute_dtype, policy.variable_dtype) == (
            "bfloat16",
            "float32",
        )
        assert keras_mp.Policy("mixed_bfloat16").fp8 is None

    def test_fp8_takes_a_recipe_or_its_config_and_is_read_only(self):
        policy = keras_mp.Policy("float32", fp8=_RECIPE)
        assert policy.fp8 is _RECIPE
        assert keras_mp.Policy("float32", fp8=_RECIPE.get_config()) == policy
        with pytest.raises(AttributeError):
            policy.fp8 = None

    def test_config_round_trip_keeps_the_recipe_and_the_loss_scale(self):
        policy = keras_mp.Policy("mixed_float16", loss_scale=64, fp8=_RECIPE)
        config = policy.get_config()
        assert config["fp8"] == _RECIPE.get_config()
        restored = keras_mp.Policy.from_config(config)
        assert restored == policy
        assert restored.fp8 == _RECIPE
        assert restored.loss_scale.get_config() == (
            policy.loss_scale.get_config()
        )
        serialized = keras.saving.serialize_keras_object(policy)
        assert keras.saving.deserialize_keras_object(serialized) == policy

    def test_a_policy_without_fp8_keeps_its_old_config(self):
        config = keras_mp.Policy("mixed_bfloat16").get_config()
        assert config == {"name": "mixed_bfloat16", "loss_scale": None}
        old = {"name": "mixed_float16", "loss_scale": None}
        assert keras_mp.Policy.from_config(old).fp8 is None

    def test_equality_and_repr_include_the_recipe(self):
        with_fp8 = keras_mp.Policy("mixed_bfloat16", fp8=True)
        assert with_fp8 == keras_mp.Policy("mixed_bfloat16", fp8=True)
        assert with_fp8 != keras_mp.Policy("mixed_bfloat16")
        assert with_fp8 != keras_mp.Policy("mixed_bfloat16", fp8=_RECIPE)
        assert "granularity='tensorwise'" in repr(with_fp8)
        assert "fp8" not in repr(keras_mp.Policy("mixed_bfloat16"))

    def test_bad_fp8_values_raise_with_the_accepted_forms(self):
        with pytest.raises(TypeError, match="Received: fp8='yes'"):
            keras_mp.Policy("mixed_bfloat16", fp8="yes")
        with pytest.raises(ValueError, match="granularity"):
            keras_mp.Policy("float32", fp8={"granularity": "columnwise"})
        with pytest.raises(ValueError, match="float compute dtype"):
            keras_mp.Policy("int32", fp8=True)

    @pytest.mark.parametrize("setter", ["keras_mp", "keras", "scope"])
    def test_a_global_policy_carrying_a_recipe_is_refused(self, setter):
        policy = keras_mp.Policy("mixed_bfloat16", fp8=True)
        with pytest.raises(ValueError, match=r"fp8=recipe\)"):
            if setter == "keras_mp":
                keras_mp.set_global_policy(policy)
            elif setter == "keras":
                keras.config.set_dtype_policy(policy)
            else:
                with keras_mp.policy_scope(policy):
                    pass
        assert keras_mp.global_policy().fp8 is None


class TestDefaultRules:
    def test_global_fp8_skips_outputs_small_dims_and_layers_without_gemm(
        self,
    ):
        keras_mp.set_global_policy("mixed_bfloat16", fp8=True)
        tokens = keras.Input((8,), dtype="int32")
        x = keras.layers.Embedding(50, 64, name="embed")(tokens)
        x = keras.layers.Dense(32, name="up")(x)
        x = keras.layers.Dense(10, name="narrow")(x)
        x = keras.layers.LayerNormalization(name="norm")(x)
        model = keras.Model(tokens, keras.layers.Dense(16, name="logits")(x))
        rows = _fp8_rows(model)
        assert rows["up"] == "current/tensorwise/hybrid"
        assert rows["narrow"] == "dims 32x10 not multiples of 16"
        assert rows["embed"] == "embedding"
        assert rows["norm"] == "no GEMM"
        assert rows["logits"] == "output layer"
        up = model.get_layer("up")
        assert up.dtype_policy.fp8 == fp8.DEFAULT_RECIPE
        assert up.compute_dtype == "bfloat16"
        assert model.get_layer("logits").dtype_policy.fp8 is None

    def test_the_table_shows_the_fp8_column_only_when_fp8_is_in_play(self):
        printed = []
        keras_mp.explain_precision(_mlp(), print_fn=printed.append)
        assert "fp8" not in printed[0].splitlines()[0].split()
        keras_mp.set_global_policy("mixed_bfloat16", fp8=True)
        keras_mp.explain_precision(_mlp(), print_fn=printed.append)
        header, _, *lines = printed[1].splitlines()
        assert header.split()[-1] == "fp8"
        assert any(
            line.startswith("up ") and "current/tensorwise/hybrid" in line
            for line in lines
        )

    def test_block_recipe_needs_multiples_of_128(self):
        keras_mp.set_global_policy(
            "mixed_bfloat16", fp8=fp8.Recipe(granularity="block")
        )
        x = keras.Input((128,))
        h = keras.layers.Dense(256, name="wide")(x)
        h = keras.layers.Dense(64, name="small")(h)
        model = keras.Model(x, keras.layers.Dense(8, name="logits")(h))
        rows = _fp8_rows(model)
        assert rows["wide"] == "current/block/hybrid"
        assert rows["small"] == "dims 256x64 not multiples of 128"

    def test_multi_head_attention_projections_are_covered(self):
        keras_mp.set_global_policy("mixed_bfloat16", fp8=True)
        x = keras.Input((8, 32))
        h = keras.layers.MultiHeadAttention(2, 16, name="mha")(x, x)
        model = keras.Model(x, keras.layers.Dense(4, name="logits")(h))
        rows = _fp8_rows(model)
        for projection in ("query", "key", "value", "attention_output"):
            assert rows[f"mha/{projection}"] == "current/tensorwise/hybrid"
        assert rows["logits"] == "output layer"

    def test_a_float32_islands_rule_that_gives_a_policy_wins(self):
        rules = keras_mp.precision_rules({"mid": "mixed_bfloat16"})
        keras_mp.set_global_policy(
            "mixed_bfloat16", float32_islands=rules, fp8=_RECIPE
        )
        model = _mlp()
        rows = _fp8_rows(model)
        assert rows["mid"] == "precision rule"
        assert rows["up"] == "current/rowwise/e4m3 margin=1"

    def test_lone_and_subclassed_layers_are_decided_when_built(self):
        keras_mp.set_global_policy("mixed_bfloat16", fp8=True)
        wide, narrow = keras.layers.Dense(32), keras.layers.Dense(3)
        wide.build((None, 64))
        narrow.build((None, 10))
        assert wide.dtype_policy.fp8 == fp8.DEFAULT_RECIPE
        assert narrow.dtype_policy.fp8 is None
        assert _fp8_rows(narrow) == {
            narrow.name: "dims 10x3 not multiples of 16"
        }

    def test_a_global_policy_map_keeps_its_entries_and_takes_the_recipe(self):
        policy_map = keras.dtype_policies.DTypePolicyMap(
            default_policy=keras_mp.Policy("mixed_bfloat16")
        )
        policy_map["up"] = keras_mp.Policy("float32")
        policy_map["mid"] = keras_mp.Policy("float32", fp8=_RECIPE)
        keras_mp.set_global_policy(policy_map, fp8=True)
        model = _mlp()
        up, mid = model.get_layer("up"), model.get_layer("mid")
        assert (up.compute_dtype, up.dtype_policy.fp8) == (
            "float32",
            fp8.DEFAULT_RECIPE,
        )
        assert keras_mp.policy.layer_policy(mid).fp8 == _RECIPE

    def test_a_lora_layer_takes_the_rules_recipe(self):
        # Its base GEMM runs in FP8, the low-rank path outside it
        # (tests/fp8_lora_test.py).
        keras_mp.set_global_policy("mixed_bfloat16", fp8=True)
        layer = keras.layers.Dense(32, lora_rank=4)
        layer.build((None, 64))
        assert layer.lora_enabled
        assert layer.dtype_policy.fp8 == fp8.DEFAULT_RECIPE
        assert _fp8_rows(layer)[layer.name] == "current/tensorwise/hybrid"


class TestExplicitRecipes:
    def test_precision_rules_give_dense_layers_a_recipe(self):
        rules = keras_mp.precision_rules(
            {keras.layers.Dense: keras_mp.Policy("mixed_bfloat16", fp8=True)}
        )
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands=rules)
        rows = _fp8_rows(_mlp())
        # Asked for by a rule, so the output layer takes it too.
        assert rows["logits"] == rows["up"] == "current/tensorwise/hybrid"
        assert rows["norm"] == "no GEMM"

    def test_a_recipe_on_a_layer_without_gemm_raises_with_the_fix(self):
        policy = keras_mp.Policy("mixed_bfloat16", fp8=True)
        rules = keras_mp.precision_rules(
            {keras.layers.LayerNormalization: policy}
        )
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands=rules)
        with pytest.raises(ValueError, match="has no GEMM") as info:
            keras.layers.LayerNormalization()
        assert "precision_rules" in str(info.value)
        keras_mp.set_global_policy(None)
        with pytest.raises(ValueError, match="has no GEMM"):
            keras.layers.Softmax(dtype=policy)

    def test_a_path_rule_with_a_recipe_on_a_layer_without_gemm_raises(self):
        policy = keras_mp.Policy("mixed_bfloat16", fp8=True)
        rules = keras_mp.precision_rules({"norm": policy})
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands=rules)
        with pytest.raises(ValueError, match="'norm' .* has no GEMM"):
            _mlp()

    def test_explicit_block_on_dims_not_multiples_of_128_raises(self):
        policy = keras_mp.Policy(
            "mixed_bfloat16", fp8=fp8.Recipe(granularity="block")
        )
        layer = keras.layers.Dense(3, dtype=policy)
        with pytest.raises(
            ValueError, match="10x3, not multiples of 128"
        ) as info:
            layer.build((None, 10))
        assert "granularity='rowwise'" in str(info.value)
        keras.layers.Dense(128, dtype=policy).build((None, 256))

    def test_a_saved_model_reloads_with_its_recipes(self, tmp_path):
        keras_mp.set_global_policy("mixed_bfloat16", fp8=_RECIPE)
        model = _mlp()
        path = str(tmp_path / "model.keras")
        model.save(path)
        keras_mp.set_global_policy(None)
        restored = keras.models.load_model(path)
        # Its policy, and the reason a layer has no recipe, are saved.
        assert _fp8_rows(restored) == {
            **_fp8_rows(model),
            "functional": "no GEMM",
        }
        assert _fp8_rows(restored)["logits"] == "output layer"
        assert restored.get_layer("up").dtype_policy.fp8 == _RECIPE


def test_rules_validate_their_multiples_and_name_the_required_one():
    with pytest.raises(ValueError, match="Received: multiple=0"):
        fp8.Rules(multiple=0)
    with pytest.raises(ValueError, match="Received: block_multiple=True"):
        fp8.Rules(block_multiple=True)
    rules = fp8.Rules(multiple=8, block_multiple=64)
    assert rules.required_multiple(fp8.Recipe()) == 8
    assert rules.required_multiple(fp8.Recipe(granularity="block")) == 64
    layer = keras.layers.Dense(24)
    layer.build((None, 40))
    assert rules.skip_reason(layer, fp8.Recipe()) is None
    assert fp8.DEFAULT_RULES.skip_reason(layer, fp8.Recipe()) == (
        "dims 40x24 not multiples of 16"
    )
