"""Summarise run_bench.sh's raw outputs into a markdown table.

Reads WORK/<bench>.<variant>.<rep>.out (last JSON line of each) and prints
medians, min..max spread, delta and ratio per metric, with the targets of
issue 4 marked PASS/FAIL (reported only: run_bench.sh's exit code does not
depend on them).
"""

import argparse
import glob
import json
import os
import re
import random
import statistics
import sys


def last_json(path):
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def load(work, bench):
    """{variant: [json, ...]} in rep order."""
    out = {}
    pat = re.compile(r"^%s\.(native|budget)\.(\d+)\.out$" % re.escape(bench))
    for p in glob.glob(os.path.join(work, bench + ".*.out")):
        m = pat.match(os.path.basename(p))
        if not m:
            continue
        out.setdefault(m.group(1), []).append((int(m.group(2)), last_json(p), p))
    return {k: [(i, j, p) for i, j, p in sorted(v)] for k, v in out.items()}


def values(runs, key):
    """The runs' figures for `key`. -1 marks a figure that could not be measured; a
    difference (`*_delta_*`) may be negative."""
    signed = "_delta_" in key
    vs = []
    for _, j, _ in runs or []:
        if (j and not j.get("error") and j.get("rc") in (None, 0)
                and isinstance(j.get(key), (int, float)) and (signed or j[key] >= 0)):
            vs.append(float(j[key]))
    return vs


def fmt(v, nd=1):
    if v is None:
        return "n/a"
    if abs(v) >= 1e6:
        return "%.3g" % v
    return ("%." + str(nd) + "f") % v


def paired(runs_a, runs_b, key):
    """b - a for each rep that both variants completed (reps ran side by side)."""
    a = {i: j for i, j, _ in runs_a or [] if j and j.get("rc") in (None, 0)}
    out = []
    for i, j, _ in runs_b or []:
        if (i in a and j and j.get("rc") in (None, 0)
                and isinstance(j.get(key), (int, float)) and isinstance(a[i].get(key), (int, float))):
            out.append(float(j[key]) - float(a[i][key]))
    return out


def median_ci(*samples, reps=4000):
    """95 % bootstrap interval of the sum of the samples' medians (each resampled on its
    own, a fixed seed): how far the figure could move with other reps of the same run."""
    samples = [list(v) for v in samples]
    if any(len(v) < 3 for v in samples):
        return None
    rng = random.Random(20261201)
    sums = sorted(sum(statistics.median(rng.choices(v, k=len(v))) for v in samples)
                  for _ in range(reps))
    return sums[int(0.025 * reps)], sums[int(0.975 * reps) - 1]


