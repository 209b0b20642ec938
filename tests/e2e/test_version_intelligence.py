"""`matrix discover` + `matrix run --new`, and `matrix bisect`, on real reference pairs.

A bisect needs versions that differ in behaviour: each synthetic runtime is the built-in reference server,
and from a planted version on its recipe carries `MATRIX_REFERENCE_FAULTS` in the provider's env, so its
pair really fails (the workers crash at start). Nothing of matrix is replaced.
"""

from __future__ import annotations

import json
import math
import re
import signal
import time
from pathlib import Path

import pytest

from matrix.bisect import max_cells
from tests.helpers.catalogs import DISCOVER_CATALOG
from tests.helpers.cli import Matrix
from tests.helpers.pep691 import serve_index, wheel, write_project
from tests.helpers.synth import campaign_rows, sync_synth, synthetic_catalog


def test_run_new_runs_exactly_the_never_run_runtimes(matrix: Matrix, tmp_path: Path) -> None:
    (tmp_path / "refpkg.toml").write_text(DISCOVER_CATALOG)
    sync_synth(matrix, str(tmp_path / "refpkg.toml"))
    first = matrix.subprocess("run", "--backend", "refpkg", "--no-report", "-q")
    assert first.returncode == 0, first.stdout + first.stderr
    write_project(tmp_path / "index", "ref-pkg", [wheel("ref-pkg", "1.0.0"), wheel("ref-pkg", "1.1.0"),
                                                  wheel("ref-pkg", "2.0.0")])  # fmt: skip
    with serve_index(tmp_path / "index") as url:
        added = matrix.subprocess("discover", "refpkg", "--index-url", url)
    assert added.returncode == 0 and "2 runtime(s) added" in added.stdout, added.stdout + added.stderr
    preview = matrix.subprocess("plan", "--new", "--json")
    assert preview.returncode == 0, preview.stdout + preview.stderr
    previewed = sorted(c["cell"].rsplit("-", 1)[-1] for c in json.loads(preview.stdout)["cells"])
    new = matrix.subprocess("run", "--new", "--no-report", "-q")
    assert new.returncode == 0, new.stdout + new.stderr
    (latest,) = matrix.sql("SELECT max(id) FROM campaign")[0]
    # Exactly the two discovered runtimes ran (the builtin pair passes on each), not 1.0.0 again.
    assert sorted(campaign_rows(matrix, int(str(latest)))) == [("1.1.0", "passed"), ("2.0.0", "passed")]
    assert previewed == ["1.1.0", "2.0.0"]  # `plan --new` previewed exactly what ran
    again = matrix.subprocess("run", "--new", "--no-report", "-q")
    assert again.returncode == 0 and "nothing to run" in again.stdout + again.stderr
    assert matrix.sql("SELECT count(*) FROM campaign")[0][0] == 2
    bad = matrix.subprocess("run", "--new", "--resume", "1")
    assert bad.returncode == 2 and "--new" in bad.stderr


