"""Sampled cross-device replay (resilient.sdc.crosscheck): attribution from the gathered
answers, pure; and the real exchange over gloo with 2 and 3 ranks in one pool: a device
that computes a wrong forward is named with three ranks, a two-rank mismatch is a tie
(both suspects, neither attributed), a clean run raises nothing, over seeds."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.sdc.crosscheck import CrossCheck, attribute, period_for


def _ranks(sus, attributed=None):
    return [s.rank for s in sus if attributed is None or s.evidence["attributed"] is attributed]


def test_attribution_names_the_odd_device_and_never_a_tie():
    clean = [10, 11, 12, 13]
    assert attribute(4, clean, [13, 10, 11, 12]) == []           # checker c recomputed c-1's loss: all agree
    # rank 2 computes wrong: its own loss and its recompute of rank 1's batch
    orig = [10, 11, 99, 13]
    first = [13, 10, 98, 12]                                     # rank 3 recomputed rank 2's batch right: 12
    sus = attribute(4, orig, first)
    assert _ranks(sus, True) == [2] and not _ranks(sus, False)
    # a transient in rank 1's original alone: only the pair (1, 2) disagrees; the third device (3)
    # agrees with the checker -> rank 1
    orig = [10, 77, 12, 13]
    sus = attribute(4, orig, [13, 10, 11, 12], second=[12, 13, 10, 11])
    assert _ranks(sus, True) == [1]
    # ... and when the third device agrees with the subject, the checker computed wrong
    sus = attribute(4, [10, 11, 12, 13], [13, 10, 55, 12], second=[12, 13, 10, 11])
    assert _ranks(sus, True) == [2]
    # no majority (all three differ), or two devices: a tie, both suspects, none attributed
    sus = attribute(4, [10, 77, 12, 13], [13, 10, 55, 12], second=[12, 13, 10, 66])
    assert _ranks(sus, False) == [1, 2] and not _ranks(sus, True)
    sus = attribute(2, [10, 77], [11, 10])                       # rank 1's original differs from 0's recompute
    assert _ranks(sus, False) == [0, 1] and not _ranks(sus, True)
    sus = attribute(2, [10, 77], [76, 99])                       # persistent on one of two: both pairs, still a tie
    assert _ranks(sus, False) == [0, 1] and not _ranks(sus, True)   # one suspicion per rank


def test_the_period_follows_the_budget_within_the_bound():
    assert period_for(1 / 3, 0.01, 50) == 34
    assert period_for(0.9, 0.01, 50) == 50                        # the bound wins over the budget
    assert period_for(0.001, 0.01, 50) == 1
    cc = CrossCheck(0.01, 50, rank=0, world=2)
    assert [s for s in range(1, 40) if cc.due(s)] == [34, 35, 36, 37, 38, 39]   # until it runs
    cc.steps.measured(34, 1 / 3)                                   # what run() does: the next one a period on
    assert [s for s in range(35, 100) if cc.due(s)][:1] == [68]
    assert not CrossCheck(0.01, 50, rank=0, world=1).active and not CrossCheck(0.0, 50, rank=0, world=2).due(34)


def _exchange(rank, world, seeds, bad_rank, scale):
    """Every rank: the same replicated model, its own batch; rank ``bad_rank``'s device
    multiplies one Linear's output by ``scale`` (every forward: a persistent fault). Returns
    the suspicions of each seed's sampled step, as (rank, attributed) pairs."""
    import torch

    out = []
    for seed in seeds:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 4))
        if rank == bad_rank:
            model[0].register_forward_hook(lambda m, a, o: o * scale)
        gen = torch.Generator().manual_seed(seed * 100 + rank)
        x, y = torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)

        def loss_of(inputs, targets):
            return torch.nn.functional.cross_entropy(model(inputs), targets)

        cc = CrossCheck(0.01, 1, rank=rank, world=world)
        torch.manual_seed(seed * 7 + rank)   # each rank's own RNG stream (dropout)
        cc.note_rng()
        loss = loss_of(x, y)                 # the training forward (dropout draws from the RNG)
        loss.backward()
        sus = cc.run(1, loss, (x, y), loss_of, step_seconds=1.0)
        out.append(sorted((s.rank, s.evidence["attributed"]) for s in sus))
    return out


@pytest.mark.timeout(300)
def test_real_exchange_attributes_with_three_ties_with_two_and_is_quiet_when_clean():
    from resilient.sdc.harness import GlooPool

    for world in (3, 2):
        with GlooPool(world, timeout=timedelta(seconds=120)) as pool:
            clean = pool.run(_exchange, [1, 2, 3], -1, 1.0)
            assert all(r == [[], [], []] for r in clean), clean   # dropout's RNG restored: no false alarm
            bad = pool.run(_exchange, [4], 1, 0.5)[0][0]           # rank 1 shrinks an output
            flip = pool.run(_exchange, [5], 0, -1.0)[0][0]         # rank 0 flips its sign
        if world == 3:
            assert bad == [(1, True)] and flip == [(0, True)]
        else:
            assert {r for r, _ in bad} == {0, 1} and not any(a for _, a in bad)   # a tie: never attributed
            assert {r for r, _ in flip} == {0, 1} and not any(a for _, a in flip)


@settings(max_examples=25, deadline=None)
@given(world=st.integers(2, 6), bits=st.lists(st.integers(0, 2 ** 40), min_size=6, max_size=6))
def test_no_answer_is_made_up_when_every_device_agrees(world, bits):
    losses = bits[:world]
    first = [losses[(c - 1) % world] for c in range(world)]
    second = [losses[(c - 2) % world] for c in range(world)]
    assert attribute(world, losses, first, second) == []
