"""Multi-turn GRPO episodes with tools (spec.grpo.agent), on posttrain's rollout.

An episode starts from the prompt with the tools' instructions (``tool_calls.Format``).
Each turn, every active episode's context is sampled on at once by an ``EpisodeSampler``,
which keeps each episode's KV cache across its turns: a turn prefills only what came
since the last (the tool message), not the whole context again. A turn that ends (its
EOS) with tool calls has them run (``tools.Toolbox``) and their results appended as the
family's tool message; the episode ends at a turn without calls, at maxTurns, at a turn
cut at turnLength, or when maxCompletionLength tokens follow the prompt. The contexts are
token ids, never text decoded and encoded again, so what the model is trained on is what
it saw and wrote.

The episode becomes one GRPO rollout: the prompt's ids, and after them the model's turns
(loss mask 1, each with its EOS) and the tool messages (mask 0) up to
maxCompletionLength; the reward functions score the episode's text after the prompt (tool
results included), with its last model turn beside it (``final_turn``, where exactAnswer
reads the answer: a tool's result is not the model's), so advantages are per episode
within the prompt's group. Turns are seeded by (the rollout's key, turn), so a resumed
run regenerates an interrupted step's episodes exactly when the tools answer as before
(the calculator always does).

Why not Tunix's agentic learner (``tunix.rl.agentic``: ToolAgent, ToolEnvironment, the
rollout orchestrator): it runs its own training loop, asynchronous and string-based, while
posttrain's loop keeps exact resume, host-local rollouts and bounded staleness (see
docs/architecture.md). posttrain takes its tools (``BaseTool``, ``CalculatorTool``) and
keeps the episode loop here, on the policy's weights as GRPO's single turns sample them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np

from posttrain.capacity import rollout_cache_length
from posttrain.trainer import tool_calls
from posttrain.trainer.episode_sampler import EpisodeSampler
from posttrain.trainer.tools import Toolbox
from posttrain.trainer.tunix_rl import TunixTokenizer

log = logging.getLogger("posttrain.grpo")


@dataclass
class Episodes:
    """A batch of episodes in the shape GrpoRun._sample takes a rollout's output."""

    text: list[str]  # each episode's text after the prompt (tool results included)
    final_turn: list[str]  # each episode's last model turn (its answer, when it gave one)
    tokens: list[list[int]]  # the model's own tokens of each episode
    left_padded_prompt_tokens: np.ndarray  # [episodes, maxPromptLength]
    completion_ids: np.ndarray  # [episodes, maxCompletionLength]
    completion_mask: np.ndarray  # 1 on the model's tokens, 0 on tools' and padding
    per_episode: dict[str, np.ndarray]  # turns, tool_calls, tool_errors of each episode


class TurnSampler(Protocol):
    def turn(self, contexts: Sequence[list[int] | None], key: Any) -> list[list[int]]:
        """The tokens each row's context (None: ended) continues with this turn, its EOS
        included when it wrote one."""
        ...


def turn_and_cache(g: Any) -> tuple[int, int]:
    """spec.grpo's tokens a model turn (agent.turnLength, else maxCompletionLength) and
    the slots of an episode's KV cache: the prompt, the episode's budget, a turn, and the
    padding of a prefill block rounded up to BLOCK (without it, a late turn after long
    ones would not fit after what is cached, and would prefill the whole context again),
    as the memory estimate counts it (``capacity.rollout_cache_length``)."""
    return int(g.agent.turn_length or g.max_completion_length), rollout_cache_length(g)


