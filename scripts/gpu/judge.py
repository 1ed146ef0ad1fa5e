"""Decide PASS/FAIL for one case of run_all.sh from the JSON of its runs.

Files: WORK/<case>.<variant>.<part>.{out,err,rc,time,partial} where variant is
native or budget and part names one process of the case ("main" for most).
PASS/FAIL is decided on the budget run; the native run's values are printed
beside it for comparison (native is expected to behave differently).

Prints one line per check to stdout:
  PASS <case>/<check> [native: ...] [budget: ...]
and appends the PASS, FAIL and SKIP lines to --results (run_all.sh counts
PASS and FAIL only); writes the full JSON and stderr extracts to --log.
A SKIP is a check the installed software cannot make: typically the native
run could not do it either (e.g. torch.compile without a working triton).
"""

import argparse
import glob
import json
import os
import re
import sys

GiB = 1 << 30
MiB = 1 << 20


def read(path, limit=None):
    try:
        with open(path, errors="replace") as f:
            s = f.read()
    except OSError:
        return None
    return s if limit is None else s[-limit:]


def last_json(text):
    if not text:
        return None
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                j = json.loads(line)
            except ValueError:
                continue
            if isinstance(j, dict):
                return j
    return None


def load_part(work, case, variant, part):
    base = os.path.join(work, "%s.%s.%s" % (case, variant, part))
    out = read(base + ".out")
    err = read(base + ".err") or ""
    rc = (read(base + ".rc") or "").strip()
    tm = (read(base + ".time") or "").strip()
    if out is None and not os.path.exists(base + ".rc"):
        return None  # this part was not run
    j = last_json(out)
    crashed = False
    if j is None:
        partial = read(base + ".partial")
        if partial:
            try:
                j = json.loads(partial)
                crashed = True
            except ValueError:
                j = None
    d = dict(j) if j else {}
    d["_json"] = j is not None
    d["_crashed"] = crashed
    d["_rc"] = int(rc) if re.fullmatch(r"-?\d+", rc or "") else rc
    d["_time"] = tm
    d["_raw"] = (out or "")[-4000:]
    lines = err.splitlines()
    d["_cb_lines"] = [l for l in lines if l.startswith("cudabudget:")][:40]
    d["_err_tail"] = lines[-15:]
    return d


def load_case(work, case):
    parts = {"native": {}, "budget": {}}
    for variant in ("native", "budget"):
        for p in sorted(glob.glob(os.path.join(work, "%s.%s.*.rc" % (case, variant)))):
            part = os.path.basename(p)[len(case) + len(variant) + 2:-3]
            d = load_part(work, case, variant, part)
            if d is not None:
                parts[variant][part] = d
    return parts


class Getter:
    """g("key") -> main part; g("part:key.sub") -> nested; None if missing."""

    def __init__(self, parts):
        self.parts = parts

    def __call__(self, path, default=None):
        part, sep, key = path.partition(":")
        if not sep:
            part, key = "main", path
        d = self.parts.get(part)
        if d is None:
            return default
        for seg in key.split("."):
            if isinstance(d, dict):
                d = d.get(seg)
            else:
                return default
        return default if d is None else d


def fmt(k, v):
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int) and abs(v) >= 64 * MiB and not k.endswith(("mib", "pid")):
        return "%.3fGiB" % (v / GiB)
    if isinstance(v, float):
        return "%.4g" % v
    if isinstance(v, list):
        return "[" + ",".join(fmt(k, x) for x in v) + "]"
    s = " ".join(str(v).split())
    return s if len(s) <= 110 else s[:107] + "..."


def show(g, keys):
    out = []
    for k in keys:
        v = g(k)
        name = k.split(":")[-1]
        out.append("%s=%s" % (name if ":" not in k else k, fmt(name, v)))
    return " ".join(out)


# ---------------------------------------------------------------- checks ----
# Each check: (name, predicate(b, n) -> True/False/None(skip), keys to show, required)
# b and n are Getters on the budget and native runs. A non-required check
# prints INFO and never fails the run.

def ok_run(part="main"):
    pre = "" if part == "main" else part + ":"

    def f(b, n):
        return bool(b(pre + "_json")) and not b(pre + "_crashed") and b(pre + "error") is None
    return ("%sran_clean" % ("" if part == "main" else part + "_"), f,
            [pre + "_rc", pre + "_crashed", pre + "error"], True)


