"""Multi-turn environments: the model acts, an environment answers, for several turns.

An environment is any class with this shape (`Env`), one instance per sample:

    env = MyEnv(example)      # example: the row's fields (prompt, answer, task, and its own columns)
    env.reset()               # the first user message (str or a list of {role, content}); None: the row's prompt
    env.step(action)          # action: the model's turn as text
        -> StepResult(observation: str | None, reward: float, done: bool, info: dict)
    env.close()               # optional: once the episode is over, however it ended

`config.env.name` names it: a built-in (`BUILT_IN`) or `module.path:ClassName`. A turn
ends at one of the model's end tokens or at one of `env.stop_strings` (tokenized, matched
on the model's ids); `Episodes` then decodes the turn, calls `step` on a worker thread of
the rollout engine, and hands back the observation's token ids, which the engine
prefills into the sample's own slot. With the tokenizer's chat template the observation
is a message of role `tool`, and only the template's text for that message (from the end
of the model's turn to the next assistant prompt) is tokenized; otherwise it is plain
text after the turn. Model tokens never go through the tokenizer again.

A sample's reward is the sum of its step rewards (plus the configured reward on the
whole transcript, if one is set: the RL loop's part). It ends when `step` says done, at
`env.max_turns` turns (finish reason "max_turns"), or when its tokens reach
`env.max_total_tokens` ("max_tokens"). An environment that raises or answers in the
wrong shape (not a StepResult), or whose close raises, ends its sample with reward 0,
counted and shown once; so does a step past `env.step_timeout_s`, which the rollout
stops waiting for (`Episodes.sample_failed`).
"""
from __future__ import annotations

import dataclasses
import functools
import threading
import time
import warnings
from typing import Sequence

import numpy as np

