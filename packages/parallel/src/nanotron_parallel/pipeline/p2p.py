"""Point-to-point transfers between neighbouring pipeline stages.

A tensor travels as its payload (raw bytes), preceded by a fixed-size int64 header (ndim,
dtype, requires_grad, shape) the first time a link carries that kind of message. Every dtype
(bool and bfloat16 included) crosses gloo and NCCL alike, because the wire only ever carries
int64 and uint8 tensors.

Shapes are agreed once, not sent every time: the receiver must read a header on the host
before it can allocate the payload buffer, a device-to-host sync on a GPU. So each message
carries a `key` both ends compute alike (the schedules use the message kind and the
micro-batch's tensor shapes, which every stage holds). The first message of a key on a link
sends its header and both ends remember the shape in `agreed` (a dict kept with the stage
module, `agreed_shapes(stage)`: another model, e.g. another tp mode, agrees anew); later
messages with that key send the payload only. A new key (a
micro-batch of another shape) negotiates again. A sender whose tensor no longer has the
agreed shape for its key raises P2PError instead of sending bytes the peer cannot read.
`key=None` always negotiates (direct `exchange` calls, tests).

`exchange_many` posts all of one call's headers together with `dist.batch_isend_irecv`, then
all the payloads. Two neighbours calling it at the same time with mirrored arguments (one
sends forward and receives backward, the other the reverse) never deadlock. A call that both
sends and receives must be matched by such a mirrored call on the peer, which is what the
1F1B schedule does (see schedules.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from nanotron_parallel.context import collective_device
from nanotron_parallel.phase_timer import comm_span

if TYPE_CHECKING:
    from nanotron_parallel.context import ParallelContext

# The order is part of the wire format: a dtype is sent as its index in this tuple.
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_MAX_NDIM = 12
_HEADER_LEN = 3 + _MAX_NDIM  # ndim, dtype code, requires_grad, shape padded with zeros


class P2PError(ValueError):
    """A tensor that cannot be sent (unsupported dtype, too many dimensions)."""


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    def to_header(self, device: torch.device) -> torch.Tensor:
        if self.dtype not in _DTYPES:
            raise P2PError(f"cannot send a tensor of dtype {self.dtype}: supported {_DTYPES}")
        if len(self.shape) > _MAX_NDIM:
            raise P2PError(f"cannot send a tensor with {len(self.shape)} dims (max {_MAX_NDIM})")
        values = [len(self.shape), _DTYPES.index(self.dtype), int(self.requires_grad)]
        values += list(self.shape) + [0] * (_MAX_NDIM - len(self.shape))
        return torch.tensor(values, dtype=torch.int64, device=device)

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(t.shape), t.dtype, t.requires_grad)

    @staticmethod
    def from_header(header: torch.Tensor) -> TensorMeta:
        values = header.tolist()  # a host sync on a GPU: once per key and link
        ndim = values[0]
        return TensorMeta(tuple(values[3 : 3 + ndim]), _DTYPES[values[1]], bool(values[2]))

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the tensor's data (a contiguous copy first if needed)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _from_bytes(buffer: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    out = buffer.view(meta.dtype) if meta.dtype != torch.uint8 else buffer
    out = out.reshape(meta.shape)
    if meta.requires_grad and out.is_floating_point():
        out.requires_grad_(True)
    return out


Agreed = dict[tuple[str, int, Hashable], TensorMeta]


def agreed_shapes(stage: nn.Module) -> Agreed:
    """The p2p shapes `stage` has agreed with its neighbours, kept with the module so that
    they live as long as the model (every step reuses them)."""
    return stage.__dict__.setdefault(_AGREED_ATTR, {})


_AGREED_ATTR = "_nanotron_p2p_agreed"


def _run_batch(ops: list[dist.P2POp]) -> None:
    if ops:
        with comm_span("pp_wait"):  # telemetry: the stage's time waiting on its neighbours
            for work in dist.batch_isend_irecv(ops):
                work.wait()


def exchange_many(
    sends: Sequence[tuple[torch.Tensor, int, Hashable]],
    recvs: Sequence[tuple[int, Hashable]],
    group: dist.ProcessGroup | None,
    device: torch.device,
    agreed: Agreed | None = None,
) -> list[torch.Tensor]:
    """Post sends `(tensor, global dst, key)` and receives `(global src, key)` together; return
    the received tensors in the order of `recvs`. Two messages between the same pair are
    matched by their order, so callers list them in the same order on both sides. Shapes of
    keys in `agreed` are not sent again (see the module docstring)."""
    agreed = {} if agreed is None else agreed
    header_ops: list[dist.P2POp] = []
    for t, dst, key in sends:
        meta = TensorMeta.of(t)
        known = agreed.get(("send", dst, key)) if key is not None else None
        if known is None:
            header_ops.append(dist.P2POp(dist.isend, meta.to_header(t.device), dst, group))
            if key is not None:
                agreed["send", dst, key] = meta
        elif known != meta:
            raise P2PError(
                f"tensor {meta} for rank {dst} differs from the shape agreed for key {key!r} "
                f"({known}); a message whose shape changes needs a new key"
            )
    metas: list[TensorMeta | None] = []
    headers: list[tuple[int, torch.Tensor]] = []
    for i, (src, key) in enumerate(recvs):
        known = agreed.get(("recv", src, key)) if key is not None else None
        if known is None:
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=device)
            header_ops.append(dist.P2POp(dist.irecv, header, src, group))
            headers.append((i, header))
        metas.append(known)
    if header_ops:
        with record_function("pp.p2p.headers"):
            _run_batch(header_ops)
    for i, header in headers:
        meta = TensorMeta.from_header(header)
        src, key = recvs[i]
        metas[i] = meta
        if key is not None:
            agreed["recv", src, key] = meta
    buffers = [torch.empty(m.nbytes, dtype=torch.uint8, device=device) for m in metas]  # type: ignore[union-attr]
    ops = [dist.P2POp(dist.isend, _as_bytes(t), dst, group) for t, dst, _ in sends]
    ops += [dist.P2POp(dist.irecv, b, src, group) for b, (src, _) in zip(buffers, recvs)]
    with record_function(f"pp.p2p.payloads sends={len(sends)} recvs={len(recvs)}"):
        _run_batch(ops)
    return [_from_bytes(b, m) for b, m in zip(buffers, metas)]  # type: ignore[arg-type]


def exchange(
    send: torch.Tensor | None = None,
    dst: int | None = None,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    send_key: Hashable = None,
    recv_key: Hashable = None,
    agreed: Agreed | None = None,
) -> torch.Tensor | None:
    """Send `send` to global rank `dst` and/or receive one tensor from global rank `src`.

    Returns the received tensor (None when `src` is None). Sends and receives of one call are
    posted together, so a mirrored call on the peer completes without deadlock.
    """
    if (send is None) != (dst is None):
        raise P2PError("exchange needs both a tensor and a destination, or neither")
    device = device or (send.device if send is not None else collective_device(group))
    sends = [] if send is None else [(send, dst, send_key)]
    recvs = [] if src is None else [(src, recv_key)]
    got = exchange_many(sends, recvs, group, device, agreed)  # type: ignore[arg-type]
    return got[0] if got else None


def send_tensor(t: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send one tensor (any shape, supported dtype, contiguous or not) to global rank `dst`."""
    exchange(send=t, dst=dst, group=group)