def smi_le(budget_gib, key="smi_mib", name="smi_per_process"):
    lim = budget_gib * 1024 * 1.02

    def f(b, n):
        v = b(key)
        return v is not None and v <= lim
    return ("%s<=%.0fMiB" % (name, lim), f, [key], True)


def eq_bytes(key, gib, name=None):
    return (name or "%s==%gGiB" % (key.split(":")[-1], gib),
            lambda b, n: b(key) == int(gib * GiB), [key], True)


def is_true(key, name=None, extra=(), required=True):
    return (name or key.split(":")[-1], lambda b, n: b(key) is True, [key] + list(extra), required)


def torch_alloc_checks(gib=8):
    return [
        ok_run(),
        is_true("first_ok", extra=["first_exc"]),
        ("second_oom_is_OutOfMemoryError",
         lambda b, n: b("second_oom") is True and b("second_exc_class") == "OutOfMemoryError",
         ["second_oom", "second_exc_class", "second_exc"], True),
        eq_bytes("total", gib, "mem_get_info_total==%gGiB" % gib),
        ("free<=total", lambda b, n: b("free") is not None and b("free") <= b("total", -1), ["free", "total"], True),
        smi_le(gib),
        is_true("after_free_ok", extra=["after_exc"]),
    ]


def jax_default_checks(gib=16):
    return [
        ok_run(),
        ("bytes_limit<=%gGiB" % gib, lambda b, n: 0 < b("bytes_limit", -1) <= gib * GiB, ["bytes_limit"], True),
        is_true("compute_ok", extra=["compute_exc"]),
        smi_le(gib),
        ("bytes_limit/budget", lambda b, n: True, ["bytes_limit", "budget_gib"], False),
    ]


def jax_alloc_checks(gib=8):
    return [
        ok_run(),
        is_true("first_ok", extra=["first_exc"]),
        ("second_fails_RESOURCE_EXHAUSTED",
         lambda b, n: b("second_fail") is True and b("second_resource_exhausted") is True,
         ["second_fail", "second_exc_class", "second_exc"], True),
        smi_le(gib),
        is_true("after_free_ok", extra=["after_exc"], required=False),
        ("bytes_limit", lambda b, n: True, ["bytes_limit"], False),
    ]


def cupy_checks(gib=8):
    return [
        ok_run(),
        is_true("first_ok", extra=["first_exc"]),
        ("second_oom_is_cupy_OutOfMemoryError",
         lambda b, n: b("second_oom") is True and str(b("second_exc_class", "")).endswith("OutOfMemoryError"),
         ["second_oom", "second_exc_class", "second_exc"], True),
        eq_bytes("total", gib, "memGetInfo_total==%gGiB" % gib),
        ("free<=total", lambda b, n: b("free") is not None and b("free") <= b("total", -1), ["free", "total"], True),
        smi_le(gib),
        is_true("after_free_ok", extra=["after_exc"]),
    ]


def numba_checks(gib=2):
    return [
        ok_run(),
        is_true("first_ok", extra=["first_exc"]),
        ("second_raises_OUT_OF_MEMORY", lambda b, n: b("second_oom") is True,
         ["second_oom", "second_exc_class", "second_code", "second_exc"], True),
        eq_bytes("total", gib, "get_memory_info_total==%gGiB" % gib),
        smi_le(gib),
        is_true("after_free_ok", extra=["after_exc"], required=False),
    ]


def cuda_c_checks(gib=8):
    return [
        ("ran_clean", lambda b, n: bool(b("_json")) and b("init_ok") is True and b("error") is None,
         ["_rc", "init_ok", "error"], True),
        is_true("first_ok", extra=["first_err"]),
        ("second_cudaErrorMemoryAllocation", lambda b, n: b("second_oom") is True, ["second_err"], True),
        eq_bytes("total", gib, "cudaMemGetInfo_total==%gGiB" % gib),
        is_true("after_free_ok", extra=["after_err"]),
        is_true("async_first_ok", extra=["async_first_err"]),
        ("async_second_cudaErrorMemoryAllocation", lambda b, n: b("async_second_oom") is True,
         ["async_second_err"], True),
        is_true("async_after_free_ok", extra=["async_after_err"]),
        ("sync_malloc_after_async_free_trims_pool", lambda b, n: b("sync_after_async_ok") is True,
         ["sync_after_async_ok", "pool_reserved_after_free", "sync_after_async_err"], True),
        smi_le(gib),
    ]


