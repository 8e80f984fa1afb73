"""The batches of torch's fused 16-bit state update.

`Layout` cuts the variables of one update into batches of cache-sized
scratch buffers (a large variable into segments, small ones sharing a
batch); `Batch` holds one batch's views of those buffers;
`hash32_in_place` is the counter hash of stochastic rounding on int32
tensors, in place (also `float8_codes.py`'s). torch is imported
inside the functions, as the module loads on every backend.
"""


def hash32_in_place(x, temporary, low_bits_only=False):
    """`keras_mp._random_bits.hash32` of int32 `x`, in place (its logical
    right shifts made by masking), with an int32 scratch `temporary` of
    `x`'s shape. The stochastic rounding of both fused updates hashes with
    it: float8 state (`float8_codes.py`) keeps 24 of its bits, 16-bit state
    only the low 16, and passes `low_bits_only` to skip the last mask (the
    last shift then an arithmetic one, which differs in the high bits only:
    one operation less a batch)."""
    import torch

    for shift, multiplier in ((16, 0x7FEB352D), (15, -2073254261), (16, None)):
        torch.bitwise_right_shift(x, shift, out=temporary)
        if multiplier is not None or not low_bits_only:
            temporary.bitwise_and_((1 << (32 - shift)) - 1)
        x.bitwise_xor_(temporary)
        if multiplier is not None:
            x.mul_(multiplier)


class Layout:
    """How the variables of one update split into batches of the scratch
    buffers: a variable larger than a batch is cut into segments, and
    consecutive small variables share one batch unless `shared` is False
    (float8 state: each batch then holds one segment, whose blocks of 128
    are whole where `batch_elements` is a multiple of 128)."""

    def __init__(self, sizes, batch_elements, device=None, shared=True):
        import torch

        self.device = device
        self.variables = len(sizes)
        self.batches = []
        segment_variables, segment_shifts = [], []
        current, used = [], 0
        for index, size in enumerate(sizes):
            if used and not shared:
                self.batches.append(current)
                current, used = [], 0
            start = 0
            while start < size:
                if used == batch_elements:
                    self.batches.append(current)
                    current, used = [], 0
                stop = min(size, start + batch_elements - used)
                current.append((index, start, stop, used))
                segment_variables.append(index)
                # Index buffer value at the segment's first element (its
                # offset `used`) + shift = the element's index `start`.
                segment_shifts.append(start - used)
                used += stop - start
                start = stop
        if current:
            self.batches.append(current)
        self.largest_batch = max(
            [sum(b - a for _, a, b, _ in batch) for batch in self.batches],
            default=0,
        )
        self.segment_variables = torch.tensor(
            segment_variables, dtype=torch.int64, device=device
        )
        self.segment_shifts = torch.tensor(
            segment_shifts, dtype=torch.int32, device=device
        )
        first = 0
        batches = []
        for batch in self.batches:
            batches.append(Batch(batch, first))
            first += len(batch)
        self.batches = batches

    def bind(self, buffers):
        for batch in self.batches:
            batch.bind(buffers)


class Batch:
    """One batch: its segments `(variable, start, stop)`, and its views of
    the scratch buffers (whole, and one per segment)."""

    def __init__(self, segments, first):
        self.segments = [(i, a, b) for i, a, b, _ in segments]
        self._offsets = [
            (offset, offset + b - a) for _, a, b, offset in segments
        ]
        self.size = sum(b - a for _, a, b, _ in segments)
        self.first = first
        self.last = first + len(segments)

    def bind(self, buffers):
        size = self.size
        self.buffers = [buffer[:size] for buffer in buffers["float"]]
        self.index = buffers["index"][:size]
        self._views = {
            id(buffer): [buffer[a:b] for a, b in self._offsets]
            for buffer in self.buffers
        }
        self._ints = {
            id(buffer): buffer.view(_int32()) for buffer in self.buffers
        }
        self._int_views = {
            id(buffer): [
                view.view(_int32()) for view in self._views[id(buffer)]
            ]
            for buffer in self.buffers
        }

    def views(self, buffer):
        return self._views[id(buffer)]

    def ints(self, buffer):
        return self._ints[id(buffer)]

    def int_views(self, buffer):
        return self._int_views[id(buffer)]


def _int32():
    import torch

    return torch.int32
