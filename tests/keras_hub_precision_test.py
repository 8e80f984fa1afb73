"""Precision decisions follow keras-hub models (issue 35, item 1).

keras-hub builds each sublayer with `dtype=` its parent's policy. That
argument is the global policy handed on, not a choice, so the float32
islands, precision rules and FP8 rules still decide those layers; a
deliberate `dtype=` (Gemma's `Softmax(dtype="float32")`) still wins. An
island inside a block returns the block's compute dtype (its `x +
residual` is raw code), and the decisions are saved with the model, so
`load_model` in a fresh process, with no policy set, rebuilds the same
layers. Tiny GPT-2, BERT and Gemma models, built from config.
"""

import json
import os
import subprocess
import sys
import textwrap

import keras
import keras_hub
import numpy as np
import pytest

import keras_mp
from keras_mp.precision import walk_layers

VOCAB, SEQ, BATCH = 64, 8, 4

# LayerNormalization (GPT-2, BERT) and Gemma's RMS norms (a keras-hub
# class, named by path) as float32 islands, over the default islands
# (Softmax, model outputs).
RULES = keras_mp.precision_rules(
    {keras.layers.LayerNormalization: "float32", r".*_norm": "float32"},
    base="default",
    name="test_islands",
)


def _gpt2():
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=SEQ,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _bert():
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=SEQ,
    )
    return keras_hub.models.BertTextClassifier(
        backbone=backbone, num_classes=2, preprocessor=None
    )


def _gemma():
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=32,
        intermediate_dim=64,
        head_dim=16,
    )
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


MODELS = {"gpt2": _gpt2, "bert": _bert, "gemma": _gemma}


def _inputs(name):
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32"),
        "padding_mask": np.ones((BATCH, SEQ), "bool"),
    }
    if name == "bert":
        x["segment_ids"] = np.zeros((BATCH, SEQ), "int32")
    return x


def _build(name, islands=RULES, fp8=True):
    keras_mp.set_global_policy(
        "mixed_bfloat16", float32_islands=islands, fp8=fp8
    )
    try:
        keras.utils.set_random_seed(0)
        return MODELS[name]()
    finally:
        keras_mp.set_global_policy(None)


def _rows(model):
    return keras_mp.explain_precision(model, print_fn=None)


def _rows_by_layer(model):
    """explain_precision's rows by layer id: layers without weights have
    no path, and a block's names repeat in the next block."""
    unique = [
        layer
        for layer in [model, *walk_layers(model, into_models=True)]
        if not isinstance(layer, keras.layers.InputLayer)
    ]
    rows = _rows(model)
    assert len(rows) == len(unique)
    for layer, row in zip(unique, rows):
        assert row["class_name"] == type(layer).__name__
    return {id(layer): row for layer, row in zip(unique, rows)}


def _summary(model):
    """What must survive a reload: per layer (in explain's order) its
    class, dtypes, rule and FP8 recipe. Layers without weights have no
    path, and their names count up per process, so the layer is left out.
    """
    return [
        [row[key] for key in sorted(row) if key != "layer"]
        for row in _rows(model)
    ]


def _fp8_count(model):
    return sum(row["fp8"].startswith("current/") for row in _rows(model))


