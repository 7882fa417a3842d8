"""The episode sampler keeps each row's KV cache across turns and prefills only what came
since: its greedy turns are the tokens a fresh greedy decode of each row's whole context
writes (KV-cache decoding is itself checked against recomputation in test_models), for a
family without a sliding window (the cache kept) and Gemma 3 (window shorter than the
cache: every turn starts over)."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from hf_fixtures import fixture_loader

from posttrain.trainer import models
from posttrain.trainer.agent_rollout import turn_and_cache
from posttrain.trainer.episode_sampler import BLOCK, EpisodeSampler

pytestmark = pytest.mark.trainer

TURN = 6
PROMPTS = [[int(t) for t in np.random.default_rng(0).integers(3, 60, n)] for n in (7, 12, 3)]
TOOL = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]  # each row's "tool message" after a turn


@pytest.fixture(scope="module")
def loaded():
    return fixture_loader()


def fresh(model, context: list[int], eos: int) -> list[int]:
    """What a greedy decode of the whole context from an empty cache writes."""
    return models.greedy_generate(model, None, context, TURN, eos_token_ids=[eos]).token_ids


def episodes(model, sampler: EpisodeSampler, eos: int) -> list[int]:
    """Three turns, row 2 ending after two; each turn checked against `fresh`. The tokens
    prefilled each turn."""
    contexts = [list(p) for p in PROMPTS]
    prefilled = []
    for turn in range(3):
        asked = [None if (turn == 2 and b == 2) else c for b, c in enumerate(contexts)]
        before = sampler.prefilled
        got = sampler.turn(asked, jax.random.PRNGKey(turn))
        prefilled.append(sampler.prefilled - before)
        for b, context in enumerate(asked):
            if context is None:
                assert got[b] == []
                continue
            assert got[b] == fresh(model, context, eos), (turn, b)
            contexts[b] = context + got[b] + TOOL[b]
    return prefilled


@pytest.mark.parametrize("family", ["llama3", "gemma3"])
def test_turns_are_what_a_fresh_decode_of_the_whole_context_writes(family, loaded):
    model, _ = loaded(family)
    never = 10**6
    # an EOS the first turn of row 1 writes, so rows end at different steps
    eos = fresh(model, PROMPTS[1], never)[2]
    for stop in (never, eos):
        sampler = EpisodeSampler(model, 3, 64, TURN, eos=stop, pad=0, temperature=None)
        prefilled = episodes(model, sampler, stop)
        assert sampler.keeps == (family != "gemma3")  # Gemma 3's window (4) < the cache
        assert prefilled == [3 * BLOCK] * 3  # contexts under BLOCK long: one block a turn


def test_a_kept_cache_prefills_only_what_came_since(loaded):
    model, _ = loaded("llama3")
    prompt = [int(t) for t in np.arange(3, 3 + 2 * BLOCK)]  # two blocks long
    sampler = EpisodeSampler(model, 1, 4 * BLOCK, TURN, eos=10**6, pad=0, temperature=None)
    first = sampler.turn([prompt], jax.random.PRNGKey(0))[0]
    assert sampler.prefilled == 2 * BLOCK
    context = prompt + first + [5, 6]
    second = sampler.turn([context], jax.random.PRNGKey(1))[0]
    assert sampler.prefilled == 3 * BLOCK  # the turn's last token and the message: one block
    assert second == fresh(model, context, 10**6)
    # A context that does not continue the row's cache starts the row over.
    other = [7] + context[1:]
    third = sampler.turn([other], jax.random.PRNGKey(2))[0]
    assert third == fresh(model, other, 10**6)
    # A turn that does not fit after what is cached (77 slots, then a block of 64 and the
    # turn's 6) starts over from the whole context (118 tokens in 122 slots).
    longer = other + third + [int(t) for t in np.arange(3, 43)]
    got = sampler.turn([longer], jax.random.PRNGKey(3))[0]
    assert got == fresh(model, longer, 10**6) and sampler.cached[0] == longer + got[:-1]
    with pytest.raises(ValueError, match="do not fit a cache of 128"):
        sampler.turn([list(range(3, 3 + 4 * BLOCK))], jax.random.PRNGKey(4))


def test_an_episode_within_its_budget_never_starts_over(loaded):
    """The cache turn_and_cache sizes holds an episode that spends its whole budget in
    full-length turns: every turn prefills one block (the last token and the message),
    never the whole context again."""
    model, _ = loaded("llama3")
    prompt, budget = PROMPTS[1], 40
    g = SimpleNamespace(max_prompt_length=len(prompt), max_completion_length=budget,
                        agent=SimpleNamespace(turn_length=TURN))  # fmt: skip
    turn, size = turn_and_cache(g)
    assert size == len(prompt) + budget + TURN + BLOCK  # what the estimate counts too
    sampler = EpisodeSampler(model, 1, size, turn, eos=10**6, pad=0, temperature=None)
    context, prefilled = list(prompt), []
    while len(context) + TURN <= len(prompt) + budget:  # the rollout's budget
        before = sampler.prefilled
        context += sampler.turn([context], jax.random.PRNGKey(len(context)))[0] + TOOL[2]
        prefilled.append(sampler.prefilled - before)
    assert len(prefilled) == 4 and prefilled == [BLOCK] * 4


def test_sampled_turns_follow_their_key(loaded):
    model, _ = loaded("llama3")

    def sample(key: int) -> list[list[int]]:
        sampler = EpisodeSampler(model, 3, 64, TURN, eos=10**6, pad=0, temperature=1.0)
        return sampler.turn(PROMPTS, jax.random.PRNGKey(key))

    assert sample(0) == sample(0)
    assert sample(0) != sample(1)
    assert all(len(row) == TURN for row in sample(0))


def test_rows_of_one_prompt_are_prefilled_once(loaded):
    """A GRPO group's first turn: numGenerations rows of one prompt share its prefill."""
    model, _ = loaded("llama3")
    p, q = PROMPTS[0], PROMPTS[1]
    sampler = EpisodeSampler(model, 3, 64, TURN, eos=10**6, pad=0, temperature=None)
    first = sampler.turn([p, p, q], jax.random.PRNGKey(0))
    assert sampler.prefilled == 2 * BLOCK  # p once, q once
    assert first[0] == first[1] == fresh(model, p, 10**6)
    assert first[2] == fresh(model, q, 10**6)
    contexts = [c + out + tool for c, out, tool in zip([p, p, q], first, TOOL, strict=True)]
    second = sampler.turn(contexts, jax.random.PRNGKey(1))
    assert sampler.prefilled == 5 * BLOCK  # the messages differ: every row its own
    assert second == [fresh(model, c, 10**6) for c in contexts]
