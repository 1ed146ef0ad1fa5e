//! No escape, no harm: each way a program once got past its budget (or was broken by
//! the library) is tried here, against the fake driver, and must no longer work.

mod util;

use util::{GI, MI, budget_run};

/// An allocation no budget could hold fails in the driver; it must not leave credit
/// behind that later allocations spend (it once gave back credit it never took).
#[test]
fn an_impossible_stream_ordered_request_leaves_the_budget_whole() {
    for huge in [
        "0xffffffffffffffff",
        "0x4000000000000000",
        "0x3fffffffffffffff",
    ] {
        for op in ["async", "poolasync"] {
            let mut ops = vec![format!("{op}:{huge}"), format!("{op}:{huge}")];
            ops.extend((0..10).map(|_| format!("{op}:1Gi")));
            ops.push("phys".to_string());
            let ops: Vec<&str> = ops.iter().map(String::as_str).collect();
            let run = budget_run("gpa", &ops, &[("CUDABUDGET_LIMIT", "1Gi")]);
            assert_eq!(run.rc(op, 0), 2, "{op}:{huge}\n{run:?}");
            assert_eq!(run.rc(op, 2), 0, "the first 1 GiB fits\n{run:?}");
            for nth in 3..12 {
                assert_eq!(
                    run.rc(op, nth),
                    2,
                    "{op}:{huge}: #{nth} must be refused\n{run:?}"
                );
            }
            assert!(
                run.num("phys", 0, "peak") <= GI,
                "{op}:{huge}: the device held {} MiB\n{run:?}",
                run.num("phys", 0, "peak") / MI
            );
        }
    }
}
