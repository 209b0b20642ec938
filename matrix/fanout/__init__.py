"""CI fan-out: a plan split into shards (`shards.py`: stable cell ids, balanced shards, the GitHub Actions
matrix), each shard's outcomes written to a file (`shard_results.py`), and the files merged into one
database (`shard_import.py`). The commands are in `matrix.cli.fanout`."""
