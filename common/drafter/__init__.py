"""The drafter, as both sides need it: the trainer trains it, producer 0 evaluates it on its target.

``draft_config`` (shape and the target-layer rule), ``blocks`` and ``masks`` (what a training step sees),
``loss``, ``model`` (DFlashDrafter, the backbone of every kind), ``head`` (what a kind adds to it), ``target_head``
(the target's frozen embedding, norm and lm_head), ``export`` (the serving formats, and loading them back); speculative decoding against a target is
common/acceptance/'s and producer/acceptance/'s. Nothing here imports producer/ or trainer/.
"""
