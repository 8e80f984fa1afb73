"""Memory of a training step, where the backend exposes it.

Imports nothing from keras_mp.
"""

import keras


def train_step_memory(model, x, y):
    """What the compiled training step of a compiled `model` needs, in bytes.

    JAX only: XLA's `memory_analysis()` of the jitted stateless step (loss,
    gradients, `optimizer.stateless_apply`), with the state donated as
    Keras's trainer does. Returns `(peak, detail)` where `peak` is
    arguments + outputs + temporaries - aliased bytes, or `(None, reason)`
    on backends whose CPU runtime reports nothing comparable.
    """
    backend = keras.backend.backend()
    if backend != "jax":
        return None, (
            f"not measured: the {backend} backend exposes no per-step "
            "allocation figure on CPU"
        )
    import jax

    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)

    def step(trainable, non_trainable, optimizer_variables, x, y):
        def loss_of(trainable):
            y_pred, new_non_trainable = model.stateless_call(
                trainable, non_trainable, x, training=True
            )
            return model.compute_loss(x=x, y=y, y_pred=y_pred), (
                new_non_trainable
            )

        (loss, non_trainable), grads = jax.value_and_grad(
            loss_of, has_aux=True
        )(trainable)
        trainable, optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        return trainable, non_trainable, optimizer_variables, loss

    arguments = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
        x,
        y,
    )
    compiled = (
        jax.jit(step, donate_argnums=(0, 1, 2)).lower(*arguments).compile()
    )
    analysis = compiled.memory_analysis()
    peak = (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes
    )
    detail = (
        f"arguments {analysis.argument_size_in_bytes}, outputs "
        f"{analysis.output_size_in_bytes}, temporaries "
        f"{analysis.temp_size_in_bytes}, aliased "
        f"{analysis.alias_size_in_bytes}"
    )
    return peak, detail
