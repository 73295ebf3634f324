"""k="auto": the number of draft tokens per round, chosen every round from what rounds cost and
what the draft gets accepted. A policy is told what each round cost and what was accepted, and
answers a k; it asks nothing else of the loop or the drafter.

The model (Leviathan et al. 2023, section 3): with per-position acceptance a_1..a_k (a_i the
chance that draft i is accepted once draft i - 1 was), a round drafting k tokens emits
E(k) = 1 + a_1 + a_1 a_2 + ... + a_1...a_k tokens and costs R_B(k) seconds for a batch of B rows.
The batch's k="auto" rows share one k: the argmax of sum_rows E_row(k) / R_B(k), k = 0 being a
plain round (E = 1).

- Acceptance (`Acceptance`): per (pair, sampling regime), per position, accepted / reached counts
  that forget at DECAY per observation (text changes; ~30 rounds count), with a Beta(1, 1)
  prior; a position never reached borrows the one before it.
- Costs (`RoundCosts`): per (pair, batch size bucket), from the last RECENT timed rounds of each
  k, the median of consecutive pairs' means (`typical`: pipelined plain rounds book their time
  unevenly). An untimed k is extrapolated from the nearest timed one at the slope a timed
  drafting k showed (SLOPE until one is timed); the choice goes at most one step beyond the
  largest timed k, so k grows as costs are measured rather than on a guess.
- Exploring: a pair new to the process times plain rounds first (R(0)), then drafts EXPLORE
  rounds at k = 1 (R(1) and a_1), then chooses. A plain choice is probed (one drafting round at
  the best drafting k) after PROBE_START plain rounds, the wait doubling after each probe that
  finds drafting still not paying (up to PROBE_MAX) and starting over once drafting pays: where
  nothing pays, probes cost about log2(rounds) rounds. A drafting choice is probed alike: after
  PROBE_START drafting rounds R(0) is timed anew (its old timings dropped, two plain rounds
  timed, as at first), the wait doubling while drafting keeps paying. R(0) is otherwise timed
  only before drafting starts, in the first rounds after a prompt, which run slower than a
  plain stretch's (1.3-3.9 ms against 1.0-1.1 ms for a tiny Qwen3.5's queued plain rounds), and
  drafting that looked better on them would never be checked again.
- Persistence: what a pair learned is saved per sampling regime in the policy file
  (`policy_store.py`) and a new process starts from it.
"""

from __future__ import annotations

import json
import math
import statistics
import time
import weakref
from collections import deque
from collections.abc import Hashable
from typing import Any

from . import policy_store
from .sampling import ParameterError

AUTO = "auto"
DEFAULT_K = AUTO
AUTO_MAX_K = 8  # the most k="auto" drafts, unless the drafter proposes more in one forward
MAX_LEARNED_K = 63  # the largest k a policy file may hold costs for (a block drafter's block)
DECAY = 0.97  # per observation of a position: about the last 30 rounds count
RECENT = 15  # timed rounds of a k whose median is its cost
SLOPE = 0.5  # R(k) / R(0) - 1 per draft token, assumed until a drafting k is timed
EXPLORE = 2  # k = 1 rounds a new pair drafts before choosing
PROBE_START = 32  # plain rounds before a plain choice is probed
PROBE_MAX = 512  # the longest wait between two probes
LOADED_WEIGHT = 8.0  # observations a saved regime's acceptance counts for at most
SAVE_EVERY = 10.0  # seconds between two saves of one pair's entry
MAX_REGIMES = 16  # sampling regimes a pair keeps (the least recently used go)


class Acceptance:
    """Per-position acceptance of one pair in one sampling regime (see the module docstring)."""

    def __init__(self, k_max: int = AUTO_MAX_K) -> None:
        self.accepted = [0.0] * k_max
        self.reached = [0.0] * k_max

    def update(self, k: int, accepted: int) -> None:
        """A round drafted k tokens and the first `accepted` were kept."""
        for i in range(min(accepted + 1, k, len(self.reached))):
            self.accepted[i] = self.accepted[i] * DECAY + (i < accepted)
            self.reached[i] = self.reached[i] * DECAY + 1

    def means(self) -> list[float]:
        """a_1..a_kmax: posterior means; a position never reached borrows the one before."""
        out, before = [], 0.5
        for a, r in zip(self.accepted, self.reached):
            before = (a + 2 * before) / (r + 2) if out else (a + 1) / (r + 2)
            out.append(before)
        return out

    @property
    def observed(self) -> float:
        return self.reached[0]