def nvsmi_checks(gib=8):
    def smi_total(g):
        raw = g("smi:_raw", "")
        for line in raw.splitlines():
            line = line.strip()
            if re.fullmatch(r"\d+", line):
                return int(line)
        return None

    def v2(b, n):
        if b("nvml:nvml_v2_total") is None and b("nvml:nvml_v2_error") is not None:
            return None  # pynvml without the v2 call: skip
        return b("nvml:nvml_v2_total") == gib * GiB

    return [
        ("nvidia-smi_memory.total==%d" % (gib * 1024),
         lambda b, n: b("smi:_rc") == 0 and smi_total(b) == gib * 1024, ["smi:_rc", "smi:_raw"], True),
        ok_run("nvml"),
        is_true("nvml:nvml_match_found", "nvml_uuid_matches_cuda0", ["nvml:nvml_index", "nvml:torch_uuid"]),
        eq_bytes("nvml:nvml_total", gib, "nvmlDeviceGetMemoryInfo_total==%gGiB" % gib),
        ("nvml_used>=1GiB", lambda b, n: b("nvml:nvml_used", -1) >= GiB, ["nvml:nvml_used"], True),
        ("nvml_free+used<=total",
         lambda b, n: b("nvml:nvml_free") is not None
         and b("nvml:nvml_free") + b("nvml:nvml_used", 0) <= b("nvml:nvml_total", -1),
         ["nvml:nvml_free", "nvml:nvml_used", "nvml:nvml_total"], True),
        ("nvml_total==torch_total", lambda b, n: b("nvml:torch_total") is not None and b("nvml:nvml_total") == b("nvml:torch_total"),
         ["nvml:nvml_total", "nvml:torch_total"], True),
        ("nvmlDeviceGetMemoryInfo_v2_total==%gGiB" % gib, v2, ["nvml:nvml_v2_total", "nvml:nvml_v2_error"], True),
        ("nvml_free_vs_torch_free", lambda b, n: True, ["nvml:nvml_free", "nvml:torch_free"], False),
        smi_le(gib, "nvml:smi_mib"),
    ]


def seed_checks():
    # The figures run_all.sh chose for this card (the H200's unless it exported others).
    jax_gib = int(os.environ.get("SEED_JAX_GIB", "40"))
    torch_gib = int(os.environ.get("SEED_TORCH_GIB", "60"))
    first_gib = int(os.environ.get("SEED_FIRST_GIB", "55"))
    return [
        ok_run("jax"),
        ("jax_bytes_limit<=%dGiB" % jax_gib, lambda b, n: 0 < b("jax:bytes_limit", -1) <= jax_gib * GiB,
         ["jax:bytes_limit"], True),
        is_true("jax:compute_ok", "jax_compute_ok"),
        smi_le(jax_gib, "jax:smi_mib", "jax_smi_per_process"),
        is_true("jax:stop_seen", "jax_held_pool_while_torch_ran", ["jax:held_s"]),
        ok_run("torch"),
        is_true("torch:first_ok", "torch_%dGiB_beside_jax" % first_gib, ["torch:first_exc"]),
        smi_le(torch_gib, "torch:smi_mib", "torch_smi_per_process"),
        ("jax_smi_seen_by_torch", lambda b, n: True, ["torch:peer_smi_mib"], False),
        ("native_reproduces_problem(torch OOM natively)", lambda b, n: n("torch:first_oom") is True,
         ["torch:first_oom"], False),
    ]


def two_gpu_perdev_checks():
    return [
        ok_run(),
        ("device_count==2", lambda b, n: b("device_count") == 2, ["device_count"], True),
        eq_bytes("dev0.total", 6, "cuda0_total==6GiB"),
        is_true("dev0.first_ok", "cuda0_4GiB_ok", ["dev0.first_exc"]),
        is_true("dev0.second_oom", "cuda0_4GiB_more_OOM", ["dev0.second_exc"]),
        eq_bytes("dev1.total", 10, "cuda1_total==10GiB"),
        is_true("dev1.first_ok", "cuda1_8GiB_ok", ["dev1.first_exc"]),
        is_true("dev1.second_oom", "cuda1_4GiB_more_OOM", ["dev1.second_exc"]),
        smi_le(6, "dev0.smi_mib", "cuda0_smi"),
        smi_le(10, "dev1.smi_mib", "cuda1_smi"),
    ]


