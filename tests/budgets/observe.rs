//! Observe mode (`CUDABUDGET_ON_EXCEED=warn`): an allocation past the budget is admitted
//! (the driver is called, the books charge it), and told: one line (at most one a
//! second, the rest counted), a counted overrun, an event. The views never go below
//! zero while the books hold more than the budget.

use crate::util::scripts::NVML_BLIND;
use crate::util::{GI, MI, budget_run};

const WARN: (&str, &str) = ("CUDABUDGET_ON_EXCEED", "warn");

/// The lines that say an allocation went past the budget.
fn overrun_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.contains("admitted past the budget (CUDABUDGET_ON_EXCEED=warn)"))
        .collect()
}

#[test]
fn in_warn_mode_every_allocation_path_is_admitted_past_the_budget() {
    // Each path, alone in a process, on a budget of 1 GiB that its 2 GiB would cross.
    let paths: &[(&str, &[&str])] = &[
        ("alloc", &["alloc:2Gi"]),
        ("pitch", &["pitch:1048576:2048"]),
        ("managed", &["managed:2Gi"]),
        ("create", &["create:2Gi"]),
        ("async", &["threshold:max", "async:2Gi"]),
        ("poolasync", &["poolasync:2Gi"]),
        ("poolasyncin", &["newpool", "poolasyncin:0:2Gi"]),
        ("array", &["array:16384:8192:0x20:4"]),
        (
            "launch",
            &["graph", "memnode:0:2Gi", "instantiate:0", "launch:0:null"],
        ),
        ("modload", &["modload"]),
        ("setlimit", &["setlimit:2:2147483648", "kernel"]),
    ];
    for (path, ops) in paths {
        let mut all = ops.to_vec();
        all.extend(["phys", "info"]);
        let run = budget_run(
            "gpa",
            &all,
            &[
                ("CUDABUDGET_LIMIT", "1Gi"),
                ("FAKE_CUDA_MODULE_BYTES", "2147483648"),
                WARN,
                NVML_BLIND,
            ],
        );
        assert_eq!(run.rc(path, 0), 0, "{path}: admitted\n{run:?}");
        assert!(
            run.num("phys", 0, "used") > GI,
            "{path}: the driver was called, and the device holds more than the budget\n{run:?}"
        );
        let lines = overrun_lines(&run.stderr);
        assert_eq!(lines.len(), 1, "{path}: one line\n{}", run.stderr);
        assert!(lines[0].starts_with("cudabudget: pid "), "{}", lines[0]);
        assert!(lines[0].contains("budget 1.00 GiB"), "{}", lines[0]);
        // The books hold more than the budget: the view says none is free, and the
        // card still looks like the budget.
        assert_eq!(run.num("info", 0, "free"), 0, "{path}\n{run:?}");
        assert_eq!(run.num("info", 0, "total"), GI, "{path}\n{run:?}");
    }
}

#[test]
fn in_warn_mode_the_books_charge_the_overrun_and_what_fits_is_charged_as_ever() {
    let run = budget_run(
        "gpa",
        &[
            "alloc:1Gi",
            "alloc:2Gi",
            "info",
            "nvml:0",
            "free:1",
            "info",
            "alloc:512Mi",
            "info",
        ],
        &[("CUDABUDGET_LIMIT", "2Gi"), WARN],
    );
    assert_eq!(run.rc("alloc", 1), 0, "{run:?}");
    assert_eq!(run.num("info", 0, "free"), 0, "3 GiB held of 2: none free");
    // NVML: total is the budget, free never below zero, used at most the total.
    assert_eq!(run.rc("nvml", 0), 0, "{run:?}");
    assert_eq!(run.num("nvml", 0, "total"), 2 * GI, "{run:?}");
    assert_eq!(run.num("nvml", 0, "free"), 0, "{run:?}");
    assert_eq!(run.num("nvml", 0, "used"), 2 * GI, "{run:?}");
    assert_eq!(run.num("nvml", 0, "free2"), 0, "{run:?}");
    // The free gives the overrun back: the books are exact again.
    assert_eq!(run.rc("free", 0), 0);
    assert_eq!(run.num("info", 1, "free"), GI, "{run:?}");
    assert_eq!(run.rc("alloc", 2), 0);
    assert_eq!(run.num("info", 2, "free"), 512 * MI, "{run:?}");
    assert_eq!(overrun_lines(&run.stderr).len(), 1, "{}", run.stderr);
}

#[test]
fn a_loop_of_overruns_writes_one_line_a_second_and_the_summary_counts_them_all() {
    let mut ops = vec!["alloc:1Gi"];
    ops.extend(std::iter::repeat_n("alloc:1Mi", 50));
    let started = std::time::Instant::now();
    let run = budget_run(
        "gpa",
        &ops,
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_LOG", "info"),
            WARN,
        ],
    );
    let seconds = started.elapsed().as_secs() as usize + 1;
    assert_eq!(run.lines_of("alloc").len(), 51, "{run:?}");
    for nth in 0..51 {
        assert_eq!(run.rc("alloc", nth), 0, "{run:?}");
    }
    let lines = overrun_lines(&run.stderr);
    assert!(
        !lines.is_empty() && lines.len() <= seconds,
        "50 overruns in {seconds} s: at most a line a second\n{}",
        run.stderr
    );
    assert!(
        run.stderr
            .contains("device 0: peak 1.04 GiB of budget 1.00 GiB, 1.04 GiB in use at exit, 0 denied, 50 admitted past the budget"),
        "{}",
        run.stderr
    );
}

#[test]
fn without_warn_the_same_allocation_is_refused() {
    // Without warn the same program is refused: warn is what admits it.
    let run = budget_run("gpa", &["alloc:2Gi"], &[("CUDABUDGET_LIMIT", "1Gi")]);
    assert_eq!(run.rc("alloc", 0), 2, "{run:?}");
    assert!(overrun_lines(&run.stderr).is_empty(), "{}", run.stderr);
}
