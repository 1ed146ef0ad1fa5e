//! A budget holds on every way a program reaches the driver, and gives back what is freed.

use crate::util::{GI, MI, budget_run, client};

const MODES: [&str; 5] = ["gpa", "gpa-ptsz", "gpa-legacy", "dlsym", "linked"];

#[test]
fn a_budget_refuses_the_allocation_that_would_cross_it_and_frees_make_room_again() {
    for mode in MODES {
        let run = budget_run(
            mode,
            &[
                "alloc:5Gi",
                "alloc:4Gi",
                "info",
                "free:0",
                "alloc:4Gi",
                "phys",
            ],
            &[("CUDABUDGET_LIMIT", "8Gi")],
        );
        assert_eq!(
            run.rc("alloc", 0),
            0,
            "{mode}: 5 GiB fits in 8 GiB\n{run:?}"
        );
        assert_eq!(
            run.rc("alloc", 1),
            2,
            "{mode}: 4 GiB more must be refused\n{run:?}"
        );
        assert_eq!(
            run.num("info", 0, "total"),
            8 * GI,
            "{mode}: the card looks like the budget"
        );
        assert_eq!(run.num("info", 0, "free"), 3 * GI, "{mode}");
        assert_eq!(run.rc("free", 0), 0);
        assert_eq!(
            run.rc("alloc", 2),
            0,
            "{mode}: after the free 4 GiB fits\n{run:?}"
        );
        assert_eq!(run.num("phys", 0, "used"), 4 * GI, "{mode}");
        assert!(run.num("phys", 0, "peak") <= 8 * GI, "{mode}");
    }
}

#[test]
fn without_a_budget_the_same_program_is_not_limited() {
    let run = client("gpa", &["alloc:5Gi", "alloc:4Gi", "info"], &[], true);
    assert_eq!(run.rc("alloc", 1), 0);
    assert_eq!(run.num("info", 0, "total"), 80 * GI);
    let native = client(
        "gpa",
        &["alloc:5Gi", "alloc:4Gi"],
        &[("CUDABUDGET_LIMIT", "8Gi")],
        false,
    );
    assert_eq!(native.rc("alloc", 1), 0, "no preload, no budget");
}

