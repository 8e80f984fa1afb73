"""The optimizer rules keras_mp runs itself, each written once.

Keras's `update_step` is the rule wherever its bits can be kept (float32
and 16-bit state on JAX and TensorFlow). keras_mp runs a rule of its own in
two places, and both run the rules below:

- float8 state (`float8_state.Float8Adam`, through `keras.ops`): Keras's
  Adam reads each moment back after storing it, and stores `v` itself,
  where the float8 update divides by the float32 moments and stores
  `sqrt(v)`;
- PyTorch's fused update of 16-bit and float8 state
  (`backend/torch/fused_state_update.py`): the same arithmetic in place
  over batches of several variables, as each eager call costs host time.

A rule is written as a short program over four float32 registers with
in-place arithmetic (`add_`, `sub_`, `mul_`, `div_`, `sqrt_`), the
operations of Keras's `update_step` in its order, and a few steps that
touch the optimizer's tensors, given by the `lanes` that run it:

- `lanes.gradient(r)`: the gradient, in float32;
- `lanes.load(name, r)`: slot `name` in float32 (a slot stored as its
  square root, `Storage.roots`, is squared);
- `lanes.store(name, source, readback, scratch)`: stores `source`, and
  leaves in `readback` what `update_step` then reads from the slot;
- `lanes.maximum(r, other)`, `lanes.add_to_variable(r)`,
  `lanes.subtract_from_variable(r)`;
- `lanes.register()`: a fifth register, which only `KerasLanes` gives
  (Adam's amsgrad on a slot stored as its square root; the fused PyTorch
  update declines amsgrad on float8 state).

`KerasLanes` runs a rule on one variable with `keras.ops` (each in-place
step rebinds the register to a new tensor); the fused PyTorch update's
lanes run it on a batch of scratch buffers with torch's in-place calls.
The same program gives both paths their bits; the tests compare each path
with Keras's own update (16-bit state) or the NumPy oracle (float8).
"""

from keras import ops

# How many registers a rule may use (the fused PyTorch update's scratch
# buffers).
REGISTERS = 4


class Storage:
    """How a state format stores an optimizer's slots, as a rule sees it.

    Args:
        roots: Names of the slots stored as their square root (read back
            squared).
        stochastic: Names of the slots rounded stochastically (where the
            wrapper draws seeds), or None for every slot.
        reads_back: Whether the update reads a slot back after storing it
            (Keras's `update_step` on 16-bit state reads the rounded value);
            otherwise it goes on with the float32 value it stored.
    """

    def __init__(self, roots=(), stochastic=None, reads_back=True):
        self.roots = frozenset(roots)
        self._stochastic = None if stochastic is None else frozenset(stochastic)
        self.reads_back = reads_back

    def is_root(self, name):
        return name in self.roots

    def is_stochastic(self, name):
        return self._stochastic is None or name in self._stochastic

    def stochastic_stores(self, names):
        """How many of the stores of slots `names` draw a seed."""
        return sum(self.is_stochastic(name) for name in names)


