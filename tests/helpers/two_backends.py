"""A catalog of two reference runtimes (a comparison between them) and a builtin runtime of another backend,
each with one quick reference case: what the report tests run real campaigns on."""

from __future__ import annotations

CATALOG = """
[[backend]]
name = "synth"

[[runtime]]
backend = "reference"
version = "0.1.0"
provider = { kind = "builtin" }
components = { matrix-reference = "0.1.0" }

[[runtime]]
backend = "reference"
version = "0.2.0"
provider = { kind = "builtin" }
components = { matrix-reference = "0.2.0" }

[[runtime]]
backend = "synth"
version = "1.0.0"
provider = { kind = "builtin" }

[[case]]
name = "ref_quick"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_0"]
startup_timeout_s = 30
launch = { lifecycle = false }

[[case]]
name = "synth_quick"
backend = "synth"
arm = "reference"
model = "tiny"
markers = ["gpu_0"]
startup_timeout_s = 30
launch = { lifecycle = false }
"""
