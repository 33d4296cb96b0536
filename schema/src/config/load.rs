//! Reading the config file: TOML syntax, `${ENV}` substitution, keys and types, then the rules
//! that span sections, reporting every problem found with its line, column and field path.
//!
//! serde stops at the first error, so each section is deserialized on its own, and within a
//! section an unknown key or bad value is reported, taken out, and the section tried again. The
//! spans come from a second, span-keeping parse of the same text (`toml_edit`).

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::path::Path;

use serde::de::DeserializeOwned;
use toml::Value;

use super::field_path::{display_path, key, FieldPath, Seg};
use super::{validate, Config, DriverKind};
use crate::lease::Workload;

/// The config format this build reads: the file's optional top-level `version` (absent: 1).
pub const CONFIG_VERSION: u64 = 1;

/// One problem in a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// 1-based line, when the problem has a place in the file.
    pub line: Option<usize>,
    /// 1-based column (in characters).
    pub column: Option<usize>,
    /// Dotted field path, e.g. `teams[1].gpu_quota`; empty for the file as a whole.
    pub path: String,
    /// What is wrong, for a person.
    pub message: String,
}

/// Every problem found in a config file, with the text to show them in.
#[derive(Debug, Clone)]
pub struct ConfigErrors {
    /// The file's name as given.
    pub file: String,
    /// The problems, in file order.
    pub errors: Vec<ConfigError>,
    source: String,
}

impl std::error::Error for ConfigErrors {}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.errors.len();
        writeln!(
            f,
            "{}: {n} error{} in the configuration",
            self.file,
            if n == 1 { "" } else { "s" }
        )?;
        for e in &self.errors {
            let place = match (e.line, e.column) {
                (Some(l), Some(c)) => format!("{}:{l}:{c}", self.file),
                _ => self.file.clone(),
            };
            let path = if e.path.is_empty() {
                String::new()
            } else {
                format!("{}: ", e.path)
            };
            writeln!(f, "{place}: error: {path}{}", e.message)?;
            if let (Some(line), Some(column)) = (e.line, e.column) {
                if let Some(text) = self.source.lines().nth(line - 1) {
                    let gutter = line.to_string();
                    writeln!(f, "{:w$} |", "", w = gutter.len())?;
                    writeln!(f, "{gutter} | {text}")?;
                    writeln!(
                        f,
                        "{:w$} | {:c$}^",
                        "",
                        "",
                        w = gutter.len(),
                        c = column - 1
                    )?;
                }
            }
        }
        Ok(())
    }
}

/// Reads and checks the config file at `path`.
pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
    load_for_build(path, |_| None)
}

/// Checks config `text`; `file` names it in messages.
pub fn parse(file: &str, text: &str) -> Result<Config, ConfigErrors> {
    parse_for_build(file, text, |_| None)
}

/// [`load`] for a build of gpuwarden that may lack some drivers: `missing` says why this build
/// cannot run a driver kind, and how to get one that can (none when it can). A `[[substrates]]`
/// entry of such a kind is an error on its `driver` line, as `enforce` would refuse it at start.
pub fn load_for_build(
    path: &Path,
    missing: impl Fn(DriverKind) -> Option<String>,
) -> Result<Config, ConfigErrors> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigErrors {
        file: file.clone(),
        errors: vec![ConfigError {
            line: None,
            column: None,
            path: String::new(),
            message: format!("cannot read the file: {e}"),
        }],
        source: String::new(),
    })?;
    parse_for_build(&file, &text, missing)
}

/// [`parse`] with [`load_for_build`]'s check of the drivers this build has.
pub fn parse_for_build(
    file: &str,
    text: &str,
    missing: impl Fn(DriverKind) -> Option<String>,
) -> Result<Config, ConfigErrors> {
    let mut ctx = Context::new(file, text);
    let config = ctx.parse_all();
    if ctx.errors.is_empty() {
        if let Some(config) = config {
            validate::check(&config, &mut |path: FieldPath, message| {
                ctx.report_at(&path, Site::Value, message)
            });
            for (i, substrate) in config.substrates.iter().enumerate() {
                if let Some(why) = missing(substrate.driver) {
                    let path = [key("substrates"), Seg::Index(i), key("driver")];
                    ctx.report_at(
                        &path,
                        Site::Value,
                        format!("substrate {} cannot run here: {why}", substrate.name),
                    );
                }
            }
            if ctx.errors.is_empty() {
                return Ok(config);
            }
        }
    }
    Err(ctx.finish())
}

/// Which part of a `key = value` pair a message points at.
#[derive(Clone, Copy)]
enum Site {
    Key,
    Value,
}

struct Context<'t> {
    file: &'t str,
    text: &'t str,
    spans: Option<toml_edit::Document<&'t str>>,
    errors: Vec<(usize, ConfigError)>,
}

