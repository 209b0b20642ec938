"""Built-in reference disaggregated server: a frontend, a prefill worker and a decode worker.

Three real processes on 127.0.0.1 that speak a small version of vLLM's toy-proxy protocol and answer
chat completions in Dynamo's shape. It starts in well under a second and can be told to misbehave in
named ways (see `faults.py`), so the test-suite can prove that the runner catches each failure.

Run with `python -m matrix.reference worker ...` or `python -m matrix.reference frontend ...`.
Nothing is imported here: start-up time matters more than convenience.
"""
