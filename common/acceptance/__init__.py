"""Acceptance evaluation, the half both sides share: the arithmetic of what a speculative decoding keeps
(``arithmetic``: the replay, tau in both conventions, by context length), the ``report`` of an evaluation and what the
trainer reads in it, and the ``records`` of the evaluations the trainer asks producer 0 for (requests and results
through the run directory). The decoding itself is the producer's (producer/acceptance/). Nothing here imports
producer/ or trainer/.
"""
