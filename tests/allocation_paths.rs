//! Stream-ordered pools, virtual memory management, arrays, NVML and the context: every
//! allocation path stays inside the budget, counted in physical terms.

mod util;

use util::{GI, MI, budget_run};

#[test]
fn stream_ordered_allocations_are_budgeted_by_the_pools_reserve() {
    for mode in ["gpa", "gpa-ptsz", "dlsym"] {
        let run = budget_run(
            mode,
            &[
                "async:5Gi",
                "async:4Gi",
                "freeasync:0",
                "async:4Gi",
                "reserve",
                "phys",
            ],
            &[("CUDABUDGET_LIMIT", "8Gi")],
        );
        assert_eq!(run.rc("async", 0), 0, "{mode}\n{run:?}");
        assert_eq!(run.rc("async", 1), 2, "{mode}: 5 + 4 > 8\n{run:?}");
        assert_eq!(
            run.rc("async", 2),
            0,
            "{mode}: the freed block is reused\n{run:?}"
        );
        assert!(run.num("phys", 0, "peak") <= 8 * GI, "{mode}");
    }
}

#[test]
fn stream_ordered_blocks_freed_by_other_threads_give_their_credit_back() {
    // Eight threads each allocate 4000 blocks of 64 KiB (2 GiB in all, against a 1 GiB
    // budget) and hand every block to the next thread, which frees it. Blocks freed on
    // another thread than their own must be found, or their credit never comes back and
    // the budget runs out.
    for mode in ["gpa", "dlsym"] {
        let run = budget_run(
            mode,
            &[
                "threshold:max",
                "asyncrelay:8:4000:64Ki",
                "sync",
                "trim:0",
                "alloc:900Mi",
                "phys",
            ],
            &[("CUDABUDGET_LIMIT", "1Gi")],
        );
        assert_eq!(run.num("asyncrelay", 0, "ok"), 32_000, "{mode}\n{run:?}");
        assert_eq!(run.num("asyncrelay", 0, "denied"), 0, "{mode}\n{run:?}");
        assert_eq!(run.num("asyncrelay", 0, "other"), 0, "{mode}\n{run:?}");
        assert_eq!(
            run.rc("alloc", 0),
            0,
            "{mode}: all blocks were freed, so 900 MiB fits\n{run:?}"
        );
        assert!(run.num("phys", 0, "peak") <= GI, "{mode}\n{run:?}");
    }
}

#[test]
fn what_a_thread_kept_for_itself_comes_back_when_it_exits() {
    // Sixteen threads each allocate 4 MiB blocks and free the previous thread's: each
    // keeps up to 8 MiB of the freed credit for its own next allocations, 64 MiB or
    // more in all. When they have exited, that credit must be the process's again, or a
    // 980 MiB allocation (992 MiB of pool growth) no longer fits in 1 GiB.
    for mode in ["gpa", "dlsym"] {
        let run = budget_run(
            mode,
            &["threshold:max", "asyncrelay:16:8:4Mi", "async:980Mi"],
            &[("CUDABUDGET_LIMIT", "1Gi")],
        );
        assert_eq!(run.num("asyncrelay", 0, "ok"), 128, "{mode}\n{run:?}");
        assert_eq!(run.num("asyncrelay", 0, "denied"), 0, "{mode}\n{run:?}");
        assert_eq!(run.rc("async", 0), 0, "{mode}\n{run:?}");
    }
}

#[test]
fn credit_of_threads_whose_last_calls_come_from_exit_handlers_comes_back_too() {
    // Sixteen threads make their only CUDA calls from a pthread-key destructor, which
    // glibc runs after the thread-local destructors: each allocates and frees 4 MiB
    // stream-ordered and keeps the credit. It must still come back when the thread is
    // gone, or the 980 MiB allocation (992 MiB of pool growth) does not fit in 1 GiB.
    for mode in ["gpa", "dlsym"] {
        let run = budget_run(
            mode,
            &["threshold:max", "keydtor:16:4Mi", "async:980Mi"],
            &[("CUDABUDGET_LIMIT", "1Gi")],
        );
        assert_eq!(run.num("keydtor", 0, "ok"), 16, "{mode}\n{run:?}");
        assert_eq!(run.rc("async", 0), 0, "{mode}\n{run:?}");
    }
}