impl<'t> Context<'t> {
    fn new(file: &'t str, text: &'t str) -> Self {
        Self {
            file,
            text,
            spans: toml_edit::Document::parse(text).ok(),
            errors: Vec::new(),
        }
    }

    fn finish(mut self) -> ConfigErrors {
        self.errors.sort_by_key(|(offset, _)| *offset);
        ConfigErrors {
            file: self.file.to_string(),
            errors: self.errors.into_iter().map(|(_, e)| e).collect(),
            source: self.text.to_string(),
        }
    }

    fn report_span(&mut self, span: Option<Range<usize>>, path: String, message: String) {
        let (line, column, offset) = match span {
            Some(span) => {
                let (l, c) = line_col(self.text, span.start);
                (Some(l), Some(c), span.start)
            }
            None => (None, None, usize::MAX),
        };
        let error = ConfigError {
            line,
            column,
            path,
            message,
        };
        if !self.errors.iter().any(|(_, e)| *e == error) {
            self.errors.push((offset, error));
        }
    }

    fn report_at(&mut self, path: &[Seg], site: Site, message: String) {
        let span = self.span_of(path, site);
        self.report_span(span, display_path(path), message);
    }

    /// The span of the key or value at `path`, or of its nearest ancestor that has one.
    fn span_of(&self, path: &[Seg], site: Site) -> Option<Range<usize>> {
        let doc = self.spans.as_ref()?;
        let mut node = Node::Item(doc.as_item());
        let mut best = None;
        for seg in path {
            let (next, key_span) = node.child(seg)?;
            let value_span = next.span();
            best = match site {
                Site::Key => key_span.or(value_span).or(best),
                Site::Value => value_span.or(key_span).or(best),
            };
            node = next;
        }
        best
    }

    fn parse_all(&mut self) -> Option<Config> {
        let mut root: toml::Table = match toml::from_str(self.text) {
            Ok(root) => root,
            Err(e) => {
                self.report_span(
                    e.span(),
                    String::new(),
                    format!("invalid TOML: {}", e.message()),
                );
                return None;
            }
        };
        substitute_env(&mut root, &mut Vec::new(), &mut |path, msg| {
            self.report_at(path, Site::Value, msg)
        });

        if let Some(version) = root.remove("version") {
            if !self.version(&version) {
                return None;
            }
        }
        const SECTIONS: [&str; 11] = [
            "kafka",
            "storage",
            "collector",
            "pipeline",
            "pricing",
            "teams",
            "workloads",
            "enforcer",
            "substrates",
            "tokens",
            "signing",
        ];
        for name in root.keys() {
            if !SECTIONS.contains(&name.as_str()) {
                let message = format!(
                    "unknown section `{name}`; expected one of {}",
                    SECTIONS.map(|s| format!("`{s}`")).join(", ")
                );
                self.report_at(&[key(name)], Site::Key, message);
            }
        }
        let mut take = |name: &str| root.remove(name);
        let kafka = self.section(take("kafka"), &[key("kafka")]);
        let storage = self.section(take("storage"), &[key("storage")]);
        let collector = self.section(take("collector"), &[key("collector")]);
        let pipeline = self.section(take("pipeline"), &[key("pipeline")]);
        let pricing = self.section(take("pricing"), &[key("pricing")]);
        let enforcer = self.section(take("enforcer"), &[key("enforcer")]);
        let signing = self.section(take("signing"), &[key("signing")]);
        let teams = self.list(take("teams"), "teams");
        let substrates = self.list(take("substrates"), "substrates");
        let tokens = self.list(take("tokens"), "tokens");
        let workloads = self.workloads(take("workloads"));
        Some(Config {
            kafka: kafka?,
            storage: storage?,
            collector: collector?,
            pipeline: pipeline?,
            pricing: pricing?,
            teams: teams?,
            workloads: workloads?,
            enforcer: enforcer?,
            substrates: substrates?,
            tokens: tokens?,
            signing: signing?,
        })
    }

    /// The file's top-level `version`: the config format it is written in, [`CONFIG_VERSION`]
    /// when absent. A newer one is refused, naming both versions, before its sections are read
    /// by rules it may have changed: false then, and nothing more is read.
    fn version(&mut self, value: &Value) -> bool {
        let at = [key("version")];
        match value.as_integer() {
            Some(v) if v >= 1 => {
                let file = self.file;
                if let Err(e) = crate::format::check(
                    || format!("the config {file}"),
                    "config",
                    v as u64,
                    CONFIG_VERSION,
                    None,
                ) {
                    self.report_at(&at, Site::Value, e.to_string());
                    return false;
                }
            }
            _ => self.report_at(
                &at,
                Site::Value,
                format!(
                    "the config's format version must be an integer from 1 to {CONFIG_VERSION}"
                ),
            ),
        }
        true
    }

