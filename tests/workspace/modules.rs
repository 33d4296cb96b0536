//! The module tree of one crate, and the edges between sibling modules its code draws: what
//! `tests/workspace.rs` checks the module order rule against.
//!
//! It reads source, not the compiler's view: each file's `mod` declarations in order (following
//! `#[path]`), then every path that starts at `crate::`, `super::` or `self::` (in `use`
//! statements, `use crate::{a, b::c}` groups included, and in code), with comments and string
//! literals left out. A path to an item that a parent file imports (`crate::Metrics` for a
//! `pub use metrics::Metrics` in lib.rs, or a private `use` that a child reaches through
//! `super::`) is followed to the module the item comes from, and a scope that glob-imports a
//! module (`use super::*`) sees that module's children by their bare names. `#[cfg]` is ignored:
//! test code and feature-gated code count like the rest.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One token of Rust source; comments are dropped and literals keep only what `#[path]` needs.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    /// `::`
    PathSep,
    Punct(char),
    /// A string literal's text (escapes kept as written); other literals are `Lit(None)`.
    Lit(Option<String>),
}

#[derive(Debug, Clone)]
struct Token {
    tok: Tok,
    line: usize,
}

fn is_ident_start(c: char) -> bool {
    c == '_' || c.is_alphabetic()
}

fn is_ident_char(c: char) -> bool {
    c == '_' || c.is_alphanumeric()
}

