"""Which cells may run at the same time, and on which GPUs.

Pure bookkeeping: no processes, no NVML. A `SlotPool` is built from an inventory taken once at start and
hands out `Lease`s; the runner decides when to ask and what to do with a lease.

Two engines on one GPU are only reliable with absolute memory caps (KV bytes or tokens): memory
*fractions* race, and engines that start at the same time each count the other's memory as free. Hence:

* without ``pack`` a GPU holds one cell, which is always safe;
* with ``pack`` a GPU holds several cells while the sum of their estimated demands plus a fixed headroom
  fits in the memory that was free on it at start; a cell without a KV bound sizes its cache from
  whatever it finds free, so it gets its GPU to itself (``Demand.exclusive``);
* `SlotPool.startup_gate` serialises engine start-ups per GPU, so one start-up never measures free memory
  while another is still allocating. (The two instances of one pair sharing a GPU must likewise be
  started one after the other; that is the launcher's job.) Start-ups whose every instance has absolute
  memory bounds (`Demand.concurrent_startup`: explicit KV bytes or tokens with a tiny utilisation
  fraction, as the arm declares) measure nothing, so they share the gate and start together; a start-up
  that sizes memory from what is free still waits for every other start-up on its GPUs, and they for it.
  Neither kind starves the other: a start-up waits for at most one turn of the other kind (`_GpuStartups`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from itertools import count

from matrix.cells import Cell
from matrix.hardware.gpus import GIB, Gpu
from matrix.kv_bound import KvBound

# KV cache per token when a case bounds its cache in tokens rather than bytes. Sized for the ~0.6B
# models the matrix uses by default (Qwen3-0.6B: 28 layers x 8 KV heads x 128 head dim x 2 for K and V
# x 2 bytes of bf16 = 112 KiB), rounded up. Bigger models need more per token; their catalog entries
# should give `kv_bound.bytes`, which is exact, or the estimate under-reserves when packing.
KV_BYTES_PER_TOKEN_ESTIMATE = 128 * 1024

# A pair is a prefill and a decode instance; each loads the weights and holds its own KV cache.
INSTANCES_PER_PAIR = 2

# With --pack the number of cells per GPU is limited by memory, not by a count; this only bounds the
# default worker count so a pack run on a big host does not start hundreds of threads.
PACK_SLOTS_PER_GPU = 16

DEFAULT_HEADROOM_BYTES = 2 * GIB


@dataclass(frozen=True)
class Demand:
    """What one cell needs to run.

    `gpus` = 0 is a CPU cell. `memory_bytes` is needed on *each* of the `gpus` GPUs. `cpu_ok` says the
    cell may run on the CPU instead when the host has no GPU. `exclusive` says the cell must not share
    its GPUs even when packing (its engines size their memory from what they find free).
    """

    cell_key: str
    gpus: int
    memory_bytes: int
    cpu_ok: bool
    exclusive: bool = False
    # Its engines' memory is fixed in absolute terms, so its start-up may overlap others on the same GPU.
    concurrent_startup: bool = False


@dataclass(frozen=True)
class Lease:
    """Resources granted to one cell; give it back with `SlotPool.release`.

    `gpu_indices` are NVML indices in ascending order, empty for a CPU slot. `memory_bytes` is what was
    reserved on each of them. `serial` tells apart two leases for the same cell key.
    """

    cell_key: str
    gpu_indices: tuple[int, ...]
    memory_bytes: int
    exclusive: bool
    serial: int
    concurrent_startup: bool = False

    @property
    def cpu(self) -> bool:
        """Whether this lease is a CPU slot (no GPU)."""
        return not self.gpu_indices

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        """The GPUs as strings, ready for ``CUDA_VISIBLE_DEVICES`` (children use PCI bus order)."""
        return tuple(str(index) for index in self.gpu_indices)


def kv_bytes(kv_bound: KvBound) -> int | None:
    """KV cache bytes for one instance from a case's `kv_bound`, or None when the case has no bound.

    With both bounds given, the larger wins: which one an engine honours depends on its backend, and
    over-reserving only costs parallelism whereas under-reserving costs an out-of-memory failure.
    """
    candidates = []
    if kv_bound.bytes is not None:
        candidates.append(kv_bound.bytes)
    if kv_bound.tokens is not None:
        candidates.append(kv_bound.tokens * KV_BYTES_PER_TOKEN_ESTIMATE)
    return max(candidates) if candidates else None


def demand_for(cell: Cell, *, cpu_ok: bool, absolute_memory: bool = False) -> Demand:
    """The demand of `cell`: per instance KV bound + weights, for both instances of the pair.

    A multi-GPU case spreads its pair over its GPUs (prefill and decode apart, or tensor-parallel
    shards), so each GPU is asked for an even share, rounded up. A GPU case without a KV bound is
    `exclusive`: its memory use is whatever the engine decides, so nothing else can be packed next to it.
    `absolute_memory` is the arm's word (`CaseInfo.absolute_memory`, from its row in `matrix.arm_table`) that
    every instance's memory is bounded absolutely; then the start-up may run concurrently with others, unless
    the case asks otherwise (`launch.exclusive_startup`).

    The seed's sidecar cells (`vllm_disaggregated`, `sglang_disaggregated`) bound their KV in absolute terms
    like the native pairs' (KV bytes with a 0.01 utilisation fraction, a 2048-token pool with a 0.05 static
    fraction) and name a `workspace_script`, which runs only under `matrix run --workspace DIR`. They used to
    start exclusive for naming it at all (10.8x one cell on the H200); now only a run that hands the engines
    to that script makes them exclusive (`arm_table.workspace_unvouched`, applied by the campaign), since
    without the option matrix's own plan starts the engines with exactly those bounds. SGLang's start-ups
    (both arms) still run alone: SGLang checks its static fraction against the memory free before and after
    its weights load, which another start-up's allocations can fail (`Engine.startup_reads_free_memory`).
    """
    case = cell.case
    gpus = case.gpus_needed
    if gpus == 0:
        return Demand(cell_key=cell.key, gpus=0, memory_bytes=0, cpu_ok=True)
    kv = kv_bytes(case.kv_bound)
    per_instance = (kv or 0) + math.ceil(case.weights_gib * GIB)
    total = INSTANCES_PER_PAIR * per_instance
    return Demand(
        cell_key=cell.key,
        gpus=gpus,
        memory_bytes=-(-total // gpus),  # integer ceiling: exact for any size
        cpu_ok=cpu_ok,
        exclusive=kv is None,
        concurrent_startup=absolute_memory and kv is not None and not case.launch.exclusive_startup,
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


class _GpuStartups:
    """Start-ups in progress on one GPU: any number of concurrent ones, or one exclusive one.

    Turns alternate so that neither kind starves the other (a phase-fair reader-writer lock):

    * an exclusive start-up waits for the GPU to have none in progress; while one waits, concurrent
      start-ups that arrive later wait behind it, so a stream of bounded cells cannot starve a cell that
      measures free memory;
    * concurrent start-ups that were already waiting when an exclusive start-up ended are *due*: they go
      in together before any further exclusive start-up, which then waits for them to finish. So a queue
      of exclusive start-ups (sidecar cells, one after another) holds a concurrent one back for at most
      one of them, instead of for the whole queue.

    `_epoch` counts the exclusive start-ups that ended; a waiting concurrent start-up that arrived in an
    earlier epoch than the current one is due.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._exclusive_waiting = 0
        self._epoch = 0
        self._shared_waiting: dict[int, int] = {}  # arrival epoch -> concurrent start-ups waiting since
        self.peers_seen: dict[int, int] = {}  # gate id -> most other start-ups in progress beside it

    def _shared_due(self) -> bool:
        return any(epoch < self._epoch for epoch in self._shared_waiting)

    def enter(self, gate_id: int, shared: bool) -> None:
        with self._cond:
            if shared:
                arrived = self._epoch
                self._shared_waiting[arrived] = self._shared_waiting.get(arrived, 0) + 1
                try:
                    self._cond.wait_for(
                        lambda: not self._exclusive and (not self._exclusive_waiting or self._epoch > arrived)
                    )
                finally:
                    self._shared_waiting[arrived] -= 1
                    if not self._shared_waiting[arrived]:
                        del self._shared_waiting[arrived]
                    self._cond.notify_all()  # the last due one in lets a waiting exclusive one re-check
                self._shared += 1
                for other in self.peers_seen:  # everyone in progress now sees one more peer
                    self.peers_seen[other] = max(self.peers_seen[other], self._shared - 1)
                self.peers_seen[gate_id] = self._shared - 1
            else:
                self._exclusive_waiting += 1
                try:
                    self._cond.wait_for(lambda: not self._exclusive and not self._shared and not self._shared_due())
                finally:
                    self._exclusive_waiting -= 1
                self._exclusive = True
                self.peers_seen[gate_id] = 0

    def leave(self, gate_id: int, shared: bool) -> int:
        """End a start-up; returns the most other start-ups it ever had beside it on this GPU."""
        with self._cond:
            if shared:
                self._shared -= 1
            else:
                self._exclusive = False
                self._epoch += 1
            self._cond.notify_all()
            return self.peers_seen.pop(gate_id, 0)


