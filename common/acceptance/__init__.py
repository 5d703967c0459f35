"""Acceptance evaluation, the part both sides share: the records of the evaluations the trainer asks producer 0 for
(``records``: requests and results through the run directory). The decoding that measures acceptance is the
producer's (producer/acceptance/). Nothing here imports producer/ or trainer/.
"""
