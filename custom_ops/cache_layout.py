"""The layout of a GPU pool's cache-manager state, shared by the ``echo::`` cache ops' references
(cache_ref.py), their Triton kernels (cache_*_kernels.py, through cache_constexpr.py), the pool
state (cache/gpu_pool.py) and the invariant checker: the ``meta`` and ``stats`` entries, the step
clock, the age buckets and the eviction batch (the reserve).
"""

from __future__ import annotations

import torch

# ---- meta layout (int32) ------------------------------------------------------------------------
CLOCK = 0  # current step clock, in [0, CLOCK_MASK]
NFREE = 1  # number of free slots: the ring gpu_free[(HEAD + i) % N_G], i < NFREE, lists them
OVERFLOW = 2  # sticky count of requests that could not be met (capacity violated)
IDX_HW = 3  # indices[IDX_HW:] are all -1 (lets kernels pad only what the last call wrote)
NMISS = 4  # scratch: distinct misses of the running recall
ALLOC_CTR = 5  # scratch: recall's placement handed to the copy launch (new HEAD + 1; 0 = not)
VICT_CTR = 6  # scratch: free's victim counter (release's push counter)
EQ_CTR = 7  # scratch: free's rank counter inside the threshold bucket
DONE = 8  # scratch: programs finished (the last one finalises and resets the scratch)
LAST_ALLOC = 9  # slots taken by the last allocate / recall
LAST_EVICT = 10  # slots evicted by the last free / recall
LAST_MISS = 11  # distinct misses of the last recall
HEAD = 12  # where the ring of free slots (gpu_free) starts, in [0, N_G)
# scratch: the phases of a one-launch free / recall (cache_fused_kernels.py), programs done with
LOOKED = 13  # the lookup (protect)
HISTED = 14  # the histogram
PLACED = 15  # the eviction + placement pass
COPIED = 16  # the row copy and the output
FREE0 = 17  # the free count when the one-launch recall started (its lookup's copy)
META_LEN = 20
SCRATCH = (NMISS, ALLOC_CTR, VICT_CTR, EQ_CTR, DONE, LOOKED, HISTED, PLACED, COPIED, FREE0)

# ---- stats layout (int64, cumulative) -----------------------------------------------------------
SELECTED = 0  # valid selected entries seen by recall
RECALLED = 1  # rows copied host -> GPU (distinct misses)
STEPS = 2  # recall calls
EVICTED = 3  # slots evicted
STATS_LEN = 4

CLOCK_MASK = (1 << 30) - 1
AGE_EXACT = 128
AGE_SHIFT = 5
NBINS = 256
PENDING = -2  # host_to_gpu value of a miss claimed inside a recall (never visible between ops)


def age_bucket(age: torch.Tensor) -> torch.Tensor:
    """Eviction bucket of an age >= 1; a higher bucket is evicted first (bucket 0 = never)."""
    return torch.where(
        age < AGE_EXACT, age, ((age - AGE_EXACT) >> AGE_SHIFT).add(AGE_EXACT).clamp(max=NBINS - 1)
    )


# An eviction frees a reserve beyond the step's need, so the next steps find free slots and skip
# the eviction passes over the N_G-sized priority array (issue 18): at N_G = 200K and ~37 misses a
# step, one eviction in ~85 steps. The reserve is the next-oldest slots, so the order stays
# oldest-first; only the batch size changes. Pools under 64 slots get no reserve (exact counts).
RESERVE_SHIFT = 6


def reserve_slots(n_g: int) -> int:
    """Slots an eviction frees beyond what the call needs: 1/64 of the pool."""
    return n_g >> RESERVE_SHIFT


def evict_target(needed: int, n_g: int, cap: int) -> int:
    """How many slots an eviction that must free ``needed`` takes: 0 when none is needed, else
    needed + the reserve, capped by CAP (the ``indices`` buffer the victims are listed in)."""
    return min(needed + reserve_slots(n_g), cap) if needed > 0 else 0