def expected_tokens(alphas: list[float], k: int) -> float:
    """E(k) = 1 + a_1 + a_1 a_2 + ... + a_1...a_k: tokens a round drafting k emits."""
    total, run = 1.0, 1.0
    for a in alphas[:k]:
        run *= a
        total += run
    return total


def typical(seconds: deque[float]) -> float:
    """A round's typical cost from its recent timings: the median of the means of consecutive
    pairs. Pipelined plain rounds book their device time unevenly: on MLX's CPU backend reading
    a round waits for the one queued behind it too, so the timings alternate ~2R and ~0 and
    their median can be either; a pair's mean undoes that, the median keeps an outlier out."""
    values = list(seconds)
    if len(values) < 2:
        return values[0]
    return statistics.median((a + b) / 2 for a, b in zip(values, values[1:]))


class RoundCosts:
    """R(k) of one pair at one batch size bucket, plus the probe schedules of its plain and its
    drafting choices."""

    def __init__(self) -> None:
        self.timings: dict[int, deque[float]] = {}
        self.plain_rounds = 0  # plain rounds since drafting last paid or a probe
        self.probe_wait = PROBE_START
        self.drafting_rounds = 0  # drafting rounds since plain last paid or a plain probe
        self.plain_wait = PROBE_START

    def update(self, k: int, seconds: float) -> None:
        """A timed round that drafted k tokens (0: plain) took `seconds`."""
        self.timings.setdefault(k, deque(maxlen=RECENT)).append(seconds)

    def timed(self, k: int) -> int:
        return len(self.timings.get(k, ()))

    def cost(self, k: int) -> float:
        """R(k): measured, or extrapolated (see the module docstring). Needs R(0)."""
        if self.timed(k):
            return typical(self.timings[k])
        plain = typical(self.timings[0])
        drafting = [j for j in self.timings if j > 0]
        slope = SLOPE
        if drafting:
            near = min(drafting, key=lambda j: abs(j - k))
            slope = max(0.0, (typical(self.timings[near]) / plain - 1) / near)
        return plain * (1 + slope * k)

    def to_json(self) -> dict[str, list[float]]:
        return {str(k): list(v) for k, v in self.timings.items()}

    def load(self, data: dict[str, list[float]]) -> None:
        """Fill in the ks this process has not timed from a saved entry."""
        for k, values in data.items():
            seconds = [float(x) for x in values][-RECENT:]
            if not all(0 < x < math.inf for x in seconds) or not 0 <= int(k) <= MAX_LEARNED_K:
                raise ValueError(f"round costs must be positive seconds (k={k}: {values})")
            if int(k) not in self.timings:
                self.timings[int(k)] = deque(seconds, maxlen=RECENT)


def choose(costs: RoundCosts, rows: list[Acceptance], limit: int) -> int:
    """One k for a batch's k="auto" rows (each row's acceptance), at most `limit` and the
    positions their acceptance covers (the pair's k_max)."""
    limit = max(0, min(limit, min((len(r.accepted) for r in rows), default=0)))
    if limit == 0 or not rows:
        return 0
    if costs.timed(0) < 2:
        return 0  # R(0) first
    if costs.timed(1) < EXPLORE or min(r.observed for r in rows) < 1:
        return 1  # a new pair, or a row in a regime never drafted: try k = 1
    alphas = [r.means() for r in rows]
    reach = min(limit, max(costs.timings) + 1)
    rates = {k: sum(expected_tokens(a, k) for a in alphas) / costs.cost(k)
             for k in range(reach + 1)}
    best = max(rates, key=lambda k: (rates[k], -k))
    if best > 0:
        costs.plain_rounds, costs.probe_wait = 0, PROBE_START
        costs.drafting_rounds += 1
        if costs.drafting_rounds < costs.plain_wait:
            return best
        costs.drafting_rounds, costs.plain_wait = 0, min(2 * costs.plain_wait, PROBE_MAX)
        costs.timings.pop(0, None)  # a plain probe: R(0) timed anew over its next plain rounds
        return 0
    costs.drafting_rounds, costs.plain_wait = 0, PROBE_START
    costs.plain_rounds += 1
    if costs.plain_rounds < costs.probe_wait:
        return 0
    costs.plain_rounds, costs.probe_wait = 0, min(2 * costs.probe_wait, PROBE_MAX)
    return max(range(1, reach + 1), key=lambda k: (rates[k], -k))


