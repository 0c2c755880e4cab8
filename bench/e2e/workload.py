"""The multi-round QA workload, in the shape of LMBenchmark's synthetic multi-round QA
(long_input_short_output): U users, R rounds each. A user's first prompt is the shared system
prompt + the user's own long history + a question; every later prompt is the previous prompt +
the answer + a new question, so the histories only grow. Answers are short. Arrivals are at a
fixed rate: user u's round r is due at (r * U + u) / rate and waits for the user's previous answer.

Token ids are random per configuration tag (same lengths and times in every configuration, no
block of one configuration can hit in another).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

TPB = 16  # tokens per KV block, every engine


@dataclass(frozen=True, slots=True)
class Shape:
    users: int
    rounds: int
    sys_len: int  # shared system prompt
    hist_len: int  # each user's own history before round 0
    q_len: int  # question per round
    answer: int  # max_tokens per answer (the client sends ignore_eos, so every answer has this length)

    def prompt_len(self, r: int) -> int:
        return self.sys_len + self.hist_len + r * (self.q_len + self.answer) + self.q_len

    def user_tokens(self) -> int:
        """One user's tokens at the end (history, every question and answer)."""
        return self.hist_len + self.rounds * (self.q_len + self.answer)

    def working_set_tokens(self) -> int:
        return self.sys_len + self.users * self.user_tokens()

    def as_dict(self) -> dict:
        return asdict(self)


def default_shape(model: str) -> Shape:
    """8b: 8 users x 4 rounds, a 1000-token system prompt, 15000-token histories, 100-token questions,
    16-token answers: prompts of 16.1k to 16.5k tokens. LMBenchmark's own defaults are 15 users x 20 rounds
    of 1000 + 20000 tokens; fewer users and rounds keep one H200 run of every configuration in minutes,
    the lengths are the seed's."""
    if model == "tiny":
        return Shape(users=4, rounds=3, sys_len=64, hist_len=320, q_len=24, answer=4)
    if model == "1b":
        return Shape(users=8, rounds=4, sys_len=1000, hist_len=15000, q_len=100, answer=16)
    return Shape(users=8, rounds=4, sys_len=1000, hist_len=15000, q_len=100, answer=16)


def rand_tokens(seed: object, n: int, vocab: int) -> list[int]:
    rng = random.Random(str(seed))
    return [rng.randrange(1, min(vocab, 256)) for _ in range(n)]


@dataclass(slots=True)
class Conversations:
    """The token ids of one configuration's run."""

    system: list[int]
    history: list[list[int]]  # per user
    questions: list[list[list[int]]]  # [user][round]

    @classmethod
    def make(cls, tag: str, shape: Shape, vocab: int) -> Conversations:
        return cls(rand_tokens(f"{tag}-sys", shape.sys_len, vocab),
                   [rand_tokens(f"{tag}-hist-{u}", shape.hist_len, vocab) for u in range(shape.users)],
                   [[rand_tokens(f"{tag}-q-{u}-{r}", shape.q_len, vocab) for r in range(shape.rounds)]
                    for u in range(shape.users)])


def due(u: int, r: int, users: int, rate: float, rate0: float = 0.0, poisson_seed: int | None = None) -> float:
    """Seconds after the start at which user u's round r is due; rate0 (if set) is round 0's rate
    (the disk setting's warm-up: the histories reach the disk tier no faster than it writes).
    Arrivals come in order (round by round, user by user), evenly spaced, or with poisson_seed as a
    Poisson process of the same mean rate (exponential gaps from that seed: the same schedule for
    every engine run with it; what serving benchmarks such as vLLM's benchmark_serving default to,
    and what makes requests queue now and then below saturation)."""
    rate0 = rate0 or rate
    k = r * users + u
    if poisson_seed is None:
        return k / rate0 if r == 0 else users / rate0 + (k - users) / rate
    gaps = _unit_gaps(poisson_seed, k + 1)
    return sum(g / (rate0 if i < users else rate) for i, g in enumerate(gaps[:k]))


_GAPS: dict[int, list[float]] = {}


def _unit_gaps(seed: int, n: int) -> list[float]:
    """The first n exponential gaps of mean 1 of this seed (the first arrival at time 0)."""
    g = _GAPS.setdefault(seed, [])
    if len(g) < n:
        rng = random.Random(seed)
        g[:] = [rng.expovariate(1.0) for _ in range(max(n, 2 * len(g)))]
    return g
