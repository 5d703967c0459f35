"""Exported drafters served by real servers, checked against this project's own decoders, and real servers measured.

The served check (one for every server and kind):

    launch/setup_llamacpp.sh  |  launch/setup_vllm.sh           # once: the server's own build and environment
    python -m launch.bench.served --server llamacpp|vllm --target HF_DIR_OR_GGUF --draft EXPORT_OR_CHECKPOINT \\
        --prompts PROMPTS.jsonl [--num-prompts 16] [--max-new-tokens 64] [--confidence-min P] [--json-out FILE]

serves the drafter with the real server and sends it the same prompts, as token ids, greedily, as our evaluator, our
live decoder and z-lab's ``dflash_generate`` get them (z-lab's for the kinds PyPI's ``dflash`` has: not DSpark); it
prints per prompt and pooled the verify forwards, drafted tokens, accepted drafts per position, tau in both
conventions and whether the tokens are identical, all on one schedule (``schedule.py``), and one JSON line. llama.cpp
gets the draft in the format its converter reads for the kind (DSpark: speculators', written from a checkpoint).
``--confidence-min P`` cuts each block of a drafter with a confidence head (DSpark) before its first draft whose
confidence is below P, on every side: llama-server's ``--spec-draft-p-min P`` and our ``eval.confidence_min``; the
drafts each verify forward verified are then compared too. Exit 0: every side agrees, or differs only where the
target itself split at a near-tie or a block was cut at a near-tie of its confidence; 1: a side differs otherwise
(the first prompt, step and token that differ are named); 2: the check could not run (no server build, a kind the
server does not serve, a block size that contradicts the export, a cut for a drafter without a confidence head, a
draft its converter refuses, a server that did not start), said in one line.

Served measurement of a running server (``measure.py``):

    python -m launch.bench.served --url http://HOST:PORT --prompts PROMPTS.jsonl | --run-dir RUN \\
        [--concurrency 8] [--max-new-tokens 256]

sends the prompts through the server's OpenAI API and reports output tokens/s, mean acceptance length and acceptance
per position from the server's own Prometheus counters (llama.cpp, vLLM, SGLang).
"""