from tlt_jax import rewards
from tlt_jax.data import prompts as prompts_lib
from tlt_jax.data import tasks
from tlt_jax.envs.base import StepResult
from tlt_jax.envs.registry import env_class


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """config.env: name ("": single-turn rollouts), max_turns (model turns per sample),
    max_total_tokens (tokens after the prompt, the model's and the observations'; 0: the
    rollout's max_tokens), stop_strings (text that ends a turn besides the end tokens;
    empty: the environment's own `stop_strings`, if it has them), overlap (environments
    step on worker threads while the other samples decode; False: on the rollout's own
    thread, decoding stopped meanwhile, to measure what the overlap hides), step_timeout_s
    (the rollout waits this long for one `step`, 0: no deadline); and config.code, the
    sandbox of the environments that run code (the python tool)."""

    name: str = ""
    max_turns: int = 1
    max_total_tokens: int = 0
    stop_strings: tuple[str, ...] = ()
    overlap: bool = True
    step_timeout_s: float = 0.0
    code: rewards.CodeReward = rewards.CodeReward()

    @classmethod
    def from_config(cls, config) -> EnvConfig:
        env, code = config.get("env") or {}, config.get("code") or {}
        return cls(name=env.get("name", "") or "", max_turns=int(env.get("max_turns", 1)),
                   max_total_tokens=int(env.get("max_total_tokens", 0)),
                   stop_strings=tuple(env.get("stop_strings", ()) or ()), overlap=bool(env.get("overlap", True)),
                   step_timeout_s=float(env.get("step_timeout_s", 0.0)), code=rewards.CodeReward(**code))

    def check(self, max_tokens: int) -> None:
        """Raises ValueError naming the field; max_tokens: what the engine's slots hold after a prompt."""
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns={self.max_turns} must be >= 1 (the model's turns per sample).")
        if self.max_total_tokens < 0 or self.max_total_tokens > max_tokens:
            raise ValueError(f"env.max_total_tokens={self.max_total_tokens} is beyond what the engine's slots hold "
                             f"after a prompt (rollout.max_tokens={max_tokens}); lower it or raise "
                             "rollout.max_tokens (0: rollout.max_tokens).")
        if not self.step_timeout_s >= 0:
            raise ValueError(f"env.step_timeout_s={self.step_timeout_s} must be >= 0 (0: no deadline).")
        if self.name:
            env_class(self.name)

    def make(self, env_cls: type, example: dict):
        """One sample's environment: `env_cls.from_env_config(example, self)` where the
        class has it (to read config.code, say), else `env_cls(example)`."""
        build = getattr(env_cls, "from_env_config", None)
        return build(example, self) if build is not None else env_cls(example)

    def total_tokens(self, max_tokens: int) -> int:
        return self.max_total_tokens or max_tokens

def no_reward(prompts: Sequence, completions: Sequence[str], **_) -> list[float]:
    """The reward on the whole transcript when config.reward is "" with an environment:
    none, the environment's step rewards alone."""
    return [0.0] * len(completions)


def example_dict(example: tasks.Example) -> dict:
    """What an environment is built from: the row's fields, with its prompt, answer and task."""
    return {**dict(example.fields), "prompt": example.prompt, "answer": example.answer, "task": example.task}


# The tokenizations of one stop string that end a turn, the tokenizer's own first: a model
# sampling at temperature 1 may spell a string in pieces the tokenizer would merge. Each
# is matched on every step of the device loop, so their number is bounded.
MAX_STOP_TOKENIZATIONS = 16


@functools.lru_cache(maxsize=64)  # each RL step's episodes ask again for the same strings
def stop_sequences(tokenizer, text: str, limit: int = MAX_STOP_TOKENIZATIONS) -> tuple[tuple[int, ...], ...]:
    """The token id sequences whose text is `text`: the tokenizer's own tokenization, then
    others made of the vocabulary's pieces (each checked by decoding it whole), fewest
    tokens first, at most `limit` in all. Not matched: a spelling beyond the limit, and one
    whose token straddles the string's first or last character (say, one token for a
    newline and "```" when the string is "```output"); give such a text, newline included,
    as a stop string of its own."""
    canonical = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    found, pieces = {canonical}, _pieces(tokenizer)
    out, frontier = [canonical], [((), 0)]  # breadth first: fewer tokens first
    while frontier and len(out) < limit:
        nxt = []
        for ids, at in frontier:
            for piece, token in pieces.get(text[at], ()):
                if not text.startswith(piece, at):
                    continue
                seq, end = ids + (token,), at + len(piece)
                if end < len(text):
                    nxt.append((seq, end))
                elif seq not in found and tokenizer.decode(list(seq)) == text:
                    found.add(seq)
                    out.append(seq)
                    if len(out) == limit:
                        return tuple(out)
        frontier = nxt[:limit * 64]  # bounded work for a long string of one-character pieces
    return tuple(out)


@functools.lru_cache(maxsize=4)
def _pieces(tokenizer) -> dict[str, list[tuple[str, int]]]:
    """{first character: [(text, id), ...]}: each vocabulary entry's text alone, by its
    first character (special tokens left out: they never spell text), once per tokenizer."""
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    ids = [i for i in range(len(tokenizer)) if i not in special]
    by_first: dict[str, list[tuple[str, int]]] = {}
    for i, piece in zip(ids, tokenizer.batch_decode([[i] for i in ids])):
        if piece and "\ufffd" not in piece:  # a partial UTF-8 character decodes to U+FFFD alone
            by_first.setdefault(piece[0], []).append((piece, i))
    return by_first


def rollout_sampling_params(env_cls: type, config: EnvConfig, tokenizer, sp):
    """sp as the rollouts of env_cls run it: the stop sequences of config.stop_strings (or
    the class's own `stop_strings`) and the transcript's token budget. What the engine's
    `warm_up(..., turns=True)` needs so that its chunks are the rollouts' own."""
    stop_strings = config.stop_strings or tuple(getattr(env_cls, "stop_strings", ()))
    sequences = tuple(seq for text in stop_strings for seq in stop_sequences(tokenizer, text))
    return dataclasses.replace(sp, stop_sequences=sequences, max_tokens=config.total_tokens(sp.max_tokens))


class Episodes:
    """The environments of one multi-turn rollout: one per sample (request i is sample
    i % num_samples of example i // num_samples), driven by the engine's `Episodes`
    protocol. After the rollout: `turns[i]` (a list of {action, observation, reward}),
    `rewards()`, `failures` and `metrics()`.

    An environment is closed once its episode is over: at once when its `step` ends it,
    by `close_episode` when the rollout ends its episode, or by `close`, which evaluation
    calls in `finally` for the rest. `sample_failed` ends a sample whose step passed
    env.step_timeout_s (`step_timeout_s`, read by the rollout) without waiting for it."""

    def __init__(self, env_cls: type, examples: Sequence[tasks.Example], num_samples: int, tokenizer,
                 prompt_format: prompts_lib.PromptFormat, end_token_ids: Sequence[int], config: EnvConfig):
        self.tokenizer, self.prompt_format, self.config = tokenizer, prompt_format, config
        self.env_cls, self.overlap = env_cls, config.overlap  # overlap: rollout.engine.Episodes'
        self.step_timeout_s = config.step_timeout_s  # the rollout's wait for one step (0: none)
        self.end_token_ids = set(end_token_ids)
        self.examples, self.num_samples = list(examples), num_samples
        self.envs = [config.make(env_cls, example_dict(e)) for e in self.examples for _ in range(num_samples)]
        self.turns: list[list[dict]] = [[] for _ in self.envs]
        self.failed = [False] * len(self.envs)
        self._open = [True] * len(self.envs)  # not closed yet
        self._acting: dict[int, str] = {}  # request -> the action its step was given
        self._abandoned: set[int] = set()  # requests whose step passed its deadline
        self._lock, self._shown = threading.Lock(), False
        self.step_seconds: list[float] = []  # each `step` call's wall time (on the engine's worker threads)
        self.first_messages = []
        for p, example in enumerate(self.examples):
            firsts = [self._reset(p * num_samples + s) for s in range(num_samples)]
            if any(f != firsts[0] for f in firsts):
                raise ValueError(f"{env_cls.__name__}.reset() gave different first messages for the samples of one "
                                 "example; make reset depend on the example alone (the samples share a prompt).")
            self.first_messages.append(example.prompt if firsts[0] is None else firsts[0])
        self._after_turn = self._template_after_turn() if prompt_format.chat_template else ""

    def _reset(self, request: int):
        first = self.envs[request].reset()
        if first is not None and not isinstance(first, str) and not prompts_lib.is_conversation(first):
            raise ValueError(f"{type(self.envs[request]).__name__}.reset() returned {type(first).__name__}; return "
                             "the first user message as a str, a list of {role, content} messages, or None.")
        return tuple(dict(m) for m in first) if prompts_lib.is_conversation(first) else first

    def prompt_ids(self) -> list[list[int]]:
        """Each example's prompt as the engine receives it: the first message, formatted."""
        return [self.prompt_format.ids(self.tokenizer, first, e.fields)
                for first, e in zip(self.first_messages, self.examples)]

    def prompt_texts(self) -> list[str]:
        return [self.prompt_format.text(self.tokenizer, first, e.fields)
                for first, e in zip(self.first_messages, self.examples)]

    def sampling_params(self, sp):
        """sp with the environment's stop sequences and the transcript's token budget."""
        return rollout_sampling_params(self.env_cls, self.config, self.tokenizer, sp)

    # -- the engine's side -------------------------------------------------------------------

    def step(self, request: int, action: np.ndarray, finish_reason: str):
        """rollout.engine.Episodes.step: the observation's ids, or the finish reason at the end."""
        text = self.tokenizer.decode([int(t) for t in action if int(t) not in self.end_token_ids])
        env = self.envs[request]
        self._acting[request] = text
        t0 = time.perf_counter()
        try:
            result = self._timed_step(env, text, t0)
            if not isinstance(result, StepResult):
                raise TypeError(f"{type(env).__name__}.step returned {result!r:.80}; return "
                                "envs.StepResult(observation, reward, done, info)")
        except Exception as e:  # noqa: BLE001 - any failure of the environment ends its sample alone
            if request not in self._abandoned:
                self._fail(request, e, text)
                self._close(request)
            return ""
        if request in self._abandoned:  # the rollout stopped waiting for this step: it ended the sample
            return ""
        record = {"action": text, "observation": result.observation, "reward": float(result.reward)}
        if result.info:
            record["info"] = dict(result.info)
        self.turns[request].append(record)
        if result.done or result.observation is None:
            self._close(request)
            return ""
        if len(self.turns[request]) >= self.config.max_turns:
            self._close(request)
            return "max_turns"
        return self.observation_ids(result.observation, ended_on_end_token=finish_reason == "eos")

    def sample_failed(self, request: int, error: Exception) -> None:
        """rollout.turns' call when it ended request's sample for its environment: a step
        past env.step_timeout_s (a TimeoutError: the step's thread is abandoned, and what
        it returns later is dropped) or an answer it could not read. Counted in
        env_failures, the first shown."""
        if isinstance(error, TimeoutError):
            with self._lock:
                self._abandoned.add(request)
        self._fail(request, error, self._acting.get(request, ""))

    def close_episode(self, request: int) -> None:
        """rollout.turns' call once request's episode is over: closes its environment, once;
        on a thread of its own where the step was abandoned (the step may still hold it)."""
        if request in self._abandoned:
            threading.Thread(target=self._close, args=(request,), name="env-close", daemon=True).start()
        else:
            self._close(request)

    def close(self) -> None:
        """Closes every environment not closed yet (the rollout calls it in `finally`, however
        the rollout ended); never raises: a close that raises fails its sample."""
        for request in range(len(self.envs)):
            if request not in self._abandoned:
                self._close(request)

    def _timed_step(self, env, text: str, t0: float):
        try:
            return env.step(text)
        finally:
            with self._lock:
                self.step_seconds.append(time.perf_counter() - t0)

    def _close(self, request: int) -> None:
        """Closes request's environment, once, if it has `close`."""
        with self._lock:
            if not self._open[request]:
                return
            self._open[request] = False
        close = getattr(self.envs[request], "close", None)
        try:
            if close is not None:
                close()
        except Exception as e:  # noqa: BLE001 - as a step's failure: its sample alone
            self._fail(request, e, None)

    def _fail(self, request: int, error: Exception, action: str | None) -> None:
        """Ends request's sample with reward 0, counted, the first failure shown; action:
        the step's (None: the failure came in `close`, after the episode's turns)."""
        with self._lock:
            self.failed[request] = True
            where = "a step" if action is not None else "close"
            prefix = "" if action is not None else "close: "
            self.turns[request].append({"action": action or "", "observation": None, "reward": 0.0,
                                        "error": f"{prefix}{type(error).__name__}: {error}"[:300]})
            if not self._shown:
                self._shown = True
                warnings.warn(f"The environment {type(self.envs[request]).__name__} failed on {where} ({error}); "
                              "that sample ends and scores 0 (counted in env_failures; shown once).", stacklevel=3)

    # -- observations as tokens --------------------------------------------------------------

    def _template_after_turn(self) -> str:
        """The chat template's text from the end of an assistant turn's content to the end of
        that message (e.g. "<|im_end|>\\n"), found by rendering a stand-in turn."""
        mark = "\x00TURN\x00"
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": "u"},
                                                   {"role": "assistant", "content": mark}], tokenize=False)
        return text[text.index(mark) + len(mark):] if mark in text else ""

    def observation_text(self, observation: str, ended_on_end_token: bool) -> str:
        """The text that follows the model's turn: with the chat template, the rest of the
        assistant message (less the end token the model wrote), the `tool` message and the
        next assistant prompt; otherwise the observation itself."""
        if not self.prompt_format.chat_template:
            return observation
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        before = self.tokenizer.apply_chat_template(base, tokenize=False)
        after = self.tokenizer.apply_chat_template(base + [{"role": "tool", "content": observation}], tokenize=False,
                                                   add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("The tokenizer's chat template renders a conversation's start differently once a tool "
                             "message follows; set data.chat_template=False for this environment (observations as "
                             "plain text).")
        rest = self._after_turn
        if ended_on_end_token:
            for end in sorted(self.end_token_ids):
                end_text = self.tokenizer.decode([end])
                if end_text and rest.startswith(end_text):
                    rest = rest[len(end_text):]
                    break
        return rest + after[len(before):]

    def observation_ids(self, observation: str, ended_on_end_token: bool) -> list[int]:
        return list(self.tokenizer(self.observation_text(observation, ended_on_end_token),
                                   add_special_tokens=False)["input_ids"])

    # -- after the rollout -------------------------------------------------------------------

    def rewards(self) -> np.ndarray:
        """float32 [n]: each sample's summed step rewards (0 where its environment failed)."""
        return np.asarray([0.0 if failed else sum(t["reward"] for t in turns)
                           for turns, failed in zip(self.turns, self.failed)], np.float32)

    def total_rewards(self, transcript_scores) -> np.ndarray:
        """float32 [n]: each sample's reward, its step rewards plus `transcript_scores` (the
        configured reward on its whole transcript); 0 where its environment failed."""
        return np.where(self.failed, 0.0, np.asarray(transcript_scores, np.float32) + self.rewards()).astype(np.float32)

    @property
    def failures(self) -> int:
        return int(sum(self.failed))

    def metrics(self) -> dict[str, float]:
        """The rollout's environment figures: env_steps (calls of `step`), env_step_s (their
        seconds summed; each ran while other samples decoded, and its sample waited that
        long in its slot), env_step_max_s, env_failures, env_turns_mean and env_turns_max
        (model turns per sample)."""
        turns = [len(t) for t in self.turns]
        return {"env_steps": len(self.step_seconds), "env_step_s": float(sum(self.step_seconds)),
                "env_step_max_s": float(max(self.step_seconds, default=0.0)), "env_failures": self.failures,
                "env_turns_mean": float(np.mean(turns)) if turns else 0.0, "env_turns_max": int(max(turns, default=0))}

