"""The target: one model, loaded once, and the engines that run it, with one table of what a tensor-parallel
follower mirrors.

``load`` the model (stored or seeded weights, this rank's shards), its stop tokens and head; ``attention`` and
``linear_attention`` the packed kernels (causal per document); ``capture`` the packed forward that writes a
drafter's features (``Target``); ``greedy`` forwards through a KV cache (``GreedyTarget``, what acceptance
evaluation verifies with); ``generation``, ``static_cache``, ``engines`` and ``generator`` batched generation
(``Generator``, synthesis and regeneration); ``operations`` the table of operations a follower mirrors;
``tensor_parallel`` the group and its control channel; ``follower`` a follower's loop; ``flops`` a forward's cost.
"""
