"""keras-hub decoders under FP8 (issue 22, item 7): GPT-2 and Gemma backbones,
sized down and built from config (no download), train 20 steps under
`set_global_policy("mixed_bfloat16", fp8=True)` on every backend, and
`explain_precision` lists which of their GEMMs run in FP8.

keras-hub is installed with `--no-deps` by the README's test command: its
`tensorflow-text` requirement would pull the full `tensorflow` package next
to `tensorflow-cpu`.
"""

import keras
import keras_hub
import numpy as np
import pytest

import keras_mp

VOCAB, SEQ, SAMPLES, BATCH = 128, 16, 160, 8  # 20 steps


def _gpt2():
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=2,
        hidden_dim=64,
        intermediate_dim=128,
        max_sequence_length=SEQ,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _gemma():
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=64,
        intermediate_dim=128,
        head_dim=32,
    )
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


# Each decoder's GEMMs: attention's four projections (EinsumDense) and the
# feed-forward block (Dense for GPT-2; a gated EinsumDense trio for Gemma).
MODELS = {
    "gpt2": (
        _gpt2,
        {
            "transformer_layer_0/self_attention/query",
            "transformer_layer_0/self_attention/key",
            "transformer_layer_0/self_attention/value",
            "transformer_layer_0/self_attention/attention_output",
            "transformer_layer_0/feedforward_intermediate_dense",
            "transformer_layer_0/feedforward_output_dense",
        },
    ),
    "gemma": (
        _gemma,
        {
            "decoder_block_0/attention/query",
            "decoder_block_0/attention/key",
            "decoder_block_0/attention/value",
            "decoder_block_0/attention/attention_output",
            "decoder_block_0/ffw_gating",
            "decoder_block_0/ffw_gating_2",
            "decoder_block_0/ffw_linear",
        },
    ),
}


def _data():
    """Arithmetic sequences of tokens (a step of 3): learnable in 20 steps."""
    rng = np.random.default_rng(0)
    start = rng.integers(0, VOCAB, (SAMPLES, 1))
    tokens = ((start + 3 * np.arange(SEQ + 1)) % VOCAB).astype("int32")
    x = {
        "token_ids": tokens[:, :-1],
        "padding_mask": np.ones((SAMPLES, SEQ), "bool"),
    }
    return x, tokens[:, 1:]


class _BatchLosses(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def _train(build, fp8):
    """The model after 20 steps, and its loss: the mean reported over the
    last 5 steps (each step's loss is the running mean Keras reports)."""
    keras_mp.set_global_policy("mixed_bfloat16", fp8=fp8)
    try:
        keras.utils.set_random_seed(0)
        model = build()
    finally:
        keras_mp.set_global_policy(None)
    x, y = _data()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    losses = _BatchLosses()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[losses],
    )
    assert len(losses.losses) == SAMPLES // BATCH
    return model, losses.losses[0], losses.losses[-1]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_keras_hub_decoder_trains_with_its_gemms_in_fp8(name):
    build, gemms = MODELS[name]
    model, first, last = _train(build, fp8=True)
    rows = keras_mp.explain_precision(model, print_fn=None)
    recipes = {row["layer"]: row["fp8"] for row in rows}
    in_fp8 = {
        layer for layer, fp8 in recipes.items() if fp8.startswith("current/")
    }
    assert in_fp8 == gemms
    # The tied embedding (a lookup, and the logits' GEMM) is left out, and
    # listed once though the task and its backbone both hold it.
    assert recipes["token_embedding"] == "embedding"
    assert [row["layer"] for row in rows].count("token_embedding") == 1
    _, bf16_first, bf16_last = _train(build, fp8=None)
    # The first step's loss is the untrained model's, ln(128) = 4.85.
    assert abs(first - bf16_first) < 0.01, (first, bf16_first)
    assert np.isfinite(last) and last < first * 0.75, (first, last)
    # Same seed: FP8's running loss within 0.1 nats of mixed_bfloat16's.
    assert abs(last - bf16_last) <= 0.1, (last, bf16_last)
