//! The crate's top-level modules form layers: the graph of which module names which, read from
//! the sources' `crate::` and `super::` paths, has no cycle, and `sys` (the FFI) names nothing
//! but the bottom layer's plain types. A cycle fails with its modules and the files that close
//! it, so the layering stays as the architecture describes it (see `src/lib.rs`).
//!
//! A module and its children count as one node (`link` is `link/*`); comments, strings and
//! character literals are skipped, since only code makes one module depend on another.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The bottom layer: plain data and error types, which name nothing above themselves. `sys`
/// may name these and nothing else of the crate.
const BOTTOM: &[&str] = &["control", "error", "events", "gpu_path", "qp"];

/// Module -> module it names -> files naming it.
type Graph = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

#[test]
fn top_level_modules_form_no_cycle() {
    let graph = graph();
    if let Some(cycle) = find_cycle(&graph) {
        let steps: Vec<String> = cycle
            .windows(2)
            .map(|w| format!("{} -> {} (in {:?})", w[0], w[1], graph[&w[0]][&w[1]]))
            .collect();
        panic!(
            "the top-level modules of psnet-verbs form a cycle: {}\n{}",
            cycle.join(" -> "),
            steps.join("\n")
        );
    }
}

#[test]
fn sys_and_the_bottom_layer_name_only_the_bottom_layer() {
    let graph = graph();
    for module in BOTTOM.iter().chain(&["sys"]) {
        for (used, files) in graph.get(*module).into_iter().flatten() {
            assert!(
                BOTTOM.contains(&used.as_str()),
                "{module} names {used} (in {files:?}), which is above the bottom layer {BOTTOM:?}"
            );
        }
    }
}

#[test]
fn the_reader_sees_paths_in_code_only() {
    let src = "use crate::a::B;\nuse crate::{b, c::D};\n// crate::x\n/* crate::y */\n\
               let s = \"crate::z\"; let c = '{';\nmod tests { use super::*; fn f() { super::q(); } }\n\
               fn g<'a>() { super::p::f(); }";
    let mut named = BTreeSet::new();
    named_modules(src, 1, &mut named);
    let expected: BTreeSet<String> = ["a", "b", "c", "p"].iter().map(|s| s.to_string()).collect();
    assert_eq!(named, expected);
}

/// The graph of the crate's top-level modules (`lib.rs` itself only declares and re-exports).
fn graph() -> Graph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let modules: BTreeSet<String> = files
        .iter()
        .map(|f| f.strip_prefix(&src).unwrap().iter().next().unwrap())
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .filter(|m| m != "lib")
        .collect();
    let reexports = root_reexports(&fs::read_to_string(src.join("lib.rs")).unwrap());
    let mut graph = Graph::new();
    for file in files {
        let rel = file.strip_prefix(&src).unwrap();
        let parts: Vec<String> = rel
            .iter()
            .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
            .collect();
        if parts == ["lib"] {
            continue;
        }
        // How deep the file's module is below the crate root: `a.rs` and `a/mod.rs` are 1.
        let depth = parts.len() - usize::from(parts.last().unwrap() == "mod");
        let node = parts[0].clone();
        let text = fs::read_to_string(&file).unwrap();
        let mut named = BTreeSet::new();
        named_modules(&text, depth, &mut named);
        let edges = graph.entry(node.clone()).or_default();
        // `crate::VerbsError` names the module that defines it; names that are neither a
        // module nor a root re-export (`$crate::` in a macro naming an item) are not edges.
        let used = named
            .into_iter()
            .filter_map(|n| reexports.get(&n).cloned().or(Some(n)))
            .filter(|m| modules.contains(m) && *m != node);
        for used in used {
            edges
                .entry(used)
                .or_default()
                .insert(rel.display().to_string());
        }
    }
    graph
}