def two_gpu_visible1_checks():
    def others_real(b, n):
        ob = b("nvml_other_totals")
        if not ob:
            return False
        on = n("nvml_other_totals")
        if on:
            return sorted(ob) == sorted(on)
        return all(isinstance(x, int) and x > 64 * GiB for x in ob)

    return [
        ok_run(),
        eq_bytes("total", 5, "cuda0_total==5GiB"),
        is_true("first_ok", "4GiB_ok", ["first_exc"]),
        is_true("second_oom", "2GiB_more_OOM", ["second_exc"]),
        is_true("nvml_match_found", "nvml_uuid_matches_cuda0", ["nvml_index", "torch_uuid"]),
        eq_bytes("nvml_total", 5, "nvml_matching_gpu_total==5GiB"),
        ("nvml_other_gpu_real_total", others_real, ["nvml_other_totals"], True),
        smi_le(5),
        ("nvml_index_of_cuda0(expect 1)", lambda b, n: True, ["nvml_index"], False),
    ]


# ------------------------------------------------ "no escape, no harm" ----

def info(name, keys):
    """A line of facts only (INFO): never counted."""
    return (name, lambda b, n: True, list(keys), False)


def like_native(key, name=None, extra=()):
    """PASS when the budget run has key True. SKIP when the native run does
    not have it either: the installed software cannot do it at all."""
    def f(b, n):
        if n(key) is not True:
            return None
        return b(key) is True
    return (name or key.split(":")[-1], f, [key] + list(extra), True)


def part_clean(part):
    """The part printed its JSON, did not crash, reported no error. SKIP when
    the native run of the part failed the same way."""
    pre = "" if part == "main" else part + ":"

    def clean(g):
        return bool(g(pre + "_json")) and not g(pre + "_crashed") and g(pre + "error") is None

    def f(b, n):
        if clean(b):
            return True
        return None if not clean(n) else False
    return ("%sran_clean" % ("" if part == "main" else part + "_"), f,
            [pre + "_rc", pre + "_crashed", pre + "error"], True)


def smi_le_if_ran(budget_gib, key, name, ran_key):
    """smi_le, but SKIP when the part did not get as far natively either."""
    lim = budget_gib * 1024 * 1.02

    def f(b, n):
        v = b(key)
        if v is None and n(ran_key) is not True:
            return None
        return v is not None and v <= lim
    return ("%s<=%.0fMiB" % (name, lim), f, [key], True)


def c_clean():
    return ("ran_clean", lambda b, n: bool(b("_json")) and not b("_crashed") and b("error") is None
            and b("ran_to_end") is True,
            ["_rc", "_crashed", "error", "init_err"], True)


def torch_graph_checks(gib=8):
    def compile_ok(b, n):
        if b("compile:compile_skip") is not None:
            return None  # triton not importable: the installed software cannot compile
        if n("compile:compile_ok") is not True:
            return None  # natively it fails too (no compiler, ...): SKIP, reason beside
        return b("compile:compile_ok") is True

    return [
        part_clean("capture"),
        like_native("capture:graph_ok", "cuda_graph_capture+replay==eager",
                    ["capture:capture_exc", "capture:replay_exc", "capture:replays",
                     "capture:replay_max_abs_diff"]),
        smi_le_if_ran(gib, "capture:smi_mib", "capture_smi_per_process", "capture:capture_ok"),
        info("capture_after_graph_alloc", ["capture:after_ok", "capture:after_exc", "capture:backend"]),
        part_clean("compile"),
        ("torch.compile(reduce-overhead)==eager", compile_ok,
         ["compile:compile_ok", "compile:compile_skip", "compile:compile_skip_hint", "compile:compile_exc",
          "compile:steps_done", "compile:max_abs_diff"], True),
        smi_le_if_ran(gib, "compile:smi_mib", "compile_smi_per_process", "compile:compile_ok"),
        info("compile_details", ["compile:triton", "compile:cudagraph_skips", "compile:compile_s",
                                 "compile:first_step_s"]),
    ]


