"""Host resources a cell needs exclusively while it runs: GPUs and network ports."""