def stat(vs, nd=1):
    if not vs:
        return None, "n/a"
    med = statistics.median(vs)
    return med, "%s (%s..%s, n=%d)" % (fmt(med, nd), fmt(min(vs), nd), fmt(max(vs), nd), len(vs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--header", default="")
    a = ap.parse_args()

    lines = []
    verdicts = []

    def row(metric, unit, native_vs, budget_vs, target_desc, judge, nd=1):
        n_med, n_s = stat(native_vs, nd)
        b_med, b_s = stat(budget_vs, nd)
        delta = ratio = None
        if n_med is not None and b_med is not None:
            delta = b_med - n_med
            ratio = (b_med / n_med) if n_med else None
        verdict = "n/a"
        if judge is None:
            verdict = "info"
        elif delta is not None:
            try:
                verdict = "PASS" if judge(n_med, b_med, native_vs, budget_vs) else "FAIL"
            except Exception as e:  # noqa: BLE001
                verdict = "ERR(%s)" % e
        if judge is not None:
            verdicts.append((metric, verdict))
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s |" % (
            metric, unit, n_s, b_s, fmt(delta, 2) if delta is not None else "n/a",
            ("%.4f" % ratio) if ratio is not None else "n/a", target_desc, verdict))

    def single(metric, unit, vs, target_desc, judge, nd=1, ci=None):
        """One figure per run (already a with/without comparison): its median decides.
        The 95 % interval of the median is shown beside it (`ci`: given, for a sum)."""
        med, txt = stat(vs, nd)
        ci = ci or (median_ci(vs) if len(vs) >= 3 else None)
        if ci is not None:
            txt += "; 95%% CI of the median %s..%s (width %s)" % (
                fmt(ci[0], nd), fmt(ci[1], nd), fmt(ci[1] - ci[0], nd))
        verdict = "info"
        if judge is not None:
            verdict = "n/a" if med is None else ("PASS" if judge(med) else "FAIL")
            verdicts.append((metric, verdict))
        lines.append("| %s | %s | %s | %s | %s |" % (metric, unit, txt, target_desc, verdict))

    if a.header:
        lines.append(a.header)
        lines.append("")
    # ---- driver micro-benchmarks ----
    d = load(a.work, "driver")
    lines.append("### Driver API (driver_bench, budget = LD_PRELOAD + CUDABUDGET_LIMIT=100Gi)")
    lines.append("")
    lines.append("| metric | unit | native median (min..max) | budget median (min..max) | delta | budget/native | target | verdict |")
    lines.append("|---|---|---|---|---|---|---|---|")
    nat, bud = d.get("native"), d.get("budget")

    def spread(vs):
        return (max(vs) - min(vs)) if vs else 0.0

    # Separate processes differ by more than the hooks cost (see BENCHMARKS.md): these
    # rows are for information; the in-process A/B below decides the targets.
    for key, label in (("sync_4k_ns", "cuMemAlloc+cuMemFree 4 KiB"),
                       ("sync_2m_ns", "cuMemAlloc+cuMemFree 2 MiB"),
                       ("sync_64m_ns", "cuMemAlloc+cuMemFree 64 MiB")):
        row(label, "ns/pair", values(nat, key), values(bud, key), "(info)", None)
    row("cuMemAllocAsync+cuMemFreeAsync 4 KiB, 1 thread", "ns/pair", values(nat, "async_1t_ns"),
        values(bud, "async_1t_ns"), "(info)", None, 2)
    row("async pairs, N threads (own streams)", "pairs/s", values(nat, "async_16t_pairs_per_s"),
        values(bud, "async_16t_pairs_per_s"), "(info)", None, 0)
    row("cuMemGetInfo_v2", "ns/call", values(nat, "meminfo_ns"), values(bud, "meminfo_ns"), "(info)",
        None)
    row("A/B in-process medians: async pair (driver's own | hook)", "ns/pair", values(bud, "ab_async_native_ns"),
        values(bud, "ab_async_hook_ns"), "(info)", None, 2)
    row("A/B in-process medians: sync 4 KiB pair (driver's own | hook)", "ns/pair", values(bud, "ab_sync_native_ns"),
        values(bud, "ab_sync_hook_ns"), "(info)", None)
    row("A/B in-process medians: N-thread async (driver's own | hook)", "pairs/s",
        values(bud, "ab_mt_native_pairs_per_s"), values(bud, "ab_mt_hook_pairs_per_s"), "(info)", None, 0)
    row("cuCtxGetDevice (not wrapped)", "ns/call", values(nat, "untouched_ns"), values(bud, "untouched_ns"),
        "+0 (within noise)",
        lambda n, b, nv, bv: b - n <= max(0.5, spread(nv), 0.05 * n), 3)
    lines.append("")
    # In-process A/B: in each run under the library, its hooks and the driver's own
    # functions timed in alternating blocks; each run gives the median of its paired
    # blocks. Without the library both arms are the driver's: the method's noise.
    lines.append("In-process A/B, one figure per run (median of paired blocks), median over runs:")
    lines.append("")
    lines.append("| metric | unit | median (min..max, runs) | target | verdict |")
    lines.append("|---|---|---|---|---|")
    single("async pair: hook minus driver's own", "ns/pair", values(bud, "ab_async_delta_ns"),
           "+<= 40 ns", lambda m: m <= 40.0, 2)
    single("  control, without the library", "ns/pair", values(nat, "ab_async_delta_ns"), "(noise)", None, 2)
    sync_rel = [100.0 * j["ab_sync_delta_ns"] / j["ab_sync_native_ns"] for _, j, _ in bud or []
                if j and j.get("ab_sync_native_ns", -1) > 0 and isinstance(j.get("ab_sync_delta_ns"), (int, float))]
    sync_ctl = [100.0 * j["ab_sync_delta_ns"] / j["ab_sync_native_ns"] for _, j, _ in nat or []
                if j and j.get("ab_sync_native_ns", -1) > 0 and isinstance(j.get("ab_sync_delta_ns"), (int, float))]
    single("sync 4 KiB pair: hook vs driver's own", "%", sync_rel, "within 1 %", lambda m: m <= 1.0, 2)
    single("  control, without the library", "%", sync_ctl, "(noise)", None, 2)
    single("cuMemGetInfo: hook minus driver's own", "ns/call", values(bud, "ab_meminfo_delta_ns"), "(info)", None, 2)
    single("N-thread async throughput: hook / driver's own", "ratio", values(bud, "ab_mt_ratio"),
           ">= 0.95", lambda m: m >= 0.95, 4)
    single("  control, without the library", "ratio", values(nat, "ab_mt_ratio"), "(noise)", None, 4)
    # The third arm: the driver's own functions with a calibrated pause before each call,
    # about as long as the hooks' own work. If it loses as much as the hooks, the loss
    # is what any work between a thread's driver calls costs a contended driver.
    single("N-thread async throughput: driver's own with a pause / driver's own", "ratio",
           values(bud, "ab_mt_pause_ratio") + values(nat, "ab_mt_pause_ratio"), "(info)", None, 4)
    single("  the pause, per pair", "ns", values(bud, "ab_mt_pause_ns_per_pair") + values(nat, "ab_mt_pause_ns_per_pair"),
           "(info)", None, 1)
    lines.append("")
    owners = set()
    errs = []
    for variant, runs in (("native", nat), ("budget", bud)):
        for i, j, p in runs or []:
            if not j:
                errs.append("%s rep %d: no JSON (see %s)" % (variant, i, os.path.basename(p)))
                continue
            if j.get("error") or j.get("errors"):
                errs.append("%s rep %d: %s %s" % (variant, i, j.get("error") or "", j.get("errors") or ""))
            owners.add("%s: cuMemAlloc->%s, cuMemAllocAsync->%s, cuCtxGetDevice->%s (resolve via %s)" % (
                variant, j.get("alloc_owner"), j.get("alloc_async_owner"), j.get("untouched_owner"),
                j.get("resolve")))
    for o in sorted(owners):
        lines.append("- resolved pointers, " + o)
    for e in errs:
        lines.append("- ERROR " + e)
    lines.append("")

    # ---- training step ----
    lines.append("### PyTorch training step (transformer d1024 x 6 layers, batch 32 x 512, bf16, AdamW)")
    lines.append("")
    lines.append("| allocator | native step ms | budget step ms | native/budget | GPU ms native | GPU ms budget | target | verdict |")
    lines.append("|---|---|---|---|---|---|---|---|")
    train_errors = []
    for conf in ("native", "async"):
        t = load(a.work, "train_" + conf)
        nv, bv = values(t.get("native"), "step_ms"), values(t.get("budget"), "step_ms")
        gn, gb = values(t.get("native"), "gpu_step_ms"), values(t.get("budget"), "gpu_step_ms")
        n_med, n_s = stat(nv, 3)
        b_med, b_s = stat(bv, 3)
        verdict, ratio = "n/a", None
        if n_med and b_med:
            ratio = n_med / b_med
            verdict = "PASS" if ratio >= 0.99 else "FAIL"
        verdicts.append(("train step " + conf, verdict))
        label = "caching (default)" if conf == "native" else "backend:cudaMallocAsync"
        lines.append("| %s | %s | %s | %s | %s | %s | >= 0.99 | %s |" % (
            label, n_s, b_s, ("%.4f" % ratio) if ratio else "n/a", stat(gn, 3)[1], stat(gb, 3)[1], verdict))
        for variant in ("native", "budget"):
            for i, j, p in t.get(variant) or []:
                if not j or j.get("error"):
                    train_errors.append("- ERROR train %s %s rep %d: %s" % (
                        conf, variant, i, (j or {}).get("error", "no JSON, see " + os.path.basename(p))))
    lines.append("")
    lines.extend(train_errors)
    lines.append("")

    # ---- start-up ----
    lines.append("### Start-up")
    lines.append("")
    lines.append("| what | unit | native median (min..max) | budget median (min..max) | delta | budget/native | target | verdict |")
    lines.append("|---|---|---|---|---|---|---|---|")
    s = load(a.work, "startup")
    tp = load(a.work, "torch_phases")
    py = load(a.work, "pystart")
    c = load(a.work, "cuinit")
    row("wall: python3 -c 'import torch; torch.zeros(1, device=\"cuda\")'", "ms", values(s.get("native"), "ms"),
        values(s.get("budget"), "ms"), "(info: see below)", None)
    row("  inside: import torch", "ms", values(tp.get("native"), "import_ms"),
        values(tp.get("budget"), "import_ms"), "(info)", None)
    row("  inside: first CUDA tensor", "ms", values(tp.get("native"), "cuda_ms"),
        values(tp.get("budget"), "cuda_ms"), "(info)", None)
    row("wall: python3 -c pass (loading the library)", "ms", values(py.get("native"), "ms"),
        values(py.get("budget"), "ms"), "(info)", None)
    row("ctypes: cuInit", "ms", values(c.get("native"), "cuinit_ms"), values(c.get("budget"), "cuinit_ms"),
        "(info)", None, 2)
    row("ctypes: cuDevicePrimaryCtxRetain", "ms", values(c.get("native"), "ctx_ms"),
        values(c.get("budget"), "ctx_ms"), "(info)", None, 2)
    row("ctypes: whole process, wall", "ms", values(c.get("native"), "ms"), values(c.get("budget"), "ms"),
        "(info)", None)
    lines.append("")
    # Paired by rep (each budget run beside its native one, the order alternating). The
    # wall time of the torch command, and `import torch` inside it, swing by hundreds of
    # ms between runs (file system), so the start-up verdict adds up the parts that can
    # be resolved and that the library can change: loading it (python -c pass) and the
    # first CUDA tensor (driver, context, cudart's entry points: every hook involved).
    # During `import torch` the library only answers dlsym calls for non-CUDA names,
    # which pass straight to glibc.
    lines.append("Start-up, paired differences (budget minus native, same rep), median over reps:")
    lines.append("")
    lines.append("| what | unit | median (min..max, reps) | target | verdict |")
    lines.append("|---|---|---|---|---|")
    wall = paired(s.get("native"), s.get("budget"), "ms")
    inside = paired(tp.get("native"), tp.get("budget"), "in_process_ms")
    load_cost = paired(py.get("native"), py.get("budget"), "ms")
    single("torch command, wall", "ms", wall, "(info: noisy)", None)
    single("torch command, inside the process", "ms", inside, "(info)", None, 2)
    single("  import torch", "ms", paired(tp.get("native"), tp.get("budget"), "import_ms"),
           "(info: noisy)", None, 2)
    single("  first CUDA tensor", "ms", paired(tp.get("native"), tp.get("budget"), "cuda_ms"),
           "(info)", None, 2)
    single("loading the library (python -c pass)", "ms", load_cost, "(info)", None, 2)
    cuda = paired(tp.get("native"), tp.get("budget"), "cuda_ms")
    total = []
    if cuda and load_cost:
        total = [statistics.median(cuda) + statistics.median(load_cost)]
    single("start-up added: first CUDA tensor + loading", "ms", total, "+<= 5 ms", lambda m: m <= 5.0, 2,
           ci=median_ci(cuda, load_cost) if cuda and load_cost else None)
    single("ctypes cuInit + context, inside", "ms", paired(c.get("native"), c.get("budget"), "in_process_ms"),
           "(info)", None, 2)
    lines.append("")
    for name, runs in (("startup", s), ("torch_phases", tp), ("pystart", py), ("cuinit", c)):
        for variant in ("native", "budget"):
            for i, j, p in runs.get(variant) or []:
                if not j or j.get("rc"):
                    lines.append("- ERROR %s %s rep %d: rc=%s" % (name, variant, i, (j or {}).get("rc")))
    lines.append("")
    tgt = [(m, v) for m, v in verdicts if v in ("PASS", "FAIL")]
    lines.append("Targets: %d met, %d missed%s" % (
        sum(1 for _, v in tgt if v == "PASS"), sum(1 for _, v in tgt if v == "FAIL"),
        "" if all(v == "PASS" for _, v in tgt) else " (" + ", ".join(m for m, v in tgt if v == "FAIL") + ")"))

    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    with open(a.out, "a") as f:
        f.write(text)


if __name__ == "__main__":
    main()
