//! The workspace's two structural rules, read from the code rather than trusted to review.
//!
//! The dependency rule (docs/ARCHITECTURE.md#crates-and-the-dependency-rule), read from
//! `cargo metadata`: `schema` depends on no other gpuwarden crate; `collector`, `pipeline` and
//! `enforcer` depend on `schema` only, never on one another; they meet in Kafka, not in code.
//!
//! The module order rule, read from each crate's source ([`modules`]): a crate's root file
//! declares its modules lowest layer first, and a module uses only modules declared before it
//! (or its own submodules), so no crate has an import cycle. The same holds among the
//! submodules of each module. `GPUWARDEN_PRINT_MODULE_GRAPH=1 cargo test --test workspace --
//! --nocapture module_graph` prints each crate's graph, one `a -> b` line per edge.

#[path = "workspace/modules.rs"]
mod modules;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use modules::Crate;

const ROLES: [&str; 3] = [
    "gpuwarden-collector",
    "gpuwarden-pipeline",
    "gpuwarden-enforcer",
];

/// The workspace's own packages, from `cargo metadata`.
fn metadata() -> serde_json::Value {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("runs cargo metadata");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn role_crates_never_depend_on_one_another() {
    let metadata = metadata();
    let deps: BTreeMap<String, Vec<String>> = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let names = p["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d["name"].as_str().unwrap().to_string())
                .filter(|n| n.starts_with("gpuwarden"))
                .collect();
            (p["name"].as_str().unwrap().to_string(), names)
        })
        .collect();

    for krate in [
        "gpuwarden-schema",
        "gpuwarden-collector",
        "gpuwarden-pipeline",
        "gpuwarden-enforcer",
    ] {
        assert!(
            deps.contains_key(krate),
            "{krate} is missing from the workspace: {deps:?}"
        );
    }
    assert_eq!(
        deps["gpuwarden-schema"],
        Vec::<String>::new(),
        "schema depends on no gpuwarden crate"
    );
    for role in ROLES {
        // Test tools such as gpuwarden-fake-nvml are allowed; another role is not, not even as
        // a dev-dependency.
        let roles: Vec<&String> = deps[role]
            .iter()
            .filter(|d| ROLES.contains(&d.as_str()))
            .collect();
        assert!(
            roles.is_empty(),
            "{role} depends on {roles:?}; roles meet in Kafka topics, not in code"
        );
    }
    // Only the binary may depend on the role crates.
    for (package, its_deps) in &deps {
        if package == "gpuwarden" {
            continue;
        }
        for role in ROLES {
            assert!(
                !its_deps.contains(&role.to_string()),
                "{package} depends on {role}"
            );
        }
    }
}

/// The sentence each crate root's doc says its module order with.
const ORDER_SENTENCE: &str = "Modules are declared lowest layer first";

/// Every crate of the workspace, by package name: the root file of its library or binary.
fn crates() -> Vec<(String, Crate)> {
    let mut roots = Vec::new();
    for package in metadata()["packages"].as_array().unwrap() {
        for target in package["targets"].as_array().unwrap() {
            let code = target["kind"]
                .as_array()
                .unwrap()
                .iter()
                .any(|k| matches!(k.as_str(), Some("lib" | "rlib" | "cdylib" | "bin")));
            let root = PathBuf::from(target["src_path"].as_str().unwrap());
            if code && !roots.iter().any(|(_, r)| r == &root) {
                roots.push((package["name"].as_str().unwrap().to_string(), root));
            }
        }
    }
    roots.sort();
    roots
        .into_iter()
        .map(|(name, root)| (name, Crate::read(&root)))
        .collect()
}

/// `path` from the workspace root, for messages.
fn shown(path: &Path) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    path.strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string()
}

/// A module path as the graph names it: `crate` for the root, `config`, `cmd::doctor`.
fn named(path: &[String]) -> String {
    if path.is_empty() {
        "crate".to_string()
    } else {
        path.join("::")
    }
}

/// The path of `parent`'s child `name`, as [`named`] writes it.
fn child(parent: &[String], name: &str) -> String {
    named(&[parent, &[name.to_string()]].concat())
}