#[test]
fn a_denial_prints_one_line_with_the_request_the_use_and_the_budget() {
    let run = budget_run(
        "gpa",
        &["alloc:5Gi", "alloc:4Gi", "alloc:4Gi", "alloc:4Gi"],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    let lines: Vec<&str> = run
        .stderr
        .lines()
        .filter(|l| l.starts_with("cudabudget:"))
        .collect();
    assert_eq!(lines.len(), 1, "rate-limited to one line: {lines:?}");
    let line = lines[0];
    for part in ["cuMemAlloc", "4.00 GiB", "5.00 GiB", "8.00 GiB", "device 0"] {
        assert!(line.contains(part), "{part:?} missing from {line:?}");
    }
}

#[test]
fn pitched_and_managed_allocations_count_too() {
    let run = budget_run(
        "gpa",
        &[
            "pitch:1000:1048576",
            "managed:6Gi",
            "managed:2Gi",
            "free:0",
            "managed:2Gi",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    assert_eq!(run.rc("pitch", 0), 0);
    assert_eq!(run.num("pitch", 0, "pitch"), 1024);
    assert_eq!(run.rc("managed", 0), 0);
    assert_eq!(
        run.rc("managed", 1),
        2,
        "1 GiB pitched + 6 + 2 > 8\n{run:?}"
    );
    assert_eq!(run.rc("managed", 2), 0);
    assert_eq!(run.num("info", 0, "free"), 0);
}

#[test]
fn eight_racing_threads_never_hold_more_than_the_budget_and_end_at_zero() {
    for mode in ["gpa", "dlsym", "linked"] {
        let run = budget_run(
            mode,
            &["racehold:8:1Gi", "race:8:200:3Gi", "phys", "info"],
            &[("CUDABUDGET_LIMIT", "10Gi")],
        );
        assert_eq!(
            run.num("racehold", 0, "ok"),
            10,
            "{mode}: exactly ten 1 GiB blocks fit\n{run:?}"
        );
        assert!(run.num("racehold", 0, "held_max") <= 10 * GI);
        assert!(run.num("race", 0, "ok") > 0);
        assert!(
            run.num("race", 0, "denied") > 0,
            "{mode}: 8 × 3 GiB cannot all fit in 10 GiB"
        );
        assert_eq!(run.num("race", 0, "other"), 0);
        assert!(
            run.num("phys", 0, "peak") <= 10 * GI,
            "{mode}: physical peak {}",
            run.num("phys", 0, "peak")
        );
        assert_eq!(run.num("phys", 0, "used"), 0);
        assert_eq!(
            run.num("info", 0, "free"),
            10 * GI,
            "{mode}: the ledger is back at zero"
        );
    }
}

#[test]
fn a_free_of_a_pointer_the_ledger_never_saw_passes_through_and_moves_nothing() {
    let run = budget_run(
        "gpa",
        &[
            "freeptr:0xdead00000000",
            "alloc:2Gi",
            "free:0",
            "free:0",
            "info",
            "alloc:8Gi",
        ],
        &[("CUDABUDGET_LIMIT", "8Gi")],
    );
    assert_eq!(run.rc("freeptr", 0), 1, "the driver's own answer");
    assert_eq!(run.rc("free", 0), 0);
    assert_eq!(
        run.rc("free", 1),
        1,
        "a double free is the driver's business"
    );
    assert_eq!(
        run.num("info", 0, "free"),
        8 * GI,
        "no counter went below zero"
    );
    assert_eq!(run.rc("alloc", 1), 0);
}

#[test]
fn per_device_budgets_override_the_default_for_their_device() {
    let run = budget_run(
        "gpa",
        &[
            "alloc:5Gi",
            "alloc:2Gi",
            "ctx:1",
            "alloc:2Gi",
            "alloc:1Mi",
            "info",
            "total:0",
            "total:1",
        ],
        &[
            ("FAKE_CUDA_DEVICES", "2"),
            ("CUDABUDGET_LIMIT", "6Gi"),
            ("CUDABUDGET_LIMIT_1", "2Gi"),
        ],
    );
    assert_eq!(run.rc("alloc", 0), 0);
    assert_eq!(run.rc("alloc", 1), 2, "device 0 has 6 GiB\n{run:?}");
    assert_eq!(run.rc("alloc", 2), 0, "device 1 has its own 2 GiB");
    assert_eq!(run.rc("alloc", 3), 2);
    assert_eq!(run.num("info", 0, "total"), 2 * GI);
    assert_eq!(run.num("total", 0, "bytes"), 6 * GI);
    assert_eq!(run.num("total", 1, "bytes"), 2 * GI);
}

#[test]
fn a_device_without_a_budget_is_not_limited() {
    let run = budget_run(
        "gpa",
        &["alloc:3Gi", "ctx:1", "alloc:60Gi", "total:1"],
        &[("FAKE_CUDA_DEVICES", "2"), ("CUDABUDGET_LIMIT_0", "2Gi")],
    );
    assert_eq!(run.rc("alloc", 0), 2);
    assert_eq!(run.rc("alloc", 1), 0);
    assert_eq!(run.num("total", 0, "bytes"), 80 * GI);
}

#[test]
fn a_percentage_is_of_the_device_s_physical_memory() {
    let run = budget_run(
        "gpa",
        &["total:0", "alloc:8Gi", "alloc:1Mi"],
        &[("CUDABUDGET_LIMIT", "10%")],
    );
    assert_eq!(run.num("total", 0, "bytes"), 8 * GI);
    assert_eq!(run.rc("alloc", 0), 0);
    assert_eq!(run.rc("alloc", 1), 2);
}

#[test]
fn hami_variables_budget_when_no_cudabudget_variable_is_set() {
    let run = budget_run(
        "gpa",
        &["total:0", "alloc:4Gi", "alloc:1Mi"],
        &[("CUDA_DEVICE_MEMORY_LIMIT", "4096m")],
    );
    assert_eq!(run.num("total", 0, "bytes"), 4 * GI);
    assert_eq!(run.rc("alloc", 1), 2);

    let run = budget_run(
        "gpa",
        &["total:0"],
        &[
            ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
            ("CUDABUDGET_LIMIT", "6Gi"),
        ],
    );
    assert_eq!(
        run.num("total", 0, "bytes"),
        4 * GI,
        "the smaller of the two wins (tests/budgets/sources.rs)"
    );

    let run = budget_run(
        "gpa",
        &["ctx:1", "total:1", "alloc:2Gi"],
        &[
            ("FAKE_CUDA_DEVICES", "2"),
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "1g"),
        ],
    );
    assert_eq!(run.num("total", 0, "bytes"), GI);
    assert_eq!(run.rc("alloc", 0), 2);

    let run = budget_run(
        "gpa",
        &["total:0", "alloc:20Gi"],
        &[("CUDA_DEVICE_MEMORY_LIMIT", "0")],
    );
    assert_eq!(
        run.num("total", 0, "bytes"),
        80 * GI,
        "HAMi's 0 means no limit"
    );
    assert_eq!(run.rc("alloc", 0), 0);
}

#[test]
fn the_exit_summary_at_info_reports_peak_and_denials() {
    let run = budget_run(
        "gpa",
        &["alloc:5Gi", "alloc:4Gi", "alloc:512Mi"],
        &[("CUDABUDGET_LIMIT", "8Gi"), ("CUDABUDGET_LOG", "info")],
    );
    let summary = run
        .stderr
        .lines()
        .find(|l| l.contains("peak"))
        .unwrap_or_else(|| panic!("no summary in {:?}", run.stderr));
    assert!(summary.contains("5.50 GiB"), "{summary}");
    assert!(summary.contains("1 denied"), "{summary}");
    let _ = MI;
}