    /// A table section; absent means all defaults.
    fn section<T: DeserializeOwned + Default>(
        &mut self,
        value: Option<Value>,
        at: &[Seg],
    ) -> Option<T> {
        match value {
            None => Some(T::default()),
            Some(value) => self.deserialize(value, at.to_vec()),
        }
    }

    /// An array-of-tables section, each element checked on its own.
    fn list<T: DeserializeOwned>(&mut self, value: Option<Value>, name: &str) -> Option<Vec<T>> {
        let items = match value {
            None => return Some(Vec::new()),
            Some(Value::Array(items)) => items,
            Some(other) => {
                self.report_at(
                    &[key(name)],
                    Site::Value,
                    format!(
                        "expected an array of tables (`[[{name}]]`), found a {}",
                        other.type_str()
                    ),
                );
                return None;
            }
        };
        let parsed: Vec<Option<T>> = items
            .into_iter()
            .enumerate()
            .map(|(i, item)| self.deserialize(item, vec![key(name), Seg::Index(i)]))
            .collect();
        parsed.into_iter().collect()
    }

    fn workloads(
        &mut self,
        value: Option<Value>,
    ) -> Option<BTreeMap<Workload, super::WorkloadPolicy>> {
        let table = match value {
            None => return Some(BTreeMap::new()),
            Some(Value::Table(table)) => table,
            Some(other) => {
                self.report_at(
                    &[key("workloads")],
                    Site::Value,
                    format!(
                        "expected a table of workloads, found a {}",
                        other.type_str()
                    ),
                );
                return None;
            }
        };
        let mut out = Some(BTreeMap::new());
        for (name, policy) in table {
            let at = vec![key("workloads"), key(&name)];
            let workload = Workload::ALL.into_iter().find(|w| w.as_str() == name);
            let Some(workload) = workload else {
                let known = Workload::ALL.map(|w| format!("`{w}`")).join(", ");
                self.report_at(
                    &at,
                    Site::Key,
                    format!("unknown workload `{name}`; expected one of {known}"),
                );
                out = None;
                continue;
            };
            match self.deserialize(policy, at) {
                Some(policy) => {
                    if let Some(out) = out.as_mut() {
                        out.insert(workload, policy);
                    }
                }
                None => out = None,
            }
        }
        out
    }

    /// Deserializes one section, reporting each problem and retrying without it, so one run
    /// finds an unknown key and a bad value in the same section.
    fn deserialize<T: DeserializeOwned>(&mut self, mut value: Value, at: FieldPath) -> Option<T> {
        let before = self.errors.len();
        let mut removed: Vec<FieldPath> = Vec::new();
        // Each round removes one key, so a section can take no more rounds than it has keys.
        for _ in 0..=count_keys(&value) {
            let err = match serde_path_to_error::deserialize::<_, T>(value.clone()) {
                Ok(parsed) => return (self.errors.len() == before).then_some(parsed),
                Err(err) => err,
            };
            let mut rel = convert_path(err.path());
            let message = err.inner().message().to_string();
            let mut full = at.clone();
            full.extend(rel.iter().cloned());

            if let Some((unknown, expected)) = parse_unknown_field(&message) {
                // serde_path_to_error has usually entered the unknown key already; not always.
                if rel.last() != Some(&key(&unknown)) {
                    rel.push(key(&unknown));
                    full.push(key(&unknown));
                }
                self.report_at(
                    &full,
                    Site::Key,
                    format!("unknown key `{unknown}`{expected}"),
                );
            } else if let Some(missing) = backticked(&message, "missing field `") {
                rel.push(key(&missing));
                // A value already reported and removed shows up again as missing: not news.
                if !removed.contains(&rel) {
                    self.report_at(
                        &full,
                        Site::Key,
                        format!("missing required key `{missing}`"),
                    );
                }
                return None;
            } else {
                self.report_at(&full, Site::Value, message);
            }
            if rel.is_empty() || !remove(&mut value, &rel) {
                return None;
            }
            removed.push(rel);
        }
        None
    }
}

fn count_keys(value: &Value) -> usize {
    match value {
        Value::Table(t) => t.len() + t.values().map(count_keys).sum::<usize>(),
        Value::Array(a) => a.iter().map(count_keys).sum(),
        _ => 0,
    }
}

/// `unknown field `x`, expected one of `a`, `b`` → (`x`, "; expected one of `a`, `b`").
fn parse_unknown_field(message: &str) -> Option<(String, String)> {
    let name = backticked(message, "unknown field `")?;
    let rest = message
        .split_once("`, ")
        .map(|(_, rest)| format!("; {rest}"))
        .unwrap_or_default();
    Some((name, rest))
}