@pytest.mark.parametrize("break_at", [1, 5, 7])
def test_bisect_finds_the_planted_break_within_the_bound(matrix: Matrix, tmp_path: Path, break_at: int) -> None:
    n = 8
    sync_synth(matrix, synthetic_catalog(tmp_path / "synth.toml", n, break_at))
    result = matrix.subprocess("bisect", "synth_pair", "--between", "1.0.0", f"1.{n - 1}.0", "--json", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert data["first"] == f"1.{break_at}.0" and data["last_other"] == f"1.{break_at - 1}.0"
    assert data["direction"] == "first bad"
    assert data["attempts"] == data["cells_run"] <= max_cells(n) == math.ceil(math.log2(n)) + 1
    # Every probe is a normal attempt of the one bisect campaign, with the pair's real error.
    rows = campaign_rows(matrix, data["campaign"])
    assert len(rows) == data["attempts"]
    for probe in data["probes"]:
        bad = int(probe["version"].split(".")[1]) >= break_at
        assert probe["verdict"] == ("bad" if bad else "good")
        assert probe["statuses"] == (["failed"] if bad else ["passed"])
        if bad:
            assert probe["messages"][0].startswith("startup:"), probe
    (selection,) = matrix.sql("SELECT selection FROM campaign WHERE id = ?", data["campaign"])[0]
    stored = json.loads(str(selection))
    assert stored["bisect"]["result"]["first"] == f"1.{break_at}.0"
    shown = matrix.subprocess("show", f"synth_pair@synth-1.{n - 1}.0", "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["status"] == "failed"


def test_bisect_finds_the_first_good_version_of_a_fix(matrix: Matrix, tmp_path: Path) -> None:
    sync_synth(matrix, synthetic_catalog(tmp_path / "synth.toml", 6, 3, fix=True))
    result = matrix.subprocess("bisect", "synth_pair", "--between", "1.5.0", "1.0.0", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "first good version: 1.3.0 (previous: 1.2.0)" in result.stdout
    assert "startup:" in result.stdout  # the evidence table carries each failing probe's error
    # The report draws the campaign as a version line, the boundary marked just before the first good one.
    report = matrix.subprocess("report", "--out", str(tmp_path / "report"))
    assert report.returncode == 0, report.stdout + report.stderr
    page = (tmp_path / "report" / "campaign-1.html").read_text()
    line = page[page.index('<ol class="bisect-line">') : page.index("</ol>")]
    versions = re.findall(r'<span class="badge (st-[a-z-]+)">(1\.\d\.0)</span>', line)
    assert [v for _, v in versions] == [f"1.{i}.0" for i in range(6)]
    boundary = line.index('class="boundary"')
    assert line.index(">1.2.0<") < boundary < line.index(">1.3.0<")
    verdicts = dict((v, css) for css, v in versions)
    assert verdicts["1.3.0"] == "st-passed" and verdicts["1.2.0"] == "st-failed" and verdicts["1.0.0"] == "st-failed"
    assert "first good version: <strong>1.3.0</strong>" in page


def test_bisect_with_nothing_to_bisect_says_so(matrix: Matrix, tmp_path: Path) -> None:
    sync_synth(matrix, synthetic_catalog(tmp_path / "synth.toml", 4, 99))
    result = matrix.subprocess("bisect", "synth_pair", "--between", "1.0.0", "1.3.0", timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the bad end 1.3.0 passed here: nothing to bisect" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("synth_pair", "--between", "1.0.0", "9.9.9"), "BAD 9.9.9 is not a runtime the case runs on"),
        (("synth_pair", "--between", "1.0.0", "1.0"), "two different versions"),
        (("synth_pair", "--between", "1.0.0", "1.3.0", "--repeat", "0"), "--repeat must be at least 1"),
        (("nosuch", "--between", "1.0.0", "1.3.0"), "unknown case 'nosuch'"),
        (("synth_pair", "--between", "1.0.0", "x.y"), "--between"),
    ],
)
def test_bisect_bad_input_exit_2_database_unchanged(
    matrix: Matrix, tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    sync_synth(matrix, synthetic_catalog(tmp_path / "synth.toml", 4, 2))
    before = matrix.dump()
    result = matrix.subprocess("bisect", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert matrix.dump() == before


def test_ctrl_c_leaves_a_resumable_bisect_campaign(matrix: Matrix, tmp_path: Path) -> None:
    n, break_at = 8, 3
    # A slow start keeps the first probe running long enough to be interrupted mid-cell.
    sync_synth(matrix, synthetic_catalog(tmp_path / "synth.toml", n, break_at))
    args = ("bisect", "synth_pair", "--between", "1.0.0", f"1.{n - 1}.0", "--json")
    proc = matrix.popen(*args)
    try:
        deadline = time.monotonic() + 60
        while not matrix.sql("SELECT 1 FROM cell_run WHERE status = 'running'") and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 3, output
    assert "interrupted: run the same command again" in output
    (campaign, status), = matrix.sql("SELECT id, status FROM campaign")
    assert status == "interrupted"
    resumed = matrix.subprocess(*args, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    data = json.loads(resumed.stdout)
    assert data["campaign"] == campaign and data["first"] == f"1.{break_at}.0"
    assert data["attempts"] <= max_cells(n)
    statuses = [s for _, s in campaign_rows(matrix, int(str(campaign)))]
    assert "interrupted" in statuses  # the stopped attempt stays on record, beside its rerun


def test_flaky_bisect_reaches_its_confidence_on_real_pairs(matrix: Matrix, tmp_path: Path) -> None:
    # flaky-start at its default rate fails every start, so the outcome is certain; the search still assumes
    # a 40 % flake and so probes until the posterior, not a single failure, names the version.
    n, break_at = 8, 5
    sync_synth(matrix, synthetic_catalog(tmp_path / "synth.toml", n, break_at, fault="flaky-start"))
    result = matrix.subprocess("bisect", "synth_pair", "--between", "1.0.0", f"1.{n - 1}.0", "--flaky", "0.4",
                               "--json", timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert data["first"] == f"1.{break_at}.0" and data["confidence"] >= 0.95
    assert data["attempts"] == len(campaign_rows(matrix, data["campaign"]))
    bad = matrix.subprocess("bisect", "synth_pair", "--between", "1.0.0", "1.7.0", "--flaky", "1.5")
    assert bad.returncode == 2 and "--flaky RATE" in bad.stderr


def test_repeat_runs_every_probe_k_times_in_one_campaign(matrix: Matrix, tmp_path: Path) -> None:
    n, break_at = 4, 2
    sync_synth(matrix, synthetic_catalog(tmp_path / "synth.toml", n, break_at))
    result = matrix.subprocess("bisect", "synth_pair", "--between", "1.0.0", "1.3.0", "--repeat", "2", "--json",
                               timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert data["first"] == "1.2.0" and data["unsure"] == []
    assert all(len(p["statuses"]) == 2 for p in data["probes"])
    assert data["attempts"] == 2 * len(data["probes"]) <= 2 * max_cells(n)
    attempts = matrix.sql("SELECT attempt FROM cell_run WHERE campaign_id = ? ORDER BY attempt", data["campaign"])
    assert sorted({int(str(a)) for (a,) in attempts}) == [1, 2]


FROM_INDEX_CATALOG = """
[[backend]]
name = "idx"
runtime_template = { package = "idx-pkg", provider = { kind = "builtin", env = { IDX_PKG = "{version}" } }, \
components = { idx-pkg = "{version}" } }

[[runtime]]
backend = "idx"
version = "1.0.0"
provider = { kind = "builtin" }

[[runtime]]
backend = "idx"
version = "2.0.0"
provider = { kind = "builtin", env = { MATRIX_REFERENCE_FAULTS = "crash-at-start" } }

[[case]]
name = "idx_pair"
backend = "idx"
arm = "reference"
model = "tiny"
markers = ["gpu_0"]
startup_timeout_s = 20
request_timeout_s = 10
launch = {}
"""


def test_bisect_from_index_walks_the_releases_the_catalog_lacks(matrix: Matrix, tmp_path: Path) -> None:
    """Only 1.0.0 (good) and 2.0.0 (bad) are in the catalog; the index has three releases between them (and a
    yanked one, a pre-release and one outside the range). They become runtimes through the template and are
    probed: the boundary is found between the last discovered release and 2.0.0."""
    (tmp_path / "idx.toml").write_text(FROM_INDEX_CATALOG)
    sync_synth(matrix, str(tmp_path / "idx.toml"))
    write_project(tmp_path / "index", "idx-pkg", [
        wheel("idx-pkg", "0.9.0"), wheel("idx-pkg", "1.0.0"), wheel("idx-pkg", "1.1.0"),
        wheel("idx-pkg", "1.2.0", yanked="bad build"), wheel("idx-pkg", "1.3.0"), wheel("idx-pkg", "1.4.0rc1"),
        wheel("idx-pkg", "1.4.0"), wheel("idx-pkg", "2.0.0"), wheel("idx-pkg", "2.1.0"),
    ])  # fmt: skip
    with serve_index(tmp_path / "index") as url:
        result = matrix.subprocess("bisect", "idx_pair", "--between", "1.0.0", "2.0.0", "--from-index",
                                   "--index-url", url, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 added as runtimes: 1.1.0, 1.3.0, 1.4.0" in result.stdout
    assert "left out: 1.2.0 (yanked)" in result.stdout
    assert "first bad version: 2.0.0 (previous: 1.4.0)" in result.stdout
    versions = {str(v): str(s) for v, s in matrix.sql(
        "SELECT runtime.version, runtime.source FROM runtime JOIN backend ON backend.id = runtime.backend_id "
        "WHERE backend.name = 'idx'")}  # fmt: skip
    assert versions == {"1.0.0": "catalog", "1.1.0": "discovered", "1.3.0": "discovered", "1.4.0": "discovered",
                        "2.0.0": "catalog"}  # fmt: skip
    probed = {v for v, _ in campaign_rows(matrix, 1)}
    assert "2.0.0" in probed and probed & {"1.1.0", "1.3.0", "1.4.0"}


def dependency_wheel(wheels: Path, version: str, *, breaks: bool) -> None:
    """A real wheel of `refdep`; a breaking version ships a .pth file, which Python runs at start-up in every
    process of the venv, that plants a start-up crash into the reference server: a dependency that breaks
    the engine, as NIXL 1.2.0 broke every P/D job."""
    import zipfile

    name = f"refdep-{version}-py3-none-any.whl"
    info = f"refdep-{version}.dist-info"
    files = {
        "refdep/__init__.py": f"__version__ = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: refdep\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }  # fmt: skip
    if breaks:
        files["refdep_break.pth"] = "import os; os.environ.setdefault('MATRIX_REFERENCE_FAULTS', 'crash-at-start')\n"
    files[f"{info}/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheels / name, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)


def test_bisect_component_walks_a_dependencys_releases_under_one_engine_runtime(
    matrix: Matrix, tmp_path: Path
) -> None:
    """The engine runtime stays fixed; each refdep release is pinned into its recipe in turn (real venvs built
    offline from real wheels); from 1.3.0 on the dependency breaks the pair."""
    import site

    import matrix as package

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    versions = ["1.0.0", "1.1.0", "1.2.0", "1.3.0", "1.4.0"]
    for v in versions:
        dependency_wheel(wheels, v, breaks=v >= "1.3.0")
    # The venv gets matrix (for `python -m matrix.reference`) and its libraries from this interpreter.
    pythonpath = ":".join([str(Path(package.__file__).parent.parent), *site.getsitepackages()])
    (tmp_path / "dep.toml").write_text(f"""
[[backend]]
name = "eng"

[[runtime]]
backend = "eng"
version = "2.0.0"
components = {{ refdep = "1.4.0" }}
provider = {{ kind = "venv", python = "3.11", env = {{ PYTHONPATH = "{pythonpath}" }}, steps = [
  ["--no-index", "--find-links", "{wheels}", "refdep==1.4.0"],
] }}

[[case]]
name = "eng_pair"
backend = "eng"
arm = "reference"
model = "tiny"
markers = ["gpu_0"]
startup_timeout_s = 30
request_timeout_s = 10
launch = {{}}
""")
    sync_synth(matrix, str(tmp_path / "dep.toml"))
    write_project(tmp_path / "index", "refdep", [wheel("refdep", v) for v in versions]
                  + [wheel("refdep", "1.5.0rc1"), wheel("refdep", "1.0.5", yanked=True)])  # fmt: skip
    with serve_index(tmp_path / "index") as url:
        result = matrix.subprocess("bisect", "eng_pair", "--component", "refdep", "--between", "1.0.0", "1.4.0",
                                   "--index-url", url, "--json", timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert (data["first"], data["last_other"], data["direction"]) == ("1.3.0", "1.2.0", "first bad")
    assert data["attempts"] <= max_cells(5)
    for probe in data["probes"]:
        assert probe["verdict"] == ("bad" if probe["version"] >= "1.3.0" else "good"), probe
    assert "left out 1.0.5 (yanked)" in result.stderr
    variants = {str(v): str(s) for v, s in matrix.sql(
        "SELECT version, source FROM runtime WHERE version LIKE '2.0.0+%'")}  # fmt: skip
    assert variants == {f"2.0.0+refdep.{v}": "derived" for v in versions}
    # A variant runs only when named: a plain plan of the backend shows the catalog's runtime alone.
    plan = matrix.subprocess("plan", "--backend", "eng", "--format", "json")
    assert plan.returncode == 0, plan.stderr
    assert [c["version"] for c in json.loads(plan.stdout)["cells"]] == ["2.0.0"], plan.stdout


def test_a_version_that_gives_no_outcome_is_stepped_around_and_named(matrix: Matrix, tmp_path: Path) -> None:
    """1.2.0's interpreter is not on this host (its cells are skipped): the bisect steps around it, finds the
    boundary from its neighbours and names 1.2.0 as unsure only when the break may be there."""
    path = Path(synthetic_catalog(tmp_path / "synth.toml", 6, 4))
    builtin = 'version = "1.2.0"\nprovider = { kind = "builtin" }'
    text = path.read_text().replace(builtin, 'version = "1.2.0"\nprovider = { kind = "host", python = "python3.99" }')
    path.write_text(text)
    sync_synth(matrix, str(path))
    result = matrix.subprocess("bisect", "synth_pair", "--between", "1.0.0", "1.5.0", "--json", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert (data["first"], data["last_other"], data["unsure"]) == ("1.4.0", "1.3.0", [])
    skipped = [p for p in data["probes"] if p["verdict"] == "skip"]
    assert [p["version"] for p in skipped] == ["1.2.0"] and "python3.99" in skipped[0]["skipped"]
    assert "stepping around it" in result.stderr