def sampling_regime(sampling: Any) -> tuple:
    """The regime a pair's acceptance is learned for: (temperature, top-p, top-k, min-p)."""
    return (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p)


def batch_bucket(rows: int) -> int:
    """The batch size whose costs a batch of `rows` uses: the next power of two."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return bucket


class DraftLengthPolicy:
    """What one (target, draft) pair has learned in this process: acceptance per sampling
    regime (of positions 1..k_max), costs per batch size bucket; `store_key` names its policy
    file entry (None: not persisted)."""

    def __init__(self, store_key: str | None = None, k_max: int = AUTO_MAX_K) -> None:
        self.k_max = k_max
        self.regimes: dict[str, Acceptance] = {}
        self.costs: dict[int, RoundCosts] = {}
        self.trees: dict[tuple, TreeChoice] = {}  # (budget, regime) -> tree or chain
        self.store_key = store_key
        self.last_save = 0.0
        if store_key is not None:
            self._load(policy_store.load_entry(store_key))

    def acceptance(self, regime: Hashable) -> Acceptance:
        key = _regime_key(regime)
        held = self.regimes.pop(key, None) or Acceptance(self.k_max)
        self.regimes[key] = held  # most recently used last
        while len(self.regimes) > MAX_REGIMES:
            self.regimes.pop(next(iter(self.regimes)))
        return held

    def tree_choice(self, budget: int, regime: Hashable) -> TreeChoice:
        """The pair's choice between trees of `budget` (or smaller) and its chain, in this
        regime."""
        key = (budget, _regime_key(regime))
        if key not in self.trees:
            self.trees[key] = TreeChoice(budget)
        return self.trees[key]

    def round_costs(self, rows: int) -> RoundCosts:
        bucket = batch_bucket(rows)
        if bucket not in self.costs:
            self.costs[bucket] = RoundCosts()
        return self.costs[bucket]

    def save(self, force: bool = False) -> None:
        """Write what the pair learned to its entry (at most every SAVE_EVERY s unless forced)."""
        now = time.monotonic()
        if self.store_key is None or not self.costs:
            return
        if not force and self.last_save and now - self.last_save < SAVE_EVERY:
            return
        self.last_save = now
        regimes = {key: {"accepted": a.accepted, "reached": a.reached}
                   for key, a in self.regimes.items()}
        costs = {str(b): c.to_json() for b, c in self.costs.items()}
        policy_store.save_entry(self.store_key, {"costs": costs, "regimes": regimes,
                                                 "saved": time.time()})

    def _load(self, entry: dict[str, Any] | None) -> None:
        if entry is None:
            return
        try:
            costs = {int(b): c for b, c in entry["costs"].items()}
            regimes = {str(key): ([float(x) for x in v["accepted"]],
                                  [float(x) for x in v["reached"]])
                       for key, v in entry["regimes"].items()}
            for bucket, data in costs.items():
                held = RoundCosts()
                held.load(data)
                self.costs[bucket] = held
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            policy_store.warn_once(f"ignoring a k='auto' policy entry that is not ours: {err}")
            self.costs = {}
            return
        for key, (accepted, reached) in regimes.items():
            if len(accepted) == self.k_max == len(reached):
                scale = min(1.0, LOADED_WEIGHT / max(reached[0], 1e-9))
                held = Acceptance(self.k_max)
                held.accepted = [x * scale for x in accepted]
                held.reached = [x * scale for x in reached]
                self.regimes[key] = held


_PAIRS: dict[tuple[int, object], tuple[weakref.ref, DraftLengthPolicy]] = {}


def shared_policy(target: object, draft: object, k_max: int = AUTO_MAX_K) -> DraftLengthPolicy:
    """The policy of a (target, draft) pair, kept while the target exists: later generations
    (and batches) start from what earlier ones measured. `draft` is the draft model object, or
    a string naming a model-free drafter and its settings; `k_max`: the most it may choose (set
    when the pair is first seen: AUTO_MAX_K, or a block drafter's block_size - 1). A pair new
    to the process starts from its policy file entry."""
    for key in [k for k, (ref, _) in _PAIRS.items() if ref() is None]:
        del _PAIRS[key]
    key = (id(target), draft if isinstance(draft, str) else id(draft))
    held = _PAIRS.get(key)
    if held is None or held[0]() is not target:
        store = None if policy_store.policy_path() is None else policy_store.pair_key(target,
                                                                                     draft)
        held = _PAIRS[key] = (weakref.ref(target), DraftLengthPolicy(store, k_max))
    return held[1]


def forget_pairs() -> None:
    """Forget every pair's policy held in this process (and the models' fingerprints): the next
    k="auto" generation of any pair starts as in a new process, from its policy file entry or
    from scratch."""
    _PAIRS.clear()
    policy_store.forget_fingerprints()


def record_rounds(target: object, draft: object, regime: Hashable,
                  rounds: dict[int, tuple[float, int]], accepted: list[float],
                  reached: list[float]) -> None:
    """Book rounds measured at fixed k outside `k="auto"` (`python -m tinydraft_mlx.check`):
    per k (0: plain) the mean seconds of a round and how many were timed, per draft position
    at `regime` the accepted / reached counts; then save the pair's entry."""
    policy = shared_policy(target, draft)
    costs = policy.round_costs(1)
    for k, (seconds, timed) in rounds.items():
        for _ in range(min(timed, RECENT)):
            if seconds > 0 and 0 <= k <= policy.k_max:
                costs.update(k, seconds)
    held = policy.acceptance(regime)
    for i in range(min(policy.k_max, len(accepted), len(reached))):
        held.accepted[i] += accepted[i]
        held.reached[i] += reached[i]
    policy.save(force=True)


