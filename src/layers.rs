//! The layering of the library's files, checked: each file imports (by `crate::` and
//! `super::` paths) only files of its own layer or of the layers below it, and the
//! imports among the files form no circle. Top to bottom: `hooks`, `lifecycle`,
//! `admit`, `tell`, `runtime`, `books`, `sys` (and `lib.rs` above them all).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

const LAYERS: &[&str] = &[
    "hooks",
    "lifecycle",
    "admit",
    "tell",
    "runtime",
    "books",
    "sys",
];

/// Every library file's module path (`admit::flow`), with its text, comments left out.
fn files(dir: &Path, module: &str, out: &mut BTreeMap<String, String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let inner = if module.is_empty() {
            name.clone()
        } else {
            format!("{module}::{name}")
        };
        if path.is_dir() && !(module.is_empty() && name == "bin") {
            files(&path, &inner, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            // A file's own tests (`mod tests` at its end) import what they test.
            let text = text.split("#[cfg(test)]\nmod tests").next().unwrap();
            let code: Vec<&str> = text
                .lines()
                .map(|l| l.split("//").next().unwrap())
                .collect();
            let key = match name.as_str() {
                "mod" => module.to_string(),
                "lib" if module.is_empty() => String::new(),
                _ => inner,
            };
            out.insert(key, code.join("\n"));
        }
    }
}

/// The files `text` (the file `module`) imports: each path after `crate::` or `super::`
/// (`{a, b::c}` groups one level deep), and each path that starts with the name of one
/// of the file's own submodules, ends at the longest prefix that is a file.
fn imports(module: &str, text: &str, known: &BTreeSet<String>) -> BTreeSet<String> {
    let parent = module.rsplit_once("::").map_or("", |(p, _)| p);
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut paths: Vec<(String, String)> = Vec::new();
    let mut starts: Vec<(String, String)> = vec![
        ("crate::".to_string(), String::new()),
        ("super::".to_string(), parent.to_string()),
    ];
    for child in known
        .iter()
        .filter_map(|k| k.strip_prefix(module)?.strip_prefix("::"))
    {
        if !child.contains("::") && !module.is_empty() {
            starts.push((format!("{child}::"), format!("{module}::{child}")));
        }
    }
    for (prefix, base) in &starts {
        for (at, _) in text.match_indices(prefix.as_str()) {
            let before = text[..at].chars().next_back();
            if before.is_some_and(|c| ident(c) || c == ':') {
                continue;
            }
            let rest = &text[at + prefix.len()..];
            let head: String = rest.chars().take_while(|&c| ident(c) || c == ':').collect();
            let group = match rest[head.len()..].strip_prefix('{') {
                Some(g) => g.split('}').next().unwrap_or("").split(',').collect(),
                None => vec![""],
            };
            for tail in group {
                let tail: String = tail
                    .trim()
                    .chars()
                    .take_while(|&c| ident(c) || c == ':')
                    .collect();
                paths.push((base.clone(), format!("{head}{tail}")));
            }
        }
    }
    let mut found = BTreeSet::new();
    for (base, path) in paths {
        let full = format!("{base}::{path}");
        let parts: Vec<&str> = full.split("::").filter(|p| !p.is_empty()).collect();
        let longest = (1..=parts.len())
            .rev()
            .map(|n| parts[..n].join("::"))
            .find(|m| known.contains(m));
        if let Some(hit) = longest.filter(|m| m != module) {
            found.insert(hit);
        }
    }
    found
}

fn layer(module: &str) -> Option<usize> {
    LAYERS
        .iter()
        .position(|l| module.split("::").next() == Some(*l))
}

#[test]
fn files_import_only_their_own_layer_or_below_and_form_no_circle() {
    let mut texts = BTreeMap::new();
    files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        "",
        &mut texts,
    );
    let known: BTreeSet<String> = texts.keys().cloned().collect();
    let graph: BTreeMap<&String, BTreeSet<String>> = texts
        .iter()
        .map(|(m, text)| (m, imports(m, text, &known)))
        .collect();
    assert!(graph.len() > 30, "{:?}", graph.keys());
    for (from, to) in &graph {
        for m in to {
            if let (Some(a), Some(b)) = (layer(from), layer(m)) {
                assert!(
                    a <= b,
                    "{from} (layer {}) imports {m} (layer {})",
                    LAYERS[a],
                    LAYERS[b]
                );
            }
        }
    }
    // Depth-first, with the path so far: a file met again on its own path closes a circle.
    fn visit<'a>(
        m: &'a str,
        graph: &'a BTreeMap<&String, BTreeSet<String>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) {
        if let Some(at) = path.iter().position(|p| *p == m) {
            panic!("import circle: {} -> {m}", path[at..].join(" -> "));
        }
        if !done.insert(m) {
            return;
        }
        path.push(m);
        for next in graph.get(&m.to_string()).into_iter().flatten() {
            visit(next, graph, path, done);
        }
        path.pop();
    }
    let mut done = BTreeSet::new();
    for m in graph.keys() {
        visit(m, &graph, &mut Vec::new(), &mut done);
    }
}