def cuda_graph_fit_checks(gib=4):
    return [
        c_clean(),
        like_native("fit_ok", "capture+upload+3_launches_ok_checksums_right",
                    ["fit_first_failed_step", "fit_first_err", "fit_checksums", "fit_expected"]),
        ("return_codes==native", lambda b, n: b("fit_rcs") is not None and b("fit_rcs") == n("fit_rcs"),
         ["fit_rcs"], True),
        ("checksums==native",
         lambda b, n: b("fit_checksums") is not None and b("fit_checksums") == n("fit_checksums"),
         ["fit_checksums"], True),
        smi_le(gib),
        info("graph_mem", ["fit_graph_mem_used", "fit_graph_mem_reserved"]),
    ]


def cuda_graph_cross_checks(gib=4):
    return [
        c_clean(),
        like_native("cap6_built_ok", "captured_6GiB_graph_instantiates",
                    ["cap6_first_failed_step", "cap6_first_err"]),
        ("captured_6GiB_upload_cudaErrorMemoryAllocation", lambda b, n: b("cap6_upload_oom") is True,
         ["cap6_upload_err"], True),
        ("captured_6GiB_launch_cudaErrorMemoryAllocation", lambda b, n: b("cap6_launch_oom") is True,
         ["cap6_launch_err"], True),
        like_native("node6_built_ok", "node_built_6GiB_graph_instantiates",
                    ["node6_first_failed_step", "node6_first_err"]),
        ("node_6GiB_upload_cudaErrorMemoryAllocation", lambda b, n: b("node6_upload_oom") is True,
         ["node6_upload_err"], True),
        ("node_6GiB_launch_cudaErrorMemoryAllocation", lambda b, n: b("node6_launch_oom") is True,
         ["node6_launch_err"], True),
        like_native("after1_ok", "1GiB_graph_after_denials_ok",
                    ["after1_first_failed_step", "after1_first_err", "after1_checksums", "after1_expected"]),
        smi_le(gib),
        info("native_ran_the_6GiB_graphs", ["cap6_ok", "node6_ok", "cap6_graph_mem_reserved",
                                            "node6_graph_mem_reserved"]),
    ]


def cuda_async_impossible_checks(gib=4):
    def fails_as_native(failed, err):
        def f(b, n):
            if b(failed) is not True:
                return False
            return b(err) == n(err) or str(b(err)).startswith("cudaErrorMemoryAllocation")
        return f

    return [
        c_clean(),
        ("cudaMallocAsync(SIZE_MAX)_fails", fails_as_native("huge_max_failed", "huge_max_err"),
         ["huge_max_failed", "huge_max_err"], True),
        ("cudaMallocAsync(2^62)_fails", fails_as_native("huge_2p62_failed", "huge_2p62_err"),
         ["huge_2p62_failed", "huge_2p62_err"], True),
        ("4x3GiB_without_free==ok,oom,oom,oom", lambda b, n: b("async3_pattern") == "ok,oom,oom,oom",
         ["async3_pattern"], True),
        eq_bytes("total", gib, "cudaMemGetInfo_total==%gGiB" % gib),
        like_native("after_free_3GiB_ok", extra=["after_free_3GiB_err"]),
        smi_le(gib),
    ]


def cuda_primary_reset_checks(gib=4):
    return [
        ("ran_clean", lambda b, n: bool(b("_json")) and not b("_crashed") and b("error") is None
         and b("ctx_ok") is True, ["_rc", "_crashed", "error", "ctx_create"], True),
        like_native("first_ok", "2.5GiB_in_created_context_ok", ["first_err"]),
        ("cuDevicePrimaryCtxReset_rc==native", lambda b, n: b("primary_reset") is not None
         and b("primary_reset") == n("primary_reset"), ["primary_reset", "primary_active_before_reset"], True),
        ("2.5GiB_more_after_primary_reset_OUT_OF_MEMORY", lambda b, n: b("second_oom") is True,
         ["second_err", "free_after_reset", "total_after_reset"], True),
        like_native("first_still_usable", "first_block_still_usable", ["first_memset"]),
        smi_le(gib),
    ]


def two_gpu_stream_checks(gib=4):
    return [
        c_clean(),
        ("device_count>=2", lambda b, n: (b("device_count") or 0) >= 2, ["device_count"], True),
        like_native("first_ok", "3GiB_on_device1_stream_ok", ["first_err"]),
        ("3GiB_more_on_device1_stream_cudaErrorMemoryAllocation", lambda b, n: b("second_oom") is True,
         ["second_err"], True),
        like_native("dev0_3GiB_ok", "device0_3GiB_after_ok", ["dev0_3GiB_err"]),
        smi_le(gib, "smi1_mib", "device1_smi"),
        smi_le(gib, "smi0_mib", "device0_smi"),
        info("where(expect first_ptr_device=1, current_device=0)",
             ["first_ptr_device", "current_device", "dev0_total", "dev1_total"]),
    ]