def _regime_key(regime: Hashable) -> str:
    return json.dumps(regime if not isinstance(regime, tuple) else list(regime))


def explain(policy: DraftLengthPolicy, regime: Hashable, rows: int = 1) -> str | None:
    """One sentence on what k="auto" has learned for a pair (its costs at `rows` rows and its
    acceptance in `regime`): what a plain and a drafting round cost, how often the first draft
    is accepted, and which k that makes best, as a ratio to plain decoding. None before it has
    timed a plain and a drafting round."""
    costs = policy.round_costs(rows)
    drafting = sorted(k for k in costs.timings if k > 0)
    if costs.timed(0) < 2 or not drafting:
        return None
    alphas = policy.acceptance(regime).means()
    plain = costs.cost(0)
    rates = {k: expected_tokens(alphas, k) * plain / costs.cost(k)
             for k in range(0, max(drafting) + 1)}
    best = max(rates, key=lambda k: (rates[k], -k))
    k = drafting[0]
    verdict = (f"so it will draft k = {best} ({rates[best]:.2f}x plain decoding)" if best else
               f"so drafting does not pay here ({max(rates[j] for j in drafting):.2f}x plain "
               "at best): it will decode plainly, trying drafting now and then")
    return (f'k="auto" has learned: a plain round costs {1000 * plain:.1f} ms and a k = {k} '
            f"round {1000 * costs.cost(k):.1f} ms on this machine, the draft's first token is "
            f"accepted {alphas[0]:.0%} of the time, {verdict}")


