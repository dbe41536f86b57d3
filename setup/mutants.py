"""Plant one plausible bug at a time in a copy of the tree and run the tests that must catch it.

    bash setup/mutants.sh                # every bug; prints the table, exit 1 if one survived
    bash setup/mutants.sh --list         # the bugs and the tests each runs
    bash setup/mutants.sh --only NAME    # some of them (repeat --only)
    bash setup/mutants.sh --no-baseline  # skip the unmutated run of the selected tests

The copy holds what git tracks and what it does not ignore (uncommitted edits included), in a
temporary directory; the project's own tree is never touched. First the selected tests run on
the unmutated copy: they must pass, or a failure below would prove nothing. Then, per bug, one
source line is replaced (the old text must occur exactly once, so an edit of the code that moves
it fails loudly here instead of planting nothing), its tests run with `pytest -x`, and the line
is put back. The table: bug, the first test that failed (or SURVIVED), seconds.

Run it before and after any change that trims, merges or moves tests: every bug killed before
must be killed after. A bug that survives is a property no test checks.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Mutant:
    name: str
    what: str          # the bug, in words
    path: str          # the file, relative to the repository
    old: str           # text that occurs exactly once in it
    new: str
    tests: tuple       # pytest node ids that must fail


F8_MOE = "tests/test_float8_moe.py::test_float8_moe_layouts_equal_one_process"
MUTANTS = [
    Mutant("ft_gradients_not_summed", "a replica group keeps its own gradient (torchft: not "
           "summed across groups)", "lingua/parallel/fault_tolerance.py",
           "self.manager.allreduce(grad, reduce_op=ReduceOp.SUM).wait()", "grad.mul_(1.0)",
           ("tests/test_fault_tolerance.py::"
            "test_two_groups_of_one_rank_equal_one_process_and_restart_exactly",
            "tests/test_fault_tolerance.py::"
            "test_the_local_recipe_two_fsdp_groups_of_two_ranks_equal_one_process")),
    Mutant("ft_heal_keeps_own_weights", "a healing replica group loads its peer's train state "
           "but keeps its own weights and optimizer state", "lingua/train/saving.py",
           'getattr(own[key], "_local_tensor", own[key]).copy_(value)', "pass",
           ("tests/test_fault_tolerance.py::"
            "test_a_killed_group_heals_from_the_live_one_even_after_a_kill_during_its_heal",)),
    Mutant("ft_heal_jsonl_not_read_forward", "a healing rank keeps its own jsonl position but "
           "does not read forward to its peer's step", "lingua/train/saving.py",
           "        for _ in range(behind):\n", "        for _ in range(0):\n",
           ("tests/test_fault_tolerance.py::"
            "test_a_group_behind_heals_and_reads_its_own_jsonl_stream_forward",)),
    Mutant("dump_dir_lock_not_taken", "a run takes no flock on its dump_dir: a second run "
           "on it is not refused", "lingua/train/dump_lock.py",
           "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", "pass",
           ("tests/test_run_directory.py::"
            "test_a_second_run_on_a_held_dump_dir_is_refused_and_writes_nothing",)),
    Mutant("chat_cache_checksum_unchecked", "the chat cache's arrays read without their CRC-32 "
           "checked: damage within the vocabulary trains silently", "lingua/data/chat.py",
           'if zlib.crc32(raw) != meta["crc32"][name]:', "if False:",
           ("tests/test_chat_data.py::test_a_damaged_chat_cache_is_rebuilt_with_a_warning"
            "[_flip_within_vocabulary]",)),
    Mutant("stool_ft_groups_share_an_id", "stool gives every replica group of a fault-tolerant "
           "run group_id 0 (each group would read the same part of the batch)",
           "lingua/launch/stool.py", 'f"fault_tolerance.group_id={g}"',
           '"fault_tolerance.group_id=0"',
           ("tests/test_stool.py::"
            "test_a_fault_tolerant_run_is_a_lighthouse_job_and_one_job_per_group",)),
    Mutant("rank1_gradient_x1.01", "rank 1's gradient 1% too large (FSDP2 against one process)",
           "lingua/train/loop.py",
           "(out.loss_sum / self.loss_denominator).backward()",
           "(out.loss_sum / self.loss_denominator * (1.01 if env.rank == 1 else 1.0)).backward()",
           ("tests/test_distributed.py::test_layout_matches_single_process[fsdp2]",)),
    Mutant("rank1_gradient_x1.01_float8_ep", "the same, float8 MoE under expert parallelism",
           "lingua/train/loop.py",
           "(out.loss_sum / self.loss_denominator).backward()",
           "(out.loss_sum / self.loss_denominator * (1.01 if env.rank == 1 else 1.0)).backward()",
           (f"{F8_MOE}[ep2]",)),
    Mutant("loss_denominator_plus_1", "the loss divided by one target more than the step counted",
           "lingua/train/loop.py",
           "self.loss_denominator = micro_batches[0].step_targets or self.global_tokens",
           "self.loss_denominator = (micro_batches[0].step_targets or self.global_tokens) + 1",
           ("tests/test_sft.py::test_the_gradient_is_that_of_the_mean_over_answer_tokens",)),
    Mutant("resume_data_one_batch_on", "resume restores the data position one global batch on",
           "lingua/data/memmap.py",
           '        self.samples_consumed = state["samples_consumed"]\n',
           '        self.samples_consumed = state["samples_consumed"] + self.args.batch_size * '
           'self.args.grad_accum * self.dp_size\n',
           ("tests/test_train.py::test_resume_is_bit_exact",)),
    Mutant("tp_norm_left_out", "a sequence-parallel norm left out of LLaMA's TP plan: its weight "
           "gradient would miss its reduction over the TP ranks",
           "lingua/models/llama/parallelize.py",
           '        "ffn_norm": SequenceParallel(),\n', "",
           ("tests/test_tensor_parallel.py::test_tp2_matches_single_process",)),
    Mutant("tp_norm_left_out_float8_moe", "the same in the MoE app's plan, float8 MoE under TP",
           "apps/moe/parallelize.py",
           '"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),',
           '"attention_norm": SequenceParallel(),',
           (f"{F8_MOE}[tp2]",)),
    Mutant("cp_rope_offset", "RoPE positions of context-parallel rank r shifted by r",
           "lingua/parallel/context_parallel.py",
           "yield CPBatch(tokens.index_select(1, positions), local_labels, positions)",
           "yield CPBatch(tokens.index_select(1, positions), local_labels, positions + ctx.rank)",
           ("tests/test_context_parallel.py::test_cp_matches_single_process",)),
    Mutant("cp_mask_ignores_window", "context parallelism masks causally (and by document) "
           "whatever the model's mask says: a sliding window is lost at cp>1",
           "lingua/parallel/context_parallel.py",
           "self.mask = self.spec.dense(positions, torch.arange(seq_len, device=device), doc_ids)",
           "self.mask = AttentionMask().dense(positions, torch.arange(seq_len, device=device), "
           "doc_ids)",
           ("tests/test_swa.py::test_layout_matches_one_process[cp2]",)),
    Mutant("lora_scale", "LoRA's update scaled by alpha / (rank + 1), not alpha / rank",
           "lingua/model/lora.py",
           "self.rank, self.alpha, self.scale = rank, alpha, alpha / rank",
           "self.rank, self.alpha, self.scale = rank, alpha, alpha / (rank + 1)",
           ("tests/test_sft_hf.py::test_peft_adapter",)),
    Mutant("lora_drops_the_bias", "a LoRA layer computes without its base Linear's bias (Qwen2's "
           "q/k/v biases lost in fine-tuning)", "lingua/model/lora.py",
           "return F.linear(x, self.weight, self.bias) + self.scale * update",
           "return F.linear(x, self.weight) + self.scale * update",
           ("tests/test_hf_families.py::test_peft_adapter_gives_our_logits[qwen2]",)),
    Mutant("qk_norm_after_rope", "Qwen3's QK-norm applied after RoPE, not before (its per-channel "
           "gain does not commute with the rotation)", "lingua/models/llama/model.py",
           "            q, k = self.q_norm(q), self.k_norm(k)\n"
           "        q, k = apply_rope(q, *rope), apply_rope(k, *rope)\n",
           "            q, k = apply_rope(q, *rope), apply_rope(k, *rope)\n"
           "            q, k = self.q_norm(q), self.k_norm(k)\n"
           "        else:\n"
           "            q, k = apply_rope(q, *rope), apply_rope(k, *rope)\n",
           ("tests/test_hf_families.py::test_logits_equal_transformers_both_ways[qwen3]",)),
    Mutant("checksum_not_checked", "a checkpoint's CRC-32 computed but never compared",
           "lingua/checkpoint/integrity.py",
           'if crc != files[name]["crc32"]:',
           'if False and crc != files[name]["crc32"]:',
           ("tests/test_resume_verify.py",)),
    Mutant("newton_schulz_coefficient", "Muon's first Newton-Schulz coefficient off by 1e-3",
           "lingua/optim/muon.py",
           "NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)",
           "NS_COEFFICIENTS = (DEFAULT_A + 1e-3, DEFAULT_B, DEFAULT_C)",
           ("tests/test_muon.py::test_one_process_equals_torch_muon_plus_adamw",)),
    Mutant("ep_permutation_off_by_one", "expert-parallel rows regrouped one place off",
           "lingua/parallel/expert_parallel.py",
           "perm = torch.argsort(row_keys, stable=True)",
           "perm = torch.argsort(row_keys, stable=True).roll(1)",
           ("tests/test_expert_parallel.py::test_ep_matches_single_process",)),
    Mutant("ep_permutation_off_by_one_float8", "the same, float8 MoE",
           "lingua/parallel/expert_parallel.py",
           "perm = torch.argsort(row_keys, stable=True)",
           "perm = torch.argsort(row_keys, stable=True).roll(1)",
           (f"{F8_MOE}[ep2]",)),
    Mutant("hook_request_ignored", "the loop ignores a hook's Request to skip data batches (a "
           "rollback's range would be trained on again)",
           "lingua/train/loop.py",
           "for _ in range(0 if self.rerun is not None else request.skip_batches):",
           "for _ in range(0):",
           ("tests/test_spikes.py::test_rollback_reloads_and_skips_the_batches_around_the_spike",)),
    Mutant("spike_window_off_by_one", "a spike judged one step before its window is full",
           "lingua/optim/spikes.py",
           "        if len(window) < window.maxlen:",
           "        if len(window) < window.maxlen - 1:",
           ("tests/test_spikes.py::test_median_rule_waits_for_a_full_window_and_keeps_skipped_"
            "values_out",)),
    Mutant("float8_grouped_wgrad_scales", "float8 experts' weight-gradient scales over all tokens,"
           " not the expert's own", "lingua/float8/moe.py",
           "grad_w[e] = _quantized(x[rows], 0).T @ _quantized(grad[rows], 0)",
           "grad_w[e] = _quantized(x, 0)[rows].T @ _quantized(grad, 0)[rows]",
           ("tests/test_float8_moe.py::test_emulated_grouped_matmul_equals_hand_quantized_"
            "matmuls",)),
    Mutant("moe_counts_not_global", "MoE balancing on each rank's own token counts",
           "lingua/parallel/expert_parallel.py",
           '        return all_reduce_sum(t, env, dims=("dp_cp",))',
           "        return t",
           ("tests/test_moe_train.py::test_moe_layouts_match_one_process[fsdp2]",)),
    Mutant("expert_bias_sign", "the aux-loss-free bias pushed towards the loaded experts",
           "lingua/model/moe.py",
           "torch.sign(c.mean() - c)", "torch.sign(c - c.mean())",
           ("tests/test_moe.py::test_expert_bias_update_formula_and_count_accumulation",)),
    Mutant("mla_rope_key_grad_not_summed", "MLA's shared rope key left out of the TP plan: wkv_a "
           "gets only this rank's heads' gradient", "apps/deepseek/parallelize.py",
           '        "attention.shared_key": SumGradOverTP(),\n', "",
           ("tests/test_deepseek.py::test_layout_matches_one_process[tp2]",)),
    Mutant("qk_norm_grad_not_summed", "Qwen3's QK-norms marked computed whole under TP (the "
           "coverage check accepts them): q_norm / k_norm get only this rank's heads' gradient",
           "lingua/models/llama/parallelize.py",
           "SequenceParallel(sequence_dim=2, use_local_output=True)",
           '__import__("lingua.parallel.tensor_parallel", fromlist=["ComputedWhole"])'
           ".ComputedWhole()",
           ("tests/test_qwen_layouts.py::test_qwen3_shape_matches_one_process[tp2]",)),
    Mutant("gated_norm_grad_not_summed", "Qwen3-Next's gated output norm (one weight for all "
           "value heads) marked computed whole under TP (the coverage check accepts it): it gets "
           "only this rank's heads' gradient", "apps/qwen3_next/parallelize.py",
           '"linear_attention.norm": _per_head_norm(),',
           '"linear_attention.norm": __import__("lingua.parallel.tensor_parallel", '
           'fromlist=["ComputedWhole"]).ComputedWhole(),',
           ("tests/test_qwen3_next_layouts.py::test_layout_matches_one_process[tp2]",)),
    Mutant("group_limit_ignored", "group-limited routing falls back to plain top-k",
           "lingua/model/moe.py",
           "        if self.topk_groups < self.n_groups:", "        if False:",
           ("tests/test_deepseek.py::test_logits_equal_transformers_both_ways",)),
    Mutant("qwen3_moe_norm_topk_ignored", "a Qwen3-MoE directory's norm_topk_prob not read: its "
           "top-k weights are not renormalised", "apps/moe/hf.py",
           '"norm_topk": bool(cfg.get("norm_topk_prob", False)),',
           '"norm_topk": kind == "qwen2_moe" and bool(cfg.get("norm_topk_prob", False)),',
           ("tests/test_moe_hf.py::test_qwen3_moe_to_ours_and_back",)),
    Mutant("router_combine_detached", "the router learns nothing: its combine weights carry no "
           "gradient (training from a Qwen3-MoE directory against transformers + AdamW)",
           "lingua/model/moe.py",
           "weights = scores.gather(-1, experts)", "weights = scores.detach().gather(-1, experts)",
           ("tests/test_moe_hf.py::test_continued_pretraining_from_a_qwen3_moe_directory",)),
    Mutant("centred_norm_plus_one_dropped", "Qwen3-Next's zero-centred RMSNorm applies its "
           "stored weight w instead of 1 + w", "apps/qwen3_next/model.py",
           "(xf * (1.0 + self.weight.float()))", "(xf * self.weight.float())",
           ("tests/test_qwen3_next.py::test_logits_equal_transformers_both_ways",)),
    Mutant("qkvz_read_ungrouped", "transformers' in_proj_qkvz (and in_proj_ba) read as one block "
           "per projection instead of per key-head group", "apps/qwen3_next/hf.py",
           "split = t.reshape(args.linear_key_heads, sum(rows), t.shape[-1]).split(rows, dim=1)",
           "split = t.split([r * args.linear_key_heads for r in rows])",
           ("tests/test_qwen3_next.py::test_logits_equal_transformers_both_ways",)),
]


def copy_tree(dest: Path) -> None:
    """What git tracks and what it does not ignore, as the working tree has it now."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def run_tests(tree: Path, tests, log: Path) -> tuple:
    """(pytest's exit code, the first failed test or '', seconds)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("WORLD_SIZE", None)
    start = time.perf_counter()
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                             "-o", "addopts=-ra", *tests], cwd=tree, env=env, stdout=out,
                            stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", log.read_text(), re.M)
    return rc, failed.group(1) if failed else "", seconds


def plant(tree: Path, m: Mutant) -> str:
    path = tree / m.path
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        sys.exit(f"mutant {m.name}: {m.path} holds its text {count} times, not once: update "
                 f"setup/mutants.py to the code as it is now.\n  text: {m.old!r}")
    path.write_text(text.replace(m.old, m.new))
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], metavar="NAME")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the copy and the logs")
    opts = parser.parse_args()
    unknown = set(opts.only) - {m.name for m in MUTANTS}
    if unknown:
        sys.exit(f"unknown mutant(s) {sorted(unknown)}; --list names them")
    chosen = [m for m in MUTANTS if not opts.only or m.name in opts.only]
    if opts.list:
        for m in chosen:
            print(f"{m.name:<34} {m.what}\n{'':<34} {m.path}; tests: {' '.join(m.tests)}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="lingua_mutants_"))
    tree, logs = work / "tree", work / "logs"
    tree.mkdir()
    logs.mkdir()
    copy_tree(tree)
    print(f"copy of the tree and logs in {work}", flush=True)
    try:
        if not opts.no_baseline:
            tests = sorted({t for m in chosen for t in m.tests})
            rc, failed, seconds = run_tests(tree, tests, logs / "baseline.log")
            print(f"unmutated: {len(tests)} selections, exit {rc}, {seconds:.0f} s", flush=True)
            if rc != 0:
                print(f"the unmutated tree fails {failed or '(see the log)'}: fix that first "
                      f"({logs / 'baseline.log'})")
                return 1
        rows = []
        for m in chosen:
            original = plant(tree, m)
            try:
                rc, failed, seconds = run_tests(tree, m.tests, logs / f"{m.name}.log")
            finally:
                (tree / m.path).write_text(original)
            verdict = failed if rc == 1 and failed else (
                "SURVIVED" if rc == 0 else f"ERROR (pytest exit {rc}, {logs / (m.name + '.log')})")
            rows.append((m, verdict, seconds))
            print(f"{m.name:<34} {verdict}  {seconds:.0f} s", flush=True)
        print("\n| bug | what | the test that failed | seconds |\n|---|---|---|---|")
        for m, verdict, seconds in rows:
            print(f"| {m.name} | {m.what} | {verdict} | {seconds:.0f} |")
        killed = sum(1 for _, v, _ in rows if not v.startswith(("SURVIVED", "ERROR")))
        print(f"\n{killed} of {len(rows)} planted bugs killed")
        return 0 if killed == len(rows) else 1
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
