"""runtime.sampler: greedy, seeded determinism, top-k/top-p, distribution, no host syncs."""

from __future__ import annotations

import pytest
import torch

from runtime.sampler import _blocked_cumsum, exponential_noise, prepare_batch, request_seed, sample
from runtime.sampling_params import SamplingParams, SamplingParamsError


def _rows(
    B: int,
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    seed0: int = 0,
    step: int = 0,
) -> dict[str, torch.Tensor]:
    return {
        "temperature": torch.full((B,), temperature),
        "top_k": torch.full((B,), top_k, dtype=torch.int64),
        "top_p": torch.full((B,), top_p),
        "seeds": torch.arange(seed0, seed0 + B, dtype=torch.int64),
        "steps": torch.full((B,), step, dtype=torch.int64),
    }


def test_greedy_is_argmax_with_model_logprob() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    for hint in (False, True):
        ids, lp = sample(logits, **_rows(6, temperature=0.0), all_greedy=hint)
        assert torch.equal(ids, logits.argmax(-1))
        ref = torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)
        torch.testing.assert_close(lp, ref)


def test_greedy_rows_mixed_with_sampled_rows() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 40)
    rows = _rows(8)
    rows["temperature"][::2] = 0.0
    ids, _ = sample(logits, **rows)
    assert torch.equal(ids[::2], logits[::2].argmax(-1))


def test_seeded_row_independent_of_batch_position_and_neighbours() -> None:
    torch.manual_seed(2)
    V = 300
    row = torch.randn(V)
    # Alone in a batch of one...
    alone, alone_lp = sample(
        row[None],
        torch.tensor([0.8]),
        torch.tensor([50]),
        torch.tensor([0.9]),
        torch.tensor([1234]),
        torch.tensor([7]),
    )
    # ...and at position 3 of a batch of 5 whose other rows differ in everything.
    logits = torch.randn(5, V)
    logits[3] = row
    temperature = torch.tensor([1.0, 0.0, 2.0, 0.8, 0.5])
    top_k = torch.tensor([-1, 5, 1, 50, -1])
    top_p = torch.tensor([1.0, 0.5, 0.3, 0.9, 1.0])
    seeds = torch.tensor([1, 2, 3, 1234, 99])
    steps = torch.tensor([0, 100, 3, 7, 7])
    ids, lp = sample(logits, temperature, top_k, top_p, seeds, steps)
    assert ids[3] == alone[0]
    torch.testing.assert_close(lp[3], alone_lp[0])


def test_noise_depends_on_seed_step_and_token() -> None:
    ids = torch.arange(64)
    base = exponential_noise(torch.tensor([5]), torch.tensor([0]), ids)
    assert torch.equal(base, exponential_noise(torch.tensor([5]), torch.tensor([0]), ids))
    assert not torch.equal(base, exponential_noise(torch.tensor([6]), torch.tensor([0]), ids))
    assert not torch.equal(base, exponential_noise(torch.tensor([5]), torch.tensor([1]), ids))
    assert base.unique().numel() == 64
    # Seeds that differ only in the high 32 bits, or only in sign, are different streams.
    hi = exponential_noise(torch.tensor([5 + 2**40]), torch.tensor([0]), ids)
    neg = exponential_noise(torch.tensor([-5]), torch.tensor([0]), ids)
    assert not torch.equal(base, hi) and not torch.equal(base, neg)


def test_noise_is_exponential() -> None:
    e = exponential_noise(torch.arange(400), torch.zeros(400, dtype=torch.int64), torch.arange(500))
    assert (e > 0).all() and torch.isfinite(e).all()
    # Exp(1): mean 1, variance 1, P(E < 0.1) = 1 - exp(-0.1). 200k samples: tolerances ~10 sigma.
    assert abs(e.mean().item() - 1.0) < 0.025
    assert abs(e.var().item() - 1.0) < 0.06
    assert abs((e < 0.1).float().mean().item() - 0.09516) < 0.007


def test_noise_rows_are_uncorrelated() -> None:
    # Neighbouring seeds and steps (and the same stream shifted by one token) look independent.
    ids = torch.arange(20000)
    e = exponential_noise(torch.tensor([7, 8, 7]), torch.tensor([3, 3, 4]), ids)
    pairs = [(e[0], e[1]), (e[0], e[2]), (e[0, 1:], e[1, :-1]), (e[0, 1:], e[2, :-1])]
    for a, b in pairs:
        assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.04


def test_steps_give_fresh_draws() -> None:
    logits = torch.zeros(200, 16)  # uniform over 16 tokens
    ids, _ = sample(
        logits, **{**_rows(200), "seeds": torch.full((200,), 42), "steps": torch.arange(200)}
    )
    assert ids.unique().numel() == 16


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    torch.manual_seed(3)
    logits = torch.randn(64, 100)
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "top_p": 0.5}):
        ids, lp = sample(logits, **_rows(64, temperature=1.5, **kw))
        assert torch.equal(ids, logits.argmax(-1)), kw
        # Only one token survives, so its renormalised probability is 1.
        torch.testing.assert_close(lp, torch.zeros(64))