/// The names `lib.rs` re-exports (`pub use module::{A, B};`), each with its module.
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let tokens = tokens(lib);
    let mut out = BTreeMap::new();
    for (i, t) in tokens.iter().enumerate() {
        if t != "use" {
            continue;
        }
        let Some(module) = tokens.get(i + 1) else {
            continue;
        };
        let end = tokens[i..]
            .iter()
            .position(|t| t == ";")
            .map_or(tokens.len(), |e| i + e);
        for j in i + 2..end {
            if is_ident(&tokens[j]) && matches!(tokens[j + 1].as_str(), "," | "}" | ";") {
                out.insert(tokens[j].clone(), module.clone());
            }
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level modules that `src` (a file whose module is `depth` below the crate root)
/// names through `crate::` or `super::` paths.
fn named_modules(src: &str, depth: usize, out: &mut BTreeSet<String>) {
    let tokens = tokens(src);
    // Braces open, each marked with whether it opened an inline `mod`.
    let mut braces: Vec<bool> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let t = tokens[i].as_str();
        match t {
            "{" => braces.push(i >= 2 && tokens[i - 2] == "mod"),
            "}" => {
                braces.pop();
            }
            "crate" if next_is_path(&tokens, i) => names_after(&tokens, i + 2, out),
            "super" if next_is_path(&tokens, i) && (i == 0 || tokens[i - 1] != "::") => {
                // Climb one module per `super`; at the crate root the next segment is a
                // top-level module.
                let mut level = depth + braces.iter().filter(|m| **m).count();
                let mut j = i;
                while tokens.get(j).map(String::as_str) == Some("super") && next_is_path(&tokens, j)
                {
                    level = level.saturating_sub(1);
                    j += 2;
                }
                if level == 0 {
                    names_after(&tokens, j, out);
                }
            }
            _ => {}
        }
        i += 1;
    }
}

fn next_is_path(tokens: &[String], i: usize) -> bool {
    tokens.get(i + 1).map(String::as_str) == Some("::")
}

/// The module named at `tokens[i]`, or each first segment of a `{ a, b::c }` group there.
fn names_after(tokens: &[String], i: usize, out: &mut BTreeSet<String>) {
    match tokens.get(i).map(String::as_str) {
        Some("{") => {
            let mut level = 0;
            let mut expect_name = true;
            for t in &tokens[i..] {
                match t.as_str() {
                    "{" => {
                        level += 1;
                        expect_name = level == 1;
                    }
                    "}" => {
                        level -= 1;
                        if level == 0 {
                            break;
                        }
                    }
                    "," => expect_name = level == 1,
                    name if expect_name && is_ident(name) => {
                        out.insert(name.to_string());
                        expect_name = false;
                    }
                    _ => expect_name = false,
                }
            }
        }
        Some(name) if is_ident(name) && name != "self" => {
            out.insert(name.to_string());
        }
        _ => {}
    }
}

fn is_ident(t: &str) -> bool {
    t.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
}

/// Identifiers, `::` and single punctuation, with comments, strings and characters left out.
fn tokens(src: &str) -> Vec<String> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if src[i..].starts_with("//") {
            i += src[i..].find('\n').unwrap_or(src.len() - i);
        } else if src[i..].starts_with("/*") {
            i += src[i..].find("*/").map_or(src.len() - i, |e| e + 2);
        } else if c == b'r' && (src[i + 1..].starts_with('"') || src[i + 1..].starts_with("#\"")) {
            // A raw string: r"..." or r#"..."# (more hashes are not used in this crate).
            let hashes = src[i + 1..].bytes().take_while(|&h| h == b'#').count();
            let close = format!("\"{}", "#".repeat(hashes));
            let body = i + 2 + hashes;
            i = body
                + src[body..]
                    .find(&close)
                    .map_or(src.len() - body, |e| e + close.len());
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c == b'\'' {
            // A character literal ('x', '\n', '\u{..}'), else a lifetime's quote.
            match src[i + 1..].char_indices().nth(1) {
                _ if b.get(i + 1) == Some(&b'\\') => {
                    i += 2 + src[i + 2..].find('\'').map_or(0, |e| e + 1);
                }
                Some((at, '\'')) => i += 1 + at + 1,
                _ => i += 1,
            }
        } else if c.is_ascii_alphanumeric() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push(src[start..i].to_string());
        } else if src[i..].starts_with("::") {
            out.push("::".to_string());
            i += 2;
        } else {
            if !c.is_ascii_whitespace() {
                out.push((c as char).to_string());
            }
            i += src[i..].chars().next().map_or(1, char::len_utf8);
        }
    }
    out
}

/// A cycle of `graph` as its modules, the first repeated at the end, if there is one.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        graph: &Graph,
        node: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flat_map(|e| e.keys()) {
            if let Some(cycle) = visit(graph, next, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(graph, node, &mut Vec::new(), &mut done))
}
