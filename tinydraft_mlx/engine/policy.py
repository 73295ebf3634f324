"""Choosing the draft length every round (`k="auto"`): measure, then maximise tokens per second.

The model (docs/design.md): a round that drafts k tokens emits
E(k) = 1 + sum_{j<=k} prod_{i<=j} alpha_i tokens (alpha_i: probability that draft position i is
accepted given the ones before it were) and costs R(k) seconds (k draft steps, one verify of k + 1
tokens, the host's share, and after plain rounds the draft's catch-up on what it missed). The
policy picks argmax_k E(k) / R(k) over k = 0 (plain decoding) .. k_max.

Both sides are measured online, not assumed:
- alpha_i: accepted / reached counts per position, discounted by `decay` at every speculative
  round (and by `PLAIN_DECAY` at every plain one where the loop `looks`, below) so that the
  estimate follows the text; a position with little data borrows strength from the pooled rate
  (posterior mean under a prior of weight `prior_strength` centred on it).
- R(k): the median of the last `RECENT` measured wall times of rounds that drafted k (a median: on a
  shared machine a round now and then takes 2-3x its usual time); timings older than `STALE_ROUNDS`
  rounds give way to k's next one, and a look (below) judges a k whose timings are that old at the
  lowest R(k) / R(0) measured here (for a k timed before R(0), over R(0)'s first estimate, taken on
  the plain rounds right after), so that it is timed afresh where that would pay (a busy moment's
  timings of R(1) at 2x otherwise kept a warm process plain for good: plain rounds never re-time
  R(1), and each look judged drafting on the same stale cost). R(0) is a running mean over rounds of
  the medians of stretches of plain rounds without their first and last rounds, booked every
  `STRETCH_BOOK` rounds. Medians on both sides, so that a round at 2-3x counts for neither (a mean
  R(0) ran ~5% above the median R(k) under this machine's noise, an offset that favoured drafting),
  and R(k) over `RECENT` = 15 timings (over 7 its sampling noise flipped drafting that paid to
  plain, for up to STALE_ROUNDS rounds at a time; replayed in docs/design.md). Pipelined plain
  rounds are not alike one by one: on MLX's CPU backend the first round of a stretch waits for two
  steps (its own and the one queued behind it) and the last for almost nothing (demo pair: 6.6, 3.3,
  ..., 3.3, 0.3 ms). Booked one by one without the first, R(0) came out 20% low (2.6 ms for 3.3) and
  a fresh process decoded plainly where k = 2 was 1.15x faster. An unmeasured k is interpolated
  linearly between measured neighbours; beyond the largest measured k it follows the slope of the
  two largest measured drafting k, or with one only adds draft steps of R(0) * draft_ratio each
  (draft_ratio: the draft/target prefill time ratio), i.e. it is optimistic (extra verification
  assumed free) until measured, so a larger k that might pay gets tried once and then judged on its
  measured cost (behind the target, where the loop looks first, only if that hope repays the
  catch-up over LOOK_HORIZON tokens: an always-rejected draft whose k = 1 was never timed was
  otherwise looked at each time its evidence faded). The policy never goes beyond the largest
  measured k plus one (timed in this process, once it has timed one: a file's k = 5 let a fresh
  process try k = 8), so a bad extrapolation costs one modest round, not a k_max-sized one, and k
  grows one step at a time. Twice the largest plus one let a new pair try k = 3 right after its
  three k = 1 timings in most fresh processes: a round at ~2x k = 1's cost, often partly rejected,
  slowing the round after it (one process, fresh policies, the k + 1 reach against 2k + 1, 60 rounds
  each: real draft T = 0 1.016x [0.981, 1.052], T = 0.7 1.028x [0.996, 1.066], oracle draft at
  acceptance 0.9 1.034x [0.995, 1.072]; again, 80 rounds: T = 0 1.019x [0.993, 1.048], T = 0.7
  1.002x [0.957, 1.047]; rounds of k >= 3 a generation 1.9 -> 0.55 at T = 0, 5.8 -> 1.2 at
  acceptance 0.9).

Where the loop looks before it leaps (below), a new pair's first rounds are plain: they measure R(0)
(its first estimate is a stretch's second round, once a third shows it was not the last), the
generation's first look (after `FIRST_LOOK` rounds) books the text's evidence, and k = 1 is then
timed in step, three times unless the evidence says the first position is rarely accepted (below
`EXPLORE_MIN`). Drafting the first rounds after the prompt explored on the text's hardest tokens
(the fresh benchmark's prompt: its first three drafts rejected in every run) and timed R(1) ahead of
R(0) (in 16 fresh processes the first R(1) / R(0) ran 8% above the same process's later one, 1.85
against 1.66 where a process then stayed plain). Replayed (bench/auto_replay.py, three noise levels,
two cost worlds): fresh texts on average -0.3 to +1.0%, the hard-start text +0.9-3.6%, texts whose
first tokens are drafted well down to -0.8%. Without looks (logits processors, ranks), or where a
generation is too short for its first look (fewer than `HORIZON` tokens left after it), the first
rounds draft one token, timed three times unless the evidence says the first position is rarely
accepted (the draft is in step with the target after the prefill: exploring then costs no catch-up,
or where it started empty the catch-up that fills it); then plain rounds measure R(0). One unlucky
start (a traced step, rejected drafts) must not keep a process plain for a whole generation, nor may
exploring cost much where speculation cannot pay (timing k = 1..3 twice each cost a fresh process 5%
of its generation there). A process that starts from the policy file does the same: it times k = 1
(where the first position is promising) and R(0) itself before its costs decide, and k = 1 three
times before it concludes plain decoding: the file's costs may have been measured under another
process's load, and a process that decodes plainly never re-times a drafting k, one that drafts
never re-times R(0) (a file's R(0) too high kept processes drafting k = 1 at acceptance 0.35, where
plain decoding was 1.15x faster, for whole generations).

When plain decoding wins on the means, speculation is still tried in three ways:
- where the draft is in step (it drafted the last round, or has just caught up on a look),
  drafting goes on as long as a Thompson draw (below) says it loses less over `HORIZON` tokens
  than a switch back would cost: a drafting round measures acceptance as it goes, a plain round
  learns nothing until the next look, so near break-even on thin evidence drafting is the better
  bet (on the means alone, three rejected first rounds kept fresh processes plain for 30-60
  rounds of a text where k = 1 paid throughout; the first tokens after a prompt are often the
  hardest). On strong evidence the draws sit at the means, and drafting that loses stops.
- where the loop looks before it leaps (below), a look once it is worth its catch-up: the
  expected saving of drafting over plain decoding where drafting saves anything, over the first
  position's posterior, times the tokens a finding holds for (`LOOK_HORIZON`, or the rest of the
  generation) (`_look_value`). It is small where the evidence is strong either way and grows as
  plain rounds fade the evidence (`PLAIN_DECAY`), so near break-even on thin evidence a look comes
  soon, on much evidence against rarely. A Thompson draw every round did this before: it made a
  look whenever one draw came out high, 47 looks in 20 warm generations of 128 tokens where
  nothing paid (~2% of the time; replayed by bench/auto_replay.py).
- where the loop does not look first (a probe is a whole drafting round), Thompson sampling:
  each position's acceptance is drawn from its posterior (uniform prior); if drafting (a k whose
  cost has been measured) would beat plain decoding at the drawn values by enough to repay within
  `HORIZON` tokens the catch-up and the round's expected loss, the best k there is tried. Where
  the evidence is thin (a new pair whose first drafts were rejected: the first tokens after a
  prompt are often the hardest) that happens now and then; with much evidence against, almost
  never.
- a probe once its expected loss fits in `probe_budget` (2%) of the time spent in plain rounds
  since speculation was last tried (by whatever chose a drafting round or a look: a new pair's
  look that timed k = 1 left the budget to a whole drafting round the round after it; across
  generations: restarted every generation, it never paid for a look whose catch-up grows with
  the stretch), so that a later easy stretch (or a cost estimate spoiled by a noisy round) is not
  missed however much evidence there is. Where the loop looks first and a drafting k's cost is
  stale, the probe re-times it: EXPLORE_TIMES rounds of it where the look finds the first
  position promising (a pair's first rounds, timed at 2.1x a plain round where a run costs 1.6x,
  otherwise kept a warm process plain at acceptance 0.9). The loss counts the
  draft's catch-up on the plain rounds it missed: a prefill of those tokens, fitted as a fixed part
  plus a part per token (demo pair: 3.5 ms after 55 plain rounds, 4.5 after 65; one price for every
  switch underrated long stretches' probes by 2x), through a prior point at a plain round's cost
  for a catch-up on almost nothing (switches timed at one stretch length alone, as a policy file's
  often are, cannot tell the two parts apart); a look's price includes its evidence (the draft's
  head on its last rows, sampled: the warps of both sides). Where the loop looks first (below) a
  probe risks its catch-up whatever the draft is worth, so the budget is spent at the rate of the
  chance that the look finds the draft worth exploring (`_probe_share`: the first position's
  posterior probability of an acceptance >= EXPLORE_MIN): a draft the last look found always
  rejected is probed again as its evidence fades (PLAIN_DECAY), not after every ~50 plain rounds.
  Probes that found nothing new (drafting still loses at the means, no re-timed cost moved by
  more than PROBE_CHANGE) slow the next ones: the budget over 1 + FRUITLESS_SLOWING per such probe
  in a row, up to FRUITLESS_CAP of them (`_end_probe`). Where nothing pays, a warm process had
  probed about once a generation (a look, three re-timing rounds, a few in-step draws), ~2% of its
  time (demo pair, T = 0.7: 0.965-0.973x plain decoding, 0.982-0.985x with the slowing); the
  price is a change only a probe can find (a drafting cost that falls, R(0) unchanged), found up
  to 3x later.
And where the loop looks first, a generation's first stretch of plain rounds looks at its text
once, after `FIRST_LOOK` rounds (a catch-up of a few tokens), whatever the evidence says while the
policy has not looked at a generated text yet (`seen_text`: a fresh process's evidence is the
first tokens', often the hardest), so that the text being written decides whether it is drafted;
a policy that has (a warm process's) looks only where a look is worth it, as above. Neither that
look nor a budgeted probe is taken in a generation's last `HORIZON` tokens: what they find would
have nothing left to pay over. Where the loop looks first the draft model starts a generation
empty (speculative.py) and that first look feeds it the prompt too; until then nothing of the
draft runs, so a generation that never looks nor drafts costs what plain decoding does. Unless
drafting pays at the means, nothing looks on an empty draft before FIRST_LOOK plain rounds: a look
on its second round (a warm process's probe budget spent there) bought the fill and one token of
evidence, where at FIRST_LOOK the same fill tells eight.

A plain choice where the loop looks first stands for `HOLD_ROUNDS` rounds (`choose`, `_due`): what
decides a plain stretch's rounds moves slowly (evidence fading by `PLAIN_DECAY` a round, R(0)
booked every `STRETCH_BOOK` rounds), so the full choice (10-40 us of Python, 3-4x that in the loop
on a 2-core CPU whose cores run MLX's compute) is made every `HOLD_ROUNDS` rounds; a budgeted
probe and a generation's first look are still taken the round they fall due, and a drafting round
or new evidence ends a hold.

The loop looks before it leaps (`looks`; without logits processors, on one rank): a round after
plain rounds first catches the draft up, books per token of the last `CATCH_UP_EVIDENCE` it caught
up on the probability that a one-token draft there would have been accepted (`observe`; greedy:
whether the draft's argmax was the token that followed, exactly where and how far a greedy draft
would have been accepted; sampled: sum min(p, q) of the warped distributions, with the target's p
kept from the plain steps), and chooses again; a probe that finds speculation hopeless costs the
catch-up only. (A generation's start booked the same kind of evidence from the prompt, target
and draft after its last 16 tokens: on the demo pair its forwards cost 2.7-5 ms a generation,
whether the draft was used or not, about what the one look it could spare costs;
docs/design.md.) Greedy, a round accepted whole also tells whether one more draft position would
have been accepted (`observe_beyond`: the next round's first draft step feeds d_k and the target's
token after it, so the draft's argmax after d_k comes with it): a policy drafting k learns
alpha_(k+1) without drafting k + 1. Without it, k = 1 rounds never reached position 2, whose
acceptance was then assumed to be the pooled rate (0.6-0.7 on the demo pair, where it is 0.85-0.9
given the first). It is read only while that position's evidence is thin (`wants_beyond`: fewer
than BEYOND_EVIDENCE discounted observations): read every round it made the verify wait ~160 us
longer, 3.5-4.5% of a generation drafting k = 1 on the demo pair (one process, fresh policies,
real draft, T = 0: 1.032x [1.002, 1.061] with it read so), and only while it could change the
choice: while k + 1, were it always accepted there, would beat k (a read of a k + 1 timed too dear
to pay told nothing and still cost: with this gate 1.023x at T = 0, 1.015x at acceptance 0.9).

What is learned is kept per (target, draft) pair across generations (`shared_policy`): the costs
(`RoundCosts`) once per pair, since they do not depend on how tokens are sampled; the acceptance
once per sampling regime (temperature, top-p, top-k, min-p), since acceptance learned at T = 0
says little about T = 1. And across processes (`policy_store.py`): a pair new to the process
starts from what the last processes on this machine, device and dtype saved for it, and saves
what it learns when a generation ends (at most every SAVE_EVERY seconds). Loaded costs are a
start only: each k's first timing in this process replaces its loaded cost, and a k not timed
here yet is estimated from what has been (`round_cost`), since the file's costs were measured
under another process's load. What does carry over is a ratio: R(k) / R(0) measured over a full
window of k's rounds (`RoundCosts.hope`; saved only from such a window, by a process or by
`python -m tinydraft_mlx.check`), which bounds k's cost from above while this process has fewer
timings of it (`_drafting_cost`): a k's first rounds after a switch are its dearest, and a
fresh process's three timings of k = 1 otherwise decided its generation.
"""