/// What breaks the module order rule in `krate`, one line each: an edge pointing down the
/// declaration order, a module file the `mod` declarations do not reach (or that does not
/// exist), a module file without a `//!` first line, a root file whose doc does not say the order.
fn problems(krate: &Crate) -> Vec<String> {
    let mut out: Vec<String> = krate.errors.clone();
    for edge in krate.violations() {
        let declared_in = &krate.modules[&edge.parent].file;
        out.push(format!(
            "{}:{}: `{}` uses `{}`, which {} declares after it: a module may use only the \
             modules declared before it (lowest layer first) and its own submodules; reorder \
             the `mod` lines, or move what both need into a module declared before both",
            shown(&edge.file),
            edge.line,
            child(&edge.parent, &edge.from),
            child(&edge.parent, &edge.to),
            shown(declared_in),
        ));
    }
    for file in krate.unreached_files() {
        out.push(format!(
            "{}: no `mod` declaration reaches this file, so nothing checks it",
            shown(&file)
        ));
    }
    for module in krate.modules.values() {
        if module.first_doc_line.as_deref().unwrap_or("").is_empty() {
            out.push(format!(
                "{}:1: the file opens with no `//!` line saying what the module owns",
                shown(&module.file)
            ));
        }
    }
    let root = &krate.modules[&Vec::new()];
    let docs = std::fs::read_to_string(&root.file).unwrap();
    if root.children.len() > 1
        && !docs
            .lines()
            .any(|l| l.starts_with("//!") && l.contains(ORDER_SENTENCE))
    {
        out.push(format!(
            "{}: the crate doc does not say \"{ORDER_SENTENCE}; a module uses only modules above \
             it in this list\"",
            shown(&root.file)
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    out.retain(|p| seen.insert(p.clone()));
    out
}

#[test]
fn every_crate_declares_its_modules_lowest_layer_first() {
    let mut failures = Vec::new();
    for (name, krate) in crates() {
        for problem in problems(&krate) {
            failures.push(format!("{name}: {problem}"));
        }
    }
    assert!(
        failures.is_empty(),
        "the module order rule is broken in {} place(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Each crate's module graph, as `GPUWARDEN_PRINT_MODULE_GRAPH=1` prints it: per module with
/// submodules, their order and one `a -> b` line per edge, `a` in declaration order.
fn graph_text(name: &str, krate: &Crate) -> String {
    let mut out = format!("{name} ({})\n", shown(&krate.root));
    let graph = krate.graph();
    for (path, module) in &krate.modules {
        if module.children.len() < 2 && !graph.contains_key(path) {
            continue;
        }
        out.push_str(&format!(
            "  {} declares, lowest first: {}\n",
            named(path),
            module.children.join(", ")
        ));
        for (from, to) in graph.get(path).into_iter().flatten() {
            out.push_str(&format!("    {from} -> {to}\n"));
        }
    }
    out
}

/// The order check must see each crate's edges, not pass because it read nothing: every crate
/// shows at least a few edges between its top-level modules, including one known edge each.
#[test]
fn module_graph_of_every_crate_is_read() {
    let crates = crates();
    let known: [(&str, &[&str], &str, &str); 6] = [
        ("gpuwarden-schema", &[], "sample", "record"),
        ("gpuwarden-collector", &[], "source", "nvml"),
        ("gpuwarden-fake-nvml", &[], "ffi", "state"),
        ("gpuwarden-pipeline", &[], "rollup", "lake"),
        ("gpuwarden-enforcer", &[], "service", "store"),
        ("gpuwarden", &["cmd"], "up", "collect"),
    ];
    let print = std::env::var_os("GPUWARDEN_PRINT_MODULE_GRAPH").is_some_and(|v| v != "0");
    for (name, parent, from, to) in known {
        let (_, krate) = crates
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("{name} is missing from the workspace"));
        let parent: Vec<String> = parent.iter().map(|s| s.to_string()).collect();
        let graph = krate.graph();
        let edges = graph.get(&parent).map_or(0, |e| e.len());
        assert!(
            edges >= 4,
            "{name}: only {edges} edge(s) among the modules of {} ({} paths read); the checker \
             is not reading this crate",
            named(&parent),
            krate.paths_read
        );
        assert!(
            krate
                .edges
                .iter()
                .any(|e| e.parent == parent && e.from == from && e.to == to),
            "{name}: the checker misses the edge {from} -> {to}"
        );
    }
    for (name, krate) in &crates {
        if print {
            println!("{}", graph_text(name, krate));
        } else {
            let edges: usize = krate.graph().values().map(|e| e.len()).sum();
            println!(
                "{name}: {} modules, {edges} edges, {} paths read",
                krate.modules.len(),
                krate.paths_read
            );
        }
    }
}

/// The checker on a crate written to break the rule in every way it reads: a `use` group, a
/// path in code, `super::` from a top-level file, a re-export, a glob import, test code, and
/// between submodules; and not fooled by the same text in comments and string literals.
#[test]
fn module_order_check_finds_each_kind_of_edge_pointing_down() {
    let dir = tempfile::tempdir().unwrap();
    let files: &[(&str, &str)] = &[
        (
            "lib.rs",
            "//! A crate that breaks the module order rule.\n\
             //!\n\
             //! Modules are declared lowest layer first; a module uses only modules above it.\n\
             pub mod low;\n\
             pub mod mid;\n\
             pub mod high;\n\
             pub use high::Top;\n",
        ),
        (
            "low.rs",
            "//! Uses what is declared after it.\n\
             // crate::high in a comment is no use; /* nor */ in a block comment:\n\
             /* crate::high /* nested */ super::high */\n\
             const TEXT: &str = \"crate::high\";\n\
             const RAW: &str = r#\"super::high \"quoted\" crate::mid\"#;\n\
             const BRACE: char = '{';\n\
             use crate::{mid, high::{self, Top as T}};\n\
             fn f() -> crate::Top { todo!() }\n\
             fn g() { super::mid::thing(); }\n\
             fn h() { for _ in crate::high::ALL {} }\n\
             #[cfg(test)]\n\
             mod tests {\n    \
                 #[test]\n    \
                 fn t() { crate::high::x(); }\n\
             }\n",
        ),
        (
            "mid.rs",
            "//! Glob-imports the crate root.\n\
             use super::*;\n\
             fn f() { low::x(); }\n\
             fn g() { high::x(); }\n\
             pub(in crate::mid) fn h() {}\n",
        ),
        (
            "high/mod.rs",
            "//! Uses what comes before it, and has submodules.\n\
             use crate::{low, mid::{self, Thing}};\n\
             mod a;\n\
             mod b;\n",
        ),
        (
            "high/a.rs",
            "//! Uses its later sibling.\nuse super::b::X;\n",
        ),
        ("high/b.rs", "use super::a;\nuse crate::low;\n"),
        ("stray.rs", "//! Declared nowhere.\n"),
    ];
    for (path, text) in files {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    let krate = Crate::read(&dir.path().join("lib.rs"));
    let mut found: Vec<String> = krate
        .violations()
        .iter()
        .map(|e| {
            let file = e.file.strip_prefix(dir.path()).unwrap().display();
            format!(
                "{file}:{} {} -> {}",
                e.line,
                child(&e.parent, &e.from),
                e.to
            )
        })
        .collect();
    found.dedup();
    assert_eq!(
        found,
        [
            "high/a.rs:2 high::a -> b",
            "low.rs:7 low -> mid",
            "low.rs:7 low -> high",
            "low.rs:8 low -> high",
            "low.rs:9 low -> mid",
            "low.rs:10 low -> high",
            "low.rs:14 low -> high",
            "mid.rs:4 mid -> high",
        ]
    );
    let mut fine: Vec<String> = krate
        .edges
        .iter()
        .filter(|e| krate.rank(&e.parent, &e.to) < krate.rank(&e.parent, &e.from))
        .map(|e| format!("{} -> {}", child(&e.parent, &e.from), e.to))
        .collect();
    fine.sort();
    fine.dedup();
    assert_eq!(
        fine,
        ["high -> low", "high -> mid", "high::b -> a", "mid -> low"]
    );
    let problems = problems(&krate);
    assert!(
        problems[0].contains(":2: `high::a` uses `high::b`, which ")
            && problems[0].contains("high/mod.rs declares after it"),
        "{problems:#?}"
    );
    assert!(
        problems.iter().any(|p| p
            .ends_with("stray.rs: no `mod` declaration reaches this file, so nothing checks it")),
        "{problems:#?}"
    );
    assert!(
        problems.iter().any(|p| p.ends_with(
            "high/b.rs:1: the file opens with no `//!` line saying what the module owns"
        )),
        "{problems:#?}"
    );
    assert_eq!(problems.len(), 10, "{problems:#?}");
}
