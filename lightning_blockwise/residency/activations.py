"""Layer-input offload: what each rematerialized layer saves for its backward, kept in pinned host memory."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from lightning_blockwise.residency.arena import HostArena
from lightning_blockwise.residency.saved_inputs import OffloadStats, SavedInput

# NOTE [ Layer-input offload ]
# Between its forward and its backward a rematerialized layer keeps one tensor: its input
# (NOTE [ Exact rematerialization ] in replay/remat.py). At long context these inputs are
# the bulk of a step's device memory (layers x tokens x hidden x 2 B: 21.5 GB at 72B and
# 16k tokens). With offload on, the forward copies each input into a host slab on a
# device-to-host stream right behind the kernels that produced it, and the device tensor
# is freed as soon as that copy has read it (``record_stream``). The backward runs the
# layers in reverse: taking layer i's input back starts the host-to-device copy of the
# input saved just before it (layer i-1's), which then overlaps layer i's recompute and
# backward. The copies move bytes unchanged, so the recompute sees the very input the
# forward saw and the run stays bit-identical.
#
# Ordering: a save's device-to-host copy waits for the compute stream (the input is
# written), its host-to-device copy waits for that copy's event, and the compute stream
# waits for the host-to-device event before the input is read. A slab goes back to the
# pool once its input has been taken back, behind the compute stream's wait; the next
# save into it waits for the compute stream again, so it cannot overwrite bytes still in
# flight. The device buffer of a fetched input is allocated on the compute stream, so the
# host-to-device copy first waits for the work queued there (the caching allocator may hand
# out memory that queued kernels still use: it orders reuse by the compute stream alone), and
# the input is read only after the compute stream waited for the copy: no record_stream.
#
# Both copies follow one pattern (``_copy``): the side stream waits for the compute stream's
# queued work and for one more event, copies, and records an event the reader waits on. The
# events are taken from a free list and given back once every wait on them has been issued
# (NOTE [ Reused events ] in residency/streamer.py), so a step creates no CUDA events.
#
# Bookkeeping is O(1) per layer: the inputs still held form a stack in save order, and the
# backward takes them from the top. An input fetched or taken back out of order is only
# marked; it leaves the stack when it reaches the top, or when the stack is pruned of dead
# and taken handles once it has grown to twice its size after the last pruning.
#
# Inputs that are not contiguous stay on the device (a contiguous copy could change the
# kernels the recompute picks); ``stats.kept_on_device`` counts them.
#
# NOTE [ Split layer inputs ]
# Host RAM can bind before the card does (the 72B shape at 64k tokens saves 86 GB of inputs beside a
# 36 GB arena), so the inputs may be split: those of the first ``m`` layers go to host slabs
# (``save``), the rest stay on the device (``keep``), and only ``m`` slabs are allocated. The first
# layers, not the last, go to the host because the two passes meet at the top of the stack: the
# forward saves the first layers' inputs earliest, so their device-to-host copies have the rest of
# the forward, the head and the loss to finish behind; the backward starts with the layers whose
# inputs never left the device, so nothing waits for a copy back at the turn (offloading the last
# layers would copy an input out and at once back in), and the host inputs come back last, when
# the device inputs above them have been freed. Kept inputs sit on the same stack as the offloaded
# ones: taking back the lowest kept input (layer ``m``'s) starts the copy back of layer ``m - 1``'s,
# one layer ahead as everywhere else. A kept input is checked, when it is taken back, for in-place
# changes since the forward, as autograd checks a tensor saved with ``save_for_backward``.


class ActivationOffload:
    """Saves layer inputs into exact-size pinned host slabs and brings them back ahead of the backward.

    See NOTE [ Layer-input offload ]. Slabs come from :class:`~lightning_blockwise.residency.arena.HostArena`
    allocations of ``num_layers`` slabs each, so host memory is exact-size, page-locked on CUDA,
    and refused before allocation when the host RAM is short.

    Inputs may also be kept on the device (:meth:`keep`, NOTE [ Split layer inputs ]): they take no slab
    and wait on the same stack, so the backward's prefetch runs across both.

    Args:
        device: The compute device.
        num_layers: Layer inputs a step saves in host memory (slabs allocated at a time).
        slab_bytes: Bytes of one slab: the largest input to expect (tokens x hidden x element size).
        pin: Page-lock the slabs (a CUDA device).
    """

    def __init__(self, device: torch.device, num_layers: int, slab_bytes: int, pin: bool) -> None:
        self.device = device
        self.num_layers = num_layers
        self.pin = pin
        self._arenas: list[HostArena] = []
        self._free: list[Tensor] = []
        self._taken = 0
        # The inputs saved and not yet fetched, in save order (NOTE [ Layer-input offload ]: a stack).
        self._live: list[weakref.ref[SavedInput]] = []
        self._prune_at = num_layers
        self._cuda = device.type == "cuda"
        self._to_host = torch.cuda.Stream(device) if self._cuda else None
        self._to_device = torch.cuda.Stream(device) if self._cuda else None
        # NOTE [ Reused events ] in residency/streamer.py: events whose waits have all been issued.
        self._events: list[torch.cuda.Event] = []
        self.slab_bytes = 0
        self.stats = OffloadStats()
        self.reserve(slab_bytes)

    @property
    def host_bytes(self) -> int:
        """Host bytes the slabs take (page-locked on CUDA)."""
        return sum(arena.nbytes for arena in self._arenas)

    def reserve(self, slab_bytes: int) -> None:
        """Make slabs of at least ``slab_bytes`` the ones handed out (allocating ``num_layers`` new ones if needed).

        Raises:
            MisconfigurationException: If the host RAM cannot hold them (from ``HostArena``).
        """
        if slab_bytes <= self.slab_bytes:
            return
        arena = self._arena(slab_bytes)
        if self._taken == 0:
            # Between steps (where the strategy re-plans): nothing reads the smaller slabs any more.
            if self._cuda:
                torch.cuda.synchronize(self.device)
            self._arenas.clear()
        # Otherwise the smaller slabs stay allocated until `close` (copies may still read them), never reused.
        self._free = list(arena.slabs)
        self._arenas.append(arena)
        self.slab_bytes = slab_bytes

    def held(self) -> list[Tensor]:
        """The host copies of the inputs saved and not yet brought back, oldest first."""
        saved = [ref() for ref in self._live]
        return [s.host for s in saved if s is not None and s.pending and s.host is not None]

    def reset_stats(self) -> OffloadStats:
        """Return the traffic counters and start new ones."""
        stats, self.stats = self.stats, OffloadStats()
        return stats

    def keep(self, hidden: Tensor) -> SavedInput:
        """Keep ``hidden`` on the device for the backward, on the stack of saved inputs.

        See NOTE [ Split layer inputs ].
        """
        self.stats.kept_on_device += 1
        saved = SavedInput(self, None, None, hidden)
        self._push(saved)
        return saved

    def save(self, hidden: Tensor) -> SavedInput:
        """Start copying ``hidden`` to host memory; the caller drops its own reference to it."""
        if not hidden.is_contiguous():
            return self.keep(hidden)
        nbytes = hidden.numel() * hidden.element_size()
        if nbytes > self.slab_bytes:
            self.reserve(nbytes)
        slab = self._free.pop() if self._free else self._grow()
        self._taken += 1
        host = slab[:nbytes].view(hidden.dtype).view(hidden.shape)
        saved = SavedInput(self, slab, host, None)
        # A slab given back by a graph dropped mid-backward may still be read by its prefetch.
        saved._stored = self._copy(self._to_host, host, hidden, after=self._to_device)
        if self._cuda:
            # The caching allocator must not hand `hidden`'s memory out before the copy has read it.
            hidden.record_stream(self._to_host)
        self._push(saved)
        self.stats.saved += 1
        self.stats.device_to_host_bytes += nbytes
        return saved

    def _push(self, saved: SavedInput) -> None:
        if len(self._live) >= self._prune_at:
            # Handles of graphs dropped without their backward, or taken out of order.
            self._live = [ref for ref in self._live if (held := ref()) is not None and held.waiting]
            self._prune_at = max(self.num_layers, 2 * len(self._live))
        self._live.append(weakref.ref(saved))

    def load(self, saved: SavedInput) -> Tensor:
        """The saved input on the device; starts bringing back the input saved before it.

        Raises:
            RuntimeError: If an input kept on the device was modified in place since it was saved.
        """
        if saved._device is not None:
            hidden, saved._device = saved._device, None
            if hidden._version != saved._version:
                raise RuntimeError(
                    f"BlockwiseStrategy: a layer input kept on the device for the backward was modified in place"
                    f" after the forward (version {saved._version}, now {hidden._version}); the recompute would read"
                    " other values than the forward did. Do not modify decoder hidden states in place."
                )
        else:
            hidden = self._take_back(saved)
        # NOTE [ Layer-input offload ]: the backward runs the layers in reverse, so the input saved last
        # among those still waiting is the next one needed: brought back now if it is in host memory, taken
        # as it is if it was kept on the device (its own load goes on from there: NOTE [ Split layer inputs ]).
        while self._live:
            following = self._live[-1]()
            if following is not None and following.waiting:
                if following.pending:
                    self._fetch(following)
                break
            self._live.pop()
        return hidden

    def _take_back(self, saved: SavedInput) -> Tensor:
        """The input of a host slab on the device, its slab given back."""
        if saved._fetched is None:
            self._fetch(saved)
        hidden, event = saved._fetched, saved._fetched_event
        assert hidden is not None
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        # Every wait on both events is issued now (NOTE [ Reused events ]).
        stored, saved._stored = saved._stored, None
        saved._fetched, saved._fetched_event, saved._host = None, None, None
        if saved._slab is not None:
            self._give(saved._slab, stored, event)
            saved._slab = None
        return hidden

    def close(self) -> None:
        """Wait for pending copies and free the host slabs."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self._live.clear()
        self._prune_at = self.num_layers
        self._free.clear()
        self._arenas.clear()
        self._events.clear()
        self._taken = 0
        self.slab_bytes = 0

    def _fetch(self, saved: SavedInput) -> None:
        if self._live and self._live[-1]() is saved:
            # The usual case; one fetched out of order stays marked on the stack (NOTE [ Layer-input offload ]).
            self._live.pop()
        host = saved._host
        assert host is not None
        device = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        # The buffer is the compute stream's: `_copy` waits for the kernels queued there (they may use its memory).
        saved._fetched_event = self._copy(self._to_device, device, host, after=saved._stored)
        saved._fetched = device
        self.stats.host_to_device_bytes += host.numel() * host.element_size()

    def _copy(
        self,
        stream: torch.cuda.Stream | None,
        dst: Tensor,
        src: Tensor,
        after: torch.cuda.Event | torch.cuda.Stream | None,
    ) -> torch.cuda.Event | None:
        """Copy ``src`` into ``dst`` on ``stream`` behind the compute stream's queued work and ``after``.

        Returns the event recorded behind the copy (``None`` on the CPU, where the copy is synchronous).
        See NOTE [ Layer-input offload ] for why each copy waits for what it waits for.
        """
        if stream is None:
            dst.copy_(src)
            return None
        # One event for both waits: each is issued right after its record (NOTE [ Reused events ]).
        ready = self._event()
        ready.record(torch.cuda.current_stream(self.device))
        stream.wait_event(ready)
        if isinstance(after, torch.cuda.Stream):
            ready.record(after)
            stream.wait_event(ready)
        elif after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        self._events.append(ready)
        done = self._event()
        done.record(stream)
        return done

    def _event(self) -> torch.cuda.Event:
        return self._events.pop() if self._events else torch.cuda.Event()

    def _grow(self) -> Tensor:
        """One more set of slabs, when more inputs are held at once than a step of ``num_layers`` saves."""
        arena = self._arena(self.slab_bytes)
        self._arenas.append(arena)
        self._free.extend(arena.slabs[1:])
        return arena.slabs[0]

    def _arena(self, slab_bytes: int) -> HostArena:
        return HostArena(
            [slab_bytes] * self.num_layers,
            pin=self.pin,
            purpose=f"the layer inputs offloaded between forward and backward ({self.num_layers} x {slab_bytes} bytes)",
            fix="train on fewer tokens per micro-batch, or keep them on the GPU (`offload_activations=False`)",
        )

    def _give(self, slab: Tensor, *events: torch.cuda.Event | None) -> None:
        """Take back a slab, and the events of its copies (NOTE [ Reused events ])."""
        self._taken = max(0, self._taken - 1)
        if self._arenas and slab.numel() >= self.slab_bytes:
            self._free.append(slab)
        self._events.extend(event for event in events if event is not None)


__all__ = ["ActivationOffload"]
