"""How the kit's typed messages and tensors ride in Flower messages: the Flower counterpart of
nefl/protocol/wire.py, shared by the strategy (aggregator/flower.py) and the client app (edge_client/flower.py).

A Flower message carries a RecordDict. The kit's message (nefl/protocol/messages.py: FlowerJoin, FlowerHello,
FlowerTask, FlowerResult) rides as its strict JSON under one ConfigRecord key, and a submodel's weights
or delta as an ArrayRecord of float32 numpy arrays. Both directions are read as hostile: the message
through the one strict loader, the arrays against exactly the names, shapes and dtype the layout
expects (checked before the bytes are parsed), and finite. Every failure is a MessageError with a
reason code, so a handler counts it and goes on.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from nefl.nested.state import GlobalState, Layout
from nefl.nested.tensors import first_non_finite
from nefl.protocol.messages import MessageError, T

MESSAGE_KEY = "nefl"  # the ConfigRecord entry that holds the kit's message
CONFIG = "config"  # the RecordDict keys, as Flower's own strategies name them
ARRAYS = "arrays"
NPY_HEADER_MAX = 4096  # np.save's header for an array of any rank the kit has is far below this
DTYPE = "float32"


def records(msg: T, arrays: ArrayRecord | None = None) -> RecordDict:
    """The RecordDict of a Flower message carrying `msg` (and `arrays`)."""
    out = RecordDict({CONFIG: ConfigRecord({MESSAGE_KEY: msg.to_json()})})
    if arrays is not None:
        out[ARRAYS] = arrays
    return out


def read_message(content: RecordDict, cls: type[T]) -> T:
    """The kit message in `content`, through the strict loader."""
    record = content.config_records.get(CONFIG)
    payload = None if record is None else record.get(MESSAGE_KEY)
    if not isinstance(payload, bytes):
        raise MessageError("no_message", f"no {cls.__name__} under {CONFIG}/{MESSAGE_KEY}")
    return cls.from_json(payload)


def tensor_arrays(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({n: Array(t.detach().to(torch.float32).cpu().contiguous().numpy()) for n, t in tensors.items()})


def read_arrays(content: RecordDict, shapes: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Exactly the float32 tensors `shapes` names, finite, from `content`'s ArrayRecord."""
    record = content.array_records.get(ARRAYS)
    if record is None:
        raise MessageError("no_arrays", f"no ArrayRecord under {ARRAYS!r}")
    if set(record) != set(shapes):
        missing, extra = sorted(set(shapes) - set(record)), sorted(set(record) - set(shapes))
        raise MessageError("tensor_mismatch", f"missing {missing[:3]}, unexpected {extra[:3]}")
    out = {}
    for name, shape in shapes.items():
        out[name] = _tensor(name, record[name], tuple(shape))
    bad = first_non_finite(out)
    if bad is not None:
        raise MessageError("non_finite", f"{bad}: non-finite values")
    return out


def _tensor(name: str, a: Array, shape: tuple[int, ...]) -> torch.Tensor:
    """One array, its declared dtype, shape and size checked before np.load reads its bytes (never a pickle)."""
    size = int(np.prod(shape, dtype=np.int64)) * 4
    if a.stype != "numpy.ndarray" or a.dtype != DTYPE or tuple(a.shape) != shape \
            or not isinstance(a.data, bytes) or not size <= len(a.data) <= size + NPY_HEADER_MAX:
        raise MessageError("tensor_mismatch", f"{name}: want {DTYPE} {list(shape)}, got {a.dtype} {list(a.shape)} "
                                              f"({a.stype}, {len(a.data) if isinstance(a.data, bytes) else '?'} bytes)")
    try:
        nd = a.numpy()
    except Exception as e:  # np.load on hostile bytes: any failure is the sender's
        raise MessageError("bad_array", f"{name}: {str(e)[:120]}") from None
    if nd.dtype != np.float32 or nd.shape != shape:
        raise MessageError("tensor_mismatch", f"{name}: the bytes hold {nd.dtype} {list(nd.shape)}")
    return torch.from_numpy(np.array(nd, copy=True))


def flat_shapes(layout: Layout) -> dict[str, torch.Size]:
    """The names and shapes of `GlobalState.flat()` for this layout."""
    out = {f"c/{n}": s for n, s in layout.global_shapes.items() if n not in layout.inconsistent}
    for k, shapes in enumerate(layout.sub_shapes):
        out.update({f"ic/{k}/{n}": s for n, s in shapes.items() if n in layout.inconsistent})
    return out


def state_arrays(state: GlobalState) -> ArrayRecord:
    """The whole global state as Flower's model arrays (what `Strategy.start` carries between rounds)."""
    return tensor_arrays(state.flat())


def read_state(arrays: ArrayRecord, layout: Layout) -> GlobalState:
    return GlobalState.from_flat(read_arrays(RecordDict({ARRAYS: arrays}), flat_shapes(layout)), layout)

