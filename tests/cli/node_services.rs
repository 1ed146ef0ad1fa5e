//! `cudabudget exporter …` and `cudabudget webhook …`: the node services are the binary
//! `cudabudget-node`, which these two commands run with the same arguments, found beside
//! the CLI and then in `PATH`; without it, one line says how to get it.

use std::path::{Path, PathBuf};

use crate::util;
use crate::util::cli::{BIN, cli_at, cudabudget, output, stderr, stdout};
use crate::util::servers::node_bin;

/// A copy of the CLI alone in a directory of this test's own (no `cudabudget-node`
/// beside it).
fn lone_cli() -> PathBuf {
    let dir = util::test_dir().join("lone");
    std::fs::create_dir_all(&dir).unwrap();
    let cli = dir.join("cudabudget");
    std::fs::copy(BIN, &cli).unwrap();
    cli
}

/// `PATH` holding only `dir`.
fn only_in_path(dir: &Path) -> String {
    dir.to_str().unwrap().to_string()
}

#[test]
fn exporter_and_webhook_run_the_node_binary_beside_the_cli_with_the_same_arguments() {
    let node = node_bin();
    // The node binary's own refusal, word for word, and its status.
    let direct = output(&mut cli_at(
        node,
        &["exporter", "--listen", "not-an-address"],
    ));
    let passed = output(&mut cudabudget(&["exporter", "--listen", "not-an-address"]));
    assert_eq!(direct.status.code(), Some(2), "{}", stderr(&direct));
    assert_eq!(passed.status.code(), direct.status.code());
    assert_eq!(stderr(&passed), stderr(&direct));
    assert!(
        stderr(&passed).starts_with("cudabudget: --listen \"not-an-address\""),
        "{}",
        stderr(&passed)
    );
    // `--help` goes through too: the node binary's help of its subcommand.
    for service in ["exporter", "webhook"] {
        let out = output(&mut cudabudget(&[service, "--help"]));
        assert!(out.status.success(), "{service}: {}", stderr(&out));
        assert!(
            stdout(&out).contains(&format!("Usage: cudabudget-node {service}")),
            "{service}: {}",
            stdout(&out)
        );
    }
}

#[test]
fn without_the_node_binary_the_cli_says_in_one_line_how_to_get_it() {
    let cli = lone_cli();
    let empty = util::test_dir().join("empty-path");
    std::fs::create_dir_all(&empty).unwrap();
    for service in ["exporter", "webhook"] {
        let out = output(
            cli_at(&cli, &[service, "--listen", "not-an-address"])
                .env("PATH", only_in_path(&empty)),
        );
        let said = stderr(&out);
        assert_eq!(out.status.code(), Some(127), "{service}: {said}");
        assert_eq!(said.lines().count(), 1, "{service}: {said}");
        assert!(said.starts_with("cudabudget: "), "{service}: {said}");
        assert!(
            said.contains(&format!("cudabudget-node {service}")),
            "{said}"
        );
        assert!(said.contains("cargo install --path crates/node"), "{said}");
        assert!(said.contains("release archive"), "{said}");
    }
}

#[test]
fn the_node_binary_is_found_in_path_when_it_is_not_beside_the_cli() {
    let cli = lone_cli();
    let node_dir = node_bin().parent().unwrap();
    let out = output(
        cli_at(&cli, &["exporter", "--listen", "not-an-address"])
            .env("PATH", only_in_path(node_dir)),
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).starts_with("cudabudget: --listen \"not-an-address\""),
        "{}",
        stderr(&out)
    );
}
