"""Multi-turn GRPO episodes with tools (spec.grpo.agent), on posttrain's rollout.

An episode starts from the prompt with the tools' instructions (``tool_calls.Format``).
Each turn, every active episode's context is sampled on at once: one batch of the same
rows every turn (an ended episode's row samples an active one's context), padded to the
longest context rounded up to 64 tokens, so the sampler compiles once per width and a
first turn's prefill costs the prompt's length, not the whole episode's budget. A turn
that ends (its EOS) with tool calls has them run (``tools.Toolbox``) and their results
appended as the family's tool message; the
episode ends at a turn without calls, at maxTurns, at a turn cut at turnLength, or when
maxCompletionLength tokens follow the prompt. The contexts are token ids, never text
decoded and encoded again: ``PinnedTokenizer`` hands the sampler the ids kept for a
context's key, so what the model is trained on is what it saw and wrote.

The episode becomes one GRPO rollout: the prompt's ids, and after them the model's turns
(loss mask 1, each with its EOS) and the tool messages (mask 0) up to
maxCompletionLength; the reward functions score the episode's text after the prompt (tool
results included), so advantages are per episode within the prompt's group. Turns are
seeded by (the rollout's key, turn), so a resumed run regenerates an interrupted step's
episodes exactly when the tools answer as before (the calculator always does).

Why not Tunix's agentic learner (``tunix.rl.agentic``: ToolAgent, ToolEnvironment, the
rollout orchestrator): it runs its own training loop, asynchronous and string-based, while
posttrain's loop keeps exact resume, host-local rollouts and bounded staleness (see
docs/architecture.md). posttrain takes its tools (``BaseTool``, ``CalculatorTool``) and
keeps the episode loop here, over the same sampler GRPO's single turns use.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from posttrain.trainer import tool_calls
from posttrain.trainer.tools import Toolbox
from posttrain.trainer.tunix_rl import TunixTokenizer

log = logging.getLogger("posttrain.grpo")


class PinnedTokenizer(TunixTokenizer):
    """TunixTokenizer that encodes a context key (``pin``) to the ids kept for it."""

    def __init__(self, tokenizer: Any, max_prompt_length: int):
        super().__init__(tokenizer, max_prompt_length)
        self.pinned: dict[str, list[int]] = {}

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        ids = self.pinned.get(text)
        return list(ids) if ids is not None else super().encode(text, **kwargs)


@dataclass
class Episodes:
    """A batch of episodes in the shape GrpoRun._sample takes a rollout's output."""

    text: list[str]  # each episode's text after the prompt (tool results included)
    tokens: list[list[int]]  # the model's own tokens of each episode
    left_padded_prompt_tokens: np.ndarray  # [episodes, maxPromptLength]
    completion_ids: np.ndarray  # [episodes, maxCompletionLength]
    completion_mask: np.ndarray  # 1 on the model's tokens, 0 on tools' and padding
    per_episode: dict[str, np.ndarray]  # turns, tool_calls, tool_errors of each episode


def widen(rollout_config: Any, g: Any) -> None:
    """The sampler's shapes for episodes: contexts up to the prompt plus the episode's
    budget, turns of turnLength tokens."""
    turn = int(g.agent.turn_length or g.max_completion_length)
    rollout_config.max_prompt_length = g.max_prompt_length + g.max_completion_length
    rollout_config.max_tokens_to_generate = turn
    rollout_config.kv_cache_size = rollout_config.max_prompt_length + turn


CONTEXT_BUCKET = 64


def context_width(longest: int, full: int) -> int:
    """The width a turn's contexts are padded to for the sampler: the longest rounded up
    to a multiple of CONTEXT_BUCKET tokens, at most `full` (the prompt and the whole
    episode's budget). An early turn's prefill then costs its own length, not the
    budget's, and the sampler compiles once per width, not once per turn."""
    return min(full, -(-longest // CONTEXT_BUCKET) * CONTEXT_BUCKET)


class AgentRollout:
    def __init__(
        self,
        g: Any,
        tok: PinnedTokenizer,
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
        self.turn_length = int(agent.turn_length or g.max_completion_length)
        self.prompt_length = int(g.max_prompt_length)
        self.budget = int(g.max_completion_length)
        self.instructions = agent.instructions or self.format.instructions(self.toolbox.schemas())
        self.said_cut = False

    def run(
        self,
        prompts: Sequence[str],
        key: Any,
        generate: Callable[[list[str]], Any],
        rollout_config: Any,
    ) -> Episodes:
        tok, eos, pad = self.tok, self.tok.eos_id(), self.tok.pad_id()
        n = len(prompts)
        prompt_ids = [self._prompt_ids(str(p)) for p in prompts]
        completion: list[list[int]] = [[] for _ in range(n)]
        mask: list[list[int]] = [[] for _ in range(n)]
        own: list[list[int]] = [[] for _ in range(n)]
        turns, calls_made, errors = [0] * n, [0] * n, [0] * n
        active = [True] * n
        keys = [f"\x00posttrain-episode-{i}" for i in range(n)]
        full = rollout_config.max_prompt_length
        for turn in range(self.max_turns):
            if not any(active):
                break
            # An ended episode's row samples an active one's context (its output is not
            # read): the batch keeps its shape, and the turn lasts as long as the active
            # episodes' turns, not as long as an ended one's continuation would.
            first = active.index(True)
            rows = [i if active[i] else first for i in range(n)]
            for i, j in enumerate(rows):
                tok.pinned[keys[i]] = prompt_ids[j] + completion[j]
            rollout_config.seed = np.asarray(jax.random.fold_in(key, turn))
            longest = max(len(prompt_ids[j]) + len(completion[j]) for j in rows)
            rollout_config.max_prompt_length = context_width(longest, full)
            try:
                out = generate(keys)
            finally:
                tok.pinned.clear()
                rollout_config.max_prompt_length = full
            for i in range(n):
                if not active[i]:
                    continue
                written = [int(t) for t in out.tokens[i]]
                ended = len(written) < self.turn_length or (written and written[-1] == eos)
                if ended and (not written or written[-1] != eos):
                    written.append(eos)
                room = self.budget - len(completion[i])
                written = written[:room]
                completion[i] += written
                mask[i] += [1] * len(written)
                own[i] += written
                turns[i] += 1
                calls = self.format.parse(str(out.text[i])) if ended else []
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
