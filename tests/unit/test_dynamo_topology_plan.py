"""[M27] the Dynamo arm's xPyD and peer-loss plans on the mocker: one `dynamo.mocker` per worker, each in its
role's mode on its own system port behind the one frontend; a `TopologySpec` whose ids are the workers'
`worker_id` label and whose ledger is each decode's generate requests; a `PeerLossSpec` over every worker."""

from __future__ import annotations

import contextlib
import http.server
import itertools
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from matrix.case_launch import DynamoLaunch, parse_typed
from matrix.cells import CaseInfo, RuntimeInfo
from matrix.check.http import loopback_client
from matrix.check.lifecycle import parse_gauges
from matrix.check.specs import EngineGauges, RequestSpec, TopologyWorker
from matrix.check.topology import UNANSWERED, instance_id, probe
from matrix.errors import ConfigError
from matrix.kv_bound import KvBound
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import LaunchContext
from matrix.launch.arms.dynamo import MOCKER_DECODE_COUNTERS, MOCKER_PREFILL_GAUGES
from matrix.launch.launch_plan import LaunchPlan, ProcessSpec
from matrix.launch.roles import compose_roles, skew_role
from matrix.markers import parse_marker_use


def _plan(tmp_path: Path, launch: dict[str, object], python: str = "/rt/python") -> LaunchPlan:
    case = CaseInfo(
        name="d", backend="dynamo", arm="dynamo", model="matrix-tiny", markers=(parse_marker_use("gpu_0"),),
        launch={"engine": "mocker", **launch}, kv_bound=KvBound(tokens=2048),
    )  # fmt: skip
    arm = get_arm("dynamo")
    ports = {r.name: 20000 + i for i, r in enumerate(arm.port_requests(case))}
    ctx = LaunchContext("cell7", case, RuntimeInfo("dynamo", "1.6.1", "v1.6.1"), ports, tmp_path,
                        python=python, model_dir=tmp_path / "model")  # fmt: skip
    return arm.plan(ctx)


def _flag(argv: tuple[str, ...], flag: str) -> list[str]:
    return [argv[i + 1] for i, part in enumerate(argv) if part == flag]


def test_2p2d_registers_every_worker_in_its_role_on_its_own_system_port(tmp_path: Path) -> None:
    plan = _plan(tmp_path, {"topology": "2p2d"})
    assert [p.role for p in plan.processes] == ["prefill", "decode", "prefill_2", "decode_2", "frontend"]
    workers = {p.role: p for p in plan.processes if p.role != "frontend"}
    for name, process in workers.items():
        assert process.argv[1:3] == ("-m", "dynamo.mocker")
        assert _flag(process.argv, "--disaggregation-mode") == [name.split("_")[0]]
        assert process.env["DYN_SYSTEM_PORT"] == str(plan.ports[f"{name}_system"])
        assert process.health[0].url == f"http://127.0.0.1:{plan.ports[f'{name}_system']}/health"
    assert len({p.env["DYN_SYSTEM_PORT"] for p in workers.values()}) == 4
    # One discovery directory and namespace: the four register behind the one frontend.
    assert len({(p.env["DYN_FILE_KV"], p.env["DYN_NAMESPACE"]) for p in plan.processes}) == 1
    # Ready only once the frontend lists a generate instance per worker, not one per component.
    (probe,) = [p for p in plan.ready_probes if p.require_endpoints]
    assert probe.require_endpoints == (".generate",) * 4


def test_2p2d_topology_spec_names_each_worker_by_its_worker_id_label(tmp_path: Path) -> None:
    plan = _plan(tmp_path, {"topology": "2p2d"})
    spec = plan.topology
    assert spec is not None and spec.topology == "2p2d" and spec.decode_counters == MOCKER_DECODE_COUNTERS
    assert [(w.name, w.role) for w in spec.workers] == [
        ("prefill", "prefill"), ("decode", "decode"), ("prefill_2", "prefill"), ("decode_2", "decode")]  # fmt: skip
    assert all(w.id_label == "worker_id" for w in spec.workers)
    assert spec.workers[3].metrics_url == f"http://127.0.0.1:{plan.ports['decode_2_system']}/metrics"
    assert spec.requests == 16  # four per worker, sent at once, so the round robin reaches every one
    assert plan.peer_loss is None and plan.lifecycle is None