def _blocks(model):
    """The transformer blocks: keras-hub layers that hold other layers."""
    return [
        layer
        for layer in model.backbone._flatten_layers(include_self=False)
        if not isinstance(layer, keras.Model)
        and layer._flatten_layers(include_self=False, recursive=False)
        and layer.name.startswith(("transformer_layer", "decoder_block"))
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_islands_reach_the_layers_a_block_hands_its_policy(name):
    model = _build(name)
    rows = _rows_by_layer(model)
    islands = 0
    for block in _blocks(model):
        if rows[id(block)]["rule"] != "global policy":
            # BERT's last block produces its backbone's output, a float32
            # island: every layer inside it that no rule of its own and
            # no deliberate `dtype=` decides computes in float32 with it.
            assert (name, block.path) == ("bert", "transformer_layer_1")
            for layer in block._flatten_layers(include_self=False):
                row = rows[id(layer)]
                assert row["compute_dtype"] == "float32", row
                if not isinstance(
                    layer,
                    (keras.layers.Softmax, keras.layers.LayerNormalization),
                ):
                    assert row["rule"] == (
                        "DEFAULT_FLOAT32_ISLANDS: model outputs -> float32 "
                        "(inside transformer_layer_1)"
                    ), row
            continue
        # Depth first: whatever a block creates for itself, as keras-hub
        # does, with `dtype=self.dtype_policy`.
        for layer in block._flatten_layers(include_self=False):
            path = layer.path or layer.name
            row = rows[id(layer)]
            if isinstance(layer, keras.layers.Softmax) and name == "gemma":
                # Gemma's `Softmax(dtype="float32")`: a deliberate dtype.
                assert row["rule"] == "dtype argument", row
                assert row["output_dtype"] == "float32", row
                continue
            island = isinstance(
                layer, (keras.layers.Softmax, keras.layers.LayerNormalization)
            ) or path.endswith("_norm")
            if not island:
                assert row["rule"] == "global policy", row
                assert row["compute_dtype"] == "bfloat16", row
                continue
            islands += 1
            expected = (
                "DEFAULT_FLOAT32_ISLANDS: Softmax -> float32"
                if isinstance(layer, keras.layers.Softmax)
                else row["rule"]
            )
            assert row["rule"] == expected, row
            assert row["rule"].split(":")[0] in (
                "test_islands",
                "DEFAULT_FLOAT32_ISLANDS",
            ), row
            assert row["compute_dtype"] == "float32", row
            # Handed back to the bfloat16 block's own code.
            assert row["output_dtype"] == "bfloat16", row
            assert layer.compute_dtype == "float32"
    # Each block's two norms (and attention's Softmax for GPT-2 and
    # BERT): none of them left to the "dtype argument".
    assert islands == {"gpt2": 6, "bert": 3, "gemma": 4}[name]
    # The FP8 rules decide those layers too: attention's four projections
    # and the feed-forward GEMMs of each block (but BERT's float32 one).
    assert _fp8_count(model) == {"gpt2": 12, "bert": 6, "gemma": 14}[name]


def test_a_deliberate_dtype_wins_and_the_handed_on_policy_does_not():
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.handed_on = keras.layers.Softmax(dtype=self.dtype_policy)
            self.chosen = keras.layers.Softmax(dtype="bfloat16")
            self.equal = keras.layers.Softmax(
                dtype=keras_mp.Policy("mixed_bfloat16")
            )
            self.other = keras.layers.Softmax(dtype=keras_mp.Policy("bfloat16"))

        def call(self, x):
            return self.handed_on(x) + self.chosen(x) + self.equal(x)

    keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
    block = Block()
    assert block.handed_on.compute_dtype == "float32"
    # A policy equal to the global one is the same hand-on.
    assert block.equal.compute_dtype == "float32"
    assert block.chosen.compute_dtype == "bfloat16"
    assert block.other.compute_dtype == "bfloat16"
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(4)(block(inputs)))
    rows = _rows_by_layer(model)
    assert rows[id(block.chosen)]["rule"] == "dtype argument"
    assert rows[id(block.other)]["rule"] == "dtype argument"
    island = rows[id(block.handed_on)]
    assert island["rule"] == "DEFAULT_FLOAT32_ISLANDS: Softmax -> float32"
    assert (island["compute_dtype"], island["output_dtype"]) == (
        "float32",
        "bfloat16",
    )
    # The block's own `+` meets one dtype on every backend.
    out = model(np.ones((2, 4), "float32"))
    assert keras.backend.standardize_dtype(out.dtype) == "float32"


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
def test_bert_classifier_fits_under_fp8_with_islands():
    """TensorFlow's `x + residual` raised "Input 'y' of 'AddV2' Op has type
    float32 that does not match type bfloat16" where an island inside
    BERT's blocks returned float32."""
    model = _build("bert")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x = _inputs("bert")
    y = np.array([0, 1, 0, 1])
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    losses = history.history["loss"]
    assert all(np.isfinite(losses)), losses
    assert _fp8_count(model) == 6


_CHILD = textwrap.dedent(
    """
    import json, sys
    import keras, keras_hub, numpy as np
    import keras_mp

    directory = sys.argv[1]
    out = {}
    for name in json.loads(sys.argv[2]):
        model = keras.saving.load_model(f"{directory}/{name}.keras")
        x = dict(np.load(f"{directory}/{name}_x.npz"))
        np.save(f"{directory}/{name}_reloaded.npy",
                np.asarray(model.predict(x, verbose=0), "float32"))
        rows = keras_mp.explain_precision(model, print_fn=None)
        out[name] = [[r[k] for k in sorted(r) if k != "layer"] for r in rows]
    print("SUMMARY" + json.dumps(out))
    """
)


@pytest.mark.slow
def test_decisions_survive_load_model_in_a_fresh_process(tmp_path):
    names = sorted(MODELS)
    expected = {}
    for name in names:
        model = _build(name)
        x = _inputs(name)
        before = _fp8_count(model)
        path = str(tmp_path / f"{name}.keras")
        model.save(path)
        np.savez(tmp_path / f"{name}_x.npz", **x)
        predictions = np.asarray(model.predict(x, verbose=0), "float32")
        expected[name] = (predictions, _summary(model))
        assert before > 0, name
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path), json.dumps(names)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = [
        line
        for line in result.stdout.splitlines()
        if line.startswith("SUMMARY")
    ][-1]
    summaries = json.loads(line[len("SUMMARY") :])
    for name in names:
        predictions, summary = expected[name]
        assert summaries[name] == summary, name
        reloaded = np.load(tmp_path / f"{name}_reloaded.npy")
        # Bit-identical: the same layers, dtypes and FP8 recipes.
        np.testing.assert_array_equal(reloaded, predictions, err_msg=name)