def max_draft_length(source: Any, k: int | str) -> int:
    """The most tokens a round may draft: 0 without drafting; for k="auto" AUTO_MAX_K, or a
    block drafter's whole block (`block` - 1: its k costs one draft forward whatever it is), at
    most what the drafter can propose (`max_k`); else k. ParameterError for a k beyond `max_k`."""
    if not source.drafts:
        return 0
    top = getattr(source, "max_k", None)  # a plug-in written before `max_k` has none
    if k == AUTO:
        if getattr(source, "block", None):
            return top
        return AUTO_MAX_K if top is None else min(AUTO_MAX_K, top)
    if top is not None and k > top:
        raise ParameterError("k", f"at most {top} with the {source.name} drafter (the most it "
                             "proposes in a round)", k)
    return k


class RecentRate:
    """One way of drafting's recent rounds (prompt lookup or the model, a tree or a chain):
    exponential means of the tokens a round gave (its accepted drafts plus the target's own
    token) and of its seconds; `rate` is tokens per second (None before its first round)."""

    WEIGHT = 0.5  # of the latest round: about the last 2-4 rounds count

    def __init__(self) -> None:
        self.tokens = self.seconds = 0.0
        self.rounds = 0

    def update(self, tokens: int, seconds: float) -> None:
        w = 1.0 if self.rounds == 0 else self.WEIGHT
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)
        self.rounds += 1

    @property
    def rate(self) -> float | None:
        return None if self.rounds == 0 else self.tokens / max(self.seconds, 1e-9)


class TreeChoice:
    """k="auto" with a node budget N: each round a tree of one of the sizes N, N // 2, N // 4,
    ... (down to `SMALLEST`; the drafter's reach deep) or the k="auto" chain (whose k may be 0:
    a plain step), whichever has recently given the most tokens per second (`RecentRate`); one
    per pair, budget and sampling regime (`DraftLengthPolicy.tree_choice`), learned across its
    generations. Each is tried once first (the largest tree first, the chain last); one that is
    not ahead is tried again after `RETRY` rounds of the others (what it gives changes with the
    text), and after twice as many each time it loses again (at most `MAX_WAIT`), so that a size
    that does not pay costs little. Exact whatever it picks: the choice reads only rounds
    already emitted."""

    RETRY, MAX_WAIT, SMALLEST = 8, 256, 4

    def __init__(self, budget: int) -> None:
        sizes = [budget]
        while sizes[-1] // 2 >= self.SMALLEST:
            sizes.append(sizes[-1] // 2)
        self.arms: list[int | None] = [*sizes, None]  # None: the chain
        self.recent = {arm: RecentRate() for arm in self.arms}
        self._since = dict.fromkeys(self.arms, 0)  # rounds of the others since its last
        self._wait = dict.fromkeys(self.arms, self.RETRY)

    def _best(self) -> int | None:
        rated = [arm for arm in self.arms if self.recent[arm].rate is not None]
        return max(rated, key=lambda arm: self.recent[arm].rate)  # ties: the larger tree

    def budget(self) -> int | None:
        """This round's tree budget (None: the chain)."""
        untried = [arm for arm in self.arms if self.recent[arm].rate is None]
        if untried:
            return untried[0]
        best = self._best()
        due = [arm for arm in self.arms if arm != best and self._since[arm] >= self._wait[arm]]
        return due[0] if due else best

    def tree(self) -> bool:
        """Whether this round verifies a tree."""
        return self.budget() is not None

    def book(self, budget: int | None, tokens: int, seconds: float) -> None:
        """A round of that budget (None: the chain) gave `tokens` in `seconds`."""
        retried = self.recent[budget].rate is not None and budget != self._best()
        self.recent[budget].update(tokens, seconds)
        for arm in self.arms:
            self._since[arm] = 0 if arm == budget else self._since[arm] + 1
        if retried:  # a retry: wait longer after a loss, as at first after a win
            self._wait[budget] = (self.RETRY if self._best() == budget
                                  else min(2 * self._wait[budget], self.MAX_WAIT))
