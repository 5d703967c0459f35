"""producer.target_model.generator: the static-cache engine against plain ``model.generate``, refill, follow-ups,
sampling, config validation and the fallback for models outside the supported family."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from producer.target_model.generation import (
    STATIC_CACHE_ENGINE,
    TRANSFORMERS_ENGINE,
    Finished,
    GenerationConfig,
    Request,
    Sampler,
)
from producer.target_model.generator import Generator
from producer.target_model.static_cache import attention_lengths

VOCAB = 160
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    # no EOS of the model's own: the reference generate stops only where a test says
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def tiny_model(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_class, model_class = classes[kind]
    torch.manual_seed(seed)
    return model_class(config_class(**{**TINY, **overrides})).eval()


def prompts_of(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def plain_greedy(
    model: torch.nn.Module, prompt: list[int], max_new_tokens: int, stop: tuple[int, ...] = ()
) -> list[int]:
    """The reference: plain generate of one prompt alone (no padding)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(stop) or None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def run(generator: Generator, requests, on_finish=None) -> dict:
    return {finished.key: finished for finished in generator.generate(requests, on_finish)}


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_equals_plain_generate_with_refill_and_every_stop(kind):
    model = tiny_model(kind)
    # Longer prompts come late, so short ones refill rows that held longer sequences (stale cache past them).
    lengths = [1, 5, 9, 14, 20, 24, 3, 11, 2, 25]
    prompts = prompts_of(lengths)
    own_limits = {2: 20, 5: 20, 8: 1}  # 5: 24 + 20 > max_len, so its row fills; 8: done at its prefill
    first = plain_greedy(model, prompts[0], 12)
    stop_at = next(i for i in range(2, 12) if first[i] not in first[:i])
    stop = (first[stop_at],)
    config = GenerationConfig(rows=3, max_new_tokens=12, max_prompt_tokens=24, max_len=40, stop_token_ids=stop)
    assert len(attention_lengths(config.cache_len)) > 1  # decode steps switch key lengths as rows grow
    generator = Generator(model, config)
    assert generator.engine == STATIC_CACHE_ENGINE
    results = run(generator, (Request(i, p, own_limits.get(i)) for i, p in enumerate(prompts)))

    assert sorted(results) == list(range(len(prompts)))
    assert results[9].stop_reason == "prompt_too_long" and results[9].new_ids == []
    for i, prompt in enumerate(prompts[:-1]):
        limit = min(own_limits.get(i, 12), 40 - len(prompt) + 1)
        expected = plain_greedy(model, prompt, limit, stop)
        assert results[i].new_ids == expected, f"prompt {i} (length {len(prompt)})"
        assert results[i].prompt_ids == prompt
    assert results[0].stop_reason == "stop" and results[0].new_ids[-1] == stop[0]
    assert results[5].stop_reason == "max_len" and len(results[5].new_ids) == 17
    assert results[8].stop_reason == ("stop" if results[8].new_ids == [stop[0]] else "length")
    assert "length" in {r.stop_reason for r in results.values()}
    stats = generator.stats
    assert stats.new_tokens == sum(len(r.new_ids) for r in results.values())
    assert stats.prefill_tokens == sum(lengths[:-1]) and stats.prefill_forwards >= 3
    assert 0.5 < stats.occupancy <= 1.0


def test_follow_ups_go_to_the_front_and_requests_are_pulled_lazily():
    model = tiny_model("qwen3", seed=3)
    questions = prompts_of([4, 6], seed=5)
    pulled = []

    def source():
        for i, prompt in enumerate(questions):
            pulled.append(i)
            yield Request(("question", i), prompt, 6)

    def next_turns(finished: Finished):
        kind, i = finished.key
        history = finished.prompt_ids + finished.new_ids
        if kind == "question":  # two answers, each continuing the whole first turn
            return [Request(("answer", i), history + [7, 8], 5), Request(("other answer", i), history + [9], 4)]
        if kind == "answer":  # queued ahead of the other answer, which is already waiting
            return [Request(("third turn", i), history + [10], 3)]
        return None

    limits = {"question": 6, "answer": 5, "other answer": 4, "third turn": 3}
    generator = Generator(model, GenerationConfig(rows=1, max_new_tokens=6, max_prompt_tokens=40))
    order, pulled_when_seen = [], []
    for finished in generator.generate(source(), next_turns):
        order.append(finished.key)
        pulled_when_seen.append(len(pulled))
        assert finished.new_ids == plain_greedy(model, finished.prompt_ids, limits[finished.key[0]]), finished.key
    assert order == [(kind, i) for i in range(2) for kind in ("question", "answer", "third turn", "other answer")]
    # Question 1 is not taken from the source before every turn of question 0 is done.
    assert pulled_when_seen == [1] * 4 + [2] * 4


def test_a_closed_generate_leaves_nothing_running():
    model = tiny_model("llama", seed=5)
    prompts = prompts_of([4, 9, 6], seed=7)
    generator = Generator(model, GenerationConfig(rows=2, max_new_tokens=12, max_prompt_tokens=12))
    first = generator.generate(Request(i, p, 3 + 9 * i) for i, p in enumerate(prompts))
    assert next(first).key == 0  # row 1 is mid-sequence when the caller walks away
    with pytest.raises(RuntimeError, match="already running"):
        next(generator.generate([Request("other", prompts[2])]))
    first.close()
    # One request: row 1 is not refilled, so a sequence left running there would surface here.
    again = run(generator, [Request("again", prompts[2])])
    assert list(again) == ["again"] and again["again"].new_ids == plain_greedy(model, prompts[2], 12)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_sampling_is_reproducible_and_tiny_top_p_is_greedy(kind):
    model = tiny_model(kind, seed=2)
    prompts = prompts_of([3, 8, 5, 6, 2], seed=4)

    def sample(**fields):
        config = GenerationConfig(rows=2, max_new_tokens=10, max_prompt_tokens=8, **fields)
        results = run(Generator(model, config), (Request(i, p) for i, p in enumerate(prompts)))
        return [results[i].new_ids for i in range(len(prompts))]

    first = sample(temperature=1.0, seed=11)
    assert sample(temperature=1.0, seed=11) == first
    assert sample(temperature=1.0, seed=12) != first
    greedy = sample(temperature=0.0)
    assert first != greedy
    assert sample(temperature=1.0, top_p=1e-6, seed=11) == greedy


