"""Redaction, printable text, bounded log tails, inert Markdown and safe links."""

from __future__ import annotations

from pathlib import Path

import pytest

from matrix.redact import redact, redact_pair
from matrix.report.links import external_url, runtime_page, slug
from matrix.report.markdown import md
from matrix.text import clean, completion_excerpt, printable, read_tail


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("HF_TOKEN=hf_abc123 next", "HF_TOKEN=*** next"),
        ('export OPENAI_API_KEY="sk-xyz"', 'export OPENAI_API_KEY="***"'),
        ('{"HF_TOKEN": "abc", "x": 1}', '{"HF_TOKEN": "***", "x": 1}'),
        ("env: {'AWS_SECRET': 'q'}", "env: {'AWS_SECRET': '***'}"),
        ("postgresql+psycopg://me:s3cr3t@db:5432/x", "postgresql+psycopg://me:***@db:5432/x"),
        ("--api-key sk-1 --hf-token=zzz", "--api-key *** --hf-token=***"),
        ("Authorization: Bearer abc.def", "Authorization: Bearer ***"),
        ("password: hunter2", "password: ***"),
        ("db_password=pw1;", "db_password=***;"),
        # Value shapes: well-known token formats wherever they stand, prefix kept ([M11] item 4).
        ("bare hf_abcdefghijklmnop1234 in a line", "bare hf_*** in a line"),
        ("ghp_abcdefghijklmnopqrstuvwxyz0123456789", "ghp_***"),
        ("token github_pat_11ABCDEFG0_abcdefghijklmnop.", "token github_pat_***."),
        ("client(sk-proj-abcdefghijklmnop1234)", "client(sk-proj-***)"),
        ("key id AKIAIOSFODNN7EXAMPLE here", "key id AKIA*** here"),
        ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "Authorization: Basic ***"),
        ("{'authorization': 'Token abc123'}", "{'authorization': 'Token ***'}"),
        # Secret words anywhere in a name.
        ("MY_SECRET_VALUE=hunter2 x", "MY_SECRET_VALUE=*** x"),
        ("HF_TOKEN_2=abc", "HF_TOKEN_2=***"),
        ("AWS_CREDENTIALS: abc", "AWS_CREDENTIALS: ***"),
        ("HF_TOKEN=\x1b[0mhf_abcdefghijkl", "HF_TOKEN=***"),
        # [M21] item 8: shapes that were missed.
        ("stripe sk_live_abcdefghijklmnop1234 x", "stripe sk_live_*** x"),
        ("rk_test_abcdefghijklmnop", "rk_test_***"),
        ("gitlab glpat-abcdefghijklmnopqrst.", "gitlab glpat-***."),
        ("//registry/:_authToken=npm_abcdefghijklmnopqrstuvwxyz0123456789", "//registry/:_authToken=***"),
        ("npm_abcdefghijklmnopqrstuvwxyz0123456789", "npm_***"),
        ("slack xapp-1-A0123-4567-abcdef", "slack xapp-***"),
        ("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.abcdefghijk_lmn ok", "jwt eyJ*** ok"),
        ("password hunter2", "password ***"),
        ("Enter passphrase 'x9y8z7'", "Enter passphrase '***'"),
        ("mysql -u root -p hunter2 db", "mysql -u root -p *** db"),
        ("sshpass -p 'hunter2' ssh", "sshpass -p '***' ssh"),
        ("postgresql://me:pa/ss@db:5432/x", "postgresql://me:***@db:5432/x"),
        ("postgresql://me:p@ss@db/x", "postgresql://me:***@db/x"),
        ("redis://:s3cr@t/x@localhost:6379/0", "redis://:***@localhost:6379/0"),
    ],
)
def test_redact_hides_secret_values(text: str, expected: str) -> None:
    assert clean(text) == expected


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("env.HF_TOKEN", "hf_x", "***"),  # [M11] item 1: a name and value shown apart
        ("env.DEPLOY_PASSWORD", "plain", "***"),
        ("env.API_KEY", "abc", "***"),
        ("env.MAX_TOKENS", "16", "16"),
        ("env.NOTE", "hf_abcdefghijklmnop", "hf_***"),
        ("python", "/usr/bin/python3", "/usr/bin/python3"),
    ],
)
def test_redact_pair_judges_the_name_too(name: str, value: str, shown: str) -> None:
    assert redact_pair(name, value) == shown


@pytest.mark.parametrize(
    "text",
    [
        "completion_tokens=64 prompt_tokens=91", "fix key: vllm#54814", "https://example.org/a:b@c", "ports: {'a': 1}",
        "max_num_batched_tokens=2048", "tokenizer='Qwen/Qwen3-0.6B'", "task-abcdefghijklmnop", "Basic setup done",
        "disk-usage-abcdefghijk",
        # [M21] item 8: ordinary text is not garbled.
        "error: unknown-key.toml: [[cases]] entry 2: unknown key 'x'", "the password is wrong",
        "docker run -p 8080:80 -p 127.0.0.1:8000:8000/tcp", "use -p to set it", "ls -p -x",
        "https://host:8080/path?x=a@b c", "see api-key.md: [setup]", "skeleton_framework npm_i",
    ],
)
def test_redact_leaves_ordinary_text_alone(text: str) -> None:
    assert redact(text) == text