def test_tiny_temperature_is_greedy_not_nan() -> None:
    # logits / 1e-45 (an fp32 subnormal) overflows to +inf: the row became NaN, the token garbage
    # and the server's JSON a 500. The limit of a vanishing temperature is the argmax, logprob 0.
    torch.manual_seed(4)
    logits = torch.randn(16, 100) * 5
    logits[:, 7] = float("-inf")  # a masked token (grammar, min_tokens) stays impossible
    for t in (1e-45, 1e-38, 1e-30):
        for filters in (True, False):
            ids, lp = sample(logits, **_rows(16, temperature=t), filters=filters)
            assert torch.equal(ids, logits.argmax(-1)), (t, filters)
            torch.testing.assert_close(lp, torch.zeros(16), msg=f"t={t}, filters={filters}")


def test_huge_temperature_is_uniform_over_allowed_tokens_not_nan() -> None:
    # SamplingParams(temperature=1e39) is finite but inf in fp32: a masked token (min_tokens'
    # EOS) gave -inf / inf = NaN, so the row sampled token 0 with a NaN logprob, and top-k kept
    # the first k vocab ids (every other logit / inf ties at 0) instead of the k most likely.
    torch.manual_seed(4)
    logits = torch.randn(64, 100) * 5
    logits[:, 0] = float("-inf")  # masked: may never be chosen
    for top_k in (-1, 5):
        params = [SamplingParams(temperature=1e39, top_k=top_k)] * 64
        sb = prepare_batch(params, list(range(64)), [0] * 64)
        ids, lp = sample(
            logits, sb.temperature, sb.top_k, sb.top_p, sb.seeds, sb.steps, filters=sb.filters
        )
        assert torch.isfinite(lp).all() and (ids != 0).all(), top_k
        if top_k == 5:
            allowed = logits.topk(5, dim=-1).indices
            assert (allowed == ids[:, None]).any(-1).all()


def test_top_k_and_top_p_keep_only_allowed_tokens() -> None:
    torch.manual_seed(4)
    logits = torch.randn(1, 30).expand(2000, 30).contiguous()
    ids, _ = sample(logits, **_rows(2000, top_k=5))
    assert set(ids.tolist()) == set(logits[0].topk(5).indices.tolist())
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    nucleus = set(order[before < 0.6].tolist())
    ids, _ = sample(logits, **_rows(2000, top_p=0.6))
    assert set(ids.tolist()) == nucleus


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square 99.9999th percentile: 7 degrees of freedom ~ 36.5, 3 degrees ~ 28.5.
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    N = 40000
    ids, lp = sample(logits.expand(N, 8).contiguous(), **_rows(N, temperature=temperature))
    probs = torch.softmax(logits / temperature, -1)
    counts = torch.bincount(ids, minlength=8).float()
    assert _chi_square(counts, probs) < 36.5
    torch.testing.assert_close(lp, probs.log()[ids])
    # Same draws with the static `filters` hint off: identical tokens (noise is per vocab id).
    ids2, _ = sample(
        logits.expand(N, 8).contiguous(), **_rows(N, temperature=temperature), filters=False
    )
    assert torch.equal(ids, ids2)


def test_empirical_distribution_after_top_k() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    N = 40000
    ids, lp = sample(logits.expand(N, 8).contiguous(), **_rows(N, top_k=4))
    kept = torch.tensor([0, 6, 1, 2])
    assert set(ids.tolist()) <= set(kept.tolist())
    probs = torch.softmax(logits[kept], -1)
    counts = torch.bincount(ids, minlength=8)[kept].float()
    assert _chi_square(counts, probs) < 28.5
    full = torch.full((8,), float("-inf"))
    full[kept] = probs.log()
    torch.testing.assert_close(lp, full[ids])


def test_chi_square_detects_a_wrong_distribution() -> None:
    # The bound above can fail: a temperature mismatch is caught.
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    N = 40000
    ids, _ = sample(logits.expand(N, 8).contiguous(), **_rows(N, temperature=1.2))
    counts = torch.bincount(ids, minlength=8).float()
    assert _chi_square(counts, torch.softmax(logits, -1)) > 36.5


@pytest.mark.parametrize("V", [7, 1024, 2500])
def test_blocked_cumsum_is_cumsum(V: int) -> None:
    x = torch.rand(3, V)
    torch.testing.assert_close(_blocked_cumsum(x), x.cumsum(-1), rtol=1e-5, atol=1e-4)


def test_masked_vocab_never_sampled() -> None:
    logits = torch.zeros(5000, 10)
    logits[:, 7:] = float("-inf")  # e.g. vocab padding
    ids, lp = sample(logits, **_rows(5000))
    assert ids.max() < 7 and torch.isfinite(lp).all()


