"""Acceptance evaluation, the producer's half: real speculative decoding of the target with a drafter (greedy, or
sampled), on held-out prompts, with the simulated acceptance beside it.

    python -m launch.evaluate --checkpoint RUN/checkpoints/step-N     # offline: the run's target and held-out data

``transcripts`` the greedy transcripts and documents' features made once with the target's greedy verifier
(producer/target_model/greedy.py);
``decoder`` the drafter's proposals and live speculative decoding; ``simulated`` the training metric on held-out
text; ``timing`` a round's costs; ``held_out`` the run's held-out prompts; ``evaluator`` the ``AcceptanceEvaluator`` that runs
them all; ``job`` producer 0's evaluations for the trainer (common/acceptance/records.py). The arithmetic and the
report are common/acceptance/'s.
"""