from __future__ import annotations

import bisect
import json
import math
import random
import statistics
import time
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable
from typing import Any

from . import policy_store

AUTO = "auto"
AUTO_MAX_K = 8
# k when none is given (API, engine, CLI, server): "auto", far ahead of any one fixed k where
# that k loses, and near the best fixed k where one pays (results/auto_fresh.json)
DEFAULT_K: int | str = AUTO
MAX_REGIMES = 16  # sampling regimes whose acceptance a pair keeps (least recently used go)
EXPLORE_KS = (1,)  # each timed EXPLORE_TIMES times before plain decoding may be concluded
EXPLORE_TIMES = 3
DRAFT_RATIO = 0.25  # a draft step's cost over a plain round's, assumed until one is measured
EXPLORE_MIN = 0.3  # mean first-position acceptance below which a new pair does not explore
CATCH_UP_EVIDENCE = 16  # the last tokens a catch-up predicts, as evidence (`observe`)
CATCH_UP_WEIGHT = 8.0  # rounds' worth of evidence a catch-up's predictions count for at most
STRETCH_BOOK = 8  # a stretch's middle rounds booked together (R(0): their median round)
RECENT = 15  # a drafting k's cost R(k): the median of its last RECENT timings in this process
PLAIN_DECAY = 0.99  # per plain round, where the loop looks before it leaps (half-life ~70)
FIRST_LOOK = 8  # plain rounds after which a generation's first stretch looks at its text
HORIZON = 32  # tokens over which a Thompson draw's gain must repay a switch to drafting
LOOK_HORIZON = 64  # tokens (at most: the rest of the generation) a look's finding holds for
LOOK_POINTS = 24  # grid over the first position's acceptance a look's value is integrated on
SWITCH_DECAY = 0.8  # weight of a past switch in the catch-up cost's fit, per switch since
STALE_ROUNDS = 32  # rounds after which a drafting k's cost is re-timed afresh by a probe
HOLD_ROUNDS = 8  # plain rounds a plain choice stands for unless a probe or the first look falls due
SAVE_EVERY = 10.0  # seconds between two saves of one pair's policy file entry
LOADED_WEIGHT = 8.0  # evidence a loaded regime's acceptance counts for (then new text leads)
ANCHOR_WEIGHT = 0.1  # switches' worth of the switch cost's prior point (`switch_cost`)
FRUITLESS_SLOWING = 0.5  # the probe budget over 1 + this per fruitless probe in a row
FRUITLESS_CAP = 4  # fruitless probes counted at most (the budget at least a third)
PROBE_CHANGE = 0.2  # a re-timed R(k) / R(0) this far from before: the probe found a change
BEYOND_EVIDENCE = 6.0  # observations of position k + 1 past which a k round stops reading it
_GRID = [(i + 0.5) / LOOK_POINTS for i in range(LOOK_POINTS)]
_LOG_GRID = [(math.log(x), math.log1p(-x)) for x in _GRID]


def _grid_posterior(accepted: float, rejected: float) -> list[float]:
    """Beta(1 + accepted, 1 + rejected) on `_GRID`, unnormalised (its largest weight 1)."""
    logs = [accepted * lx + rejected * l1x for lx, l1x in _LOG_GRID]
    top = max(logs)
    return [math.exp(w - top) for w in logs]