#[test]
fn allocations_from_an_explicit_pool_count_too() {
    let run = budget_run(
        "dlsym",
        &[
            "poolasync:3Gi",
            "newpool",
            "poolasyncin:0:3Gi",
            "poolasyncin:0:3Gi",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    assert_eq!(run.rc("poolasync", 0), 0);
    assert_eq!(run.rc("poolasyncin", 0), 0, "{run:?}");
    assert_eq!(run.rc("poolasyncin", 1), 2, "{run:?}");
    assert!(run.num("phys", 0, "peak") <= 8 * GI);
}

#[test]
fn a_synchronous_allocation_after_an_async_free_stays_within_the_budget_physically() {
    // PyTorch sets the release threshold to the maximum: freed blocks stay in the pool.
    let run = budget_run(
        "gpa",
        &[
            "threshold:max",
            "async:5Gi",
            "freeasync:0",
            "sync",
            "reserve",
            "alloc:4Gi",
            "reserve",
            "phys",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    assert_eq!(
        run.num("reserve", 0, "bytes"),
        5 * GI,
        "the pool kept the block\n{run:?}"
    );
    assert_eq!(
        run.rc("alloc", 0),
        0,
        "the pool is trimmed before a denial\n{run:?}"
    );
    assert_eq!(run.num("reserve", 1, "bytes"), 0);
    assert!(
        run.num("phys", 0, "peak") <= 8 * GI,
        "physical peak {}",
        run.num("phys", 0, "peak")
    );
    assert_eq!(run.num("phys", 0, "used"), 4 * GI);
    assert_eq!(run.num("info", 0, "free"), 4 * GI);
}

#[test]
fn the_pools_cached_memory_is_charged_until_it_really_goes_back() {
    let run = budget_run(
        "gpa",
        &["threshold:max", "async:5Gi", "freeasync:0", "sync", "info"],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    // The pool still holds 5 GiB of the device: the view says so.
    assert_eq!(run.num("info", 0, "free"), 3 * GI, "{run:?}");
}

#[test]
fn vmm_memory_counts_until_released_and_unmapped() {
    let run = budget_run(
        "dlsym",
        &[
            "create:4Gi",
            "map:0",
            "create:4Gi",
            "release:0",
            "create:4Gi",
            "unmap:0",
            "create:4Gi",
            "phys",
        ],
        &[("CUDABUDGET_LIMIT", "6Gi")],
    );
    assert_eq!(run.rc("create", 0), 0);
    assert_eq!(run.rc("create", 1), 2, "{run:?}");
    assert_eq!(run.rc("create", 2), 2, "released but still mapped\n{run:?}");
    assert_eq!(run.rc("create", 3), 0, "released and unmapped\n{run:?}");
    assert!(run.num("phys", 0, "peak") <= 6 * GI);
}

#[test]
fn the_driver_rejects_what_it_rejects_before_the_budget_decides() {
    // PyTorch tries a FABRIC handle first and falls back on any error but OOM.
    let run = budget_run(
        "gpa",
        &["createfabric:2Gi", "createfabric:20Gi", "create:20Gi"],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    assert_eq!(run.rc("createfabric", 0), 801, "{run:?}");
    assert_eq!(
        run.rc("createfabric", 1),
        801,
        "not supported beats out of budget\n{run:?}"
    );
    assert_eq!(run.rc("create", 0), 2);
}

#[test]
fn host_memory_from_cu_mem_create_is_not_device_memory() {
    let run = budget_run("gpa", &["createhost:16Gi"], &[("CUDABUDGET_LIMIT", "8Gi")]);
    assert_eq!(run.rc("createhost", 0), 0);
}

#[test]
fn arrays_are_charged_from_their_descriptors() {
    // 1024 x 1024 x 4 channels of float: 16 MiB each.
    let run = budget_run(
        "gpa",
        &[
            "array:1024:1024:0x20:4",
            "array:1024:1024:0x20:4",
            "destroy:0",
            "array3d:64:64:64:0x20:4",
            "mipmap:1024:1024:0:0x20:4:11",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "20Mi")],
    );
    assert_eq!(run.rc("array", 0), 0);
    assert_eq!(run.rc("array", 1), 2, "{run:?}");
    assert_eq!(run.rc("destroy", 0), 0);
    assert_eq!(run.rc("array3d", 0), 0);
    assert_eq!(run.rc("mipmap", 0), 2, "4 + 21.3 MiB > 20 MiB\n{run:?}");
    assert_eq!(run.num("info", 0, "free"), 16 * MI);
}

#[test]
fn nvml_and_cu_mem_get_info_agree() {
    let run = budget_run(
        "gpa",
        &["alloc:3Gi", "info", "nvml:0"],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    let (free, total) = (run.num("info", 0, "free"), run.num("info", 0, "total"));
    assert_eq!(run.num("nvml", 0, "total"), total, "{run:?}");
    assert_eq!(run.num("nvml", 0, "total2"), total);
    assert_eq!(run.num("nvml", 0, "used"), 3 * GI);
    assert_eq!(run.num("nvml", 0, "free"), free);
    assert_eq!(run.num("nvml", 0, "used2"), 3 * GI);
    assert!(run.num("nvml", 0, "free") + run.num("nvml", 0, "used") <= run.num("nvml", 0, "total"));
}

#[test]
fn nvml_reports_the_budget_for_the_right_physical_card() {
    let run = budget_run(
        "gpa",
        &["total:0", "nvml:1", "nvml:0"],
        &[
            ("FAKE_CUDA_DEVICES", "2"),
            ("CUDA_VISIBLE_DEVICES", "1"),
            ("CUDABUDGET_LIMIT_0", "5Gi"),
        ],
    );
    assert_eq!(run.num("total", 0, "bytes"), 5 * GI);
    assert_eq!(
        run.num("nvml", 0, "total"),
        5 * GI,
        "physical card 1 is ordinal 0\n{run:?}"
    );
    assert_eq!(
        run.num("nvml", 1, "total"),
        80 * GI,
        "card 0 is not this process's"
    );
}

#[test]
fn the_context_is_charged_when_it_is_created() {
    let run = budget_run(
        "gpa",
        &["info", "alloc:7Gi", "alloc:513Mi", "phys"],
        &[
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("FAKE_CUDA_CTX_BYTES", "536870912"),
        ],
    );
    assert_eq!(run.num("info", 0, "free"), 8 * GI - 512 * MI, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 0);
    assert_eq!(
        run.rc("alloc", 1),
        2,
        "7 GiB + 512 MiB of context is the whole budget"
    );
    assert!(run.num("phys", 0, "peak") <= 8 * GI);
}

#[test]
fn an_allocation_right_after_the_context_waits_for_its_charge_on_every_path() {
    // NVML is slow to start: the context exists before it can be measured. The first
    // allocation must not pass as if the context took nothing.
    for op in ["alloc:8Gi", "create:8Gi", "async:8Gi"] {
        let run = budget_run(
            "gpa",
            &[op, "phys"],
            &[
                ("CUDABUDGET_LIMIT", "8Gi"),
                ("FAKE_CUDA_CTX_BYTES", "536870912"),
                ("FAKE_NVML_INIT_DELAY_MS", "300"),
            ],
        );
        let name = op.split(':').next().unwrap_or(op);
        assert_eq!(
            run.rc(name, 0),
            2,
            "{op}: 8 GiB + 512 MiB of context\n{run:?}"
        );
        assert!(run.num("phys", 0, "peak") <= 8 * GI, "{op}: {run:?}");
    }
}

#[test]
fn allocations_racing_the_contexts_measurement_are_not_counted_as_context() {
    // Eight threads allocate while NVML's process query (50 ms) measures the context
    // (0 B here): what they allocate meanwhile must not be charged as context memory.
    let run = budget_run(
        "gpa",
        &["race:8:2000:1Gi", "info"],
        &[
            ("CUDABUDGET_LIMIT", "10Gi"),
            ("FAKE_NVML_INIT_DELAY_MS", "5"),
            ("FAKE_NVML_PROC_DELAY_MS", "50"),
        ],
    );
    assert_eq!(run.num("race", 0, "ok"), 16_000, "{run:?}");
    assert_eq!(run.num("race", 0, "denied"), 0, "{run:?}");
    assert_eq!(run.num("info", 0, "free"), 10 * GI, "{run:?}");
}

#[test]
fn in_a_pid_namespace_the_context_is_the_devices_growth_across_its_creation() {
    // NVML lists host pids in a PID namespace, so it never finds this process: the
    // context is measured from the device's use before and after it. (The first context
    // goes and a new one is made once NVML is surely up.)
    let run = budget_run(
        "gpa",
        &[
            "ctxreset:0",
            "sleep:200",
            "ctx:0",
            "info",
            "alloc:7Gi",
            "alloc:513Mi",
        ],
        &[
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("FAKE_CUDA_CTX_BYTES", "536870912"),
            ("FAKE_NVML_PID_OFFSET", "100000"),
        ],
    );
    assert_eq!(run.rc("ctx", 0), 0, "{run:?}");
    assert_eq!(run.num("info", 0, "free"), 8 * GI - 512 * MI, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 0);
    assert_eq!(run.rc("alloc", 1), 2, "{run:?}");
}

/// `cmd` run as PID 1 of a new PID namespace (`unshare -Urpf --mount-proc`), or `None`
/// where this machine cannot make one.
fn in_new_pid_namespace(cmd: &std::process::Command) -> Option<std::process::Command> {
    let probe = std::process::Command::new("unshare")
        .args(["-Urpf", "--mount-proc", "true"])
        .output()
        .ok()?;
    if !probe.status.success() {
        return None;
    }
    let mut wrapped = std::process::Command::new("unshare");
    wrapped
        .args(["-Urpf", "--mount-proc"])
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (key, value) in cmd.get_envs() {
        match value {
            Some(v) => wrapped.env(key, v),
            None => wrapped.env_remove(key),
        };
    }
    Some(wrapped)
}

#[test]
fn in_a_real_pid_namespace_the_first_context_waits_for_nvml_to_measure_it() {
    // A real PID namespace, and NVML reporting host pids (the offset): the library must
    // read the device's use before the context, even though NVML starts slowly.
    let cmd = util::client_command(
        "gpa",
        &["info", "alloc:7Gi", "alloc:513Mi"],
        &[
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("FAKE_CUDA_CTX_BYTES", "536870912"),
            ("FAKE_NVML_PID_OFFSET", "100000"),
            ("FAKE_NVML_INIT_DELAY_MS", "100"),
        ],
        Some(&util::lib_path()),
    );
    let Some(cmd) = in_new_pid_namespace(&cmd) else {
        eprintln!("skipped: this machine cannot create a PID namespace (unshare -Urpf)");
        return;
    };
    let run = util::run(cmd);
    assert_eq!(run.num("info", 0, "free"), 8 * GI - 512 * MI, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 2, "{run:?}");
}

#[test]
fn when_the_last_context_goes_its_memory_leaves_the_books() {
    let run = budget_run(
        "gpa",
        &["alloc:5Gi", "ctxreset:0", "ctx:0", "info", "alloc:6Gi"],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    assert_eq!(run.rc("ctxreset", 0), 0, "{run:?}");
    assert_eq!(run.num("info", 0, "free"), 8 * GI, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 0);
}

#[test]
fn in_a_real_pid_namespace_memory_no_call_names_is_reconciled_within_a_second() {
    // NVML lists the process under a pid it cannot know (as host pids in a container):
    // the pid that appears with the first context is taken as its own, so the footprint
    // re-read finds the 300 MiB a kernel launch grew (local memory), as on the host.
    let cmd = util::client_command(
        "gpa",
        &["info", "kernel", "sleep:1100", "alloc:1Mi", "info"],
        &[
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("FAKE_CUDA_CTX_BYTES", "536870912"),
            ("FAKE_CUDA_LAUNCH_LOCAL_BYTES", "314572800"),
            ("FAKE_NVML_PID_OFFSET", "100000"),
        ],
        Some(&util::lib_path()),
    );
    let Some(cmd) = in_new_pid_namespace(&cmd) else {
        eprintln!("skipped: this machine cannot create a PID namespace (unshare -Urpf)");
        return;
    };
    let run = util::run(cmd);
    assert_eq!(run.num("info", 0, "free"), 8 * GI - 512 * MI, "{run:?}");
    assert_eq!(run.rc("kernel", 0), 0, "{run:?}");
    assert_eq!(
        run.num("info", 1, "free"),
        8 * GI - 512 * MI - 300 * MI - MI,
        "{run:?}"
    );
}

#[test]
fn in_a_real_pid_namespace_a_context_nvml_was_too_slow_to_measure_is_charged_the_estimate() {
    // NVML starts after the 2 s the first context waits for it: nothing measured the
    // device before the context, and NVML never lists this process (host pids). When
    // NVML comes up the context is charged CUDABUDGET_CONTEXT_MEMORY, as the README
    // says, not the nothing that the device's use minus an unknown "before" would give.
    let cmd = util::client_command(
        "gpa",
        &["sleep:2500", "info", "alloc:7Gi", "alloc:425Mi"],
        &[
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("CUDABUDGET_CONTEXT_MEMORY", "600Mi"),
            ("FAKE_CUDA_CTX_BYTES", "536870912"),
            ("FAKE_NVML_PID_OFFSET", "100000"),
            ("FAKE_NVML_INIT_DELAY_MS", "3000"),
        ],
        Some(&util::lib_path()),
    );
    let Some(cmd) = in_new_pid_namespace(&cmd) else {
        eprintln!("skipped: this machine cannot create a PID namespace (unshare -Urpf)");
        return;
    };
    let run = util::run(cmd);
    assert_eq!(run.num("info", 0, "free"), 8 * GI - 600 * MI, "{run:?}");
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 2, "{run:?}");
}