/// Splits `src` into tokens, skipping comments (doc comments too: an intra-doc link is not a
/// use) and the insides of string, raw string, byte string and character literals.
fn tokenize(src: &str) -> Vec<Token> {
    let chars: Vec<char> = src.chars().collect();
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    let mut tokens = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if chars[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if c == '"' {
            let start = line;
            let (text, next) = quoted(&chars, i + 1, &mut line);
            tokens.push(Token {
                tok: Tok::Lit(Some(text)),
                line: start,
            });
            i = next;
        } else if c == '\'' {
            if at(i + 1) == '\\' {
                // '\n', '\'', '\u{..}': the closing quote is the first one after the escape.
                i += 3;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
                tokens.push(Token {
                    tok: Tok::Lit(None),
                    line,
                });
            } else if at(i + 2) == '\'' {
                i += 3;
                tokens.push(Token {
                    tok: Tok::Lit(None),
                    line,
                });
            } else {
                // A lifetime or a label: its name follows as an identifier, which is harmless.
                i += 1;
            }
        } else if c.is_ascii_digit() {
            while i < chars.len() && is_ident_char(chars[i]) {
                i += 1;
            }
            tokens.push(Token {
                tok: Tok::Lit(None),
                line,
            });
        } else if is_ident_start(c) {
            let start = i;
            while i < chars.len() && is_ident_char(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut hashes = 0;
            while at(i + hashes) == '#' {
                hashes += 1;
            }
            let raw_prefix = matches!(word.as_str(), "r" | "br" | "cr");
            if raw_prefix && at(i + hashes) == '"' {
                // r"..", r#".."#: ends at a quote followed by as many hashes.
                let start_line = line;
                i += hashes + 1;
                loop {
                    if i >= chars.len() {
                        break;
                    }
                    if chars[i] == '"' && (0..hashes).all(|h| at(i + 1 + h) == '#') {
                        i += 1 + hashes;
                        break;
                    }
                    if chars[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
                tokens.push(Token {
                    tok: Tok::Lit(None),
                    line: start_line,
                });
            } else if word == "r" && hashes == 1 && is_ident_start(at(i + 1)) {
                // A raw identifier, r#type.
                let start = i + 1;
                i = start;
                while i < chars.len() && is_ident_char(chars[i]) {
                    i += 1;
                }
                tokens.push(Token {
                    tok: Tok::Ident(chars[start..i].iter().collect()),
                    line,
                });
            } else if matches!(word.as_str(), "b" | "c") && at(i) == '"' {
                let start_line = line;
                let (_, next) = quoted(&chars, i + 1, &mut line);
                i = next;
                tokens.push(Token {
                    tok: Tok::Lit(None),
                    line: start_line,
                });
            } else if word == "b" && at(i) == '\'' {
                i += if at(i + 1) == '\\' { 2 } else { 1 };
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
                tokens.push(Token {
                    tok: Tok::Lit(None),
                    line,
                });
            } else {
                tokens.push(Token {
                    tok: Tok::Ident(word),
                    line,
                });
            }
        } else if c == ':' && at(i + 1) == ':' {
            tokens.push(Token {
                tok: Tok::PathSep,
                line,
            });
            i += 2;
        } else {
            tokens.push(Token {
                tok: Tok::Punct(c),
                line,
            });
            i += 1;
        }
    }
    tokens
}

/// The text of a string literal whose opening quote is just before `i`, and the index after its
/// closing quote.
fn quoted(chars: &[char], mut i: usize, line: &mut usize) -> (String, usize) {
    let start = i;
    while i < chars.len() && chars[i] != '"' {
        if chars[i] == '\\' {
            i += 1;
        }
        if chars.get(i) == Some(&'\n') {
            *line += 1;
        }
        i += 1;
    }
    (chars[start..i.min(chars.len())].iter().collect(), i + 1)
}

/// The first `//!` line of a file, before any item (a `//` comment or `#![..]` may precede it).
fn first_doc_line(src: &str) -> Option<String> {
    for line in src.lines().map(str::trim) {
        if let Some(doc) = line.strip_prefix("//!") {
            return Some(doc.trim().to_string());
        }
        if !(line.is_empty() || line.starts_with("//") || line.starts_with("#![")) {
            return None;
        }
    }
    None
}

fn ident(tokens: &[Token], i: usize) -> Option<&str> {
    match tokens.get(i).map(|t| &t.tok) {
        Some(Tok::Ident(s)) => Some(s),
        _ => None,
    }
}

fn punct(tokens: &[Token], i: usize, c: char) -> bool {
    tokens.get(i).map(|t| &t.tok) == Some(&Tok::Punct(c))
}

fn path_sep(tokens: &[Token], i: usize) -> bool {
    tokens.get(i).map(|t| &t.tok) == Some(&Tok::PathSep)
}

/// One path of a use tree (or of a path in code), as written: `crate::a::b`, `super::x`.
#[derive(Debug, Clone)]
struct UsePath {
    segments: Vec<String>,
    /// The line its last segment is on (in a group over several lines, its own line).
    line: usize,
    glob: bool,
    /// The name it is imported as (`as alias`), when not its last segment.
    alias: Option<String>,
}

/// Reads the use tree (or plain path) starting at `*i`, with `prefix` already read, expanding
/// groups: `a::{b, c::{d, e as f}, *}` gives `a::b`, `a::c::d`, `a::c::e` (as `f`) and `a::*`.
fn use_tree(tokens: &[Token], i: &mut usize, mut prefix: Vec<String>) -> Vec<UsePath> {
    loop {
        if let Some(name) = ident(tokens, *i) {
            prefix.push(name.to_string());
            *i += 1;
            if path_sep(tokens, *i) {
                *i += 1;
                continue;
            }
            let mut alias = None;
            if ident(tokens, *i) == Some("as") {
                alias = ident(tokens, *i + 1).map(str::to_string);
                *i += 2;
            }
            return vec![UsePath {
                segments: prefix,
                line: tokens[*i - 1].line,
                glob: false,
                alias,
            }];
        }
        if punct(tokens, *i, '*') {
            *i += 1;
            return vec![UsePath {
                segments: prefix,
                line: tokens[*i - 1].line,
                glob: true,
                alias: None,
            }];
        }
        if punct(tokens, *i, '{') {
            *i += 1;
            let mut paths = Vec::new();
            while *i < tokens.len() && !punct(tokens, *i, '}') {
                let before = *i;
                paths.extend(use_tree(tokens, i, prefix.clone()));
                if punct(tokens, *i, ',') {
                    *i += 1;
                } else if *i == before {
                    // Not a use tree after all (a struct literal in a macro, say): step over.
                    *i += 1;
                }
            }
            *i += 1;
            return paths;
        }
        // `crate::f::<T>()`, `super::X {`, end of input: the path ends here.
        return vec![UsePath {
            segments: prefix,
            line: tokens[(*i).min(tokens.len()) - 1].line,
            glob: false,
            alias: None,
        }];
    }
}

/// A `mod name;` declaration (not an inline `mod name { .. }`), in declaration order.
#[derive(Debug, Clone)]
struct ModDecl {
    name: String,
    line: usize,
    /// The `#[path = ".."]` it carries.
    path_attr: Option<String>,
}

/// The file-backed modules `tokens` declares outside any braces, in order.
fn mod_decls(tokens: &[Token]) -> Vec<ModDecl> {
    let mut decls = Vec::new();
    let mut depth = 0usize;
    for (i, t) in tokens.iter().enumerate() {
        match &t.tok {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => depth = depth.saturating_sub(1),
            Tok::Ident(kw) if kw == "mod" && depth == 0 => {
                let (Some(name), true) = (ident(tokens, i + 1), punct(tokens, i + 2, ';')) else {
                    continue;
                };
                decls.push(ModDecl {
                    name: name.to_string(),
                    line: t.line,
                    path_attr: path_attribute(tokens, i),
                });
            }
            _ => {}
        }
    }
    decls
}

/// The `#[path = ".."]` among the attributes before the `mod` at `i`.
fn path_attribute(tokens: &[Token], mod_at: usize) -> Option<String> {
    // Walk back over `pub`, `pub(crate)` and the attributes, stopping at the item before.
    let mut i = mod_at;
    while i > 0 {
        i -= 1;
        match &tokens[i].tok {
            Tok::Punct(';') | Tok::Punct('}') | Tok::Punct('{') => return None,
            Tok::Ident(p)
                if p == "path"
                    && punct(tokens, i + 1, '=')
                    && punct(tokens, i.wrapping_sub(1), '[') =>
            {
                if let Some(Tok::Lit(Some(text))) = tokens.get(i + 2).map(|t| &t.tok) {
                    return Some(text.clone());
                }
            }
            _ => {}
        }
    }
    None
}

/// One module of the tree, with the file it lives in.
#[derive(Debug)]
pub(crate) struct Module {
    /// Its path from the crate root (empty for the root).
    pub(crate) path: Vec<String>,
    pub(crate) file: PathBuf,
    /// Its file-backed children, in declaration order.
    pub(crate) children: Vec<String>,
    /// Its file's first `//!` line, if it has one.
    pub(crate) first_doc_line: Option<String>,
    tokens: Vec<Token>,
}

/// A reference from code in one module to a sibling of it (or of one of its ancestors): the
/// parent they share, `from` and `to` (children of that parent), and where it is written.
#[derive(Debug, Clone)]
pub(crate) struct Edge {
    pub(crate) parent: Vec<String>,
    pub(crate) from: String,
    pub(crate) to: String,
    pub(crate) file: PathBuf,
    pub(crate) line: usize,
}

/// A crate's modules and the edges between them.
#[derive(Debug)]
pub(crate) struct Crate {
    pub(crate) root: PathBuf,
    /// Every module, by path; the root's is empty.
    pub(crate) modules: BTreeMap<Vec<String>, Module>,
    pub(crate) edges: Vec<Edge>,
    /// Paths starting at `crate::`, `super::` or `self::` that were read (edges or not).
    pub(crate) paths_read: usize,
    /// Problems reading the tree: a declared module without a file.
    pub(crate) errors: Vec<String>,
}

impl Crate {
    /// Reads the crate whose root file (lib.rs, main.rs) is `root`.
    pub(crate) fn read(root: &Path) -> Crate {
        let mut krate = Crate {
            root: root.to_path_buf(),
            modules: BTreeMap::new(),
            edges: Vec::new(),
            paths_read: 0,
            errors: Vec::new(),
        };
        let dir = root.parent().unwrap().to_path_buf();
        krate.load(Vec::new(), root.to_path_buf(), dir);
        krate.scan();
        krate
    }

    /// Reads the module at `path` from `file`, then its children; `dir` is where they live.
    fn load(&mut self, path: Vec<String>, file: PathBuf, dir: PathBuf) {
        let src = match std::fs::read_to_string(&file) {
            Ok(src) => src,
            Err(e) => {
                self.errors.push(format!("{}: {e}", file.display()));
                return;
            }
        };
        let first_doc_line = first_doc_line(&src);
        let tokens = tokenize(&src);
        let decls = mod_decls(&tokens);
        self.modules.insert(
            path.clone(),
            Module {
                path: path.clone(),
                file: file.clone(),
                children: decls.iter().map(|d| d.name.clone()).collect(),
                first_doc_line,
                tokens,
            },
        );
        let file_dir = file.parent().unwrap().to_path_buf();
        for decl in decls {
            let mut child_path = path.clone();
            child_path.push(decl.name.clone());
            let (child_file, child_dir) = if let Some(rel) = &decl.path_attr {
                let child_file = file_dir.join(rel);
                let child_dir = child_file.parent().unwrap().to_path_buf();
                (child_file, child_dir)
            } else if dir.join(format!("{}.rs", decl.name)).exists() {
                (dir.join(format!("{}.rs", decl.name)), dir.join(&decl.name))
            } else if dir.join(&decl.name).join("mod.rs").exists() {
                (dir.join(&decl.name).join("mod.rs"), dir.join(&decl.name))
            } else {
                self.errors.push(format!(
                    "{}:{}: mod {} has no file ({}.rs or {}/mod.rs)",
                    file.display(),
                    decl.line,
                    decl.name,
                    decl.name,
                    decl.name
                ));
                continue;
            };
            self.load(child_path, child_file, child_dir);
        }
    }

    /// Whether `path` names a file-backed module.
    fn is_module(&self, path: &[String]) -> bool {
        self.modules.contains_key(path)
    }

    /// Every `use` outside braces in every module file, `pub` or not (a child reaches its
    /// parent's private imports through `super::`): (module, name) -> the absolute path it names.
    fn imports(&self) -> BTreeMap<(Vec<String>, String), Vec<String>> {
        let mut out = BTreeMap::new();
        for module in self.modules.values() {
            let tokens = &module.tokens;
            let mut depth = 0usize;
            let mut i = 0;
            while i < tokens.len() {
                match &tokens[i].tok {
                    Tok::Punct('{') => depth += 1,
                    Tok::Punct('}') => depth = depth.saturating_sub(1),
                    Tok::Ident(kw) if kw == "use" && depth == 0 => {
                        let mut j = i + 1;
                        for used in use_tree(tokens, &mut j, Vec::new()) {
                            if used.glob {
                                continue;
                            }
                            let Some(target) = self.resolve(&module.path, &used.segments) else {
                                continue;
                            };
                            let name = used
                                .alias
                                .clone()
                                .or_else(|| used.segments.last().cloned())
                                .unwrap();
                            out.insert((module.path.clone(), name), target);
                        }
                        i = j;
                        continue;
                    }
                    _ => {}
                }
                i += 1;
            }
        }
        out
    }

    /// The absolute path that `segments`, written in module `scope`, names: `crate::`,
    /// `super::`, `self::` and a first segment naming a child of `scope`; `None` for a path that
    /// starts anywhere else (another crate, an item in scope).
    fn resolve(&self, scope: &[String], segments: &[String]) -> Option<Vec<String>> {
        let mut rest = segments;
        let mut base: Vec<String> = match rest.first().map(String::as_str) {
            Some("crate") => {
                rest = &rest[1..];
                Vec::new()
            }
            Some("self") => {
                rest = &rest[1..];
                scope.to_vec()
            }
            Some("super") => {
                let mut base = scope.to_vec();
                while rest.first().map(String::as_str) == Some("super") {
                    base.pop();
                    rest = &rest[1..];
                }
                base
            }
            Some(first) => {
                let mut child = scope.to_vec();
                child.push(first.to_string());
                if !self.is_module(&child) {
                    return None;
                }
                scope.to_vec()
            }
            None => return None,
        };
        base.extend(rest.iter().filter(|s| *s != "self").cloned());
        Some(base)
    }

    /// The module or imported path that `name` means in `parent`: its child of that name, or
    /// what a `use` there names.
    fn lookup(
        &self,
        imports: &BTreeMap<(Vec<String>, String), Vec<String>>,
        parent: &[String],
        name: &str,
    ) -> Option<Vec<String>> {
        let mut child = parent.to_vec();
        child.push(name.to_string());
        if self.is_module(&child) {
            return Some(child);
        }
        imports.get(&(parent.to_vec(), name.to_string())).cloned()
    }

    /// What `name` means in `scope` through `use glob::*`: a child of `glob`, or what `glob`
    /// imports when `scope` can see its private imports (`glob` is `scope` or an ancestor, as
    /// in a test module's `use super::*`).
    fn glob_lookup(
        &self,
        imports: &BTreeMap<(Vec<String>, String), Vec<String>>,
        glob: &[String],
        scope: &[String],
        name: &str,
    ) -> Option<Vec<String>> {
        let mut child = glob.to_vec();
        child.push(name.to_string());
        if self.is_module(&child) {
            return Some(child);
        }
        if scope.starts_with(glob) {
            return imports.get(&(glob.to_vec(), name.to_string())).cloned();
        }
        None
    }

    /// Reads every module's paths into edges.
    fn scan(&mut self) {
        /// An inline module open at this point of a file (`mod tests {`), the brace depth it
        /// closes at, and the modules it glob-imports (`use super::*`).
        struct Scope {
            path: Vec<String>,
            depth: usize,
            globs: Vec<Vec<String>>,
        }
        let imports = self.imports();
        let mut edges = Vec::new();
        let mut paths_read = 0;
        for module in self.modules.values() {
            let tokens = &module.tokens;
            let mut scopes = vec![Scope {
                path: module.path.clone(),
                depth: 0,
                globs: Vec::new(),
            }];
            let mut depth = 0usize;
            let mut i = 0;
            while i < tokens.len() {
                match &tokens[i].tok {
                    Tok::Punct('{') => {
                        depth += 1;
                        i += 1;
                        continue;
                    }
                    Tok::Punct('}') => {
                        if scopes.len() > 1 && scopes.last().unwrap().depth == depth {
                            scopes.pop();
                        }
                        depth = depth.saturating_sub(1);
                        i += 1;
                        continue;
                    }
                    Tok::Ident(kw) if kw == "mod" && punct(tokens, i + 2, '{') => {
                        if let Some(name) = ident(tokens, i + 1) {
                            let mut path = scopes.last().unwrap().path.clone();
                            path.push(name.to_string());
                            depth += 1;
                            scopes.push(Scope {
                                path,
                                depth,
                                globs: Vec::new(),
                            });
                            i += 3;
                            continue;
                        }
                    }
                    _ => {}
                }
                // A path starts here: not after `::`, not a visibility's `pub(in crate::x)`.
                let starts_path = path_sep(tokens, i + 1)
                    && !path_sep(tokens, i.wrapping_sub(1))
                    && !(ident(tokens, i.wrapping_sub(1)) == Some("in")
                        && punct(tokens, i.wrapping_sub(2), '(')
                        && ident(tokens, i.wrapping_sub(3)) == Some("pub"));
                let Some(word) = ident(tokens, i).filter(|_| starts_path) else {
                    i += 1;
                    continue;
                };
                let scope = scopes.last().unwrap();
                let scope_path = scope.path.clone();
                let rooted = matches!(word, "crate" | "super" | "self");
                // A bare `name::` that a glob import of this scope brings in: not a child of
                // the scope, nor a name it imports itself (that `use` is read already).
                let glob_base = if rooted || self.lookup(&imports, &scope_path, word).is_some() {
                    None
                } else {
                    scope
                        .globs
                        .iter()
                        .find(|g| self.glob_lookup(&imports, g, &scope_path, word).is_some())
                        .cloned()
                };
                if !rooted && glob_base.is_none() {
                    i += 1;
                    continue;
                }
                let is_use = ident(tokens, i.wrapping_sub(1)) == Some("use");
                for used in use_tree(tokens, &mut i, Vec::new()) {
                    let target = match &glob_base {
                        Some(base) => self
                            .glob_lookup(&imports, base, &scope_path, &used.segments[0])
                            .map(|mut t| {
                                t.extend(used.segments[1..].iter().cloned());
                                t
                            }),
                        None => self.resolve(&scope_path, &used.segments),
                    };
                    let Some(target) = target else { continue };
                    paths_read += 1;
                    if used.glob && is_use {
                        scopes.last_mut().unwrap().globs.push(target.clone());
                    }
                    if let Some(edge) =
                        self.edge(&scope_path, target, &imports, &module.file, used.line)
                    {
                        edges.push(edge);
                    }
                }
            }
        }
        self.edges = edges;
        self.paths_read = paths_read;
    }

    /// The edge a reference from `scope` to `target` draws, if it reaches a sibling of `scope`
    /// or of one of its ancestors: the first point where the two paths part, following the
    /// parent's imports (`pub use` re-exports and private `use`s) there.
    fn edge(
        &self,
        scope: &[String],
        mut target: Vec<String>,
        imports: &BTreeMap<(Vec<String>, String), Vec<String>>,
        file: &Path,
        line: usize,
    ) -> Option<Edge> {
        for _ in 0..8 {
            let part = scope
                .iter()
                .zip(&target)
                .take_while(|(a, b)| a == b)
                .count();
            if part >= scope.len() || part >= target.len() {
                // Its own item, a child's, or an ancestor's own item.
                return None;
            }
            let parent = &scope[..part];
            let from = &scope[part];
            let to = &target[part];
            let declared = |name: &String| {
                let mut p = parent.to_vec();
                p.push(name.clone());
                self.is_module(&p)
            };
            if declared(to) {
                if !declared(from) {
                    // An inline module of the parent (the crate root's `mod tests { .. }`).
                    return None;
                }
                return Some(Edge {
                    parent: parent.to_vec(),
                    from: from.clone(),
                    to: to.clone(),
                    file: file.to_path_buf(),
                    line,
                });
            }
            // An item of the parent: follow it if the parent imports it from a module.
            let via = imports.get(&(parent.to_vec(), to.clone()))?;
            let mut next = via.clone();
            next.extend(target[part + 1..].iter().cloned());
            target = next;
        }
        None
    }

    /// The position of `name` among `parent`'s children, lowest layer first.
    pub(crate) fn rank(&self, parent: &[String], name: &str) -> usize {
        self.modules[parent]
            .children
            .iter()
            .position(|c| c == name)
            .unwrap()
    }

    /// The edges that point down the declaration order: a module using one declared after it.
    pub(crate) fn violations(&self) -> Vec<&Edge> {
        self.edges
            .iter()
            .filter(|e| self.rank(&e.parent, &e.to) > self.rank(&e.parent, &e.from))
            .collect()
    }

    /// Each parent's distinct edges, `(from, to)`, in declaration order of `from`, then `to`.
    pub(crate) fn graph(&self) -> BTreeMap<Vec<String>, Vec<(String, String)>> {
        let mut ranked: BTreeMap<Vec<String>, BTreeSet<_>> = BTreeMap::new();
        for e in &self.edges {
            ranked.entry(e.parent.clone()).or_default().insert((
                self.rank(&e.parent, &e.from),
                self.rank(&e.parent, &e.to),
                (e.from.clone(), e.to.clone()),
            ));
        }
        ranked
            .into_iter()
            .map(|(parent, edges)| (parent, edges.into_iter().map(|(_, _, e)| e).collect()))
            .collect()
    }

    /// Every `.rs` file under the root's directory that no `mod` declaration reaches.
    pub(crate) fn unreached_files(&self) -> Vec<PathBuf> {
        let reached: BTreeSet<PathBuf> = self
            .modules
            .values()
            .filter_map(|m| m.file.canonicalize().ok())
            .collect();
        let mut unreached = Vec::new();
        let mut dirs = vec![self.root.parent().unwrap().to_path_buf()];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap().flatten() {
                let p = entry.path();
                if p.is_dir() {
                    dirs.push(p);
                } else if p.extension().is_some_and(|e| e == "rs")
                    && !reached.contains(&p.canonicalize().unwrap())
                {
                    unreached.push(p);
                }
            }
        }
        unreached.sort();
        unreached
    }
}
