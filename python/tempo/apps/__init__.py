"""tempo's applications, built on the library: the Hugging Face bench (bench.py, `python -m
tempo.bench`) and the memory-vs-throughput frontier (frontier.py and its report,
`python -m tempo.frontier`), on one shared runner (runner.py: the model presets, batches, the
peers' pieces and a measured training step); SLiM's measurement (slim.py, `python -m
tempo.slim`) and the tokenizer for `tempo train` (pretokenize.py, `python -m tempo.pretokenize`).
The library (tempo.ops, tempo.nn, tempo.optimize, tempo.auto, tempo.memory, tempo.slim) never
imports them."""
