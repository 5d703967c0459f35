"""The producer's data side: from the files of ``data.paths`` to the batches of one shard, in their order.

A record goes through it in this order:

- files.py: the containers users hold (JSONL, Parquet, Arrow, dataset folders), read at random; bad records
  (``BadRecord``) and data that cannot be read as configured (``DataError``).
- chat.py: chat records as OpenAI messages (the layouts of OpenAI, ShareGPT, UltraChat), their checks.
- render.py: chat rendering through the target's template, the assistant turns' loss mask (``ChatSource``).
- sources.py: documents by stable sample id (``DataSource``), the tokenized and synthetic sources.
- held_out.py: the records held out of training for evaluation.
- order.py: each shard's deterministic, seekable order of sample ids, epoch after epoch.
- batching.py: token-budget batches grouped by length, resumable by cursor (``BatchPlan``).
- build.py: what the config builds from these: a run's sources, its held-out split, a shard's plan.
"""