fn backticked(message: &str, prefix: &str) -> Option<String> {
    let rest = message.strip_prefix(prefix)?;
    rest.split('`').next().map(str::to_string)
}

fn convert_path(path: &serde_path_to_error::Path) -> FieldPath {
    use serde_path_to_error::Segment;
    path.iter()
        .filter_map(|seg| match seg {
            Segment::Seq { index } => Some(Seg::Index(*index)),
            Segment::Map { key } => Some(Seg::Key(key.clone())),
            Segment::Enum { variant } => Some(Seg::Key(variant.clone())),
            Segment::Unknown => None,
        })
        .collect()
}

fn remove(value: &mut Value, path: &[Seg]) -> bool {
    let Some((last, parents)) = path.split_last() else {
        return false;
    };
    let mut node = value;
    for seg in parents {
        node = match (seg, node) {
            (Seg::Key(k), Value::Table(t)) => match t.get_mut(k) {
                Some(v) => v,
                None => return false,
            },
            (Seg::Index(i), Value::Array(a)) => match a.get_mut(*i) {
                Some(v) => v,
                None => return false,
            },
            _ => return false,
        };
    }
    match (last, node) {
        (Seg::Key(k), Value::Table(t)) => t.remove(k).is_some(),
        (Seg::Index(i), Value::Array(a)) if *i < a.len() => {
            a.remove(*i);
            true
        }
        _ => false,
    }
}

/// Replaces `${NAME}` in every string with the environment variable `NAME`; `$${` is a literal
/// `${`. An unset variable is an error at the string that names it.
fn substitute_env(
    table: &mut toml::Table,
    path: &mut FieldPath,
    report: &mut dyn FnMut(&[Seg], String),
) {
    for (k, v) in table.iter_mut() {
        path.push(key(k));
        substitute_value(v, path, report);
        path.pop();
    }
}

fn substitute_value(
    value: &mut Value,
    path: &mut FieldPath,
    report: &mut dyn FnMut(&[Seg], String),
) {
    match value {
        Value::String(s) if s.contains('$') => match expand(s) {
            Ok(expanded) => *s = expanded,
            Err(message) => report(path, message),
        },
        Value::Table(t) => substitute_env(t, path, report),
        Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                path.push(Seg::Index(i));
                substitute_value(item, path, report);
                path.pop();
            }
        }
        _ => {}
    }
}

pub(crate) fn expand(text: &str) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i..];
        if let Some(tail) = after.strip_prefix("$${") {
            out.push_str("${");
            rest = tail;
        } else if let Some(tail) = after.strip_prefix("${") {
            let end = tail
                .find('}')
                .ok_or_else(|| format!("unclosed `${{` in \"{text}\"; write `${{NAME}}`, or `$${{` for a literal `${{`"))?;
            let name = &tail[..end];
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(format!("`${{{name}}}` is not an environment variable name"));
            }
            let value = std::env::var(name).map_err(|_| {
                format!("environment variable `{name}` is not set (referenced as `${{{name}}}`)")
            })?;
            out.push_str(&value);
            rest = &tail[end + 1..];
        } else {
            out.push('$');
            rest = &after[1..];
        }
    }
    out.push_str(rest);
    Ok(out)
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = text[line_start..offset].chars().count() + 1;
    (line, column)
}

/// A place in the span-keeping parse: a table, an array of tables, or a value.
#[derive(Clone, Copy)]
enum Node<'a> {
    Item(&'a toml_edit::Item),
    Table(&'a toml_edit::Table),
    Value(&'a toml_edit::Value),
}

impl<'a> Node<'a> {
    fn span(&self) -> Option<Range<usize>> {
        match self {
            Node::Item(item) => item.span(),
            Node::Table(table) => table.span(),
            Node::Value(value) => value.span(),
        }
    }

    fn child(&self, seg: &Seg) -> Option<(Node<'a>, Option<Range<usize>>)> {
        match seg {
            Seg::Key(k) => {
                let table: &'a dyn toml_edit::TableLike = match *self {
                    Node::Item(item) => item.as_table_like()?,
                    Node::Table(table) => table,
                    Node::Value(value) => value.as_inline_table()?,
                };
                let (key, item) = table.get_key_value(k)?;
                Some((Node::Item(item), key.span()))
            }
            Seg::Index(i) => match *self {
                Node::Item(toml_edit::Item::ArrayOfTables(tables)) => {
                    Some((Node::Table(tables.get(*i)?), None))
                }
                Node::Item(toml_edit::Item::Value(toml_edit::Value::Array(array)))
                | Node::Value(toml_edit::Value::Array(array)) => {
                    Some((Node::Value(array.get(*i)?), None))
                }
                _ => None,
            },
        }
    }
}