@pytest.mark.parametrize(("topology", "roles"), [("1p2d", ["prefill", "decode", "decode_2"]),
                                                  ("2p1d", ["prefill", "decode", "prefill_2"])])  # fmt: skip
def test_other_topologies_come_from_the_same_plan(tmp_path: Path, topology: str, roles: list[str]) -> None:
    plan = _plan(tmp_path, {"topology": topology})
    assert [p.role for p in plan.processes] == [*roles, "frontend"]
    assert plan.topology is not None and [w.name for w in plan.topology.workers] == roles


def test_a_pair_without_topology_keeps_its_plan(tmp_path: Path) -> None:
    plan = _plan(tmp_path, {})
    assert [p.role for p in plan.processes] == ["prefill", "decode", "frontend"]
    assert plan.topology is None and plan.peer_loss is None
    (probe,) = [p for p in plan.ready_probes if p.require_endpoints]
    assert probe.require_endpoints == (".generate",) * 2


def test_the_aggregated_control_still_runs_one_worker_without_a_mode(tmp_path: Path) -> None:
    plan = _plan(tmp_path, {"aggregated": True})
    assert [p.role for p in plan.processes] == ["worker", "frontend"]
    assert "--disaggregation-mode" not in plan.processes[0].argv


def test_peer_loss_reads_each_survivor_by_what_its_role_publishes(tmp_path: Path) -> None:
    table = {"streams": 4, "stream_tokens": 512, "bound_s": 10, "release_timeout_s": 30}
    plan = _plan(tmp_path, {"topology": "2p2d", "peer_loss": table})
    spec = plan.peer_loss
    assert spec is not None and (spec.streams, spec.stream_tokens, spec.bound_s) == (4, 512, 10.0)
    assert spec.release_timeout_s == 30.0 and spec.roles == ("prefill", "decode")
    assert [w.name for w in spec.workers] == ["prefill", "decode", "prefill_2", "decode_2"]
    gauges = {g.role: g for g in spec.gauges}
    assert (gauges["prefill_2"].running, gauges["prefill_2"].waiting, gauges["prefill_2"].kv_usage) == \
        MOCKER_PREFILL_GAUGES  # fmt: skip
    assert gauges["decode_2"] == EngineGauges("decode_2", spec.workers[3].metrics_url)  # vLLM's gauges


def test_peer_loss_without_topology_covers_the_pair(tmp_path: Path) -> None:
    plan = _plan(tmp_path, {"peer_loss": True})
    assert plan.peer_loss is not None and [w.name for w in plan.peer_loss.workers] == ["prefill", "decode"]
    assert plan.topology is None