def recv_tensor(
    src: int, group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """Receive one tensor sent by `send_tensor` from global rank `src`."""
    out = exchange(src=src, group=group, device=device)
    assert out is not None
    return out


@dataclass
class StageComm:
    """The four directions one pipeline stage talks in, for the schedules.

    `prev` and `next` are the global ranks of the neighbouring stages (None at the ends); the
    calls that involve a missing neighbour do nothing and return None. Each call takes the
    keys of its messages (see the module docstring); `agreed` outlives the step.
    """

    prev: int | None
    next: int | None
    group: dist.ProcessGroup | None
    device: torch.device
    stage: int = 0  # this pp rank, for the profiler's range names
    agreed: Agreed | None = None

    @staticmethod
    def from_context(pc: ParallelContext, agreed: Agreed | None = None) -> StageComm:
        return StageComm(
            pc.prev_stage_rank, pc.next_stage_rank, pc.pp_group, pc.device, pc.pp_rank, agreed
        )

    def _exchange(
        self,
        send: torch.Tensor | None,
        dst: int | None,
        src: int | None,
        send_key: Hashable = None,
        recv_key: Hashable = None,
    ) -> torch.Tensor | None:
        if dst is None:
            send = None  # the last stage sends no activation, the first no input gradient
        elif send is None:
            raise P2PError(f"nothing to send to stage rank {dst}, which waits for a tensor")
        if send is None and src is None:
            return None
        with record_function("pp.p2p"):
            return exchange(
                send, dst, src, self.group, self.device, send_key, recv_key, self.agreed
            )

    def recv_forward(self, key: Hashable = None) -> torch.Tensor | None:
        return self._exchange(None, None, self.prev, recv_key=_kind(FORWARD, key))

    def send_forward(self, y: torch.Tensor, key: Hashable = None) -> None:
        self._exchange(y, self.next, None, send_key=_kind(FORWARD, key))

    def recv_backward(self, key: Hashable = None) -> torch.Tensor | None:
        return self._exchange(None, None, self.next, recv_key=_kind(BACKWARD, key))

    def send_backward(self, grad_x: torch.Tensor | None, key: Hashable = None) -> None:
        self._exchange(grad_x, self.prev, None, send_key=_kind(BACKWARD, key))

    def send_forward_recv_backward(
        self, y: torch.Tensor, key: Hashable = None, recv_key: Hashable = None
    ) -> torch.Tensor | None:
        keys = _kind(FORWARD, key), _kind(BACKWARD, recv_key)
        return self._exchange(y, self.next, self.next, *keys)

    def send_backward_recv_forward(
        self, grad_x: torch.Tensor | None, key: Hashable = None, recv_key: Hashable = None
    ) -> torch.Tensor | None:
        keys = _kind(BACKWARD, key), _kind(FORWARD, recv_key)
        return self._exchange(grad_x, self.prev, self.prev, *keys)


FORWARD, BACKWARD = "F", "B"  # activations travel forward, their gradients backward


def _kind(kind: str, key: Hashable) -> Hashable:
    return None if key is None else (kind, key)