def dataloader_fork_checks(gib=8):
    def wall_lt(limit):
        def f(b, n):
            try:
                return float(b("_time") or 1e9) < limit
            except ValueError:
                return False
        return f

    return [
        ok_run(),
        is_true("hold_ok", extra=["hold_exc"]),
        ("all_batches_arrived", lambda b, n: b("batches_ok") is True,
         ["batches_seen", "batches_expected", "epochs_done"], True),
        ("no_worker_timeout_or_death",
         lambda b, n: b("epochs") is not None and b("epochs_done") == b("epochs") and b("loader_exc") is None,
         ["epochs_done", "loader_exc_class", "loader_exc"], True),
        ("denied_while_forking(oom_asks_during_loader>0)", lambda b, n: (b("asks_oom_during_loader") or 0) > 0,
         ["asks_oom_during_loader", "asks_during_loader", "forks"], True),
        ("asker_saw_only_OutOfMemoryError", lambda b, n: b("asks_other") == 0 and b("asker_stopped") is True,
         ["asks_other", "asks_other_exc", "asker_stopped"], True),
        ("wall_time<120s", wall_lt(120), ["_time", "loader_s"], True),
        is_true("after_ok", "4GiB_after_forks_ok", ["after_exc"]),
        smi_le(gib),
        info("asks", ["asks", "asks_ok", "asks_oom"]),
    ]


def footprint_rawmodule_checks(gib=2):
    return [
        ok_run(),
        info("native_load", ["load_ok", "smi_mib"]),
        ("load_refused_OUT_OF_MEMORY", lambda b, n: b("load_ok") is False and b("load_oom") is True,
         ["load_ok", "load_oom", "load_exc"], True),
        smi_le(gib),
    ]


def footprint_heap_checks(gib=2):
    return [
        ok_run(),
        info("native_heap", ["set_heap_6GiB_ok", "kernel_malloc_3GiB_ok", "smi_mib"]),
        ("heap_6GiB_refused_OUT_OF_MEMORY",
         lambda b, n: b("set_heap_6GiB_ok") is False and b("set_heap_6GiB_oom") is True,
         ["set_heap_6GiB_ok", "set_heap_6GiB_exc", "heap_limit"], True),
        ("kernel_malloc_3GiB_fails", lambda b, n: b("kernel_malloc_3GiB_ok") is False,
         ["kernel_malloc_3GiB_ok", "kernel_ok"], True),
        smi_le(gib),
    ]


def footprint_spill_checks(gib=24, namespaced=False):
    checks = [
        ok_run(),
        info("native_spill", ["spill_ok", "after_ok", "smi_mib", "smi_mib_source"]),
        like_native("spill_ok", "spilling_kernel_runs", ["spill_exc"]),
        ("local_memory_reconciled:more_refused",
         lambda b, n: b("after_ok") is False and b("after_oom") is True,
         ["after_ok", "after_exc", "free_after_spill", "total_after_spill"], True),
        smi_le(gib),
    ]
    if namespaced:
        checks.insert(1, is_true("in_pid_namespace"))
    return checks


CASES = {
    "torch_native": torch_alloc_checks,
    "torch_expandable": torch_alloc_checks,
    "torch_async": torch_alloc_checks,
    "jax_default": jax_default_checks,
    "jax_platform": jax_alloc_checks,
    "jax_async": jax_alloc_checks,
    "cupy_default": cupy_checks,
    "cupy_async": cupy_checks,
    "numba": numba_checks,
    "cuda_c": cuda_c_checks,
    "nvsmi": nvsmi_checks,
    "seed": seed_checks,
    "two_gpu_perdev": two_gpu_perdev_checks,
    "two_gpu_visible1": two_gpu_visible1_checks,
    "torch_graph": torch_graph_checks,
    "torch_graph_async": torch_graph_checks,
    "cuda_graph_fit": cuda_graph_fit_checks,
    "cuda_graph_cross": cuda_graph_cross_checks,
    "cuda_async_impossible": cuda_async_impossible_checks,
    "cuda_primary_reset": cuda_primary_reset_checks,
    "two_gpu_stream": two_gpu_stream_checks,
    "dataloader_fork": dataloader_fork_checks,
    "footprint_rawmodule": footprint_rawmodule_checks,
    "footprint_heap": footprint_heap_checks,
    "footprint_spill": footprint_spill_checks,
    "footprint_pidns": lambda: footprint_spill_checks(namespaced=True),
    "torch_no_nvml": torch_alloc_checks,
}


