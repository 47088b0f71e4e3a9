"""How messages cross between ranks: a small pickled header and one flat byte tensor holding every tensor.

Pickling a message with tensors in it (``torch.distributed``'s object collectives) serialises each tensor's storage
on its own (a ``torch.save`` a tensor: 0.9 ms for one upload of the bench's small CNN, and as much again to read it
back on rank 0), so a rank's 25 uploads cost tens of milliseconds a round, about what their training costs (profile
in docs/performance.md, "Distributed backend"). Here a message is pickled with every dense tensor replaced by a
reference (its dtype, shape and place in one buffer: ``pickle``'s persistent ids), and the tensors' bytes are
copied once into one contiguous ``uint8`` tensor: each dtype's tensors back to back (a section, one ``torch.cat``),
each section starting at a multiple of 16 bytes, so that every tensor's view of the buffer is aligned. A message
(``send``/``recv``: the headers of its parts, a few KB, and their buffers) crosses as two point-to-point tensor
transfers of ``torch.distributed``, with no serialisation of the tensors at all; between ranks of one machine the
payload goes through shared memory instead and only its lengths cross (``shm``).

On the receiving side every tensor is a view of the received buffer (no copy), contiguous and on the CPU, holding
the very bits that were sent: what a pickled CPU copy held, so the numbers are unchanged. Views share their buffer
(as the vectorised engine's uploads share the stacks they leave), which lives as long as any of them: the client
state rank 0 writes into its store is copied there (a file's bytes, or the in-memory store's clone). Tensors that
are not plain dense ones (sparse, quantized, a subclass such as ``nn.Parameter``) are pickled as before, inside the
header.

``finite_sections`` checks every floating-point tensor of a buffer for non-finite values in one pass per dtype, so
that rank 0 can seal the uploads it received (``contract.FiniteSeal``) instead of reading each one again.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import shm

#: every tensor starts at a multiple of this many bytes of the buffer (the largest element size: complex128)
ALIGN = 16


def _plain(obj: Any) -> bool:
    """A tensor that travels in the buffer: a dense ``torch.Tensor`` (not a subclass, which is pickled as before),
    sent detached, as every tensor crossing ranks was (the shipped model state, the uploads)."""
    return type(obj) is torch.Tensor and obj.layout == torch.strided and not obj.is_quantized


class _Packer(pickle.Pickler):
    """Pickles a message with each plain tensor replaced by its index in ``tensors``."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.seen: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not _plain(obj):
            return None
        i = self.seen.get(id(obj))
        if i is None:
            i = self.seen[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return i


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]):
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self.tensors[pid]


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pack(obj: Any) -> tuple[bytes, torch.Tensor]:
    """``obj`` as (header, buffer): the header is picklable bytes (the message with tensor references, and where each
    tensor lies); the buffer a 1-d ``uint8`` CPU tensor with every tensor's bytes, grouped by dtype: each dtype's
    tensors back to back (a section), each section starting at a multiple of ``ALIGN`` bytes."""
    f = io.BytesIO()
    packer = _Packer(f)
    packer.dump(obj)
    tensors = packer.tensors
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    places: list[Any] = [None] * len(tensors)
    sections: dict[torch.dtype, tuple[int, int]] = {}
    offset = 0
    for dtype, group in by_dtype.items():
        offset = _padded(offset)
        start = offset
        for i in group:
            nbytes = tensors[i].numel() * tensors[i].element_size()
            places[i] = (dtype, tuple(tensors[i].shape), offset, nbytes)
            offset += nbytes
        sections[dtype] = (start, offset)
    buf = torch.empty(offset, dtype=torch.uint8)
    for dtype, group in by_dtype.items():
        start, end = sections[dtype]
        flat = [tensors[i].detach().reshape(-1) for i in group if tensors[i].numel()]
        if not flat:
            continue
        devices = {t.device for t in flat}
        section = buf[start:end].view(dtype)
        if devices == {section.device}:
            torch.cat(flat, out=section)
        elif len(devices) == 1:  # on one GPU: joined there, then one copy to the CPU
            section.copy_(torch.cat(flat))
        else:
            torch.cat([t.cpu() for t in flat], out=section)
    header = pickle.dumps((f.getvalue(), places, sections), protocol=pickle.HIGHEST_PROTOCOL)
    return header, buf