class StartupGate(AbstractContextManager[None]):
    """One lease's start-up: its GPUs entered in index order, left in reverse; reusable, not reentrant.

    A class rather than a generator so that the same gate object can be entered again later (e.g. for a
    restart of the pair) instead of failing as a spent generator would. It records its last start-up
    (`record`) so the executor can store the overlap with the outcome.
    """

    _ids = count(1)

    def __init__(self, gpus: Sequence[_GpuStartups], *, shared: bool) -> None:
        self._gpus = tuple(gpus)
        self._shared = shared
        self._id = next(self._ids)
        self._window: tuple[float, float] | None = None
        self._entered_at = 0.0
        self._peers = 0

    def __enter__(self) -> None:
        taken: list[_GpuStartups] = []
        try:
            for gpu in self._gpus:
                gpu.enter(self._id, self._shared)
                taken.append(gpu)
        except BaseException:  # e.g. KeyboardInterrupt while waiting: give back what we hold
            for gpu in reversed(taken):
                gpu.leave(self._id, self._shared)
            raise
        self._entered_at = time.time()

    def __exit__(self, *exc: object) -> None:
        peers = [gpu.leave(self._id, self._shared) for gpu in reversed(self._gpus)]
        self._window = (self._entered_at, time.time())
        self._peers = max(peers, default=0)

    def record(self) -> dict[str, object]:
        """The last start-up through this gate: its mode, its wall-clock window, and the most other
        start-ups that were in progress on its GPUs beside it (0 when it ran alone)."""
        if self._window is None:
            return {}
        mode = "concurrent" if self._shared else "exclusive"
        return {"startup_mode": mode, "startup_window": [round(t, 3) for t in self._window],
                "startup_peers": self._peers}  # fmt: skip


