"""[M15] item 4: the KV-transfer ledger from the engines' own counters, on recorded real scrapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from matrix.check.ledger import MIB, SOURCES, ledger, measure
from matrix.report.fmt import fmt_kv_ledger, fmt_rate

METRICS = Path(__file__).resolve().parents[1] / "data" / "metrics"


def scrape(name: str) -> str:
    return (METRICS / name).read_text(encoding="utf-8")


def test_sglang_prefill_scrapes_give_one_transfer_of_48_kib() -> None:
    """SGLang 0.5.21 (recorded around one request): latency in ms, size in MiB, both histograms."""
    found = measure(scrape("sglang-0.5.21-prefill-before.prom"), scrape("sglang-0.5.21-prefill-after.prom"), "p")
    assert found["transfers"] == 1
    assert found["bytes"] == round(0.046875 * MIB) == 49152
    assert found["seconds"] == pytest.approx(8.599362000040855e-3)
    # SGLang itself reported 0.00532 GB/s with binary GB; the ledger's GB is decimal.
    assert found["gb_per_s"] == pytest.approx(49152 / 8.599362000040855e-3 / 1e9)
    assert found["source"] == "sglang at p"


def test_vllm_nixl_counters_are_read_from_a_recorded_decode_scrape() -> None:
    """vLLM's NIXL histograms as a real decode published them (idle: zero), then the same text with one
    transfer added to the series the ledger reads."""
    before = scrape("vllm-rs-0.31.0-gpu-decode.txt")
    idle = measure(before, before)
    assert idle == {"transfers": 0, "bytes": 0, "seconds": 0.0, "gb_per_s": None, "source": "vllm-nixl"}
    after = (
        before.replace('vllm:nixl_xfer_time_seconds_count{model_name="matrix-tiny-random",engine="0"} 0',
                       'vllm:nixl_xfer_time_seconds_count{model_name="matrix-tiny-random",engine="0"} 2')
        .replace('vllm:nixl_xfer_time_seconds_sum{model_name="matrix-tiny-random",engine="0"} 0.0',
                 'vllm:nixl_xfer_time_seconds_sum{model_name="matrix-tiny-random",engine="0"} 0.004')
        .replace('vllm:nixl_bytes_transferred_sum{model_name="matrix-tiny-random",engine="0"} 0.0',
                 'vllm:nixl_bytes_transferred_sum{model_name="matrix-tiny-random",engine="0"} 4000000.0')
    )  # fmt: skip
    assert after != before
    found = measure(before, after)
    assert (found["transfers"], found["bytes"], found["seconds"]) == (2, 4_000_000, pytest.approx(0.004))
    assert found["gb_per_s"] == pytest.approx(1.0)


def test_a_scrape_without_transfer_counters_gives_no_ledger() -> None:
    """An aggregated SGLang server publishes no kv_transfer series: not measured, not "0 bytes"."""
    aggregated = scrape("sglang-0.5.21-aggregated.prom")
    assert measure(aggregated, aggregated) == {}


def test_the_endpoint_that_saw_the_most_bytes_stands_for_the_attempt() -> None:
    before, after = scrape("sglang-0.5.21-prefill-before.prom"), scrape("sglang-0.5.21-prefill-after.prom")
    aggregated = scrape("sglang-0.5.21-aggregated.prom")
    urls = ["http://127.0.0.1:1/metrics", "http://127.0.0.1:2/metrics"]
    found = ledger(urls, {0: aggregated, 1: before}, {0: aggregated, 1: after})
    assert found["bytes"] == 49152 and found["source"] == "sglang at http://127.0.0.1:2/metrics"
    # An endpoint that could not be read before the request is left out (its totals are not a delta).
    assert ledger(urls, {0: aggregated}, {0: aggregated, 1: after}) == {}


def test_every_source_names_three_distinct_series() -> None:
    for source in SOURCES:
        assert len(set(source.series)) == 3, source


@pytest.mark.parametrize(
    ("gb_per_s", "shown"),
    [(12.43, "12.4 GB/s"), (1.0, "1 GB/s"), (0.897, "897 MB/s"), (0.000897, "897 kB/s"), (0.0059, "5.9 MB/s"),
     (0.9996, "1 GB/s"), (0.0009996, "1 MB/s"), (0.99949, "999 MB/s")],
)
def test_a_rate_is_shown_in_the_unit_that_keeps_it_short(gb_per_s: float, shown: str) -> None:
    # A CPU pair moves kilobytes: "0.000897 GB/s" was a raw-looking float in `show` and the report.
    assert fmt_rate(gb_per_s) == shown
    assert fmt_kv_ledger({"transfers": 1, "bytes": 5800, "seconds": 0.00649, "gb_per_s": gb_per_s}).endswith(
        f"5.8 kB in 6.490 ms ({shown})"
    )