class Adam:
    """Keras's `Adam.update_step` (AdamW's decay is applied before it)."""

    @staticmethod
    def slots(optimizer):
        """The slots `update_step` stores, in its order."""
        names = ["momentum", "velocity"]
        return names + ["velocity_hat"] if optimizer.amsgrad else names

    @staticmethod
    def constants(optimizer, learning_rate, scalar):
        """`alpha` as `update_step` computes it, and the hyperparameters
        (`scalar` turns a Python number into what the lanes multiply by)."""
        dtype = "float32"
        lr = ops.cast(learning_rate, dtype)
        local_step = ops.cast(optimizer.iterations + 1, dtype)
        beta_1_power = ops.power(ops.cast(optimizer.beta_1, dtype), local_step)
        beta_2_power = ops.power(ops.cast(optimizer.beta_2, dtype), local_step)
        return {
            "alpha": lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power),
            "one_minus_beta_1": scalar(1 - optimizer.beta_1),
            "one_minus_beta_2": scalar(1 - optimizer.beta_2),
            "epsilon": scalar(optimizer.epsilon),
            "amsgrad": optimizer.amsgrad,
        }

    @staticmethod
    def run(lanes, c):
        x, y, z, w = lanes.registers
        root = lanes.storage.is_root("velocity")
        # m += (g - m) * (1 - beta_1)
        lanes.load("momentum", x)
        lanes.gradient(y)
        y.sub_(x)
        y.mul_(c["one_minus_beta_1"])
        x.add_(y)
        lanes.store("momentum", x, readback=z, scratch=w)
        # v += (g * g - v) * (1 - beta_2)
        lanes.load("velocity", x)
        lanes.gradient(y)
        y.mul_(y)
        y.sub_(x)
        y.mul_(c["one_minus_beta_2"])
        x.add_(y)
        if c["amsgrad"] and root:
            # v_hat = maximum(v_hat, v), taken on `v` before its root is
            # stored: only `KerasLanes` run this (a fifth register).
            v_hat = lanes.register()
            lanes.load("velocity_hat", v_hat)
            lanes.maximum(v_hat, x)
        if root:
            # The slot holds sqrt(v), which the update divides by.
            x.sqrt_()
        lanes.store("velocity", x, readback=w, scratch=y)
        if c["amsgrad"]:
            if root:
                v_hat.sqrt_()
                lanes.store("velocity_hat", v_hat, readback=w, scratch=y)
            else:
                # v_hat = maximum(v_hat, v); v = v_hat
                lanes.load("velocity_hat", x)
                lanes.maximum(x, w)
                lanes.store("velocity_hat", x, readback=w, scratch=y)
        # variable -= m * alpha / (sqrt(v) + epsilon)
        z.mul_(c["alpha"])
        if not root:
            w.sqrt_()
        w.add_(c["epsilon"])
        z.div_(w)
        lanes.subtract_from_variable(z)


class SGD:
    """Keras's `SGD.update_step`."""

    @staticmethod
    def slots(optimizer):
        return ["momentum"] if optimizer.momentum != 0 else []

    @staticmethod
    def constants(optimizer, learning_rate, scalar):
        return {
            "lr": ops.cast(learning_rate, "float32"),
            "momentum": ops.cast(optimizer.momentum, "float32"),
            "with_momentum": optimizer.momentum != 0,
            "nesterov": optimizer.nesterov,
        }

    @staticmethod
    def run(lanes, c):
        x, y, z, w = lanes.registers
        lanes.gradient(y)
        y.mul_(c["lr"])
        if not c["with_momentum"]:
            # variable -= g * lr
            lanes.subtract_from_variable(y)
            return
        # m = m * momentum - g * lr
        lanes.load("momentum", x)
        x.mul_(c["momentum"])
        x.sub_(y)
        lanes.store("momentum", x, readback=z, scratch=w)
        if c["nesterov"]:
            # variable += m * momentum - g * lr
            z.mul_(c["momentum"])
            z.sub_(y)
        # else: variable += m
        lanes.add_to_variable(z)


