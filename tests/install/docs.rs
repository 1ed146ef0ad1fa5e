//! The documents: every test, file and command that a README or a maintainer's document
//! cites exists, so a reader who follows one finds it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The documents a reader follows: the READMEs, docs/, BENCHMARKS and the CHANGELOG.
fn documents() -> Vec<PathBuf> {
    let root = root();
    let mut docs = vec![
        root.join("README.md"),
        root.join("deploy/README.md"),
        root.join("BENCHMARKS.md"),
        root.join("CHANGELOG.md"),
        root.join("docs/design.md"),
        root.join("docs/testing.md"),
        root.join("scripts/gpu/README.md"),
        root.join("tests/fake_driver/README.md"),
    ];
    for entry in std::fs::read_dir(root.join("deploy")).unwrap() {
        let dir = entry.unwrap().path();
        for readme in [dir.join("README.md"), dir.join("cudabudget/README.md")] {
            if readme.is_file() {
                docs.push(readme);
            }
        }
    }
    docs
}

/// What `text` quotes as code: each line of its fenced blocks, and the texts between
/// single backticks elsewhere.
fn quoted(text: &str) -> Vec<&str> {
    let mut quotes = Vec::new();
    let mut prose = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if fenced {
            quotes.push(line);
        } else {
            prose.push(line);
        }
    }
    for line in prose {
        quotes.extend(line.split('`').skip(1).step_by(2));
    }
    quotes
}

/// The integration test targets: the root package's `[[test]]`s (its Cargo.toml turns
/// autotests off) and crates/node's, found as cargo finds them.
fn test_targets() -> BTreeSet<String> {
    let mut targets = BTreeSet::new();
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let mut in_test = false;
    for line in manifest.lines() {
        if line.starts_with('[') {
            in_test = line == "[[test]]";
        } else if in_test && let Some(name) = line.strip_prefix("name = ") {
            targets.insert(name.trim_matches('"').to_owned());
        }
    }
    let node = root().join("crates/node/tests");
    for entry in std::fs::read_dir(&node).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if path.extension().is_some_and(|e| e == "rs") || path.join("main.rs").is_file() {
            targets.insert(name);
        }
    }
    targets
}

/// Whether `filter` (`cargo test --test tests FILTER`) names a module of the test binary,
/// and what follows it (`install::deploy`, `property::any_sequence`) is in that module's
/// files.
fn names_a_suite(filter: &str) -> bool {
    let tests = root().join("tests");
    let mut parts = filter.split("::").filter(|p| !p.is_empty());
    let Some(suite) = parts.next() else {
        return false;
    };
    let binary = std::fs::read_to_string(tests.join("tests.rs")).unwrap();
    if !binary.lines().any(|l| l == format!("mod {suite};")) {
        return false;
    }
    let mut sources = Vec::new();
    let file = tests.join(format!("{suite}.rs"));
    if file.is_file() {
        sources.push(std::fs::read_to_string(file).unwrap());
    }
    if let Ok(entries) = std::fs::read_dir(tests.join(suite)) {
        for entry in entries {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "rs") {
                sources.push(std::fs::read_to_string(path).unwrap());
            }
        }
    }
    parts.all(|part| {
        tests.join(suite).join(format!("{part}.rs")).is_file()
            || sources.iter().any(|s| s.contains(part))
    })
}

#[test]
fn every_test_target_the_documents_name_exists() {
    let targets = test_targets();
    let mut wrong = Vec::new();
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for quote in quoted(&text) {
            let words: Vec<&str> = quote.split_whitespace().collect();
            for (i, pair) in words.windows(2).enumerate() {
                if pair[0] != "--test" {
                    continue;
                }
                let filter = words.get(i + 2).filter(|w| !w.starts_with('-'));
                let known = targets.contains(pair[1])
                    && (pair[1] != "tests" || filter.is_none_or(|f| names_a_suite(f)));
                if !known {
                    wrong.push(format!("{}: `{quote}`", doc.display()));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "no such test target:\n{}",
        wrong.join("\n")
    );
}

/// Whether `quote` reads as a path of the repository: it starts with one of its
/// top-level directories and has no spaces, globs or placeholders.
fn repository_path(quote: &str) -> Option<&str> {
    const TOP: &[&str] = &[
        "tests/", "scripts/", "deploy/", "benches/", "crates/", "docs/", "src/", ".ci/",
    ];
    let path = quote.trim_end_matches([':', ',', '.', ')']);
    let plain = !path.contains([' ', '*', '<', '>', '{', '}', '$', '…'])
        && !path.contains("...")
        && TOP.iter().any(|top| path.starts_with(top));
    plain.then_some(path)
}

#[test]
fn every_repository_file_the_documents_cite_exists() {
    let root = root();
    let mut wrong = Vec::new();
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for quote in quoted(&text) {
            // A path, alone or as the first word of a command (`bash scripts/x.sh --y`).
            let words = quote.split_whitespace();
            for word in words {
                let Some(path) = repository_path(word) else {
                    continue;
                };
                // `file.rs:line`, `dir/file.rs` with a function after `::` are files.
                let file = path.split([':', '#']).next().unwrap_or(path);
                let relative = doc.parent().unwrap().join(file);
                if !root.join(file).exists() && !relative.exists() {
                    wrong.push(format!("{}: `{quote}`", doc.display()));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "no such file:\n{}", wrong.join("\n"));
}

#[test]
fn every_cudabudget_command_the_documents_show_exists() {
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_cudabudget"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    let node_help = std::process::Command::new(crate::util::servers::node_bin())
        .arg("--help")
        .output()
        .unwrap();
    let node_help = String::from_utf8_lossy(&node_help.stdout).into_owned();
    let names = |help: &str, command: &str| {
        help.lines()
            .any(|l| l.split_whitespace().next() == Some(command))
    };
    let mut wrong = Vec::new();
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for quote in quoted(&text) {
            // The words, each with the one before (a value of an option, as in
            // `docker compose -p cudabudget up`, is not a command).
            let words: Vec<&str> = std::iter::once("")
                .chain(quote.split_whitespace())
                .collect();
            for pair in words.windows(3) {
                if pair[0].starts_with('-') {
                    continue;
                }
                let binary = Path::new(pair[1]).file_name().and_then(|n| n.to_str());
                let command = pair[2];
                let known = match binary {
                    Some("cudabudget") => command.starts_with('-') || names(&help, command),
                    Some("cudabudget-node") => {
                        command.starts_with('-') || names(&node_help, command)
                    }
                    _ => true,
                };
                if !known && command.chars().all(|c| c.is_ascii_lowercase() || c == '-') {
                    wrong.push(format!("{}: `{quote}`", doc.display()));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "no such command:\n{}", wrong.join("\n"));
}
