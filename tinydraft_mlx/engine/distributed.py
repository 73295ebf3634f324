"""Beyond one machine: the target tensor-parallel over MLX's distributed backend (the group
`mlx.launch` started), the draft whole on every rank.

Each rank runs the same decode loop. The target's forward passes are collective (mlx-lm's
`model.shard(group)` all-reduces inside every layer), so every rank must run exactly the same
sequence of forward passes with exactly the same inputs, or the ranks hang or, worse, mix
different sequences into one sum. Whatever is decided from local state is therefore decided once,
on rank 0, and shared: the sampling seed when none is given, and `k="auto"`'s per-round choice
(it comes from timings, which differ per rank). Everything else follows from identical tokens:
the target's logits are identical on all ranks after the all-reduce, the draft and prompt lookup
are deterministic, and EOS, stop strings and max_tokens are functions of the tokens. At the end
of each generation the ranks compare a checksum of their tokens (one all-gather) and raise
`DesyncError` on every rank if they differ.

MLX's collectives have no timeout: a rank that stops answering is noticed only when its
connection breaks (the ring backend then fails the pending collective and the process exits
with an error); `mlx.launch` ends the other ranks when one exits with an error.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn


class GroupError(ValueError):
    """This process cannot join a ranks' group as asked (a setup problem the user fixes)."""


class DesyncError(RuntimeError):
    """The ranks generated different tokens: their per-round decisions diverged."""


class Ranks:
    """This process's place in a distributed group, and the few agreements the loop needs."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank, self.size = group.rank(), group.size()

    def __repr__(self) -> str:
        return f"Ranks(rank={self.rank}, size={self.size})"

    def agree(self, value: int) -> int:
        """Rank 0's `value` on every rank (an all-reduce in which the other ranks add 0). Values
        must fit in int32."""
        mine = mx.array([value if self.rank == 0 else 0], dtype=mx.int32)
        return int(mx.distributed.all_sum(mine, group=self.group, stream=mx.cpu).item())

    def check_same(self, tokens: Sequence[int]) -> None:
        """Compare a checksum of `tokens` across ranks (one all-gather); DesyncError on every
        rank when any differs."""
        digest = checksum(tokens)
        mine = mx.array([digest, len(tokens)], dtype=mx.int32)[None]
        everyone = mx.distributed.all_gather(mine, group=self.group, stream=mx.cpu).tolist()
        if any(row != everyone[0] for row in everyone):
            raise DesyncError(
                f"the ranks generated different tokens (rank {self.rank}: checksum, length = "
                f"{everyone[self.rank]}; all ranks: {everyone}): a per-round decision diverged")


def checksum(tokens: Sequence[int]) -> int:
    """A 31-bit polynomial hash of the token sequence (order matters)."""
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 1) % 2_147_483_647
    return h


def ranks_of(model: nn.Module) -> Ranks | None:
    """The group a model is sharded over (mlx-lm's sharded linear layers hold it as `group`), or
    None for a model on one process. Looked up at every generation, so the walk over the module
    tree is kept direct: `named_modules()` names every module on the way (3.8-4.7 ms a generation
    on a 36-layer Qwen2's 472 modules, 0.5-0.7 ms on the demo target's 82, the time to first
    token of every request); this walk takes a quarter of that (0.8-1.2 and 0.12-0.19 ms)."""
    stack: list[Any] = [model] if isinstance(model, nn.Module) else []
    nested = (nn.Module, list, tuple, dict)
    while stack:
        node = stack.pop()
        if isinstance(node, nn.Module):
            group = vars(node).get("group")
            if isinstance(group, mx.distributed.Group) and group.size() > 1:
                return Ranks(group)
            children = node.values()
        else:
            children = node.values() if isinstance(node, dict) else node
        stack.extend(child for child in children if isinstance(child, nested))
    return None


def join() -> Ranks:
    """Join the group `mlx.launch` started (GroupError when this process was not launched as one
    of several ranks, or when MLX could not start the group, e.g. a port in use)."""
    if not mx.distributed.is_available():
        raise GroupError("--distributed: this MLX build has no distributed backend")
    try:
        group = mx.distributed.init()
    except RuntimeError as err:  # e.g. the ring's "Couldn't bind socket (error: 98)"
        raise GroupError(f"--distributed: MLX could not join the ranks' group ({err}); where a "
                         "port mlx.launch assigned is in use, give it others with "
                         "mlx.launch --starting-port PORT") from err
    if group.size() < 2:
        raise GroupError("--distributed: this process is not one of several ranks; start it "
                         "with mlx.launch (e.g. mlx.launch --backend ring --hosts 127.0.0.1 -n 2 "
                         "python -m tinydraft_mlx.generate --distributed ...)")
    return Ranks(group)


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """A starting port for `mlx.launch --starting-port` on this machine: `count` consecutive
    ports (the ring gives rank r the starting port + r) all free now, drawn below the kernel's
    ephemeral range. A port the OS hands out (a bind to port 0) sits in that range, where the
    port after it may be any client connection's: a CI run's rank 1 failed with "Couldn't bind
    socket (error: 98)" so. RuntimeError where none is found."""
    low = 32768  # Linux's default start of the range (macOS's is 49152)
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if ranges.is_file():
        low = int(ranges.read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        start = rng.randrange(max(1024, low - 12000), low - count)
        held = []
        try:
            for port in range(start, start + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind((host, port))
            return start
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports found below {low}")
