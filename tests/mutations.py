"""Mutation check: apply each one-line bug below to a temporary copy of the repository and run the
test that is meant to catch it; every one must FAIL. Not a pytest module (no ``test_`` prefix):
run it by hand, it takes a few minutes on 2 cores.

    python tests/mutations.py            # all mutations
    python tests/mutations.py seq_len    # the ones whose name contains "seq_len"

Prints ``mutation -> tests -> FAILED as expected`` (or ``PASSED: the mutation survived``) per
line; exits 1 if any mutation survived or no longer applies (its line changed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = [
    Mutation(
        "dynamic_decode compiles per bucket (the batch never marked dynamic)",
        "echo_compile/compiled.py",
        "                _mark_batch_dynamic(args)",
        "                pass",
        ("tests/test_dynamic_decode.py::test_one_compile_serves_every_bucket_with_equal_logits",),
    ),
    Mutation(
        "warm-up captures the smallest bucket first",
        "runtime/model_runner.py",
        "for b in sorted(buckets)[::-1]",
        "for b in sorted(buckets)",
        ("tests/test_dynamic_decode.py::test_warmup_captures_the_largest_bucket_first",),
    ),
    Mutation(
        "fp8 K = 16384 split-K rule at every M above 32",
        "custom_ops/fp8_linear_kernels.py",
        "if k >= 16384 and 32 < m <= 128:",
        "if k >= 16384 and m > 32:",
        ("tests/test_fp8_linear.py::test_split_k_configs_fit_the_tile_counters_at_every_m",),
    ),
    Mutation(
        "scheduler ignores B x topk <= gpu_tokens",
        "custom_ops/cache/config.py",
        "return min(max_batch, gpu_tokens // topk)",
        "return max_batch",
        ("tests/test_scheduler_cap.py", "tests/test_attended_set.py"),
    ),
    Mutation(
        "engine ignores stop_token_ids",
        "runtime/detokenize.py",
        "(token_id in self.eos and not p.ignore_eos) or token_id in p.stop_token_ids",
        "(token_id in self.eos and not p.ignore_eos)",
        ("tests/test_engine_finish.py::test_stop_token_ids",),
    ),
    Mutation(
        "engine ignores EOS",
        "runtime/detokenize.py",
        "(token_id in self.eos and not p.ignore_eos) or token_id in p.stop_token_ids",
        "token_id in p.stop_token_ids",
        ("tests/test_engine_finish.py::test_eos_and_ignore_eos",),
    ),
    Mutation(
        "decode seq_len off by one",
        "runtime/model_runner.py",
        "lens[:n] = pos[:n].to(torch.int32) + 1",
        "lens[:n] = pos[:n].to(torch.int32)",
        ("tests/test_runner_inputs.py",),
    ),
    Mutation(
        "sparse attention does not mask -1 entries (op)",
        "custom_ops/attention.py",
        's = s.masked_fill(~valid, float("-inf"))',
        "s = s",
        ("tests/test_lossless_short.py::test_attention_ignores_minus_one_entries",),
    ),
    Mutation(
        "the model attends -1 padding as host slot 0",
        "model/model.py",
        "pool, slots = cache_layer.fetch(host_slots)",
        "pool, slots = cache_layer.fetch(host_slots.clamp(min=0))",
        ("tests/test_golden_logits.py",),
    ),
    Mutation(
        "prefill reference: a query sees the token after its own",
        "custom_ops/prefill.py",
        "causal = t[None, :] <= positions[:, None]",
        "causal = t[None, :] <= positions[:, None] + 1",
        ("tests/test_prefill_model.py",),
    ),
    Mutation(
        "prefill logits kernel: a query sees the token after its own",
        "custom_ops/prefill_kernels.py",
        's = tl.where(tt[None, :] <= pos[:, None], s, float("-inf"))',
        's = tl.where(tt[None, :] <= pos[:, None] + 1, s, float("-inf"))',
        ("tests/test_prefill_ops.py::test_prefill_logits_kernel_matches_reference",),
    ),
    Mutation(
        "prefill gather: the copy reads the next row of the page",
        "custom_ops/prefill_gather_kernels.py",
        "src = src_ptr + (page * _PAGE + p % _PAGE)[:, None] * ROW_W",
        "src = src_ptr + (page * _PAGE + (p + 1) % _PAGE)[:, None] * ROW_W",
        ("tests/test_prefill_gather.py::test_kernel_matches_reference",),
    ),
    Mutation(
        "prefill gather: the last query block's rows never copied",
        "custom_ops/prefill_gather_kernels.py",
        "cp.copy(len(blocks) - 1, (e - s) * topk)",
        "pass",
        ("tests/test_prefill_gather.py::test_kernel_matches_reference",),
    ),
    Mutation(
        "prefill gather reference: the host row of the next slot",
        "custom_ops/prefill_gather.py",
        "rows[mark] = host_kv[slots[mark]].to(sel.device)",
        "rows[mark] = host_kv[slots[mark] + 1].to(sel.device)",
        ("tests/test_prefill_gather.py::test_engine_without_prefill_buffer_is_lossless",),
    ),
    Mutation(
        "prefix cache: the cached prefix never loaded into the prefill buffer",
        "runtime/engine.py",
        "self.cache.load_prefill(req.slots(0, req.cached_tokens).to(self.device))",
        "pass",
        ("tests/test_prefix_cache.py::test_cached_prefix_gives_the_logits_of_a_full_prefill",),
    ),
    Mutation(
        "prefix cache: a prompt's last token taken from the cache too",
        "runtime/scheduler.py",
        "pages = self.prefix.match(req.prompt_ids, req.prefill_end // PAGE, known)",
        "pages = self.prefix.match(req.prompt_ids, len(req.prompt_ids) // PAGE, known)",
        ("tests/test_prefix_cache.py::test_requests_that_take_no_prefix",),
    ),
    Mutation(
        "prefix cache: a chain touched first page first (parents evicted before children)",
        "runtime/prefix_cache.py",
        "for page in reversed(chain):",
        "for page in chain:",
        ("tests/test_prefix_cache.py::test_descendants_go_before_their_parents_and_with_them",),
    ),
    Mutation(
        "prefix cache: pages a finished request leaves never counted evictable",
        "runtime/prefix_cache.py",
        "self.num_evictable += sum(1 for p in pages if p in self._key and self.pages.refs(p) == 1)",
        "pass",
        ("tests/test_prefix_cache.py",),
    ),
    Mutation(
        "prefix cache: pages cached after an error",
        "runtime/scheduler.py",
        "            if cache:",
        "            if True:",
        ("tests/test_prefix_cache.py::test_error_finishes_cache_nothing_and_random_traffic_keeps_the_counts",),
    ),
    Mutation(
        "prefix cache: a prefill never looks again for pages cached since its admission",
        "runtime/scheduler.py",
        "                self._extend_prefix(r)",
        "                pass",
        ("tests/test_prefix_cache.py::test_a_burst_on_one_document_prefills_it_once",),
    ),
    Mutation(
        "prefix cache: a match remembered across an eviction",
        "runtime/scheduler.py",
        "known = memo[1] if memo is not None and memo[0] == epoch else []",
        "known = memo[1] if memo is not None else []",
        ("tests/test_prefix_cache.py::test_a_waiting_requests_match_is_redone_after_an_eviction",),
    ),
    Mutation(
        "prefix cache: a page registered under a cached page its sequence does not hold",
        "runtime/prefix_cache.py",
        "            elif page != pages[i]:\n                return i",
        "            elif False:\n                return i",
        ("tests/test_prefix_cache.py::test_a_page_computed_twice_stops_the_later_sequence",),
    ),
    Mutation(
        "prefix cache: a group head ending in an error still caches its pages",
        "runtime/scheduler.py",
        "                self._drop_head(group, cache)",
        "                self._drop_head(group)",
        ("tests/test_prefix_cache.py::test_a_raising_release_hook_loses_no_evictable_page_and_an_error_caches_no_head",),
    ),
    Mutation(
        "stop string: one character too few held back",
        "runtime/tokenizer.py",
        "for n in range(min(len(s) - 1, len(buf)), longest, -1):",
        "for n in range(min(len(s) - 2, len(buf)), longest, -1):",
        ("tests/test_stop_strings_hard.py",),
    ),
    Mutation(
        "top-k ties go to the later token",
        "custom_ops/indexer.py",
        "order = torch.sort(-score, dim=1, stable=True).indices[:, :K]",
        "order = (L - 1 - torch.sort(-score.flip(1), dim=1, stable=True).indices)[:, :K]",
        ("tests/test_topk_ties.py::test_reference_topk_with_ties",),
    ),
    Mutation(
        "age buckets 128 steps wide instead of 32",
        "custom_ops/cache_layout.py",
        "((age - AGE_EXACT) >> AGE_SHIFT)",
        "((age - AGE_EXACT) >> (AGE_SHIFT + 2))",
        ("tests/test_cache_statemachine.py::test_eviction_partly_empties_an_age_bucket",),
    ),
    Mutation(
        "indexer rope interleaved (the pre-fix reference bug)",
        "model/model.py",
        "q = torch.cat([apply_rope(q_pe, cos, sin, interleaved=False), q_nope], dim=-1)",
        "q = torch.cat([apply_rope(q_pe, cos, sin, interleaved=True), q_nope], dim=-1)",
        ("tests/test_golden_logits.py",),
    ),
    Mutation(
        "MoE weights from the bias-corrected scores",
        "model/moe.py",
        "weights = original.gather(1, indices)",
        "weights = scores.gather(1, indices)",
        ("tests/test_golden_logits.py",),
    ),
    Mutation(
        "ranks keep their own KV sizes, not the least over the ranks",
        "runtime/distributed/size_agreement.py",
        "agreed[name] = min(values)",
        "agreed[name] = next(v for v in values if v[1] == ctx.rank)",
        (
            "tests/test_distributed_size_agreement.py::"
            "test_every_rank_takes_the_least_of_each_automatic_size",
        ),
    ),
    Mutation(
        "the host pool's fault-in misses each span's last partial chunk",
        "custom_ops/cache/host_pool.py",
        "for o in range(0, n, FAULT_CHUNK)]",
        "for o in range(0, n - FAULT_CHUNK + 1, FAULT_CHUNK)]",
        ("tests/test_host_pool.py",),
    ),
]


def copy_repo(dst: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for f in files:
        src = ROOT / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)


def run_one(m: Mutation) -> bool:
    """True when the mutation was caught (its tests failed)."""
    with tempfile.TemporaryDirectory(prefix="mut-") as tmp:
        root = Path(tmp)
        copy_repo(root)
        target = root / m.path
        text = target.read_text()
        if text.count(m.old) != 1:
            print(f"{m.name} -> NOT APPLIED: the line is not in {m.path} exactly once")
            return False
        target.write_text(text.replace(m.old, m.new))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests],
            cwd=root, env=env, capture_output=True, text=True,
        )  # fmt: skip
        caught = r.returncode == 1  # tests failed (2+ would be an error of the run itself)
        verdict = (
            "FAILED as expected" if caught else f"PASSED: the mutation survived (rc {r.returncode})"
        )
        print(f"{m.name} -> {' '.join(m.tests)} -> {verdict}", flush=True)
        if r.returncode not in (0, 1):
            print(r.stdout[-2000:], r.stderr[-2000:])
        return caught


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not argv or any(a in m.name for a in argv)]
    results = [run_one(m) for m in chosen]
    print(f"{sum(results)}/{len(results)} mutations caught")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