@pytest.mark.parametrize(
    ("launch", "match"),
    [
        ({"topology": "3x1"}, "not an xPyD topology"),
        ({"topology": "2p2d", "engine": "vllm"}, "launch.topology runs on the Dynamo arm's mocker workers only"),
        ({"peer_loss": True, "aggregated": True}, "launch.peer_loss runs on the Dynamo arm's mocker workers only"),
        ({"topology": "1p2d", "script": "disagg.sh"}, "mocker workers only"),
        ({"peer_loss": {"streams": 0}}, "launch.peer_loss.streams = 0"),
    ],
)
def test_a_topology_or_peer_loss_the_arm_cannot_run_is_refused_at_sync(launch: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_typed("dynamo", DynamoLaunch, launch)


def test_peer_loss_false_is_left_out_on_any_engine() -> None:
    parsed = parse_typed("dynamo", DynamoLaunch, {"engine": "vllm", "peer_loss": False})
    assert isinstance(parsed, DynamoLaunch) and parsed.peer_loss is False


METRICS = (
    'dynamo_component_inflight_requests{dynamo_component="prefill",dynamo_endpoint="generate",'
    'dynamo_namespace="matrix_x",worker_id="2214f3450a09892c"} 2\n'
    "dynamo_work_handler_queue_depth 1\n"
)


@contextlib.contextmanager
def _serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[int]:
    """A real HTTP server on 127.0.0.1 with `handler`, its port yielded, shut down after."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def metrics_url() -> Iterator[str]:
    """A real HTTP server on loopback answering a Dynamo worker's /metrics text."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with _serving(Handler) as port:
        yield f"http://127.0.0.1:{port}/metrics"


def test_the_instance_id_is_the_worker_id_label_in_decimal(metrics_url: str) -> None:
    # What the frontend reports as nvext.worker_id.prefill_worker_id for this worker.
    worker = TopologyWorker("prefill", "prefill", metrics_url.replace("/metrics", "/health"), metrics_url, "worker_id")
    with loopback_client(5.0) as client:
        assert instance_id(client, worker) == str(0x2214F3450A09892C) == "2455855174670453036"
        assert instance_id(client, TopologyWorker("p", "prefill", "", metrics_url, "instance")) is None


def test_a_gauge_named_empty_is_not_published_and_reads_zero() -> None:
    gauges = EngineGauges("prefill", "http://127.0.0.1:1/metrics", *MOCKER_PREFILL_GAUGES)
    assert parse_gauges(METRICS, gauges) == {"running": 2.0, "waiting": 1.0, "kv_usage": 0.0}
    # A named gauge the text lacks is still an error, never a silent 0.
    assert isinstance(parse_gauges(METRICS, EngineGauges("decode", "http://127.0.0.1:1/metrics")), str)


def _answer(number: int) -> bytes:
    """A chat completion as Dynamo's frontend answers it, naming pair (1, 10 + number % 2)."""
    return json.dumps({
        "id": f"chatcmpl-{number}", "object": "chat.completion", "created": 1, "model": "matrix-tiny",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": " pezovi losovi sopeso"},
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": 14, "completion_tokens": 3, "total_tokens": 17},
        "nvext": {"worker_id": {"prefill_worker_id": 1, "decode_worker_id": 10 + number % 2}},
    }).encode()  # fmt: skip


@pytest.fixture
def chat_url() -> Iterator[str]:
    """A real frontend on loopback that refuses every third request with 503, as Dynamo does one routed to a
    dead worker."""
    counter = itertools.count(1)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            number = next(counter)
            body = _answer(number) if number % 3 else b'{"message":"Service temporarily unavailable","code":503}'
            self.send_response(200 if number % 3 else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with _serving(Handler) as port:
        yield f"http://127.0.0.1:{port}/v1/chat/completions"


def test_the_checks_own_requests_name_their_pairs_and_a_refused_one_fails(chat_url: str) -> None:
    entries, failures = probe(RequestSpec(chat_url, "matrix-tiny", "hello", 3, 10.0), 6)
    assert len(entries) == 4 and {e["prefill_worker_id"] for e in entries} == {1}
    assert {e["decode_worker_id"] for e in entries} <= {10, 11}
    (failure,) = failures
    assert failure.name == UNANSWERED
    assert failure.message.startswith("2 of the 6 request(s) sent to put every worker to work were not answered 200")


def test_a_skew_cell_runs_each_worker_of_a_role_in_that_roles_runtime(tmp_path: Path) -> None:
    """`--prefill-runtime dynamo=A --decode-runtime dynamo=B` on a topology case: "prefill_2" is a prefill."""
    launch = {"topology": "2p2d"}
    base = _plan(tmp_path, launch, "/decode-rt/python")
    by_role = {"prefill": _plan(tmp_path, launch, "/prefill-rt/python"), "decode": base, "frontend": base}
    composed = compose_roles(base, by_role)
    assert {p.role: p.argv[0] for p in composed.processes} == {
        "prefill": "/prefill-rt/python", "prefill_2": "/prefill-rt/python", "decode": "/decode-rt/python",
        "decode_2": "/decode-rt/python", "frontend": "/decode-rt/python"}  # fmt: skip
    assert skew_role(ProcessSpec(role="decode_3", argv=())) == "decode"
    with pytest.raises(ConfigError, match="runs more than one role in one process"):
        skew_role(ProcessSpec(role="worker_2", argv=()))
