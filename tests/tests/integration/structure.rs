//! The house's shape: inside each crate, the top-level modules import each
//! other without circles (a module that needs something of another's that
//! needs it back means one of them holds two ideas).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const CRATES: [&str; 6] = [
    "shared",
    "model",
    "server",
    "client",
    "client-wasm",
    "tests",
];

/// The `.rs` files under `dir` (build output and npm packages left out).
pub(crate) fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
        if path.is_dir() {
            if !path.ends_with("target") && !path.ends_with("node_modules") {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without comments and without its unit tests (a test
/// module may use anything of its crate).
fn code_of(text: &str) -> String {
    let without_tests = match text.find("#[cfg(test)]") {
        Some(at)
            if text[at..]
                .lines()
                .nth(1)
                .is_some_and(|l| l.contains("mod tests")) =>
        {
            &text[..at]
        }
        _ => text,
    };
    without_tests
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Each top-level module of a crate and the top-level modules it names
/// through `crate::`.
fn module_graph(krate: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let src = krate.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let top = |file: &Path| -> Option<String> {
        let relative = file.strip_prefix(&src).ok()?;
        let first = relative.components().next()?.as_os_str().to_str()?;
        let name = first.trim_end_matches(".rs");
        (!matches!(name, "lib" | "main" | "bin")).then(|| name.to_string())
    };
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        if let Some(module) = top(file) {
            graph.entry(module).or_default();
        }
    }
    for file in &files {
        let Some(module) = top(file) else { continue };
        let code = code_of(&std::fs::read_to_string(file).unwrap());
        for (at, _) in code.match_indices("crate::") {
            // `corolla_model::` and the like are other crates.
            if code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let name: String = code[at + "crate::".len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if name != module && graph.contains_key(&name) {
                graph.get_mut(&module).unwrap().insert(name);
            }
        }
    }
    graph
}

/// The circles of `graph`: strongly connected parts of more than one module.
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    let reaches = |from: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(m) = todo.pop() {
            for next in &graph[&m] {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let reach: BTreeMap<&String, BTreeSet<String>> =
        graph.keys().map(|m| (m, reaches(m))).collect();
    let mut found: Vec<BTreeSet<String>> = Vec::new();
    for m in graph.keys() {
        let part: BTreeSet<String> = reach[m]
            .iter()
            .filter(|other| reach[*other].contains(m))
            .cloned()
            .collect();
        if part.len() > 1 && !found.contains(&part) {
            found.push(part);
        }
    }
    found
}

#[test]
fn no_crate_has_an_import_circle_between_its_modules() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut report = Vec::new();
    for krate in CRATES {
        let graph = module_graph(&root.join(krate));
        assert!(graph.len() > 1, "{krate}: no modules found");
        for circle in circles(&graph) {
            let edges: Vec<String> = circle
                .iter()
                .map(|m| {
                    let inside: Vec<&String> =
                        graph[m].iter().filter(|n| circle.contains(*n)).collect();
                    format!("{m} -> {inside:?}")
                })
                .collect();
            report.push(format!("{krate}: {}", edges.join(", ")));
        }
    }
    assert!(report.is_empty(), "import circles:\n{}", report.join("\n"));
}

/// The check sees a circle where there is one.
#[test]
fn a_circle_is_found() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(m, to)| (m.to_string(), to.into_iter().map(String::from).collect()))
    .collect();
    let found = circles(&graph);
    assert_eq!(found.len(), 1);
    assert_eq!(
        found[0],
        ["a", "b", "c"].into_iter().map(String::from).collect()
    );
}
