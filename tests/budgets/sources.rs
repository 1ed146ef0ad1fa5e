//! The budget is the most restrictive of what is given: ours (`CUDABUDGET_LIMIT_<N>`,
//! else `CUDABUDGET_LIMIT`) and HAMi-core's (`CUDA_DEVICE_MEMORY_LIMIT_<N>`, else
//! `CUDA_DEVICE_MEMORY_LIMIT`), on every device. Platforms that force the preload set
//! HAMi's variables; a user who adds one of ours must not lift HAMi's budget anywhere.

use crate::util::{GI, budget_run};

#[test]
fn hamis_budget_holds_on_a_device_that_only_ours_leaves_out() {
    // HAMi's 1g holds on device 1 even where our budget names device 0 only.
    let run = budget_run(
        "gpa",
        &["ctx:1", "total:1", "alloc:2Gi", "alloc:1Gi", "alloc:1Mi"],
        &[
            ("FAKE_CUDA_DEVICES", "2"),
            ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
            ("CUDABUDGET_LIMIT_0", "4Gi"),
        ],
    );
    assert_eq!(run.num("total", 0, "bytes"), GI, "{}", run.dump());
    assert_eq!(
        run.rc("alloc", 0),
        2,
        "2 GiB under HAMi's 1g\n{}",
        run.dump()
    );
    assert_eq!(run.rc("alloc", 1), 0, "{}", run.dump());
    assert_eq!(run.rc("alloc", 2), 2, "{}", run.dump());
}

#[test]
fn where_both_name_a_device_the_smaller_budget_wins() {
    for (ours, hami, expected) in [("3Gi", "2048m", 2 * GI), ("1Gi", "2g", GI)] {
        let run = budget_run(
            "gpa",
            &["total:0", "ctx:1", "total:1"],
            &[
                ("FAKE_CUDA_DEVICES", "2"),
                ("CUDABUDGET_LIMIT_1", ours),
                ("CUDA_DEVICE_MEMORY_LIMIT_1", hami),
                ("CUDABUDGET_LIMIT", "6Gi"),
                ("CUDA_DEVICE_MEMORY_LIMIT", "5g"),
            ],
        );
        assert_eq!(run.num("total", 1, "bytes"), expected, "{}", run.dump());
        assert_eq!(run.num("total", 0, "bytes"), 5 * GI, "{}", run.dump());
    }
    // A percentage is resolved against the device's size, then compared.
    for (memory, expected) in [("85899345920", 8 * GI), ("214748364800", 10 * GI)] {
        let run = budget_run(
            "gpa",
            &["total:0"],
            &[
                ("FAKE_CUDA_MEM", memory),
                ("CUDABUDGET_LIMIT", "10%"),
                ("CUDA_DEVICE_MEMORY_LIMIT", "10g"),
            ],
        );
        assert_eq!(run.num("total", 0, "bytes"), expected, "{}", run.dump());
    }
}

#[test]
fn our_variables_alone_budget_as_before() {
    let run = budget_run(
        "gpa",
        &["total:0", "ctx:1", "total:1", "alloc:60Gi"],
        &[("FAKE_CUDA_DEVICES", "2"), ("CUDABUDGET_LIMIT_0", "2Gi")],
    );
    assert_eq!(run.num("total", 0, "bytes"), 2 * GI, "{}", run.dump());
    assert_eq!(run.num("total", 1, "bytes"), 80 * GI, "{}", run.dump());
    assert_eq!(run.rc("alloc", 0), 0, "device 1 is not budgeted");
}

#[test]
fn hamis_variables_alone_budget_as_before() {
    let run = budget_run(
        "gpa",
        &["total:0", "alloc:3Gi", "ctx:1", "total:1", "alloc:2Gi"],
        &[
            ("FAKE_CUDA_DEVICES", "2"),
            ("CUDA_DEVICE_MEMORY_LIMIT", "2g"),
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "3g"),
        ],
    );
    assert_eq!(run.num("total", 0, "bytes"), 2 * GI, "{}", run.dump());
    assert_eq!(run.rc("alloc", 0), 2, "{}", run.dump());
    assert_eq!(run.num("total", 1, "bytes"), 3 * GI, "{}", run.dump());
    assert_eq!(run.rc("alloc", 1), 0, "{}", run.dump());
}
