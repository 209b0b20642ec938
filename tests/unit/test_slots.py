"""Slot bookkeeping with fake inventories: packing, quarantine, CPU slots, start-up gates, threads."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace

import pytest

from matrix.cells import CaseInfo, Cell, RuntimeInfo
from matrix.hardware.gpus import GIB, Gpu
from matrix.kv_bound import KvBound
from matrix.markers import parse_marker_use
from matrix.schedule import Demand, Lease, SlotPool, demand_for
from matrix.schedule.slots import KV_BYTES_PER_TOKEN_ESTIMATE, PACK_SLOTS_PER_GPU, kv_bytes


def _gpus(*free_gib: float, total_gib: int = 80) -> list[Gpu]:
    """GPUs with `free_gib` GiB free each (the rest counts as used by someone else at start)."""
    total = total_gib * GIB
    return [Gpu(i, f"GPU-{i:08x}", "Fake", total, total - int(free * GIB)) for i, free in enumerate(free_gib)]


def _demand(key: str = "c", *, gpus: int = 1, gib: float = 0, cpu_ok: bool = False, exclusive: bool = False) -> Demand:
    return Demand(cell_key=key, gpus=gpus, memory_bytes=int(gib * GIB), cpu_ok=cpu_ok, exclusive=exclusive)


def _cell(markers: list[str], *, kv_bound: KvBound | None = None, weights_gib: float = 0.0) -> Cell:
    case = CaseInfo(
        name="case",
        backend="vllm",
        arm="dynamo",
        model="m",
        markers=tuple(parse_marker_use(m) for m in markers),
        kv_bound=kv_bound or KvBound(),
        weights_gib=weights_gib,
    )
    return Cell(case=case, runtime=RuntimeInfo(backend="vllm", version="0.30.0", tag="v0.30.0"))


# --- demands ----------------------------------------------------------------------------------------


def test_demand_counts_both_instances_of_the_pair() -> None:
    demand = demand_for(_cell(["gpu_1"], kv_bound=KvBound(bytes=GIB), weights_gib=1.5), cpu_ok=False)
    assert demand == Demand("case@vllm-0.30.0", 1, 2 * (GIB + 3 * GIB // 2), False, exclusive=False)


def test_demand_from_tokens_and_split_over_gpus() -> None:
    demand = demand_for(_cell(["gpu_2"], kv_bound=KvBound(tokens=2048)), cpu_ok=True)
    assert demand.gpus == 2
    assert demand.cpu_ok
    assert demand.memory_bytes == 2048 * KV_BYTES_PER_TOKEN_ESTIMATE  # 2 instances over 2 GPUs


def test_kv_bytes_takes_larger_bound() -> None:
    assert kv_bytes(KvBound(bytes=1, tokens=1)) == KV_BYTES_PER_TOKEN_ESTIMATE
    assert kv_bytes(KvBound(bytes=10 * GIB, tokens=1)) == 10 * GIB
    assert kv_bytes(KvBound()) is None


def test_demand_without_kv_bound_is_exclusive() -> None:
    assert demand_for(_cell(["gpu_1"], weights_gib=1.0), cpu_ok=False).exclusive


def test_cpu_cell_demand() -> None:
    demand = demand_for(_cell(["e2e"], kv_bound=KvBound(bytes=GIB)), cpu_ok=False)
    assert (demand.gpus, demand.memory_bytes, demand.exclusive) == (0, 0, False)


# --- without pack -----------------------------------------------------------------------------------


def test_one_cell_per_gpu_without_pack() -> None:
    pool = SlotPool(_gpus(70, 70), pack=False, cpu_slots=0)
    first = pool.try_acquire(_demand("a", gib=1))
    second = pool.try_acquire(_demand("b", gib=1))
    assert first is not None and second is not None
    assert (first.gpu_indices, second.gpu_indices) == ((0,), (1,))
    assert pool.try_acquire(_demand("c", gib=1)) is None
    pool.release(first)
    third = pool.try_acquire(_demand("c", gib=1))
    assert third is not None and third.gpu_indices == (0,)
    assert third.gpu_ids == ("0",)
    assert not third.cpu


def test_without_pack_prefers_most_free_gpu() -> None:
    pool = SlotPool(_gpus(10, 70, 70), pack=False, cpu_slots=0)
    lease = pool.try_acquire(_demand(gib=1))
    assert lease is not None and lease.gpu_indices == (1,)


def test_slots() -> None:
    assert SlotPool(_gpus(70, 70), pack=False, cpu_slots=3).slots == 5
    assert SlotPool(_gpus(70, 70), pack=True, cpu_slots=1).slots == 2 * PACK_SLOTS_PER_GPU + 1
    assert SlotPool([], pack=False, cpu_slots=0).slots == 0


# --- pack -------------------------------------------------------------------------------------------


def test_pack_until_memory_runs_out_with_headroom() -> None:
    # 10 GiB free, 2 GiB headroom: 8 GiB for cells, so three 2.5 GiB cells fit and a fourth does not.
    pool = SlotPool(_gpus(10), pack=True, cpu_slots=0, headroom_bytes=2 * GIB)
    leases = [pool.try_acquire(_demand(str(i), gib=2.5)) for i in range(3)]
    assert all(lease is not None and lease.gpu_indices == (0,) for lease in leases)
    assert pool.try_acquire(_demand("3", gib=2.5)) is None
    assert pool.try_acquire(_demand("small", gib=0.5)) is not None  # 7.5 + 0.5 = 8 still fits exactly
    assert pool.try_acquire(_demand("tiny", gib=0.01)) is None
    lease = leases[0]
    assert lease is not None
    pool.release(lease)
    assert pool.try_acquire(_demand("3", gib=2.5)) is not None


def test_pack_spreads_to_gpu_with_most_unreserved_memory() -> None:
    pool = SlotPool(_gpus(20, 20), pack=True, cpu_slots=0, headroom_bytes=0)
    picks = []
    for i in range(4):
        lease = pool.try_acquire(_demand(str(i), gib=4))
        assert lease is not None
        picks.append(lease.gpu_indices)
    assert picks == [(0,), (1,), (0,), (1,)]


def test_pack_exclusive_demand_gets_gpu_alone() -> None:
    pool = SlotPool(_gpus(70), pack=True, cpu_slots=0)
    shared = pool.try_acquire(_demand("shared", gib=1))
    assert shared is not None
    assert pool.try_acquire(_demand("alone", exclusive=True)) is None  # GPU not empty
    pool.release(shared)
    alone = pool.try_acquire(_demand("alone", exclusive=True))
    assert alone is not None
    assert pool.try_acquire(_demand("shared", gib=1)) is None  # nobody joins an exclusive cell
    pool.release(alone)
    assert pool.try_acquire(_demand("shared", gib=1)) is not None


# --- quarantine -------------------------------------------------------------------------------------


def test_quarantine_stops_new_cells_but_not_running_ones() -> None:
    pool = SlotPool(_gpus(70, 70), pack=False, cpu_slots=0)
    running = pool.try_acquire(_demand("a"))
    assert running is not None and running.gpu_indices == (0,)
    pool.quarantine(1, "3.0 GiB still used after cell x")
    pool.quarantine(1, "later symptom")
    assert pool.quarantined == {1: "3.0 GiB still used after cell x"}
    assert pool.try_acquire(_demand("b")) is None
    pool.release(running)
    lease = pool.try_acquire(_demand("b"))
    assert lease is not None and lease.gpu_indices == (0,)
    pool.quarantine(0, "leak")
    assert pool.can_ever_fit(_demand("c")) == (
        "needs 1 GPU, host has 0 usable (2 quarantined: GPU 0: leak; GPU 1: 3.0 GiB still used after cell x)"
    )
    assert pool.slots == 0
    with pytest.raises(ValueError, match="GPU 5"):
        pool.quarantine(5, "no such GPU")


# --- multi-GPU --------------------------------------------------------------------------------------


def test_multi_gpu_takes_gpus_with_most_free_memory() -> None:
    pool = SlotPool(_gpus(30, 70, 50, 70), pack=True, cpu_slots=0, headroom_bytes=0)
    lease = pool.try_acquire(_demand("tp2", gpus=2, gib=40))
    assert lease is not None and lease.gpu_indices == (1, 3)
    assert lease.memory_bytes == 40 * GIB
    # GPU 2 has 50 GiB unreserved, GPUs 0, 1 and 3 have 30 each: only one GPU fits another 40.
    assert pool.try_acquire(_demand("tp2b", gpus=2, gib=40)) is None
    again = pool.try_acquire(_demand("tp2c", gpus=2, gib=30))
    assert again is not None and again.gpu_indices == (0, 2)  # 50 free, then a tie of 30s goes to index 0
    pool.release(lease)
    pool.release(again)
    assert pool.try_acquire(_demand("tp4", gpus=4, gib=30)) is not None


def test_multi_gpu_without_pack_needs_idle_gpus() -> None:
    pool = SlotPool(_gpus(70, 70, 70), pack=False, cpu_slots=0)
    single = pool.try_acquire(_demand("one"))
    assert single is not None
    pair = pool.try_acquire(_demand("two", gpus=2))
    assert pair is not None and pair.gpu_indices == (1, 2)
    assert pool.try_acquire(_demand("two-more", gpus=2)) is None
    assert pool.can_ever_fit(_demand("two-more", gpus=2)) is None  # possible later, just not now


# --- CPU slots --------------------------------------------------------------------------------------


def test_cpu_slots() -> None:
    pool = SlotPool(_gpus(70), pack=False, cpu_slots=2)
    a = pool.try_acquire(_demand("a", gpus=0))
    b = pool.try_acquire(_demand("b", gpus=0))
    assert a is not None and b is not None and a.cpu and b.cpu and a.gpu_indices == ()
    assert pool.try_acquire(_demand("c", gpus=0)) is None
    assert pool.try_acquire(_demand("gpu")) is not None  # CPU slots and GPUs are separate
    pool.release(a)
    assert pool.try_acquire(_demand("c", gpus=0)) is not None


def test_cpu_ok_gpu_cell_falls_back_only_without_gpus() -> None:
    no_gpu = SlotPool([], pack=False, cpu_slots=1)
    lease = no_gpu.try_acquire(_demand("gpu-cell", cpu_ok=True, gib=5))
    assert lease is not None and lease.cpu
    assert no_gpu.try_acquire(_demand("gpu-cell-2", cpu_ok=True)) is None  # the one CPU slot is taken
    assert no_gpu.try_acquire(_demand("gpu-only")) is None
    assert no_gpu.can_ever_fit(_demand("gpu-cell", cpu_ok=True)) is None
    # With a GPU on the host a GPU cell waits for it rather than silently testing the CPU path.
    with_gpu = SlotPool(_gpus(70), pack=False, cpu_slots=1)
    first = with_gpu.try_acquire(_demand("first", cpu_ok=True))
    assert first is not None and first.gpu_indices == (0,)
    assert with_gpu.try_acquire(_demand("second", cpu_ok=True)) is None


# --- can_ever_fit -----------------------------------------------------------------------------------


def test_can_ever_fit_messages() -> None:
    assert SlotPool([], pack=False, cpu_slots=4).can_ever_fit(_demand()) == "needs 1 GPU, host has 0"
    assert SlotPool(_gpus(70), pack=False, cpu_slots=0).can_ever_fit(_demand(gpus=2)) == "needs 2 GPUs, host has 1"
    no_headroom = SlotPool(_gpus(79.6, 40), pack=False, cpu_slots=0, headroom_bytes=0)
    assert no_headroom.can_ever_fit(_demand(gib=80)) == "needs 80.0 GiB on one GPU, largest has 79.6 GiB free"
    assert no_headroom.can_ever_fit(_demand(gib=79)) is None
    headroom = SlotPool(_gpus(79.6, 40), pack=True, cpu_slots=0)
    assert headroom.can_ever_fit(_demand(gib=78)) == (
        "needs 78.0 GiB + 2.0 GiB headroom on one GPU, largest has 79.6 GiB free"
    )
    assert headroom.can_ever_fit(_demand(gpus=2, gib=50)) == (
        "needs 50.0 GiB + 2.0 GiB headroom on each of 2 GPUs, 1 of 2 have that much free (largest 79.6 GiB)"
    )
    assert SlotPool([], pack=False, cpu_slots=0).can_ever_fit(_demand(gpus=0)) is not None
    assert "CPU slot" in str(SlotPool([], pack=False, cpu_slots=0).can_ever_fit(_demand(cpu_ok=True)))
    assert SlotPool([], pack=False, cpu_slots=1).can_ever_fit(_demand(gpus=0)) is None


def test_release_twice_is_an_error() -> None:
    pool = SlotPool(_gpus(70), pack=False, cpu_slots=0)
    lease = pool.try_acquire(_demand())
    assert lease is not None
    pool.release(lease)
    with pytest.raises(ValueError, match="not held"):
        pool.release(lease)
    with pytest.raises(ValueError, match="not held"):
        pool.release(Lease("forged", (0,), 0, False, 999))


# --- start-up gate ----------------------------------------------------------------------------------


def test_startup_gate_serialises_startups_on_one_gpu() -> None:
    pool = SlotPool(_gpus(70), pack=True, cpu_slots=0)
    leases = [pool.try_acquire(_demand(str(i), gib=1)) for i in range(2)]
    assert all(lease is not None for lease in leases)
    first_inside = threading.Event()
    release_first = threading.Event()
    second_inside = threading.Event()
    inside = 0
    overlaps: list[int] = []
    guard = threading.Lock()

    def start(lease: Lease, entered: threading.Event, hold: threading.Event | None) -> None:
        nonlocal inside
        with pool.startup_gate(lease):
            with guard:
                inside += 1
                overlaps.append(inside)
            entered.set()
            if hold is not None:
                assert hold.wait(5)
            with guard:
                inside -= 1

    a, b = leases
    assert a is not None and b is not None
    t1 = threading.Thread(target=start, args=(a, first_inside, release_first))
    t1.start()
    assert first_inside.wait(5)
    t2 = threading.Thread(target=start, args=(b, second_inside, None))
    t2.start()
    assert not second_inside.wait(0.005)  # blocked while the first start-up holds the gate
    release_first.set()
    assert second_inside.wait(5)
    t1.join(5)
    t2.join(5)
    assert overlaps == [1, 1]


def test_startup_gates_of_different_gpus_are_independent() -> None:
    pool = SlotPool(_gpus(70, 70), pack=False, cpu_slots=1)
    a = pool.try_acquire(_demand("a"))
    b = pool.try_acquire(_demand("b"))
    cpu = pool.try_acquire(_demand("cpu", gpus=0))
    assert a is not None and b is not None and cpu is not None
    with pool.startup_gate(a), pool.startup_gate(b), pool.startup_gate(cpu), pool.startup_gate(cpu):
        pass


def test_multi_gpu_gates_do_not_deadlock() -> None:
    pool = SlotPool(_gpus(70, 70, 70), pack=True, cpu_slots=0, headroom_bytes=0)
    x = pool.try_acquire(_demand("x", gpus=3, gib=1))
    y = pool.try_acquire(_demand("y", gpus=3, gib=1))
    assert x is not None and y is not None
    # Same GPUs in a different order must still be locked in index order.
    y_reversed = Lease(y.cell_key, tuple(reversed(y.gpu_indices)), y.memory_bytes, y.exclusive, y.serial)
    done = []

    def worker(lease: Lease) -> None:
        for _ in range(200):
            with pool.startup_gate(lease):
                pass
        done.append(lease.cell_key)

    threads = [threading.Thread(target=worker, args=(lease,)) for lease in (x, y_reversed)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(done) == ["x", "y"]


# --- threads ----------------------------------------------------------------------------------------


def test_many_threads_never_oversubscribe() -> None:
    pool = SlotPool(_gpus(20, 20, 20), pack=True, cpu_slots=2, headroom_bytes=2 * GIB)
    capacity = 18 * GIB
    errors: list[str] = []
    reserved = {0: 0, 1: 0, 2: 0}
    cpu_in_use = 0
    guard = threading.Lock()
    start = threading.Barrier(16)

    def worker(seed: int) -> None:
        nonlocal cpu_in_use
        rng = random.Random(seed)
        start.wait()
        for i in range(300):
            demand = _demand(f"{seed}-{i}", gpus=rng.choice([0, 1, 1, 2]), gib=rng.choice([1, 3, 5]))
            lease = pool.try_acquire(demand)
            if lease is None:
                continue
            with guard:
                if lease.cpu:
                    cpu_in_use += 1
                    if cpu_in_use > 2:
                        errors.append(f"{cpu_in_use} CPU cells")
                for index in lease.gpu_indices:
                    reserved[index] += lease.memory_bytes
                    if reserved[index] > capacity:
                        errors.append(f"GPU {index} over capacity")
            with guard:
                if lease.cpu:
                    cpu_in_use -= 1
                for index in lease.gpu_indices:
                    reserved[index] -= lease.memory_bytes
            pool.release(lease)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert pool.active_leases == ()
    # Everything was given back: the whole capacity is available again.
    assert pool.try_acquire(_demand("full", gpus=3, gib=18)) is not None


def test_startup_gate_is_reusable() -> None:
    pool = SlotPool(_gpus(70), pack=False, cpu_slots=0)
    lease = pool.try_acquire(_demand())
    assert lease is not None
    gate = pool.startup_gate(lease)
    for _ in range(2):  # a spent generator-based context manager would fail the second time
        with gate:
            pass
    with pool.startup_gate(lease):  # and the lock was given back
        pass


# --- concurrent start-ups ([M17] goal 3) -------------------------------------------------------------


def test_concurrent_startup_needs_the_arms_word_and_a_bound() -> None:
    bounded = _cell(["gpu_1"], kv_bound=KvBound(bytes=GIB))
    assert demand_for(bounded, cpu_ok=False, absolute_memory=True).concurrent_startup
    assert not demand_for(bounded, cpu_ok=False).concurrent_startup  # the arm did not vouch for it
    unbounded = _cell(["gpu_1"])
    assert not demand_for(unbounded, cpu_ok=False, absolute_memory=True).concurrent_startup
    forced = replace(bounded, case=replace(bounded.case, launch={"exclusive_startup": True}))
    assert not demand_for(forced, cpu_ok=False, absolute_memory=True).concurrent_startup


def _start_two(pool: SlotPool, first: Demand, second: Demand) -> tuple[list[str], list[dict[str, object]]]:
    """Start-up of `first` holds its gate until `second` has tried to enter; returns the order of events."""
    a, b = pool.try_acquire(first), pool.try_acquire(second)
    assert a is not None and b is not None and a.gpu_indices == b.gpu_indices == (0,)
    events: list[str] = []
    guard = threading.Lock()
    a_inside, b_tried = threading.Event(), threading.Event()
    gates = [pool.startup_gate(a), pool.startup_gate(b)]

    def run_a() -> None:
        with gates[0]:
            with guard:
                events.append("a in")
            a_inside.set()
            b_tried.wait(5)
            time.sleep(0.1)  # gives a blocked b the chance to (wrongly) get in
            with guard:
                events.append("a out")

    def run_b() -> None:
        assert a_inside.wait(5)
        b_tried.set()
        with gates[1], guard:
            events.append("b in")
        with guard:
            events.append("b out")

    threads = [threading.Thread(target=run_a), threading.Thread(target=run_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return events, [gate.record() for gate in gates]  # type: ignore[attr-defined]


def test_bounded_startups_on_one_gpu_overlap_and_say_so() -> None:
    pool = SlotPool(_gpus(70), pack=True, cpu_slots=0)
    shared = [replace(_demand(k, gib=1), concurrent_startup=True) for k in "ab"]
    events, records = _start_two(pool, *shared)
    assert events.index("b in") < events.index("a out"), events  # b started while a was still starting
    assert [r["startup_mode"] for r in records] == ["concurrent", "concurrent"]
    assert [r["startup_peers"] for r in records] == [1, 1]
    (_, a_ready), (b_entered, _) = (r["startup_window"] for r in records)  # type: ignore[misc]
    assert b_entered < a_ready


@pytest.mark.parametrize("which", ["first", "second", "both"])
def test_a_startup_that_measures_free_memory_never_overlaps_another(which: str) -> None:
    pool = SlotPool(_gpus(70), pack=True, cpu_slots=0)
    first = replace(_demand("a", gib=1), concurrent_startup=which == "second")
    second = replace(_demand("b", gib=1), concurrent_startup=which == "first")
    events, records = _start_two(pool, first, second)
    assert events == ["a in", "a out", "b in", "b out"], events  # queued
    assert [r["startup_peers"] for r in records] == [0, 0]


def test_a_waiting_exclusive_startup_is_not_starved_by_bounded_ones() -> None:
    pool = SlotPool(_gpus(70), pack=True, cpu_slots=0)
    leases = [pool.try_acquire(replace(_demand(k, gib=1), concurrent_startup=k != "x")) for k in "axb"]
    assert all(lease is not None for lease in leases)
    a, x, b = (pool.startup_gate(lease) for lease in leases if lease is not None)
    order: list[str] = []
    x_may_leave = threading.Event()

    def start(gate: AbstractContextManager[None], name: str, hold: threading.Event | None = None) -> None:
        with gate:
            order.append(name)
            if hold is not None:
                hold.wait(5)

    with a:
        tx = threading.Thread(target=start, args=(x, "x", x_may_leave))
        tx.start()
        deadline = time.monotonic() + 5
        while not pool._startups[0]._exclusive_waiting and time.monotonic() < deadline:
            time.sleep(0.001)
        tb = threading.Thread(target=start, args=(b, "b"))
        tb.start()
        time.sleep(0.05)
        assert order == []  # x waits for a; b, bounded like a, still waits behind x
    deadline = time.monotonic() + 5
    while not order and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)
    assert order == ["x"]  # b still waits: x measures free memory alone
    x_may_leave.set()
    tx.join(5)
    tb.join(5)
    assert order == ["x", "b"]


def _wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert condition()


def test_a_queue_of_exclusive_startups_holds_concurrent_ones_back_for_one_turn_only() -> None:
    """[M31] The packed seed matrix: sidecar cells start exclusive one after another, native cells could
    start together. Those already waiting go in as soon as the running exclusive start-up ends, before the
    next exclusive one; a concurrent one arriving after that waits for the next exclusive turn."""
    pool = SlotPool(_gpus(70), pack=True, cpu_slots=0)
    names = ["x1", "x2", "x3", "n1", "n2", "n3"]
    leases = [pool.try_acquire(replace(_demand(k, gib=1), concurrent_startup=k[0] == "n")) for k in names]
    gates = dict(zip(names, (pool.startup_gate(lease) for lease in leases if lease is not None), strict=True))
    gpu = pool._startups[0]
    order: list[str] = []
    guard = threading.Lock()
    may_leave = {name: threading.Event() for name in names}

    def start(name: str) -> None:
        with gates[name]:
            with guard:
                order.append(name)
            may_leave[name].wait(5)

    threads: dict[str, threading.Thread] = {}

    def launch(name: str) -> None:
        threads[name] = threading.Thread(target=start, args=(name,))
        threads[name].start()

    launch("x1")
    _wait_until(lambda: order == ["x1"])
    for name in ("x2", "x3"):
        launch(name)
    _wait_until(lambda: gpu._exclusive_waiting == 2)
    for name in ("n1", "n2"):
        launch(name)
    _wait_until(lambda: sum(gpu._shared_waiting.values()) == 2)
    may_leave["x1"].set()
    _wait_until(lambda: len(order) == 3)
    time.sleep(0.05)  # a wrongly admitted exclusive start-up would show up now
    assert order[0] == "x1" and sorted(order[1:]) == ["n1", "n2"], order  # both due ones in together
    launch("n3")  # arrives while x2 and x3 wait: it waits for the next exclusive turn
    time.sleep(0.05)
    assert len(order) == 3, order
    may_leave["n1"].set()
    may_leave["n2"].set()
    _wait_until(lambda: len(order) == 4)
    time.sleep(0.05)
    assert order[3] in ("x2", "x3") and len(order) == 4, order  # the exclusive one alone, n3 still waits
    first_x = order[3]
    may_leave[first_x].set()
    _wait_until(lambda: len(order) == 5)
    assert order[4] == "n3", order  # due now, before the last exclusive one
    may_leave["n3"].set()
    _wait_until(lambda: len(order) == 6)
    may_leave["x2"].set()
    may_leave["x3"].set()
    for thread in threads.values():
        thread.join(5)
    assert not any(thread.is_alive() for thread in threads.values())
