"""The batch's peak over time (engine/growth.py) against a step-by-step count of its blocks."""

import random

import pytest

from minillm.engine.growth import GrowthProfile


def blocks_over_time(rows: list[tuple[int, int, int]], block_size: int) -> int:
    """Step by step: (tokens, steps, forks) rows, each fork growing a token a step until its end
    (the first holds the tokens, the others only what they generate)."""
    longest = max((steps for _, steps, _ in rows), default=0)
    peak = 0
    for step in range(longest + 1):
        held = 0
        for tokens, steps, forks in rows:
            if step <= steps:
                held += -(-(tokens + step) // block_size) + (forks - 1) * -(-step // block_size)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("seed", range(40))
def test_peak_with_bounds_the_step_by_step_peak(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    running = [(rng.randrange(1, 300), rng.randrange(0, 200), 1) for _ in range(rng.randrange(0, 12))]
    candidate = (rng.randrange(0, 300), rng.randrange(0, 200), rng.choice([1, 1, 3]))
    profile = GrowthProfile([(tokens, steps) for tokens, steps, _ in running], block_size)

    exact_alone = blocks_over_time(running, block_size)
    exact_with = blocks_over_time(running + [candidate], block_size)
    slack = len(running) + 2 * candidate[2] + 1  # a last block counted full per row, the forks' bound
    assert exact_alone <= profile.peak <= exact_alone + len(running)
    assert (
        exact_with
        <= profile.peak_with(*candidate)
        <= exact_with + slack + (candidate[2] - 1) * (candidate[1] // block_size + 1)
    )


def test_sequences_that_finish_early_leave_their_blocks_to_a_newcomer():
    """Two sequences of 100 tokens, one ending now, one in 100 steps, and a newcomer of 100 tokens
    living 50: each one's own peak sums to 100 + 200 + 150 = 450 tokens, but the short one is gone
    before the others grow, and the newcomer before the long one peaks: the batch never holds
    more than 300 (at step 50)."""
    profile = GrowthProfile([(100, 0), (100, 100)], block_size=1)
    assert profile.peak == 200
    assert profile.peak_with(100, 50) == 300