def part_summary(d):
    if d is None:
        return "not run"
    smi = d.get("smi_mib")
    if smi is None and isinstance(d.get("dev0"), dict):
        smi = "%s+%s" % (d["dev0"].get("smi_mib"), d.get("dev1", {}).get("smi_mib"))
    if smi is None and ("smi0_mib" in d or "smi1_mib" in d):
        smi = "%s+%s" % (d.get("smi0_mib"), d.get("smi1_mib"))
    s = "rc=%s %ss smi=%sMiB" % (d.get("_rc"), d.get("_time") or "?", smi)
    if not d.get("_json"):
        s += " NO-JSON"
    if d.get("_crashed"):
        s += " CRASHED(partial)"
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--results", required=True)
    a = ap.parse_args()

    parts = load_case(a.work, a.case)
    b, n = Getter(parts["budget"]), Getter(parts["native"])
    lines = []
    names = sorted(set(parts["native"]) | set(parts["budget"]))
    hdr = "== %s: " % a.case + " | ".join(
        "%s%s native[%s] budget[%s]" % ("" if p == "main" else p + ": ", "", part_summary(parts["native"].get(p)),
                                         part_summary(parts["budget"].get(p)))
        for p in names)
    lines.append(hdr)

    checks = CASES.get(a.case)
    if checks is None:
        lines.append("FAIL %s/judge unknown case" % a.case)
        checks = []
    else:
        checks = checks()
    if not parts["budget"]:
        lines.append("FAIL %s/run no budget run found in %s" % (a.case, a.work))
        checks = []
    for name, pred, keys, required in checks:
        try:
            r = pred(b, n)
        except Exception as e:  # noqa: BLE001 - a missing value is a failed check
            r = False
            keys = list(keys) + ["(check raised %s: %s)" % (type(e).__name__, e)]
        if not required:
            tag = "INFO"
        elif r is None:
            tag = "SKIP"
        else:
            tag = "PASS" if r else "FAIL"
        lines.append("%s %s/%s [native: %s] [budget: %s]" % (tag, a.case, name, show(n, keys), show(b, keys)))

    # details for the log
    detail = ["", "#" * 78, hdr]
    for variant in ("native", "budget"):
        for p in names:
            d = parts[variant].get(p)
            if d is None:
                continue
            j = {k: v for k, v in d.items() if not k.startswith("_")}
            detail.append("-- %s %s/%s: rc=%s time=%ss json=%s crashed=%s" % (
                a.case, variant, p, d["_rc"], d["_time"], d["_json"], d["_crashed"]))
            detail.append("   json: " + json.dumps(j, sort_keys=True, default=str))
            if not d["_json"] and d["_raw"].strip():
                detail.append("   stdout tail:")
                detail.extend("     " + l for l in d["_raw"].splitlines()[-15:])
            if d["_cb_lines"]:
                detail.append("   cudabudget lines on stderr:")
                detail.extend("     " + l for l in d["_cb_lines"])
            bad = d["_rc"] != 0 or not d["_json"] or d.get("error")
            if bad and d["_err_tail"]:
                detail.append("   stderr tail:")
                detail.extend("     " + l for l in d["_err_tail"])
    with open(a.log, "a") as f:
        f.write("\n".join(detail + lines) + "\n")
    with open(a.results, "a") as f:
        for l in lines:
            if l.startswith(("PASS ", "FAIL ", "SKIP ")):  # SKIP is listed, never counted
                f.write(l + "\n")
    for l in lines:
        print(l)
    # On a failure, show why on the console too (short).
    if any(l.startswith("FAIL ") for l in lines):
        for p in names:
            d = parts["budget"].get(p)
            if d and (d["_rc"] != 0 or not d["_json"] or d.get("error")):
                print("   budget/%s: rc=%s error=%s" % (p, d["_rc"], fmt("error", d.get("error"))))
                for l in d["_err_tail"][-6:]:
                    print("     | " + l[:200])
    sys.stdout.flush()


if __name__ == "__main__":
    main()