class RoundCosts:
    """Measured round costs of a (target, draft) pair, whatever the sampling: per k a moving
    average of a round's wall time and how many rounds were timed, and the draft's catch-up
    when drafting resumes after plain rounds (the price of a switch): a fixed part plus a part
    per plain round the draft missed, fitted by least squares over recent switches."""

    def __init__(self) -> None:
        self.round_seconds: dict[int, float] = {}
        self.timed: Counter[int] = Counter()
        # discounted sums over switches of 1, behind, seconds, behind^2, behind * seconds
        self.switch_fit = [0.0] * 5
        self.switches = 0
        self.here: set[int] = set()  # k timed in this process (the others were loaded)
        self.recent: dict[int, deque[float]] = {}  # per drafting k its latest timings here
        # per drafting k the lowest R(k) / R(0) measured here (at each booking: the median over
        # the plain round then): the cost a probe hopes for (`DraftLengthPolicy.choose`)
        self.best_ratio: dict[int, float] = {}
        self.rounds = 0  # rounds booked in this process
        self.last_timed: dict[int, int] = {}  # per k, `rounds` when it was last timed here
        # per drafting k, R(k) / R(0) as the latest full window of RECENT timings measured it,
        # here or in an earlier process (the policy file): what k's first few timings (in this
        # process, or after its timings went stale) are judged against (`_drafting_cost`). A
        # process that timed k a few times only (a fresh process's first rounds after a switch,
        # 15-25% dearer than a run's on the demo pair) does not overwrite it with their ratio
        self.hope: dict[int, float] = {}
        # seconds per token of the latest fill (a generation's first catch-up, which feeds a
        # draft that started empty the prompt too): what a look costs before it (`_switch_price`)
        self.fill_per_token = 0.0
        # R(0) was last set by a drafting round's bound (`DraftLengthPolicy._bound_plain`), not
        # by plain rounds: a ratio to it is no measurement (`hope` is not taken against it)
        self.plain_bounded = False

    def stale(self, k: int) -> bool:
        """Whether k's timings here are older than STALE_ROUNDS rounds (never timed: not
        stale)."""
        return k in self.last_timed and self.rounds - self.last_timed[k] >= STALE_ROUNDS

    def book_switch(self, behind: int, seconds: float) -> None:
        """A catch-up of `seconds` after `behind` plain rounds."""
        w, b, c, bb, bc = (x * SWITCH_DECAY for x in self.switch_fit)
        self.switch_fit = [w + 1, b + behind, c + seconds, bb + behind * behind,
                           bc + behind * seconds]
        self.switches += 1

    def switch_cost(self, behind: int, anchor: float | None = None) -> float:
        """Estimated seconds of a catch-up after `behind` plain rounds (0.0 before any).
        `anchor`: a catch-up's price on almost nothing (`DraftLengthPolicy._switch_price`: a
        plain round), a prior point of the fit at 0 rounds behind of weight ANCHOR_WEIGHT: with
        it, switches timed at one stretch length set the part per round, not the fixed part
        alone (a policy file's switches, every one after ~50 plain rounds at 3.4 ms, priced a
        look after 10 at 3.4 ms where it cost ~2)."""
        w, b, c, bb, bc = self.switch_fit
        if anchor is not None:
            w, c = w + ANCHOR_WEIGHT, c + ANCHOR_WEIGHT * anchor
        if w <= 0:
            return 0.0
        mean_b, mean_c = b / w, c / w
        spread = bb / w - mean_b * mean_b
        slope = max(0.0, (bc / w - mean_b * mean_c) / spread) if spread > 1e-6 else 0.0
        fixed = max(0.0, mean_c - slope * mean_b)
        return fixed + slope * behind

    def to_json(self) -> dict[str, Any]:
        return {"round_seconds": {str(k): v for k, v in self.round_seconds.items()},
                "timed": {str(k): n for k, n in self.timed.items()},
                "switch_fit": self.switch_fit, "switches": self.switches,
                "hope": {str(k): v for k, v in self.hope.items()}}

    def load(self, data: dict[str, Any]) -> None:
        """Start from saved costs (ValueError/TypeError/KeyError if they are not ours)."""
        seconds = {int(k): float(v) for k, v in data["round_seconds"].items()}
        timed = Counter({int(k): int(n) for k, n in data["timed"].items()})
        if any(v <= 0 for v in seconds.values()) or set(timed) - set(seconds):
            raise ValueError("round costs must be positive, timed only where measured")
        self.round_seconds.update(seconds)
        self.timed.update(timed)
        fit = [float(x) for x in data["switch_fit"]]
        if len(fit) != 5 or fit[0] < 0:
            raise ValueError("switch_fit must be 5 sums")
        self.switch_fit = fit
        self.switches = int(data["switches"])
        hope = {int(k): float(v) for k, v in data.get("hope", {}).items()}
        if any(k < 1 or not v > 0 for k, v in hope.items()):
            raise ValueError("hopes are ratios of drafting rounds to plain ones")
        self.hope.update(hope)

    def merge(self, loaded: RoundCosts) -> None:
        """Take costs `loaded` from the policy file where this process has measured none: each
        k not timed yet, the switch cost's fit if no switch has been."""
        for k, seconds in loaded.round_seconds.items():
            if k not in self.round_seconds:
                self.round_seconds[k] = seconds
                self.timed[k] = loaded.timed[k]
        if not self.switches:
            self.switch_fit, self.switches = list(loaded.switch_fit), loaded.switches
        for k, ratio in loaded.hope.items():
            self.hope.setdefault(k, ratio)


class _Probe:
    """A budgeted probe under way (`DraftLengthPolicy._end_probe`): R(k) / R(0) when it began
    and the k its rounds drafted."""

    def __init__(self, ratios: dict[int, float]) -> None:
        self.ratios = ratios
        self.begun = False  # its look (catch-up) or first drafting round has been booked
        self.drafted: set[int] = set()


