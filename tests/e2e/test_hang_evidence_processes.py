"""The evidence of a hang (`matrix.launch.hang`) read from real processes: /proc state, wchan, threads, log tail."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from matrix.check.specs import RequestSpec
from matrix.launch.hang import waiting_on

REQUEST = RequestSpec(url="http://127.0.0.1:1/v1/chat/completions", model="m", prompt="p", max_tokens=8)


def test_each_roles_process_tree_state_wchan_and_log_tail_are_read(tmp_path: Path) -> None:
    # A parent that waits on a sleeping child: the shape of an engine and its engine-core process.
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(1.0)
        log = tmp_path / "decode.log"
        log.write_text("starting\nwaiting for remote KV of request 7\n")
        text = waiting_on({"decode": proc.pid, "prefill": 2**22 + 7}, {"decode": log}, REQUEST, 12.3)
    finally:
        proc.kill()
        proc.wait()
    lines = text.splitlines()
    assert lines[0] == f"request in flight: POST {REQUEST.url} (max_tokens 8), no answer after 12.3 s"
    decode = text.split("decode:\n", 1)[1].split("prefill:\n", 1)[0]
    # The parent and its child, each sleeping in the kernel (wait4 / a timed sleep), with their threads.
    assert decode.count("state S (sleeping), wchan ") == 2, decode
    assert f"pid {proc.pid} " in decode and "1 threads: 1 in " in decode, decode
    assert decode.rstrip().endswith("log| waiting for remote KV of request 7"), decode
    assert text.rstrip().endswith(f"pid {2**22 + 7}: exited"), text
