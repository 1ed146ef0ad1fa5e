//! The integration tests: one binary (`cargo test --test tests`), one module per group of
//! what users rely on (docs/testing.md says what each covers). A test is named by its
//! path, `cargo test --test tests jobs::sharing::` runs a group's file, and the harness
//! runs the tests of every group on parallel threads of this one process: each test
//! keeps its files in a directory of its own ([`util::test_dir`]) and hands its settings
//! to the processes it starts, never to this process's environment.
//!
//! `tests/cudarc_client.rs` is the one other test binary (`harness = false`): it is also
//! the client program the library is preloaded into.

mod allocation_paths;
mod budgets;
mod cli;
mod fake_driver_selftest;
mod footprint;
mod fork_and_capture;
mod helm_chart;
mod install;
mod jobs;
mod live_budgets;
mod loaders;
mod monitoring;
mod pods;
mod property;
mod tenants;
mod util;
mod views;
mod webhook;

/// Every suite under `tests/` is a module of this binary (`autotests = false` in
/// Cargo.toml: a file left out would never run, and nothing would say so).
#[test]
fn every_suite_in_the_tests_directory_is_a_module_of_this_binary() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let this = std::fs::read_to_string(root.join("tests.rs")).unwrap();
    let declared: Vec<&str> = this
        .lines()
        .filter_map(|l| l.strip_prefix("mod ")?.strip_suffix(';'))
        .collect();
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&root).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_str().unwrap().to_owned();
        let suite = if path.extension().is_some_and(|e| e == "rs") {
            !["tests", "cudarc_client"].contains(&name.as_str())
        } else {
            path.join("mod.rs").is_file() || path.join("main.rs").is_file()
        };
        if suite && !declared.contains(&name.as_str()) {
            missing.push(name);
        }
    }
    assert!(
        missing.is_empty(),
        "suites that are not modules of tests/tests.rs: {missing:?}"
    );
}