class AgentRollout:
    def __init__(
        self,
        g: Any,
        tok: TunixTokenizer,
        template_source: str | None,
        environ: Mapping[str, str] = os.environ,
    ):
        agent = g.agent
        fmt = str(agent.tool_format)
        self.format = (
            tool_calls.detect(template_source) if fmt == "auto" else tool_calls.FORMATS[fmt]
        )
        self.toolbox = Toolbox(agent, environ)
        self.tok = tok
        self.max_turns = int(agent.max_turns)
        self.turn_length, self.cache_size = turn_and_cache(g)
        self.prompt_length = int(g.max_prompt_length)
        self.budget = int(g.max_completion_length)
        self.instructions = agent.instructions or self.format.instructions(self.toolbox.schemas())
        self.said_cut = False

    def sampler(self, model: Any, rows: int, temperature: float | None) -> EpisodeSampler:
        """A sampler for one batch of `rows` episodes on `model` (greedy without a
        temperature), its cache the prompt, the episode's budget and a turn long."""
        return EpisodeSampler(
            model,
            rows,
            self.cache_size,
            self.turn_length,
            eos=self.tok.eos_id(),
            pad=self.tok.pad_id(),
            temperature=temperature,
        )

    def run(self, prompts: Sequence[str], key: Any, sampler: TurnSampler) -> Episodes:
        tok, eos, pad = self.tok, self.tok.eos_id(), self.tok.pad_id()
        n = len(prompts)
        prompt_ids = [self._prompt_ids(str(p)) for p in prompts]
        completion: list[list[int]] = [[] for _ in range(n)]
        mask: list[list[int]] = [[] for _ in range(n)]
        own: list[list[int]] = [[] for _ in range(n)]
        turns, calls_made, errors = [0] * n, [0] * n, [0] * n
        final = [""] * n
        active = [True] * n
        for turn in range(self.max_turns):
            if not any(active):
                break
            contexts = [prompt_ids[i] + completion[i] if active[i] else None for i in range(n)]
            out = sampler.turn(contexts, jax.random.fold_in(key, turn))
            for i in range(n):
                if not active[i]:
                    continue
                written = out[i][: self.budget - len(completion[i])]
                ended = written[-1:] == [eos]
                completion[i] += written
                mask[i] += [1] * len(written)
                own[i] += written
                turns[i] += 1
                text = final[i] = tok.decode(written[:-1] if ended else written)
                calls = self.format.parse(text) if ended else []
                last = turn == self.max_turns - 1
                if not calls or last or len(completion[i]) >= self.budget:
                    active[i] = False
                    continue
                before = self.toolbox.errors
                results = [self.toolbox.run(c) for c in calls]
                calls_made[i] += len(calls)
                errors[i] += self.toolbox.errors - before
                message = tok.tokenizer.encode(self.format.result_turn(results))
                message = message[: self.budget - len(completion[i])]
                completion[i] += message
                mask[i] += [0] * len(message)
                if len(completion[i]) >= self.budget:
                    active[i] = False
        return Episodes(
            text=[tok.tokenizer.decode(c, skip_special_tokens=True) for c in completion],
            final_turn=final,
            tokens=own,
            left_padded_prompt_tokens=_left_padded(prompt_ids, self.prompt_length, pad),
            completion_ids=_right_padded(completion, self.budget, pad),
            completion_mask=_right_padded(mask, self.budget, 0),
            per_episode={
                "episode_turns": np.asarray(turns, np.int32),
                "episode_tool_calls": np.asarray(calls_made, np.int32),
                "episode_tool_errors": np.asarray(errors, np.int32),
            },
        )

    def _prompt_ids(self, prompt: str) -> list[int]:
        """The prompt with the tools' instructions; said once when they do not fit."""
        ids = self.tok.tokenizer.encode(self.format.with_tools(prompt, self.instructions))
        if len(ids) > self.prompt_length and not self.said_cut:
            self.said_cut = True
            log.warning(
                "spec.grpo.maxPromptLength: a prompt with the tools' instructions has %d "
                "tokens; its first %d (the instructions first) are cut; raise maxPromptLength",
                len(ids), len(ids) - self.prompt_length,
            )  # fmt: skip
        return ids[-self.prompt_length :]


def step_metrics(rolled: Mapping[str, Any]) -> dict[str, float]:
    """A step's turns (mean per episode), tool calls and tool errors, and the share of its
    episodes whose calls were well formed (``well_formed_calls``: at least one call, and
    every call read and ran without an error), from the rollout's own per-episode counts
    (so asynchronous rollouts report the step they train)."""
    if "episode_turns" not in rolled:
        return {}
    calls = np.asarray(rolled["episode_tool_calls"])
    errors = np.asarray(rolled["episode_tool_errors"])
    return {
        "turns": float(np.mean(rolled["episode_turns"])),
        "tool_calls": float(np.sum(calls)),
        "tool_errors": float(np.sum(errors)),
        "well_formed_calls": float(np.mean((calls > 0) & (errors == 0))),
    }


def _left_padded(rows: list[list[int]], width: int, pad: int) -> np.ndarray:
    out = np.full((len(rows), width), pad, np.int32)
    for i, row in enumerate(rows):
        row = row[-width:]
        if row:
            out[i, width - len(row) :] = row
    return out


def _right_padded(rows: list[list[int]], width: int, pad: int) -> np.ndarray:
    out = np.full((len(rows), width), pad, np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row[:width]
    return out
