"""A stand-in for `k="auto"`'s policy that plays a fixed schedule of k, cycling, so that a test
does not depend on this machine's timings. It implements what the decode loop asks of a policy:
`choose` and `update`, the evidence hooks (`observe`, `observe_beyond`, `end_stretch`: recorded,
not used) and `looks` (whether a round after plain rounds catches the
draft up, books its predictions and chooses again: `LOOKS`, fixed per class whatever the loop
sets)."""

from __future__ import annotations


class ScriptedPolicy:
    SCHEDULE: tuple[int, ...] = (1,)
    LOOKS = False

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.rounds = 0
        self.observed: list[list[bool]] = []
        self.beyond: list[tuple[int, bool]] = []
        self.caught_up: list[bool] = []  # per `choose`: whether the draft had just caught up

    @property
    def looks(self) -> bool:
        return self.LOOKS

    @looks.setter
    def looks(self, value: bool) -> None:
        pass  # the schedule decides

    def choose(self, limit: int, caught_up: bool = False) -> int:
        self.caught_up.append(caught_up)
        k = self.SCHEDULE[self.rounds % len(self.SCHEDULE)]
        self.rounds += 1
        return min(k, limit)

    def update(self, k: int, accepted: int, seconds: float, catch_up: float = 0.0,
               filled: bool = False) -> None:
        pass

    def observe(self, matches: list[bool]) -> None:
        self.observed.append(matches)

    def observe_beyond(self, position: int, accepted: bool) -> None:
        self.beyond.append((position, accepted))

    def wants_beyond(self, position: int) -> bool:
        return True  # every round's evidence, to be checked

    def whole_chance(self, k: int) -> float:
        return 1.0  # every drafting round queues its next first step (the loop's gate decides)

    def end_stretch(self) -> None:
        pass
