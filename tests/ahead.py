"""Recording the draft chains the decode loop runs, to tell the rounds whose first draft step's
forward ran ahead (`Drafter.ahead`, queued behind the previous round's verify) from the others."""

from __future__ import annotations


def record_chains(monkeypatch) -> list[tuple[bool, int]]:
    """From now on, per draft chain (`drafters._draft_chain`): whether its first step's forward
    ran ahead, and its first draft token (read as it is proposed). Clear the list to start
    over."""
    import tinydraft_mlx.engine.drafters as drafters

    chain, chains = drafters._draft_chain, []

    def recorded(*args):
        drafts, *rest = chain(*args)
        chains.append((args[9] is not None, drafts[0].item()))  # args[9]: `start`
        return (drafts, *rest)

    monkeypatch.setattr(drafters, "_draft_chain", recorded)
    return chains
