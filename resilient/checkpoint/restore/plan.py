"""The fetch plan of a restore: which file each rank gets from where. A pure function of what every rank
needs and holds, identical on every rank (each computes it from the same gathered lists), testable
without processes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from resilient.checkpoint.replicate.transfer import Transfer


@dataclass(frozen=True)
class FetchPlan:
    """``transfers``: point-to-point sends over the manager's group, in the order every rank runs them;
    ``downloads``: rank -> names it reads from the persistent tier; ``missing``: (rank, name) no source
    holds (the step cannot be assembled)."""

    transfers: list[Transfer] = field(default_factory=list)
    downloads: dict[int, list[str]] = field(default_factory=dict)
    missing: list[tuple[int, str]] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return not self.missing


def plan_fetch(needs: Sequence[Sequence[str]], have: Sequence[Sequence[str]], sizes: Mapping[str, int],
               in_persistent: bool, blocks: Sequence[Mapping[str, Sequence[int]]] | None = None,
               bounds: Mapping[str, Sequence[tuple[int, int]]] | None = None) -> FetchPlan:
    """Sources, fastest first: the rank's own node (``have[r]``), another rank's copy over the group (the
    least loaded sender, ties to the lowest rank), the persistent tier (when it holds the step).

    ``needs[r]``: the files rank ``r`` loads; ``have[r]``: the files rank ``r`` holds a copy of on its node;
    ``blocks[r]``: for files rank ``r`` reads only in part (a resharded restore), the verification blocks it
    reads, whose ``bounds`` (name -> (start, end) of each block) give a transfer's size: only those travel.
    """
    plan = FetchPlan()
    load = [0] * len(needs)
    held = [set(h) for h in have]
    for r, wanted in enumerate(needs):
        part = blocks[r] if blocks is not None else {}
        for n in sorted(wanted):
            if n in held[r]:
                continue
            providers = [q for q in range(len(needs)) if q != r and n in held[q]]
            if providers:
                q = min(providers, key=lambda q: (load[q], q))
                load[q] += 1
                if n in part and bounds is not None and n in bounds:
                    bs = tuple(sorted(part[n]))
                    size = sum(bounds[n][i][1] - bounds[n][i][0] for i in bs)
                    plan.transfers.append(Transfer(src=q, dst=r, name=n, size=size, blocks=bs))
                else:
                    plan.transfers.append(Transfer(src=q, dst=r, name=n, size=sizes[n]))
            elif in_persistent:
                plan.downloads.setdefault(r, []).append(n)
            else:
                plan.missing.append((r, n))
    return plan