def test_no_host_sync_fullgraph() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(sample, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    logits = torch.randn(4, 64)
    rows = _rows(4, temperature=0.9, top_k=10, top_p=0.8)
    rows["temperature"][1] = 0.0
    ids, lp = compiled(logits, **rows)
    ref_ids, ref_lp = sample(logits, **rows)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(lp, ref_lp)


def test_bad_inputs_raise() -> None:
    logits = torch.randn(2, 8)
    with pytest.raises(ValueError, match="logits"):
        sample(logits.half(), **_rows(2))
    with pytest.raises(ValueError, match="top_k"):
        sample(logits, **{**_rows(2), "top_k": torch.ones(2)})
    with pytest.raises(ValueError, match="seeds"):
        sample(logits, **{**_rows(2), "seeds": torch.zeros(3, dtype=torch.int64)})


def test_prepare_batch_and_hints() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=3, seed=7)]
    b = prepare_batch(params, [1, 7], [0, 4])
    assert not b.all_greedy and b.filters
    assert b.top_k.tolist() == [-1, 3] and b.steps.tolist() == [0, 4]
    logits = torch.randn(2, 20)
    ids, _ = sample(
        logits,
        b.temperature,
        b.top_k,
        b.top_p,
        b.seeds,
        b.steps,
        all_greedy=b.all_greedy,
        filters=b.filters,
    )
    assert ids[0] == logits[0].argmax()
    g = prepare_batch([SamplingParams(temperature=0.0, top_k=3)], [0], [0])
    assert g.all_greedy and not g.filters
    with pytest.raises(ValueError, match="differ in length"):
        prepare_batch(params, [1], [0, 0])
    assert request_seed(SamplingParams(seed=-3)) == -3
    assert SamplingParams(top_k=0) == SamplingParams(top_k=-1)  # 0 disables top-k, as in vLLM
    assert 0 <= request_seed(SamplingParams()) < 2**63


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": 2**63}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"logit_bias": [(5, 100), (5, 100)]}, "logit_bias"),  # (was +200 on token 5)
    ],
)
def test_sampling_params_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(SamplingParamsError, match=field) as err:
        SamplingParams(**kwargs)
    assert err.value.param == field


def test_sampling_params_normalises_sequences() -> None:
    p = SamplingParams(stop="###", stop_token_ids=[3, 4], temperature=0)
    assert p.stop == ("###",) and p.stop_token_ids == (3, 4) and p.greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    hash(p)  # frozen and hashable
    # None is none, as vLLM's SamplingParams reads it (it was a SamplingParamsError)
    none = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None)
    assert none == SamplingParams() and none.stop == none.stop_token_ids == none.logit_bias == ()


@pytest.mark.cuda
def test_cuda_no_host_sync_and_cuda_graphs() -> None:
    """On the GPU: no host sync (sync debug mode "error"), CPU-consistent results, and the
    compiled sampler captures into CUDA graphs without skips."""
    from torch._dynamo.utils import counters

    torch.manual_seed(6)
    B, V = 64, 129280  # the V3.2 vocabulary
    logits = torch.randn(B, V, device="cuda") * 4
    rows = {k: v.cuda() for k, v in _rows(B, temperature=0.8, top_k=50, top_p=0.9).items()}
    rows["temperature"][::4] = 0.0  # greedy rows mixed in
    rows["top_k"][1::4] = -1
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids, lp = sample(logits, **rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    cpu_ids, _ = sample(logits.cpu(), **{k: v.cpu() for k, v in rows.items()})
    assert torch.equal(ids.cpu()[::4], cpu_ids[::4])  # greedy rows: exact
    # Sampled rows: the noise is bit-identical; only float reductions may flip a near tie.
    assert (ids.cpu() == cpu_ids).float().mean() >= 0.95
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(sample, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        c_ids, c_lp = compiled(logits, **rows)
    torch.cuda.synchronize()
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert torch.equal(c_ids[::4], ids[::4]) and (c_ids == ids).float().mean() >= 0.95


def test_generation_defaults_from_the_checkpoint() -> None:
    from runtime.sampling_params import generation_defaults

    gen = {"bos_token_id": 0, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 0}
    d = generation_defaults(gen)
    assert d == SamplingParams(temperature=0.6, top_p=0.95)  # the other fields are not read
    assert generation_defaults(gen, "none") == SamplingParams() == generation_defaults({})
    with pytest.raises(ValueError, match="generation_config must be auto or none"):
        generation_defaults(gen, "vllm")
    with pytest.raises(ValueError, match="generation_config.json field 'top_p'"):
        generation_defaults({"top_p": 1.5})
    with pytest.raises(ValueError, match="expected a JSON object"):
        generation_defaults([])


def test_generation_defaults_take_max_new_tokens_as_max_tokens() -> None:
    """HF's max_new_tokens is the max_tokens of a request without params, as vLLM reads it;
    a bad one is refused under its own name."""
    from runtime.sampling_params import generation_defaults

    assert generation_defaults({"max_new_tokens": 7, "top_p": 0.5}) == SamplingParams(
        max_tokens=7, top_p=0.5
    )
    assert generation_defaults({"max_new_tokens": None}).max_tokens == SamplingParams().max_tokens
    assert generation_defaults({"max_new_tokens": 7}, "none") == SamplingParams()
    with pytest.raises(ValueError, match="field 'max_new_tokens'.*got 0"):
        generation_defaults({"max_new_tokens": 0})
