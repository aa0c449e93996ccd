"""Point-to-point transfers between neighbouring pipeline stages.

Every tensor travels as two messages: a fixed-size int64 header (ndim, dtype, requires_grad,
shape) and the payload as raw bytes. The receiver therefore needs no prior knowledge of the
shape or dtype, and every dtype (bool and bfloat16 included) crosses gloo and NCCL alike,
because the wire only ever carries int64 and uint8 tensors.

`exchange` posts all of one call's sends and receives together with `dist.batch_isend_irecv`,
header first and payload second. Two neighbours calling it at the same time with mirrored
arguments (one sends forward and receives backward, the other the reverse) never deadlock.
A call that both sends and receives must be matched by such a mirrored call on the peer,
which is what the 1F1B schedule does (see schedules.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.profiler import record_function

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
    def from_header(header: torch.Tensor) -> TensorMeta:
        values = header.tolist()
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


def default_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where received tensors live: the current CUDA device under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _run_batch(ops: list[dist.P2POp]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def exchange(
    send: torch.Tensor | None = None,
    dst: int | None = None,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> torch.Tensor | None:
    """Send `send` to global rank `dst` and/or receive one tensor from global rank `src`.

    Returns the received tensor (None when `src` is None). Sends and receives of one call are
    posted together, so a mirrored call on the peer completes without deadlock.
    """
    if (send is None) != (dst is None):
        raise P2PError("exchange needs both a tensor and a destination, or neither")
    device = device or (send.device if send is not None else default_device(group))
    recv_header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=device)
    ops: list[dist.P2POp] = []
    if send is not None:
        meta = TensorMeta(tuple(send.shape), send.dtype, send.requires_grad)
        ops.append(dist.P2POp(dist.isend, meta.to_header(send.device), dst, group))
    if src is not None:
        ops.append(dist.P2POp(dist.irecv, recv_header, src, group))
    _run_batch(ops)

    ops = []
    recv_buffer = None
    if send is not None:
        ops.append(dist.P2POp(dist.isend, _as_bytes(send), dst, group))
    if src is not None:
        recv_meta = TensorMeta.from_header(recv_header.cpu())
        recv_buffer = torch.empty(recv_meta.nbytes, dtype=torch.uint8, device=device)
        ops.append(dist.P2POp(dist.irecv, recv_buffer, src, group))
    _run_batch(ops)
    return None if recv_buffer is None else _from_bytes(recv_buffer, recv_meta)


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
    calls that involve a missing neighbour do nothing and return None.
    """

    prev: int | None
    next: int | None
    group: dist.ProcessGroup | None
    device: torch.device
    stage: int = 0  # this pp rank, for the profiler's range names

    @staticmethod
    def from_context(pc: ParallelContext) -> StageComm:
        if pc.pp_size > 1 and pc.backend == "nccl":
            # NCCL needs every rank of a group in its first collective before batched p2p
            # between a subset of them; one tiny all-reduce per step makes sure of it.
            dist.all_reduce(torch.zeros(1, device=pc.device), group=pc.pp_group)
        return StageComm(pc.prev_stage_rank, pc.next_stage_rank, pc.pp_group, pc.device, pc.pp_rank)

    def _exchange(
        self, send: torch.Tensor | None, dst: int | None, src: int | None
    ) -> torch.Tensor | None:
        if dst is None:
            send = None  # the last stage sends no activation, the first no input gradient
        elif send is None:
            raise P2PError(f"nothing to send to stage rank {dst}, which waits for a tensor")
        if send is None and src is None:
            return None
        with record_function("pp.p2p"):
            return exchange(send, dst, src, self.group, self.device)

    def recv_forward(self) -> torch.Tensor | None:
        return self._exchange(None, None, self.prev)

    def send_forward(self, y: torch.Tensor) -> None:
        self._exchange(y, self.next, None)

    def recv_backward(self) -> torch.Tensor | None:
        return self._exchange(None, None, self.next)

    def send_backward(self, grad_x: torch.Tensor | None) -> None:
        self._exchange(grad_x, self.prev, None)

    def send_forward_recv_backward(self, y: torch.Tensor) -> torch.Tensor | None:
        return self._exchange(y, self.next, self.next)

    def send_backward_recv_forward(self, grad_x: torch.Tensor | None) -> torch.Tensor | None:
        return self._exchange(grad_x, self.prev, self.prev)