class SlotPool:
    """Thread-safe bookkeeping of GPU and CPU slots for a run.

    `gpus` is the inventory taken at start (their `memory_used` then counts as taken for the whole run,
    since it belongs to someone else). `cpu_slots` is how many CPU cells may run at once. `headroom_bytes`
    is kept free on every GPU on top of the estimates, for CUDA contexts, activations and graphs that the
    estimates leave out.

    Choices are deterministic: the GPUs with the most unreserved memory win, the lowest index among equals.
    """

    def __init__(
        self,
        gpus: Sequence[Gpu],
        *,
        pack: bool,
        cpu_slots: int,
        headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
        max_gpus_per_cell: int | None = None,
    ) -> None:
        """`max_gpus_per_cell` bounds one cell when `gpus` span several hosts (a Ray cluster): a cell's
        pair runs on one node, so it can never get more GPUs than the largest node has."""
        if cpu_slots < 0:
            raise ValueError(f"cpu_slots must be >= 0, got {cpu_slots}")
        if headroom_bytes < 0:
            raise ValueError(f"headroom_bytes must be >= 0, got {headroom_bytes}")
        indices = [gpu.index for gpu in gpus]
        if len(set(indices)) != len(indices):
            raise ValueError(f"duplicate GPU indices in {indices}")
        self._gpus = {gpu.index: gpu for gpu in sorted(gpus, key=lambda gpu: gpu.index)}
        self._pack = pack
        self._cpu_slots = cpu_slots
        self._headroom = headroom_bytes
        self._max_gpus_per_cell = max_gpus_per_cell
        # Bytes each GPU can give to cells in total: free at start minus headroom.
        self._capacity = {index: gpu.memory_free - headroom_bytes for index, gpu in self._gpus.items()}
        self._lock = threading.Lock()
        self._reserved = dict.fromkeys(self._gpus, 0)
        self._cells = dict.fromkeys(self._gpus, 0)
        self._exclusive: set[int] = set()
        self._quarantined: dict[int, str] = {}
        self._cpu_used = 0
        self._active: dict[int, Lease] = {}
        self._serials = count(1)
        # Separate from `_lock`: a start-up holds its gate for minutes, bookkeeping must not wait on it.
        self._startups = {index: _GpuStartups() for index in self._gpus}

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        """Every GPU of the pool, quarantined or not, by index."""
        return tuple(self._gpus.values())

    @property
    def pack(self) -> bool:
        return self._pack

    @property
    def quarantined(self) -> dict[int, str]:
        """GPU index -> why it gets no new cells."""
        with self._lock:
            return dict(self._quarantined)

    @property
    def active_leases(self) -> tuple[Lease, ...]:
        """Leases handed out and not yet released, oldest first."""
        with self._lock:
            return tuple(self._active.values())

    @property
    def slots(self) -> int:
        """How many cells can run at once in the best case: the natural default for the worker count.

        Without pack, one per usable GPU plus the CPU slots; with pack, memory is the real limit, so
        `PACK_SLOTS_PER_GPU` per GPU stands in. Can be 0 (no usable GPU, no CPU slot).
        """
        with self._lock:
            usable = len(self._gpus) - len(self._quarantined)
        per_gpu = PACK_SLOTS_PER_GPU if self._pack else 1
        return usable * per_gpu + self._cpu_slots

    def _runs_on_cpu(self, demand: Demand) -> bool:
        # A GPU cell falls back to the CPU only on a host with no GPU at all, not when its GPUs are busy
        # or quarantined: running it on the CPU there would silently test something else.
        return demand.gpus == 0 or (not self._gpus and demand.cpu_ok)

    def _fits(self, index: int, demand: Demand) -> bool:
        if index in self._quarantined:
            return False
        if not self._pack:
            return self._cells[index] == 0 and demand.memory_bytes <= self._capacity[index]
        if index in self._exclusive or (demand.exclusive and self._cells[index] > 0):
            return False
        return self._reserved[index] + demand.memory_bytes <= self._capacity[index]

    def try_acquire(self, demand: Demand) -> Lease | None:
        """A lease for `demand` if it can start now, else None (never blocks).

        None means "not now" or "never"; `can_ever_fit` tells which.
        """
        with self._lock:
            if self._runs_on_cpu(demand):
                if self._cpu_used >= self._cpu_slots:
                    return None
                self._cpu_used += 1
                lease = Lease(demand.cell_key, (), 0, False, next(self._serials))
                self._active[lease.serial] = lease
                return lease
            if demand.gpus <= 0:
                return None
            candidates = [index for index in self._gpus if self._fits(index, demand)]
            if len(candidates) < demand.gpus:
                return None
            # Most unreserved memory first spreads cells over GPUs, which also keeps start-ups on
            # different GPUs from queueing at the same gate; ties go to the lowest index.
            candidates.sort(key=lambda index: (self._reserved[index] - self._capacity[index], index))
            chosen = tuple(sorted(candidates[: demand.gpus]))
            for index in chosen:
                self._reserved[index] += demand.memory_bytes
                self._cells[index] += 1
                if demand.exclusive:
                    self._exclusive.add(index)
            serial, concurrent = next(self._serials), demand.concurrent_startup
            lease = Lease(demand.cell_key, chosen, demand.memory_bytes, demand.exclusive, serial, concurrent)
            self._active[lease.serial] = lease
            return lease

    def release(self, lease: Lease) -> None:
        """Give a lease back. Releasing one twice is a bug and raises ValueError."""
        with self._lock:
            if self._active.pop(lease.serial, None) != lease:
                raise ValueError(f"lease {lease.serial} for {lease.cell_key} is not held by this pool")
            if lease.cpu:
                self._cpu_used -= 1
                return
            for index in lease.gpu_indices:
                self._reserved[index] -= lease.memory_bytes
                self._cells[index] -= 1
                if lease.exclusive:
                    self._exclusive.discard(index)

    def quarantine(self, gpu_index: int, reason: str) -> None:
        """Give GPU `gpu_index` no new cells (e.g. memory it should have freed is still taken).

        Cells already on it keep their lease and release it normally. The first reason is kept, since it
        is usually the cause and later ones its consequences.
        """
        with self._lock:
            if gpu_index not in self._gpus:
                raise ValueError(f"GPU {gpu_index} is not in this pool (GPUs {sorted(self._gpus)})")
            self._quarantined.setdefault(gpu_index, reason)

    def can_ever_fit(self, demand: Demand) -> str | None:
        """None if `demand` could run on this pool once it is idle, else why not, for the report.

        Quarantined GPUs do not count, so a cell waiting for a GPU that was just quarantined can be
        skipped instead of waiting forever.
        """
        with self._lock:
            quarantined = dict(self._quarantined)
        if self._runs_on_cpu(demand):
            if self._cpu_slots > 0:
                return None
            if demand.gpus == 0:
                return "needs a CPU slot, the run allows 0 CPU cells at once"
            return f"needs {demand.gpus} GPU{_s(demand.gpus)}, host has 0 (and no CPU slot to fall back to)"
        if self._max_gpus_per_cell is not None and demand.gpus > self._max_gpus_per_cell:
            most = self._max_gpus_per_cell
            return f"needs {demand.gpus} GPU{_s(demand.gpus)} on one node, the largest node has {most}"
        usable = [index for index in self._gpus if index not in quarantined]
        if len(usable) < demand.gpus:
            reason = f"needs {demand.gpus} GPU{_s(demand.gpus)}, host has {len(usable)}"
            if quarantined:
                why = "; ".join(f"GPU {index}: {text}" for index, text in sorted(quarantined.items()))
                reason += f" usable ({len(quarantined)} quarantined: {why})"
            return reason
        headroom = f" + {_gib(self._headroom)} GiB headroom" if self._headroom else ""
        free = sorted((self._gpus[index].memory_free for index in usable), reverse=True)
        fitting = sum(1 for index in usable if demand.memory_bytes <= self._capacity[index])
        if fitting >= demand.gpus:
            return None
        if demand.gpus == 1:
            need = f"{_gib(demand.memory_bytes)} GiB{headroom}"
            return f"needs {need} on one GPU, largest has {_gib(free[0])} GiB free"
        return (
            f"needs {_gib(demand.memory_bytes)} GiB{headroom} on each of {demand.gpus} GPUs, "
            f"{fitting} of {len(usable)} have that much free (largest {_gib(free[0])} GiB)"
        )

    def startup_gate(self, lease: Lease) -> AbstractContextManager[None]:
        """Hold this while the lease's engines start up: one start-up per GPU at a time, except that
        start-ups of leases with `concurrent_startup` run together (see the module docstring).

        GPUs are entered in index order so two multi-GPU start-ups cannot deadlock. A CPU lease gets a
        no-op gate.
        """
        if lease.cpu:
            return nullcontext()
        gpus = [self._startups[index] for index in sorted(set(lease.gpu_indices))]
        return StartupGate(gpus, shared=lease.concurrent_startup)


def _s(n: int) -> str:
    return "" if n == 1 else "s"