def test_printable_drops_ansi_and_escapes_control_characters() -> None:
    text = "\x1b[31mred\x1b[0m\r\nline\x00\x07 \x1b]0;title\x07end \ud800 \ufffe tab\tok"
    assert printable(text) == "red\nline\\x00\\x07 end \\ud800 \\ufffe tab\tok"


def test_printable_shows_bidi_overrides_and_zero_width_characters() -> None:
    # [M21] item 9: they reorder or hide text ("Trojan Source"); shown as visible escapes like control bytes.
    text = "run\u202etxt.exe \u2066iso\u2069 \u202a\u202b\u202c\u202d a\u200bb\u200c\u200d\u200e\u200f\u2060\ufeff é 😀"
    assert printable(text) == (
        "run\\u202etxt.exe \\u2066iso\\u2069 \\u202a\\u202b\\u202c\\u202d a\\u200bb\\u200c\\u200d\\u200e\\u200f"
        "\\u2060\\ufeff é 😀"
    )


def test_read_tail_of_a_huge_log_is_bounded(tmp_path: Path) -> None:
    log = tmp_path / "prefill.log"
    line = "x" * 99 + "\n"
    log.write_text(line * 20_000 + "HF_TOKEN=hunter2 \x1b[1mlast\x1b[0m\n")
    tail = read_tail(log, max_lines=200, max_bytes=64 * 1024)
    assert tail is not None
    assert tail.truncated and tail.size > 2_000_000
    assert tail.lines == 200 and len(tail.text) < 64 * 1024
    assert tail.text.endswith("HF_TOKEN=*** last")
    assert read_tail(tmp_path / "missing.log") is None


def test_read_tail_handles_invalid_utf8_and_one_huge_line(tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    log.write_bytes(b"\xff\xfe" + b"y" * 200_000)
    tail = read_tail(log, max_bytes=1024)
    assert tail is not None and tail.text == ""  # the only line was cut by the byte cap


def test_clean_combines_both() -> None:
    assert clean("\x1b[32mMY_KEY=v\x1b[0m") == "MY_KEY=***"
    assert clean(None) == ""


def test_markdown_text_is_inert() -> None:
    out = md("<script>alert(1)</script> [x](javascript:alert(1)) | @team `code`\nnext")
    assert "<" not in out and ">" not in out
    assert "\\[x\\]\\(javascript:alert\\(1\\)\\)" in out
    assert "\\|" in out and "@\u200bteam" in out and "\n" not in out


def test_links_are_followed_only_for_http() -> None:
    assert external_url("https://github.com/vllm-project/vllm/pull/54814")
    for bad in ("javascript:alert(1)", "data:text/html,x", "//evil", "", None, "http://"):
        assert external_url(bad) is None


def test_page_names_are_safe() -> None:
    assert runtime_page("vllm", "0.29.1rc1.dev347+gdee37d891") == "runtime-vllm-0.29.1rc1.dev347_gdee37d891.html"
    assert slug('../<img src=x onerror="a">') == "_img_src_x_onerror_a_"


def test_completion_excerpt_redacts_then_cuts() -> None:
    # [M21] item 7: a token straddling the 200-character cut kept the 7 characters before the cut.
    token = "ghp_" + "ZqXcut7" + "abcdefghijklmnop"
    text = "a" * 188 + " " + token + " and more"
    assert "ZqX" in (text[:200])  # what a cut before redaction kept
    excerpt = completion_excerpt(text)
    assert "ZqX" not in excerpt and excerpt == "a" * 188 + " ghp_*** an" + "…"
    assert len(excerpt) == 200


def test_remembered_secrets_are_hidden_by_value(monkeypatch: pytest.MonkeyPatch) -> None:
    # [M21] item 6: a catalog secret printed bare (no name next to it) is hidden wherever it stands.
    from matrix import redact as module

    monkeypatch.setattr(module, "_KNOWN", ())
    module.remember_secrets(["s3cr3t-value", "16", "true", "abc", "s3cr3t-value-longer"])
    assert redact("auth failed for s3cr3t-value-longer and s3cr3t-value") == "auth failed for *** and ***"
    assert redact("max_tokens 16 true abc") == "max_tokens 16 true abc"  # counts, flags, short values stay


@pytest.mark.parametrize(
    "name", ["MY_API_KEY", "DB_PASSWORD", "HF_TOKEN", "APIKEY", "aws_secret", "X_PWD", "tokenizer", "MAX_TOKENS"],
)
def test_catalog_secret_names_agree_with_redaction(name: str) -> None:
    from matrix.catalog.secrets import SECRET_NAME, provider_secrets
    from matrix.redact import secret_name

    assert bool(SECRET_NAME.search(name)) == secret_name(name)
    assert provider_secrets([{"env": {name: "value-1"}}]) == ({"value-1"} if secret_name(name) else set())