class RMSprop:
    """Keras's `RMSprop.update_step`."""

    @staticmethod
    def slots(optimizer):
        names = ["velocity"]
        if optimizer.centered:
            names.append("average_gradient")
        if optimizer.momentum > 0:
            names.append("momentum")
        return names

    @staticmethod
    def constants(optimizer, learning_rate, scalar):
        return {
            "lr": ops.cast(learning_rate, "float32"),
            "rho": scalar(optimizer.rho),
            "one_minus_rho": scalar(1 - optimizer.rho),
            "epsilon": scalar(optimizer.epsilon),
            "centered": optimizer.centered,
            "momentum": scalar(optimizer.momentum),
            "with_momentum": optimizer.momentum > 0,
        }

    @staticmethod
    def run(lanes, c):
        x, y, z, w = lanes.registers
        # velocity = rho * velocity + (1 - rho) * g * g
        lanes.load("velocity", x)
        x.mul_(c["rho"])
        lanes.gradient(y)
        y.mul_(y)
        y.mul_(c["one_minus_rho"])
        x.add_(y)
        lanes.store("velocity", x, readback=z, scratch=w)
        if c["centered"]:
            # average = rho * average + (1 - rho) * g
            lanes.load("average_gradient", x)
            x.mul_(c["rho"])
            lanes.gradient(y)
            y.mul_(c["one_minus_rho"])
            x.add_(y)
            lanes.store("average_gradient", x, readback=w, scratch=y)
            # denominator = velocity - average * average + epsilon
            w.mul_(w)
            z.sub_(w)
        z.add_(c["epsilon"])
        # increment = lr * g / sqrt(denominator)
        z.sqrt_()
        lanes.gradient(y)
        y.mul_(c["lr"])
        y.div_(z)
        if c["with_momentum"]:
            # m = momentum * m + increment; variable -= m
            lanes.load("momentum", x)
            x.mul_(c["momentum"])
            x.add_(y)
            lanes.store("momentum", x, readback=z, scratch=w)
            y = z
        # variable -= increment (or m)
        lanes.subtract_from_variable(y)


# By the `kind` of `_keras_internals.torch_builtin_update_state`.
RULES = {"adam": Adam, "sgd": SGD, "rmsprop": RMSprop}


class _Register:
    """A `KerasLanes` register: its value a tensor, rebound by each step."""

    __slots__ = ("value",)

    def __init__(self, value=None):
        self.value = value

    def add_(self, other):
        self.value = ops.add(self.value, _value(other))

    def sub_(self, other):
        self.value = ops.subtract(self.value, _value(other))

    def mul_(self, other):
        self.value = ops.multiply(self.value, _value(other))

    def div_(self, other):
        self.value = ops.divide(self.value, _value(other))

    def sqrt_(self):
        self.value = ops.sqrt(self.value)


def _value(operand):
    return operand.value if isinstance(operand, _Register) else operand


class KerasLanes:
    """Runs a rule on one variable with `keras.ops` (see the module).

    Args:
        optimizer: The Keras optimizer being updated.
        slots: Its `state_slots.StateSlots` (reads, writes and seeds).
        storage: The format's `Storage`.
        gradient: The variable's gradient.
        variable: The variable (a reference variable of `slots`).
    """

    def __init__(self, optimizer, slots, storage, gradient, variable):
        self._optimizer = optimizer
        self._slots = slots
        self.storage = storage
        self._gradient = ops.cast(gradient, "float32")
        self._variable = variable
        self.registers = tuple(_Register() for _ in range(REGISTERS))

    @staticmethod
    def scalar(number):
        """A Python hyperparameter as the float32 tensor every backend (and
        the NumPy oracle) multiplies by."""
        return ops.cast(number, "float32")

    def register(self):
        return _Register()

    def gradient(self, register):
        register.value = self._gradient

    def load(self, name, register):
        value = self._slots.read(self._variable, name)
        register.value = value * value if self.storage.is_root(name) else value

    def store(self, name, source, readback, scratch):
        seed = (
            self._slots.next_seed()
            if self.storage.is_stochastic(name)
            else None
        )
        self._slots.write(self._variable, name, source.value, seed)
        readback.value = (
            self._slots.read(self._variable, name)
            if self.storage.reads_back
            else source.value
        )

    def maximum(self, register, other):
        register.value = ops.maximum(register.value, other.value)

    def add_to_variable(self, register):
        variable = self._variable
        self._optimizer.assign_add(
            variable, ops.cast(register.value, variable.dtype)
        )

    def subtract_from_variable(self, register):
        variable = self._variable
        self._optimizer.assign_sub(
            variable, ops.cast(register.value, variable.dtype)
        )


def keras_update(rule, optimizer, slots, storage, gradient, variable, lr):
    """One variable's update by `rule`, with `keras.ops` (`KerasLanes`)."""
    lanes = KerasLanes(optimizer, slots, storage, gradient, variable)
    rule.run(lanes, rule.constants(optimizer, lr, lanes.scalar))