class DraftLengthPolicy:
    """Online choice of k. `choose(limit)` before a round, `update(k, accepted, seconds)` after."""

    def __init__(
        self,
        k_max: int = AUTO_MAX_K,
        *,
        draft_ratio: float = DRAFT_RATIO,
        decay: float = 0.97,
        smoothing: float = 0.1,
        prior_strength: float = 2.0,
        probe_budget: float = 0.02,
        costs: RoundCosts | None = None,
    ) -> None:
        self.k_max = k_max
        self.draft_ratio = draft_ratio
        self.decay = decay
        self.smoothing = smoothing
        self.prior_strength = prior_strength
        self.accepted = [0.0] * k_max  # discounted counts per draft position
        self.rejected = [0.0] * k_max
        self.costs = RoundCosts() if costs is None else costs  # may be shared by policies
        # k -> moving average of a round's wall time; rounds per k whose wall time was booked
        self.round_seconds, self.timed = self.costs.round_seconds, self.costs.timed
        self.probe_budget = probe_budget
        self.plain_seconds = 0.0  # time in plain rounds since speculation was last tried
        self.stretch: list[float] = []  # seconds of the plain rounds not yet booked
        self.pending: float | None = None  # the latest plain round's seconds (if not the last)
        self.behind = 0  # plain rounds since the last drafting round (the draft missed them)
        self.rng = random.Random(0)  # Thompson draws (seeded: a run's choices are repeatable)
        # whether the loop looks before it leaps: a round after plain rounds first catches the
        # draft up, books its predictions (`observe`) and chooses again, so that a probe which
        # finds speculation hopeless costs only the catch-up (set per generation by the loop)
        self.looks = False
        self.look_due = False  # a generation's first plain stretch has not looked yet
        self.chosen: Counter[int] = Counter()
        self.seen_text = False  # a catch-up's evidence (of generated text) has been booked
        # within one `choose` (the costs do not change): the costs in use, each k's round cost
        self._known: dict[int, float] | None = None
        self._ks: list[int] = []  # its k, sorted
        self._memo: dict[int, float] = {}
        self.held = 0  # further plain rounds the latest plain choice stands for (`choose`)
        # a budgeted probe that found a stale k's cost: the drafting rounds it still owes that k
        # (`retime_k`) so that its cost is timed afresh (`_choose`)
        self.retime = 0
        self.retime_k = 0
        # tokens the draft lacks beyond the plain rounds it missed: the prompt, where the draft
        # starts a generation empty (set per generation by the loop; 0 once a catch-up fed it)
        self.empty = 0
        # budgeted probes in a row that found nothing new (`_end_probe`), which slow the next
        # ones (`_budget_allows`); the probe under way, if any
        self.fruitless = 0
        self.probe: _Probe | None = None

    # -- estimates -------------------------------------------------------------------------------
    def round_cost(self, k: int) -> float:
        """Estimated seconds of a round drafting k tokens (needs R(0) measured). Once this
        process has timed a drafting round, a k it has not timed is estimated from what it has
        timed (and R(0)), not from costs loaded from the policy file: those were measured under
        another process's load (a file written on a busy machine had R(2) at 1.7x R(1) where it
        is 1.4x, so k = 2 was never tried again), and the estimate below is optimistic, so such a
        k gets timed here once and is then judged on its own cost."""
        if self._known is None:  # outside `choose`
            return self._round_cost(k, self._costs_in_use())
        cost = self._memo.get(k)
        if cost is None:
            cost = self._memo[k] = self._round_cost(k, self._known)
        return cost

    def _round_cost(self, k: int, known: dict[int, float]) -> float:
        if k in known:
            return known[k]
        ks = self._ks if known is self._known else sorted(known)
        at = bisect.bisect(ks, k)  # ks[:at] are below k, ks[at:] above
        if 0 < at < len(ks):  # interpolate
            lo, hi = ks[at - 1], ks[at]
            w = (k - lo) / (hi - lo)
            return known[lo] * (1 - w) + known[hi] * w
        # beyond the largest measured k: the measured slope of the two largest drafting k, else
        # draft steps only (optimistic: verifying more tokens is assumed free). Not the smaller
        # of the two: where a draft position costs far more than the prefill ratio says (a
        # draft step 0.4x a plain round, measured 2.5 ms a position), every larger k looked
        # cheap in turn and a warm policy tried k = 5, 7, 8 at 15-19 ms a round
        hi = ks[at - 1]
        slope = known[0] * self.draft_ratio
        if at >= 2 and ks[at - 2] >= 1:
            lo = ks[at - 2]
            slope = max(0.0, (known[hi] - known[lo]) / (hi - lo))
        return known[hi] + slope * (k - hi)

    def _costs_in_use(self) -> dict[int, float]:
        """The measured round costs estimates start from: R(0) and, once this process has timed
        a drafting round, the drafting k it has timed; before that, everything known (loaded
        from the policy file too)."""
        timed_here = self.costs.here - {0}
        if not timed_here:
            return self.round_seconds
        return {k: v for k, v in self.round_seconds.items() if k in timed_here or k == 0}

    def _timed_here(self, k: int) -> int:
        """Rounds drafting k timed in this process (not loaded from the policy file)."""
        return self.timed[k] if k in self.costs.here else 0

    @staticmethod
    def expected_tokens(alphas: list[float], k: int) -> float:
        total, reach = 1.0, 1.0
        for alpha in alphas[:k]:
            reach *= alpha
            total += reach
        return total

    def _draw(self) -> list[float]:
        """A draw of each draft position's acceptance from its posterior under a uniform prior,
        Beta(1 + accepted, 1 + rejected): not centred on the pooled rate, which the same few
        rounds drive (3 rejected first rounds then left almost no chance of a probe), and wide
        where a position has not been reached (so longer drafts get tried when shorter ones
        are accepted)."""
        return [self.rng.betavariate(1.0 + a, 1.0 + r)
                for a, r in zip(self.accepted, self.rejected)]

    def acceptance_means(self) -> list[float]:
        """Posterior mean acceptance per position, the prior centred on the pooled rate."""
        total_a, total_r = sum(self.accepted), sum(self.rejected)
        pooled = (1.0 + total_a) / (2.0 + total_a + total_r)
        return [
            (a + self.prior_strength * pooled) / (a + r + self.prior_strength)
            for a, r in zip(self.accepted, self.rejected)
        ]

    def whole_chance(self, k: int) -> float:
        """The chance that a round drafting k tokens is accepted whole: the product of the first
        k positions' posterior mean acceptance."""
        chance = 1.0
        for alpha in self.acceptance_means()[:k]:
            chance *= alpha
        return chance

    # -- decisions -------------------------------------------------------------------------------
    def start_generation(self) -> None:
        """A generation starts: its draft is in step with its target (or starts empty: its first
        catch-up fills it), its first plain stretch has not looked at its text yet (FIRST_LOOK)
        and no plain choice holds. The probe budget (`plain_seconds`, the plain time since
        speculation was last tried) runs on: restarted every generation, it never paid for a look
        in a warm process whose drafting cost had been timed in a bad moment, since within a plain
        stretch the look's catch-up grows by more per round (~0.05 ms on the demo pair, CPU) than
        `probe_budget` of a plain round (~0.04 ms), and such a pair decoded generation after
        generation plainly at an acceptance of 0.9 (docs/design.md)."""
        self.look_due = True
        self.behind = 0
        self.held = 0
        self.retime = 0
        if self.probe is not None:
            self._end_probe()

    def choose(self, limit: int, caught_up: bool = False) -> int:
        """k for the next round, at most `limit` (tokens the round may still emit, minus one);
        `caught_up`: the draft has just caught up on the plain rounds it missed (a look), so it
        is in step with the target as after a drafting round."""
        if self.held > 0 and not caught_up and not self._due(limit):
            # a plain stretch's choice stands for HOLD_ROUNDS rounds (`_due`)
            self.held -= 1
            return 0
        self.held = 0
        # each round cost once per choice (called every round, its time overlapping the queued
        # step's: at 34 us with every cost recomputed per use it cost sampled plain rounds ~3%)
        self._known, self._memo = self._costs_in_use(), {}
        self._ks = sorted(self._known)
        try:
            k = self._choose(limit, caught_up)
        finally:
            self._known = None
        if k > 0:  # speculation tried, whatever chose it: the probe budget starts again (a new
            # pair's look that would time k = 1, not counted as a probe, left the budget to a
            # whole drafting round the round after it had found the draft hopeless)
            self.plain_seconds = 0.0
        if k == 0 and not caught_up and self._looks_first():
            self.held = HOLD_ROUNDS - 1
            if self.look_due and self.behind < FIRST_LOOK:  # chosen afresh where it falls due
                self.held = min(self.held, FIRST_LOOK - 1 - self.behind)
        return k

    def _due(self, limit: int) -> bool:
        """Whether a held plain choice (`choose`) must be made afresh now: a budgeted probe falls
        due, checked every round as in `_choose` (a hold ends where a generation's first look
        falls due). What else decides a plain stretch's rounds moves slowly: the evidence fades
        by PLAIN_DECAY a round, R(0) is booked every STRETCH_BOOK rounds, a look's value grows as
        the evidence fades. So the full choice (10-40 us of Python, 3-4x that in the loop where
        the host shares a 2-core CPU with MLX's compute) is made every HOLD_ROUNDS plain rounds,
        and new evidence (a look, a drafting round) ends a hold at once."""
        if limit < HORIZON:  # no probe in a generation's last HORIZON tokens
            return False
        return self._budget_allows(self._switch_price())

    def _switch_price(self) -> float:
        """Seconds a switch to drafting costs now: the draft's catch-up on the plain rounds it
        missed (`RoundCosts.switch_cost`), its fit anchored at a plain round's cost for a
        catch-up on almost nothing (the price before any switch was timed); where the draft
        started this generation empty and has not been fed yet, at least the fill that catch-up
        is (the prompt too, at the latest fill's time per token): priced as a switch, a look at
        a new generation's start cost 1.5-2x what a budgeted probe paid for (demo pair, CPU:
        fills of 3.3-7.6 ms, an always-rejected draft)."""
        price = self.costs.switch_cost(self.behind, anchor=self.round_seconds[0])
        if self.empty:
            price = max(price, self.costs.fill_per_token * (self.empty + self.behind))
        return price

    def _choose(self, limit: int, caught_up: bool) -> int:
        remaining = limit  # tokens the generation may still emit after this one
        limit = max(0, min(limit, self.k_max))
        if limit == 0:
            return 0
        # the first position's mean acceptance under a uniform prior: 1/3 after one rejection
        promising = (1.0 + self.accepted[0]) / (2.0 + self.accepted[0] + self.rejected[0]) \
            >= EXPLORE_MIN
        look_pending = self.look_due and (
            0 not in self.costs.here or self.behind < FIRST_LOOK)
        if self.looks and not caught_up and not self.costs.here - {0} and look_pending \
                and remaining >= HORIZON + max(0, FIRST_LOOK - self.behind):
            # a new pair that looks first starts plain: R(0), until the generation's first look
            # at its text falls due (FIRST_LOOK, taken below), after which k = 1 is timed in step
            # (`untried` below) next to R(0)'s timings, on the text being written (module
            # docstring)
            return 0
        if 0 not in self.costs.here:  # k = 1 while the draft is in step, then R(0), timed here
            # (a file's R(0), measured under another process's load, too high, kept processes
            # drafting k = 1 at acceptance 0.35 for whole generations: drafting never re-times it)
            return 1 if self._timed_here(1) < EXPLORE_TIMES and self.behind == 0 and promising \
                else 0
        reach = max(self._known) + 1  # one beyond the largest k timed (module docstring)
        alphas = self.acceptance_means()
        plain_rate = 1.0 / self.round_seconds[0]
        rates, tokens, reached = {}, 1.0, 1.0  # E(k) built up over k (`expected_tokens`)
        for k in range(1, min(limit, reach) + 1):
            reached *= alphas[k - 1]
            tokens += reached
            rates[k] = tokens / self.round_cost(k)
        if not rates:
            return 0
        best = max(rates, key=lambda k: (rates[k], -k))
        timed = max(self.timed)
        measured = [k for k in rates if k <= timed]  # the k whose cost is timed, not extrapolated
        # behind the target (a look comes first), drafting at a cost extrapolated for a k not
        # timed yet (optimistic: the draft's steps only) must also repay the catch-up over the
        # tokens a look's finding holds for (LOOK_HORIZON, or the rest of the generation), else
        # the best k timed decides: a draft always rejected, whose k = 1 no look ever let be
        # timed, was otherwise looked at each time PLAIN_DECAY faded the evidence far enough for
        # E(1) to beat R(0) * (1 + draft_ratio), about once a generation where the draft's
        # prefill is a tenth of the target's; the probe budget and a look's worth
        # (`_look_value`) decide such looks
        pick = best
        if rates[best] > plain_rate and best not in measured and not caught_up and (
                self._looks_first() or (self.looks and self.empty > 0)) and min(
                remaining, LOOK_HORIZON) * (1.0 / plain_rate - 1.0 / rates[best]) \
                < self._switch_price():
            pick = max(measured, key=lambda k: (rates[k], -k), default=0)
        if pick and rates[pick] > plain_rate:
            return pick
        if self.retime and (caught_up or self.behind == 0) and promising \
                and self.retime_k <= limit:
            return self.retime_k  # a budgeted probe re-times a stale k (below)
        self.retime = 0
        if self.empty and self.looks and self.behind < FIRST_LOOK:
            # the draft starts this generation empty: a look now buys the fill (the prompt) and
            # tells what the draft would have done on `behind` tokens only, where at FIRST_LOOK
            # the same fill tells eight (a warm process's probe budget, spent on its second
            # round, looked each generation at one token: an always-rejected draft, demo pair)
            return 0
        switch = self._switch_price()
        # Thompson sampling where the draft is in step (it drafted last round, or has just caught
        # up): drafting goes on unless a draw says it loses more over HORIZON tokens than a
        # switch back would cost. A drafting round measures acceptance as it goes, a plain round
        # learns nothing until the next look, so near break-even on thin evidence drafting is
        # the better bet: on the means alone, three rejected first rounds (the first tokens after
        # a prompt are often the hardest) kept fresh processes plain for 30-60 rounds of a text
        # where k = 1 paid throughout
        if measured and (self.behind == 0 or caught_up):
            pick, drawn_rate = self._drawn_best(measured)
            if HORIZON * (1.0 / drawn_rate - 1.0 / plain_rate) < switch:
                return pick
        # just caught up, where a k's cost is stale (not timed for STALE_ROUNDS rounds): draft if
        # it pays at the lowest cost measured for it, so that it is timed afresh. Timings taken
        # in a busy moment (R(1) at 2x for 7 rounds running) otherwise kept a warm process plain
        # for good: its probes look first, and each look judged drafting on the same stale cost
        if caught_up and measured:
            hoped = {k: self.expected_tokens(alphas, k) / self._hoped_cost(k) for k in measured}
            pick = max(hoped, key=lambda k: (hoped[k], -k))
            if hoped[pick] > plain_rate:
                return pick
        # too little evidence yet to give up on speculation: each process times k = 1 itself
        # (a file's costs measured under another process's load, drafting at 3x a plain round,
        # kept every later process plain, and plain-only processes saved the stale costs again).
        # Where the loop looks first and has looked at a text, once a look finds the first
        # position promising (`caught_up`): behind the target this path took a look whenever
        # PLAIN_DECAY faded the evidence of an always-rejected draft to a mean of EXPLORE_MIN
        untried = [k for k in EXPLORE_KS if k <= limit and self._timed_here(k) < EXPLORE_TIMES]
        if untried and promising and (
                caught_up or not self._looks_first() or not self.seen_text):
            return untried[0]
        # where the loop looks before it leaps, a look is worth its catch-up when what it may find
        # is: `_look_value`. A generation's first plain stretch looks at its text once (module
        # docstring) whatever that says while this policy has not looked at a text yet (its
        # evidence is the first tokens', often the hardest); afterwards (a warm
        # process) only where the look is worth it: warm processes whose draft is rarely right
        # looked once a generation and found nothing (~2.5% of a 64-token generation)
        worth_a_look = bool(measured) and self._looks_first() and self._look_value(
            measured, alphas, plain_rate, remaining, switch) > switch
        # what the first look or a budgeted probe finds pays over the tokens after it: none in a
        # generation's last HORIZON tokens (warm, alpha 0: a probe after ~60 of 64 plain rounds
        # cost 6.5 ms, 4% of the generation, and could have gained at most a few tokens)
        room = remaining >= HORIZON
        if self.look_due and self.looks and self.behind >= FIRST_LOOK and room and (
                worth_a_look or not self.seen_text):
            self.look_due = False
            return best
        if worth_a_look:
            return max(measured, key=lambda k: (rates[k], -k))
        # Thompson sampling (module docstring) where the loop does not look first (a probe is then
        # a whole drafting round), over the k up to the largest timed one (the extrapolated cost
        # of an unmeasured k is optimistic: where looks kept finding the draft hopeless, R(1) was
        # never measured and a draw of 0.2 looked worth a catch-up): a draw acts when drafting the
        # next HORIZON tokens at its rate would save more than the catch-up costs (priced as a
        # plain round until one is measured) plus the round's own expected loss. Not "when this
        # round alone pays, catch-up included": on the demo pair that asked for a drawn acceptance
        # > 0.94 and never happened; nor "when the drawn rate beats plain": each draw that
        # favoured drafting by a hair bought a catch-up, every third round on the demo pair.
        # Where the loop looks first, a look's value above decides instead: a draw a round made
        # near break-even a look every few rounds (47 looks in 20 generations of 128 tokens,
        # ~2% of a warm process's time where nothing paid; replayed: bench/auto_replay.py)
        if measured and not self._looks_first():
            pick, drawn_rate = self._drawn_best(measured)
            if HORIZON * (1.0 / plain_rate - 1.0 / drawn_rate) > self._probe_loss(
                    pick, alphas, switch):
                return pick
        # Plain decoding wins on the evidence. Probe `best` anyway once the plain rounds since the
        # last probe have earned it: its expected loss must fit in `probe_budget` of that time,
        # so probing costs at most ~probe_budget of the decode time, a hopeless k is probed
        # rarely and a cheap probe often (`_probe_loss`). Where the loop looks first the loss is
        # the catch-up whatever the draft is worth, so the budget is spent at the rate of the
        # chance the look finds a draft worth exploring (`_probe_share`): as the evidence
        # fades (PLAIN_DECAY) that chance rises, so a probe still comes, later where the last
        # look found the draft hopeless (always rejected, fresh processes: a second look after
        # ~50 plain rounds cost 1.5% of a 128-token generation, and found nothing)
        # Where the loop looks before it leaps and a drafting k's cost is stale (not timed for
        # STALE_ROUNDS rounds), the probe also re-times that k: if the look finds the first
        # position promising, EXPLORE_TIMES rounds draft it whatever its old cost says, as a new
        # pair's first rounds time k = 1. A cost timed in a bad moment (a pair's first rounds,
        # 2.1x a plain round where a run costs 1.6x) otherwise stood for good: a look judges a
        # stale k at the lowest ratio measured for it (`_hoped_cost`), the same bad timings
        if room and self._budget_allows(self._probe_loss(best, alphas, switch)):
            stale = [k for k in measured if self.costs.stale(k)]
            if stale and self.looks:
                self.retime = EXPLORE_TIMES
                self.retime_k = max(stale, key=lambda k: (rates[k], -k))
            self.probe = _Probe(self._ratios())
            return best
        return 0

    def _budget_allows(self, loss: float) -> bool:
        """Whether the plain time since speculation was last tried has earned a probe expected
        to lose `loss` seconds: `probe_budget` of it, times `_probe_share` (computed only once the
        whole budget covers the loss)."""
        earned = self.plain_seconds * self.probe_budget / (1.0 + FRUITLESS_SLOWING * self.fruitless)
        return earned >= loss and earned * self._probe_share() >= loss

    def _probe_share(self) -> float:
        """The share of `probe_budget` a probe may spend now (`_choose`, `_due`): where the loop
        looks first, the first position's posterior probability, Beta(1 + accepted, 1 +
        rejected) on the look's grid, of an acceptance of at least EXPLORE_MIN (3 us); else
        all of it."""
        if not self._looks_first():
            return 1.0
        weights = _grid_posterior(self.accepted[0], self.rejected[0])
        return sum(w for x, w in zip(_GRID, weights) if x >= EXPLORE_MIN) / sum(weights)

    def _looks_first(self) -> bool:
        """Whether a drafting round now would first catch the draft up and choose again on its
        evidence (the loop looks before it leaps, and the draft is behind by more than a round or
        two): what a probe then risks is the catch-up only."""
        return self.looks and self.behind > 2

    def _look_value(self, ks: list[int], alphas: list[float], plain_rate: float,
                    remaining: int, against: float = 0.0) -> float:
        """Seconds a look is expected to save: the expected saving per token of drafting the best
        of `ks` over plain decoding, where it saves anything, over the first position's
        posterior Beta(1 + accepted, 1 + rejected) (integrated on a grid of LOOK_POINTS; the later
        positions at their means), times the tokens a finding holds for (LOOK_HORIZON, or the rest
        of the generation). A look acts on what it finds: drafting where the text now pays, plain
        where it does not, so only the first case is worth anything. Unlike a Thompson draw each
        round (a look whenever one draw came out high), this grows slowly as plain rounds fade the
        evidence (PLAIN_DECAY), and stays small where the evidence is strong either way. Where a
        bound on it (Cantelli's on the share of the posterior above the lowest break-even, times
        the saving at acceptance 1) is already at most `against`, that bound."""
        # per k: E(k) at first-position acceptance x is 1 + x * tail[k], and drafting k saves
        # time per token where x > its break-even (R(k) / R(0) - 1) / tail[k]
        plain = 1.0 / plain_rate
        options = []
        for k in ks:
            tail = self.expected_tokens(alphas[1:], k - 1)
            cost = self.round_cost(k)
            options.append((cost, tail, (cost / plain - 1.0) / tail))
        lowest = min(even for _, _, even in options)
        a, r = self.accepted[0], self.rejected[0]
        horizon = min(remaining, LOOK_HORIZON)

        def saving_at(x: float) -> float:  # seconds per token the best option saves at x
            return plain - min(cost / (1.0 + x * tail) for cost, tail, _ in options)

        mean = (1.0 + a) / (2.0 + a + r)
        if lowest > mean:
            var = mean * (1.0 - mean) / (3.0 + a + r)
            bound = horizon * var / (var + (lowest - mean) ** 2) * saving_at(1.0)
            if bound <= against:
                return bound
        weights = _grid_posterior(a, r)
        saving = 0.0
        for x, weight in zip(_GRID, weights):
            if x > lowest and weight > 1e-6:  # (below every break-even nothing is saved)
                gain = saving_at(x)
                if gain > 0:
                    saving += weight * gain
        return horizon * saving / sum(weights)

    def _hoped_cost(self, k: int) -> float:
        """R(k), or where it is stale (k not timed for STALE_ROUNDS rounds) the lowest R(k) /
        R(0) measured here times R(0) now if that is lower."""
        cost, ratio = self.round_cost(k), self.costs.best_ratio.get(k)
        if ratio is None or not self.costs.stale(k):
            return cost
        return min(cost, ratio * self.round_seconds[0])

    def _drawn_best(self, ks: list[int]) -> tuple[int, float]:
        """The best of `ks` at a Thompson draw of the acceptance, and its tokens per second."""
        drawn = self._draw()
        rates = {k: self.expected_tokens(drawn, k) / self.round_cost(k) for k in ks}
        pick = max(rates, key=lambda k: (rates[k], -k))
        return pick, rates[pick]

    def _probe_loss(self, k: int, alphas: list[float], switch: float) -> float:
        """Expected seconds lost by a probe drafting k while plain decoding wins on the means
        (so the round's own part is >= 0): the catch-up `switch`, plus the round's time beyond
        what plain decoding would take for the tokens it yields, except where the loop looks
        first (the draft is behind: it catches up, books what it predicted and chooses again,
        drafting only if that says it pays)."""
        if self._looks_first():
            return switch
        return switch + self.round_cost(k) - self.expected_tokens(alphas, k) * self.round_seconds[0]

    def update(self, k: int, accepted: int, seconds: float, catch_up: float = 0.0,
               filled: bool = False) -> None:
        """Book a round that drafted k tokens, of which the first `accepted` were kept, in
        `seconds` of wall time; seconds <= 0: the time is unknown or unrepresentative (the
        round traced a compiled step), only the acceptance is booked. `catch_up`: seconds the
        draft spent catching up on plain rounds before this one, not part of `seconds`: the
        price of a switch, which prices probes but not sustained drafting (round_seconds);
        `filled`: that catch-up also fed a draft that started empty the prompt (its first in a
        generation), not a switch's price."""
        self.chosen[k] += 1
        self.costs.rounds += 1
        probe = self.probe
        if probe is not None:  # a budgeted probe: its look (catch-up) or drafting has begun
            probe.begun = probe.begun or catch_up > 0 or k > 0
            if k > 0:
                probe.drafted.add(k)
            elif probe.begun:  # (a pipelined plain round may come before its look)
                self._end_probe()
        if k > 0:
            self.retime = max(0, self.retime - 1)
        elif catch_up > 0:  # the look a re-time waited for chose plain decoding. Not any plain
            # round: the loop chooses the round after a pipelined plain one before booking it, so
            # a probe chosen so was cleared by the plain round it was chosen in, before its look
            self.retime = 0
        if k > 0 or catch_up > 0:
            self.held = 0
        if catch_up > 0:
            self.look_due = False
            if filled and self.empty + self.behind > 0:  # what a look costs before a fill
                self.costs.fill_per_token = catch_up / (self.empty + self.behind)
            self.empty = 0
            if not filled:
                self.costs.book_switch(self.behind, catch_up)
            self.behind = 0  # the draft has caught up (a round may still end up plain)
        self.behind = self.behind + 1 if k == 0 else 0
        if k > 0:
            self.end_stretch()
        # forget per observation, and where the loop looks before it leaps per plain round too
        # (more slowly: PLAIN_DECAY): evidence from the text of long ago (a hard start) fades
        # while drafting is off, and a cheap look at the text of now decides. Without looks, a
        # stretch of plain rounds keeps the last evidence (a probe then costs a whole round).
        decay = self.decay if k > 0 else PLAIN_DECAY if self.looks else 1.0
        if decay < 1.0:
            self.accepted = [a * decay for a in self.accepted]
            self.rejected = [r * decay for r in self.rejected]
        for i in range(min(accepted, self.k_max)):
            self.accepted[i] += 1.0
        if accepted < k:
            self.rejected[accepted] += 1.0
        if seconds <= 0:
            return
        if k == 0:
            self.plain_seconds += seconds
            if self.behind <= 1:  # a stretch's first round: two steps' wait (the loop does
                return  # not time it either)
            if self.pending is not None:  # not the stretch's last round after all
                self.stretch.append(self.pending)
            self.pending = seconds
            if self.stretch and (0 not in self.costs.here or len(self.stretch) >= STRETCH_BOOK):
                self._book_stretch()  # the first estimate at once: nothing is chosen without it
            return
        self._book(k, seconds, 1)

    def _drafting_pays(self, ratios: dict[int, float]) -> bool:
        """Whether a drafting k timed here beats plain decoding at the posterior means, at its
        R(k) / R(0) in `ratios` (`_ratios`)."""
        alphas = self.acceptance_means()
        return any(self.expected_tokens(alphas, k) > ratio for k, ratio in ratios.items())

    def _ratios(self) -> dict[int, float]:
        """R(k) / R(0) of each drafting k timed here (empty before R(0) is)."""
        plain = self.round_seconds.get(0, 0.0) if 0 in self.costs.here else 0.0
        return {k: self.round_seconds[k] / plain for k in self.costs.here - {0}} if plain else {}

    def _end_probe(self) -> None:
        """A budgeted probe is over (its look chose plain decoding, or drafting stopped, or the
        generation ended): it found nothing new where drafting does not pay at the means now
        (`_drafting_pays`: not on its rounds' own luck, three rounds of k = 1 at acceptance 0.6
        all accepted one time in five) and the cost of each k it drafted is within PROBE_CHANGE
        of what it was. Those count in a row (up to FRUITLESS_CAP) and slow the next probes;
        one that found drafting paying or a cost moved starts the count again."""
        probe, self.probe = self.probe, None
        now = self._ratios()
        paid = self._drafting_pays(now)
        moved = any(k in now and k in probe.ratios
                    and abs(now[k] / probe.ratios[k] - 1.0) > PROBE_CHANGE for k in probe.drafted)
        self.fruitless = 0 if paid or moved else min(FRUITLESS_CAP, self.fruitless + 1)

    def observe(self, evidence: list[float]) -> None:
        """Book the evidence of a draft's catch-up: per token it was fed, the probability that a
        one-token draft after it would have been accepted (greedy: 1.0 or 0.0, whether its
        argmax was the token that followed; sampled: sum min(p, q) there). A draft starting at
        each of those positions would have been accepted as far as the run goes: greedy,
        exactly (the draft follows the text while it is accepted); sampled, the expected counts
        along the text the target produced (the product of the probabilities), a position past
        the catch-up being unobserved. The runs overlap, so the catch-up counts as at most
        CATCH_UP_WEIGHT rounds' evidence."""
        self.seen_text = True
        n = len(evidence)
        accepted, reached = [0.0] * self.k_max, [0.0] * self.k_max
        for t in range(n):
            reach = 1.0
            for i in range(min(self.k_max, n - t)):
                reached[i] += reach
                reach *= evidence[t + i]
                accepted[i] += reach
                if reach <= 0.0:
                    break
        self._add_evidence(accepted, reached, n)

    def observe_beyond(self, position: int, accepted: bool) -> None:
        """Book evidence on draft position `position` + 1 from a round that drafted `position`
        tokens, all accepted: whether the draft's greedy prediction one step further was the
        target's token there (the next round's first draft step computes it anyway). Exactly what
        a round drafting one more token would have booked there, so a policy drafting k learns
        whether k + 1 would pay without trying it."""
        self.held = 0
        if position < self.k_max:
            if accepted:
                self.accepted[position] += 1.0
            else:
                self.rejected[position] += 1.0

    def wants_beyond(self, position: int) -> bool:
        """Whether the next drafting round should read the evidence on draft position `position`
        + 1 that a round drafting `position` tokens, all accepted, leaves (`observe_beyond`):
        while that position has fewer than BEYOND_EVIDENCE (discounted) observations. Reading
        it every round cost 3.5-4.5% of a generation drafting k = 1 (demo pair, CPU: its
        verify waits ~160 us longer); at ~6 observations the posterior mean is mostly the
        data's, and the reads needed to hold it there (one every ~5 drafting rounds as `decay`
        fades it) cost a fifth of that. And only while what they tell could change the choice
        (once R(0) is known): while drafting one more token, were it always accepted, would
        beat drafting `position` at the means. Reads that could not, where k + 1 had been timed
        too dear, still cost 1-4% of a run's rounds (demo pair, CPU, acceptance 0.9; one
        process, fresh policies, 100 rounds, with this gate / without: real draft T = 0 1.023x
        [1.002, 1.047], acceptance 0.9 1.015x, 0.7 1.006x)."""
        if position >= self.k_max or \
                self.accepted[position] + self.rejected[position] >= BEYOND_EVIDENCE:
            return False
        if 0 not in self.round_seconds:
            return True
        alphas, known = self.acceptance_means()[:position], self._costs_in_use()
        hoped = self.expected_tokens([*alphas, 1.0], position + 1)  # position + 1 always kept
        return hoped / self._round_cost(position + 1, known) > \
            self.expected_tokens(alphas, position) / self._round_cost(position, known)

    def _add_evidence(self, accepted: list[float], reached: list[float], starts: int) -> None:
        """Add per-position counts from `starts` overlapping observations, scaled down to at
        most CATCH_UP_WEIGHT rounds' worth."""
        self.held = 0
        if starts:
            scale = min(1.0, CATCH_UP_WEIGHT / starts)
            for i, (a, r) in enumerate(zip(accepted, reached)):
                self.accepted[i] += scale * a
                self.rejected[i] += scale * (r - a)

    def end_stretch(self) -> None:
        """A stretch of plain rounds has ended (drafting resumes, or the generation ends): its
        last round, which waited for almost nothing, is left out as its first was."""
        self.pending = None
        self._book_stretch()

    def _book_stretch(self) -> None:
        """Book the plain rounds not yet booked at their median (as R(k) is a median: a round at
        2-3x now and then must not weigh on one side only)."""
        if self.stretch:
            rounds, self.stretch = self.stretch, []
            self._book(0, statistics.median(rounds), len(rounds))

    def _book(self, k: int, seconds: float, rounds: int) -> None:
        """Fold `rounds` rounds of `seconds` each into R(k); the first timing of k in this
        process replaces a cost loaded from the policy file (`round_cost`)."""
        if k not in self.costs.here:
            self.costs.here.add(k)
            self.timed[k] = 0
        self.timed[k] += rounds
        if k > 0:  # the median of the latest timings: a scheduler's hiccup (a round at 2-3x,
            # seen every few dozen rounds on a shared machine) must not decide, and R(1) was
            # judged on its first two rounds, one of them at 1.4x the rest. Timings older than
            # STALE_ROUNDS rounds describe another moment of the machine: the first timing since
            # replaces them
            costs = self.costs
            recent = costs.recent.setdefault(k, deque(maxlen=RECENT))
            if costs.stale(k):
                recent.clear()
            costs.last_timed[k] = costs.rounds
            recent.append(seconds)
            median = statistics.median(recent)
            self._bound_plain(k, median, len(recent))
            self.round_seconds[k] = self._drafting_cost(k, median)
            self._note_ratio(k)
            return
        # plain rounds (booked as a stretch's median, many rounds each): a running mean at first,
        # then a moving average of weight `smoothing` per round
        self.costs.plain_bounded = False
        old = self.round_seconds.get(k, 0.0)
        weight = max(1.0 - (1.0 - self.smoothing) ** rounds, rounds / self.timed[k])
        self.round_seconds[k] = old + weight * (seconds - old)
        if self.timed[k] == rounds:  # R(0)'s first booking here: the drafting k timed before it
            # (a new pair's first rounds) get their R(k) / R(0) too, over the plain rounds right
            # after them. Without it a cost timed in a busy moment at the start had no ratio a
            # look could hope for, and kept a fresh process plain for the rest of its generation
            # once R(0) had followed the machine back (R(1) at 2x, measured twice in the loop)
            for j in self.costs.here - {0}:
                self.round_seconds[j] = self._drafting_cost(j)
                self._note_ratio(j)

    def _bound_plain(self, k: int, median: float, timings: int) -> None:
        """Hold R(0) to what a drafting round timed now allows: a round drafting k is a verify
        forward, at least a plain round's, plus k draft steps, so R(0) <= R(k) / (1 + k * d),
        R(k) the median of k's latest timings (three at least: one round is no evidence) and d a
        draft step's share of a plain round, here half `draft_ratio`: the prefill ratio can
        overstate a draft step where verifying is nearly free (a GPU-like machine, R(k) = 1 +
        0.12k plain rounds against a ratio of 0.25), and the bound is for an R(0) that is grossly
        off. Drafting never re-times R(0): booked at 3x in a busy plain stretch (1.9x was seen,
        CPU), it let a draft always rejected keep drafting once the machine was quiet again,
        since at an R(1) below that R(0) drafting wins whatever the acceptance (simulated: a third
        of the rounds drafted and rejected). A full window's R(k) / R(0) against an R(0) so set is
        the bound's (1 + k * d), not kept as k's hope (`RoundCosts.plain_bounded`)."""
        if timings < 3 or 0 not in self.costs.here:
            return
        bound = median / (1.0 + 0.5 * k * self.draft_ratio)
        if self.round_seconds[0] > bound:
            self.round_seconds[0] = bound
            self.costs.plain_bounded = True  # (a full window's ratio to it would be the bound's)

    def _drafting_cost(self, k: int, median: float | None = None) -> float:
        """R(k) from k's timings here: their median (`median`, where the caller has it), or while
        they are fewer than RECENT (a new process's, or after they went stale), at most R(0) times
        the ratio the latest full window measured (`RoundCosts.hope`, here or in the policy
        file). A k's first rounds after a switch are its dearest (the draft cold after plain
        rounds, no step ahead after a rejection: 15-25% above a run's on the demo pair, CPU), and
        a fresh process judged k = 1 on three of them: 1.9x a plain round where a run of it
        costs 1.4-1.5x; with the policy file (whose cost the first timing replaced) 16 of 32
        fresh processes then decoded most of their 128 tokens plainly where k = 1 paid, 3 of 32
        with this bound.
        Only ever lower: a file that says drafting is dearer than this process finds never
        keeps it plain (a process that does not draft never times a drafting round), and one
        that says cheaper costs at most RECENT rounds before this process's own median
        decides."""
        recent, costs = self.costs.recent[k], self.costs
        cost = statistics.median(recent) if median is None else median
        plain = self.round_seconds.get(0, 0.0) if 0 in costs.here else 0.0
        if plain > 0 and len(recent) >= RECENT:  # a full window: the ratio to hope for next
            if not costs.plain_bounded:  # time (not against an R(0) the bound set)
                costs.hope[k] = cost / plain
        elif plain > 0 and k in costs.hope:
            cost = min(cost, costs.hope[k] * plain)
        return cost

    def _note_ratio(self, k: int) -> None:
        """Keep R(k) / R(0) now if it is the lowest measured here (`RoundCosts.best_ratio`;
        nothing before R(0) is known)."""
        if self.round_seconds.get(0, 0.0) > 0:
            ratio = self.round_seconds[k] / self.round_seconds[0]
            self.costs.best_ratio[k] = min(self.costs.best_ratio.get(k, ratio), ratio)