def unpack(header: bytes, buf: torch.Tensor) -> Any:
    """The message ``pack`` made ``(header, buf)`` of; its tensors are views of ``buf``."""
    body, places, _ = pickle.loads(header)
    tensors = [buf[start:start + nbytes].view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)
               for dtype, shape, start, nbytes in places]
    return _Unpacker(io.BytesIO(body), tensors).load()


def finite_sections(header: bytes, buf: torch.Tensor) -> bool:
    """Whether every floating-point or complex tensor in ``buf`` is finite: ``aggregate.all_finite`` (a sum per
    tensor, the exact check only when a sum is not finite) over each dtype's section as one tensor (the section's
    tensors lie back to back, so it reads exactly their values)."""
    from ..functional.aggregate import all_finite

    _, _, sections = pickle.loads(header)
    return all_finite({str(dtype): buf[start:end].view(dtype) for dtype, (start, end) in sections.items()})


#: the first of a message's two transfers: (length of its pickled headers, of its payload, the generation of the
#: shared-memory segment holding the payload or 0 when the payload follows over gloo); a length of STOP: no
#: message follows
STOP = -1


def send(parts: list[tuple[bytes, torch.Tensor]], dst: int, group: Any = None) -> None:
    """Send rank ``dst`` a message of packed parts: the lengths and the payload's place (three numbers), then
    the payload, the parts' headers (pickled together) followed by each part's buffer (each at a multiple of
    ``ALIGN``). Between ranks of one machine the payload is written into this direction's shared-memory segment
    (``shm``: the lengths carry its generation) and only the numbers cross gloo; otherwise both sends start at
    once (``isend``), so that the payload follows the lengths without a round trip between them. Either way the
    payload costs one more copy of the buffers (a memcpy: tens of microseconds a MB)."""
    offsets, end = [], 0
    for _, b in parts:  # (after the headers; each part at a multiple of ALIGN, so that its views stay aligned)
        offsets.append(end)
        end = _padded(end + b.numel())
    headers = pickle.dumps([(h, b.numel(), at) for (h, b), at in zip(parts, offsets)])
    start = _padded(len(headers))
    place = shm.writer(dist.get_rank(), dst).buffer(start + end) if shm.enabled() else None
    gen, payload = place or (0, torch.empty(start + end, dtype=torch.uint8))
    payload[:len(headers)] = torch.frombuffer(bytearray(headers), dtype=torch.uint8)
    for (_, b), at in zip(parts, offsets):
        payload[start + at:start + at + b.numel()] = b
    sizes = torch.tensor([len(headers), payload.numel(), gen], dtype=torch.int64)
    if gen:
        dist.send(sizes, dst, group)
        return
    for work in [dist.isend(sizes, dst, group), dist.isend(payload, dst, group)]:
        work.wait()


class Stop(NamedTuple):
    """What ``recv`` returns after ``send_stop``: no message follows; ``failed``: the run ended in an error."""

    failed: bool


def send_stop(dst: int, group: Any = None, failed: bool = False) -> None:
    """Tell rank ``dst`` that no message follows (``recv`` returns ``Stop(failed)``)."""
    dist.send(torch.tensor([STOP, int(failed), 0], dtype=torch.int64), dst, group)


def recv(src: int, group: Any = None) -> list[tuple[bytes, torch.Tensor]] | Stop:
    """The next message from rank ``src``, as its packed parts (``unpack`` each; the buffers are views of the
    payload), or a ``Stop`` after ``send_stop``."""
    sizes = torch.empty(3, dtype=torch.int64)
    dist.recv(sizes, src, group)
    n_headers, n_payload, gen = sizes.tolist()
    if n_headers == STOP:
        return Stop(bool(n_payload))
    if gen:  # in the sender's shared-memory segment (``shm``), copied out: the segment takes the next message
        try:
            payload = shm.reader(src, dist.get_rank()).read(gen, n_payload)
        except OSError as exc:  # (as a failed transfer: the rank is reported lost)
            raise RuntimeError(f"reading rank {src}'s message from shared memory: {exc}") from None
    else:
        payload = torch.empty(n_payload, dtype=torch.uint8)
        dist.recv(payload, src, group)
    start = _padded(n_headers)
    return [(header, payload[start + at:start + at + n])
            for header, n, at in pickle.loads(payload[:n_headers].numpy().tobytes())]