def test_top_p_keeps_the_nucleus_only():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    for top_p, nucleus in ((0.7, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})):
        drawn = Sampler(GenerationConfig(temperature=1.0, top_p=top_p, seed=0), torch.device("cpu"))(logits)
        assert set(drawn.tolist()) == nucleus, top_p
    hot = Sampler(GenerationConfig(temperature=1.0, seed=0), torch.device("cpu"))(logits)
    share = (hot == 0).float().mean().item()
    assert abs(share - 0.5) < 0.05  # temperature 1 keeps the model's own distribution


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_new_tokens", 0),
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("seed", -1),
        ("stop_token_ids", (3, -1)),
        ("rows", 0),
        ("max_prompt_tokens", 0),
        ("max_len", 8),
        ("prefill_tokens", 8),
        ("refill_rows", 65),
        ("cuda_graph", "yes"),
    ],
)
def test_bad_config_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=f"GenerationConfig.{field} "):
        GenerationConfig(**{"max_prompt_tokens": 16, field: value})


def test_a_cache_larger_than_the_available_memory_is_refused_before_it_is_allocated(monkeypatch):
    """A static KV cache the host cannot hold would get the process killed (and killed again at every restart):
    it is refused first, saying what it needs, what is there and how many rows fit."""
    import producer.target_model.static_cache as generate

    model = tiny_model("llama")  # 2 layers x 2 (keys, values) x 2 heads x 16 x 4 bytes = 512 bytes per position
    monkeypatch.setattr(generate, "available_memory", lambda device: 100 * 2**20)
    allocated = []
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: allocated.append(a) or real_zeros(*a, **k))
    with pytest.raises(
        generate.GenerationMemoryError,
        match=r"a static KV cache of 4096 rows x 64 positions needs 0\.12 GiB, and cpu has 0\.10 GiB "
        r"available: at most 2880 rows of 64 positions fit",
    ):
        Generator(model, GenerationConfig(max_new_tokens=32, max_prompt_tokens=32, rows=4096))
    assert not allocated, "nothing is allocated before the refusal"
    monkeypatch.undo()
    monkeypatch.setattr(generate, "available_memory", lambda device: 100 * 2**20)
    assert (
        Generator(model, GenerationConfig(max_new_tokens=32, max_prompt_tokens=32, rows=2880)).engine
        == STATIC_CACHE_ENGINE
    )


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="prompt_ids"):
        Request("empty", [])
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request("zero", [1, 2], 0)


def test_model_outside_the_family_falls_back_to_plain_generate(caplog):
    # Sliding-window layers: outside what the static-cache forward does.
    model = tiny_model("qwen3", seed=4, use_sliding_window=True, sliding_window=6, max_window_layers=0)
    prompts = prompts_of([3, 9, 5, 12, 7], seed=6)
    first = plain_greedy(model, prompts[1], 8)
    stop = (first[next(i for i in range(2, 8) if first[i] not in first[:i])],)
    with caplog.at_level(logging.WARNING, logger="producer.target_model.generator"):
        generator = Generator(
            model, GenerationConfig(rows=2, max_new_tokens=8, max_prompt_tokens=12, stop_token_ids=stop)
        )
    assert generator.engine == TRANSFORMERS_ENGINE
    assert "sliding_attention" in generator.refusal and "falls back" in caplog.text
    results = run(generator, (Request(i, p) for i, p in enumerate(prompts)))
    for i, prompt in enumerate(prompts):
        assert results[i].new_ids == plain_greedy(model, prompt, 8, stop), i
    assert results[1].stop_reason == "stop"
    assert generator.stats.new_tokens == sum(len(r.new_ids) for r in results.values())

    def sampled(generator: Generator) -> list[list[int]]:
        return [
            f.new_ids for f in sorted(generator.generate(Request(i, prompts[0]) for i in range(3)), key=lambda f: f.key)
        ]

    config = GenerationConfig(rows=2, max_new_tokens=8, max_prompt_tokens=12, temperature=1.0, seed=3)
    first_call, second_call = sampled(generator := Generator(model, config)), sampled(generator)
    assert first_call != second_call  # a prompt asked again (a Magpie prefix) gets new samples
    assert sampled(Generator(model, config)) == first_call


@pytest.mark.gpu
def test_cuda_graph_engine_matches_plain_generate_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    prompts = prompts_of([3, 17, 9, 30, 5, 12], seed=8)
    for dtype, compared in ((torch.float32, 16), (torch.bfloat16, 3)):
        model = tiny_model("qwen3", seed=9).to("cuda", dtype)
        generator = Generator(model, GenerationConfig(rows=4, max_new_tokens=16, max_prompt_tokens=32, refill_rows=1))
        assert generator.uses_cuda_graphs
        results = run(generator, (Request(i, p) for i, p in enumerate(prompts)))
        assert generator.stats.warmup_seconds > 0
        for i, prompt in enumerate(prompts):
            expected = plain_greedy(model, prompt, 16)
            assert results[i].new_ids[:compared] == expected[:compared], (dtype, i)