class _Pair:
    """What a (target, draft) pair has learned: its costs, and a policy per sampling regime;
    `store_key` names its entry in the policy file (None: not persisted), `saved` the regimes'
    acceptance read from it."""

    def __init__(self, target: object, draft: object) -> None:
        self.target = weakref.ref(target)
        self.draft = None if isinstance(draft, str) else weakref.ref(draft)
        self.name = draft if isinstance(draft, str) else None  # a model-free drafter's
        self.costs = RoundCosts()
        self.policies: OrderedDict[Hashable, DraftLengthPolicy] = OrderedDict()
        self.store_key: str | None = None
        self.saved: dict[str, dict[str, list[float]]] = {}
        self.last_save = 0.0
        self.loaded = False  # the policy file's entry has been read (`load`)

    def load(self) -> None:
        """Read the pair's policy file entry, once: its key fingerprints both models (~1 ms on
        the demo pair), so a generation whose first round is plain anyway takes it after its
        first token (`settle`). Merged in place (the policies made before share these costs):
        what this process has measured stands, the file fills in the rest."""
        if self.loaded:
            return
        self.loaded = True
        target = self.target()
        draft = self.draft() if self.draft is not None else self.name
        if target is None or draft is None:
            return
        self.store_key = _store_key(target, draft)
        if self.store_key is None:
            return
        entry = policy_store.load_entry(self.store_key)
        if entry is None:
            return
        try:
            costs = RoundCosts()
            costs.load(entry["costs"])
            saved = {str(r): {"accepted": [float(x) for x in v["accepted"]],
                              "rejected": [float(x) for x in v["rejected"]]}
                     for r, v in entry["regimes"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            policy_store._warn_once(f"ignoring a k='auto' policy entry that is not ours: {err}")
            return
        self.costs.merge(costs)
        self.saved = saved
        for regime, policy in self.policies.items():
            self._start_from_saved(regime, policy)

    def _start_from_saved(self, regime: Hashable, policy: DraftLengthPolicy) -> None:
        """Add a regime's saved acceptance to its policy's, worth LOADED_WEIGHT rounds at most."""
        saved = self.saved.get(_regime_key(regime))
        if saved is not None and len(saved["accepted"]) == AUTO_MAX_K == len(saved["rejected"]):
            total = sum(saved["accepted"]) + sum(saved["rejected"])
            scale = min(1.0, LOADED_WEIGHT / total) if total > 0 else 0.0
            policy.accepted = [a + x * scale for a, x in zip(policy.accepted, saved["accepted"])]
            policy.rejected = [r + x * scale for r, x in zip(policy.rejected, saved["rejected"])]

    def policy(self, regime: Hashable, draft_ratio: float) -> DraftLengthPolicy:
        policy = self.policies.get(regime)
        if policy is None:
            policy = self.policies[regime] = DraftLengthPolicy(
                AUTO_MAX_K, draft_ratio=draft_ratio, costs=self.costs)
            self._start_from_saved(regime, policy)
            while len(self.policies) > MAX_REGIMES:
                self.policies.popitem(last=False)
        self.policies.move_to_end(regime)
        return policy

    def save(self, force: bool = False) -> None:
        """Write what the pair has learned to its policy file entry (at most every SAVE_EVERY
        seconds unless `force`)."""
        self.load()  # (an entry not read yet is not overwritten with less)
        if self.store_key is None or not self.costs.round_seconds:
            return
        now = time.monotonic()
        if not force and self.last_save and now - self.last_save < SAVE_EVERY:
            return
        self.last_save = now
        regimes = dict(self.saved)
        for regime, policy in self.policies.items():
            regimes[_regime_key(regime)] = {"accepted": policy.accepted,
                                            "rejected": policy.rejected}
        policy_store.save_entry(self.store_key, {"costs": self.costs.to_json(),
                                                 "regimes": regimes, "saved": time.time()})

    def alive(self) -> bool:
        return self.target() is not None and (self.draft is None or self.draft() is not None)

    def holds(self, target: object, draft: object) -> bool:
        return self.target() is target and (self.draft is None or self.draft() is draft)


_SHARED: dict[tuple[int, object], _Pair] = {}


def shared_policy(target: object, draft: object, draft_ratio: float,
                  regime: Hashable = None, *, settled: bool = True) -> DraftLengthPolicy:
    """The policy of a (target, draft) pair for one sampling `regime` (e.g. the tuple of
    temperature, top-p, top-k and min-p), kept while both models exist: later generations start
    from what earlier ones measured instead of learning it again. Costs are shared by every
    regime of the pair, acceptance is the regime's own. `draft` is the draft model object, or a
    string naming a model-free drafter and its settings. A pair new to the process starts from
    its policy file entry; `settled=False` leaves reading it to `settle(policy)` (a generation
    whose first round is plain: after its first token)."""
    for key in [k for k, pair in _SHARED.items() if not pair.alive()]:
        del _SHARED[key]  # pairs that no longer exist
    key = (id(target), draft if isinstance(draft, str) else id(draft))
    pair = _SHARED.get(key)
    if pair is None or not pair.holds(target, draft):
        pair = _SHARED[key] = _Pair(target, draft)
    if settled:
        pair.load()
    policy = pair.policy(regime, draft_ratio)
    policy.start_generation()
    policy.pair = pair
    return policy


def settle(policy: DraftLengthPolicy) -> None:
    """Make sure the policy's pair has read its policy file entry (see `shared_policy`)."""
    pair = getattr(policy, "pair", None)
    if pair is not None:
        pair.load()


def save_policy(policy: DraftLengthPolicy | None, force: bool = False) -> None:
    """After a generation: book its last plain rounds and save what its pair has learned (see
    `_Pair.save`)."""
    if policy is not None:
        policy.end_stretch()
    pair = getattr(policy, "pair", None)
    if pair is not None:
        pair.save(force)


def sampling_regime(sampling: Any) -> tuple:
    """The regime a pair's acceptance is learned for: (temperature, top-p, top-k, min-p)."""
    return (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p)


def record_rounds(target: object, draft: object, regime: Hashable,
                  rounds: dict[int, tuple[float, int]], accepted: list[float],
                  reached: list[float]) -> None:
    """Book rounds measured at fixed k outside `k="auto"` (`python -m tinydraft_mlx.check`) as
    the pair's policy would have: per k (0: plain) the mean seconds of a round and how many were
    timed, per draft position at `regime` the accepted / reached counts; then save the pair's
    policy file entry, so that the next process starts from them."""
    policy = shared_policy(target, draft, 0.25, regime)
    plain, plain_timed = rounds.get(0, (0.0, 0))
    for k, (seconds, timed) in rounds.items():
        if seconds > 0 and timed > 0:
            policy.round_seconds[k] = seconds
            policy.timed[k] += timed
            if k > 0 and timed >= RECENT and plain > 0 and plain_timed > 0:
                policy.costs.hope[k] = seconds / plain  # a run's ratio (`_drafting_cost`)
    for i in range(min(policy.k_max, len(accepted), len(reached))):
        policy.accepted[i] += accepted[i]
        policy.rejected[i] += max(0.0, reached[i] - accepted[i])
    save_policy(policy, force=True)


def _store_key(target: object, draft: object) -> str | None:
    if policy_store.policy_path() is None:
        return None
    return policy_store.pair_key(target, draft)


def _regime_key(regime: Hashable) -> str:
    return json.dumps(regime if not isinstance(regime, tuple) else list(regime))


# -- batches ----------------------------------------------------------------------------------
# A batched round verifies B x (k + 1) positions: its cost grows with B, so the k that pays falls
# as the batch grows (for a large B it may be 0). Costs are kept per (target, draft, batch-size
# bucket); acceptance stays each sequence's own (its regime's policy).

_BATCH_COSTS: dict[tuple[int, int, int], tuple[weakref.ref, DraftLengthPolicy]] = {}


def batch_bucket(rows: int) -> int:
    """The batch size whose costs a batch of `rows` uses: the next power of two."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return bucket


def batch_costs(target: object, draft: object, rows: int, draft_ratio: float) -> DraftLengthPolicy:
    """The round costs of batched rounds of about `rows` sequences on a (target, draft) pair, as
    a `DraftLengthPolicy` whose own acceptance is unused (`choose_for_batch` takes the rows')."""
    for key in [k for k, (ref, _) in _BATCH_COSTS.items() if ref() is None]:
        del _BATCH_COSTS[key]
    bucket = batch_bucket(rows)
    key = (id(target), id(draft), bucket)
    held = _BATCH_COSTS.get(key)
    if held is None or held[0]() is not target:
        policy = DraftLengthPolicy(AUTO_MAX_K, draft_ratio=draft_ratio)
        near = [(abs(b.bit_length() - bucket.bit_length()), b) for (t, d, b), (ref, _) in
                _BATCH_COSTS.items() if t == id(target) and d == id(draft) and ref() is target]
        if near:  # start from the nearest batch size's costs, each worth one round: a batch
            # whose size moves (requests joining and leaving) does not learn from nothing
            # (plain first, then probes) at every size it passes through
            source = _BATCH_COSTS[(id(target), id(draft), min(near)[1])][1]
            policy.round_seconds.update(source.round_seconds)
            policy.timed.update({k: 1 for k in source.round_seconds})
        held = _BATCH_COSTS[key] = (weakref.ref(target), policy)
    return held[1]


def choose_for_batch(costs: DraftLengthPolicy, rows: list[DraftLengthPolicy],
                     limit: int) -> int:
    """One k for the batch's k="auto" sequences: argmax_k of the tokens the batch expects,
    sum over rows of E_row(k), per second of a batched round drafting k, R_B(k); 0 (plain
    rounds) when that does not beat B / R_B(0), with the same probing of speculation as one
    sequence's policy (`DraftLengthPolicy.choose`)."""
    limit = max(0, min(limit, costs.k_max))
    known = costs.round_seconds
    if 0 not in known or limit == 0 or not rows:
        return 0
    reach = max(known) + 1  # as one sequence's policy: k grows one step at a time
    alphas = [row.acceptance_means() for row in rows]

    def expected(k: int) -> float:
        return sum(costs.expected_tokens(a, k) for a in alphas)

    rates = {k: expected(k) / costs.round_cost(k) for k in range(1, min(limit, reach) + 1)}
    if not rates:
        return 0
    best = max(rates, key=lambda k: (rates[k], -k))
    plain = len(rows) / known[0]
    if rates[best] > plain:
        costs.plain_seconds = 0.0
        return best
    loss = costs.round_cost(best) + known[0] - expected(best) * known[0] / len(rows)
    if costs.plain_seconds * costs.probe_budget >= loss:
        costs.plain_seconds = 0.0
        return best
    return 0
