//! The documentation's internal links: in README.md, docs/*.md and every page of the book
//! (docs/src/), each relative link names a file that exists and each `#anchor` a heading of its
//! target (mdBook's and GitHub's heading ids), and every page of the book is in
//! docs/src/SUMMARY.md. Links to other sites are not followed.
//!
//! The Markdown is read by a small scanner rather than a full parser: it skips fenced code
//! blocks, inline code and HTML comments, and reads inline links and images
//! (`[text](dest)`), reference definitions (`[label]: dest`) and HTML `href`/`src` attributes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A link found in a page: its 1-based line and its destination as written.
#[derive(Debug)]
struct Link {
    line: usize,
    dest: String,
}

/// What the scanner reads from one page.
#[derive(Debug, Default)]
struct Page {
    links: Vec<Link>,
    /// The ids of its headings (deduplicated as mdBook and GitHub do) and of its HTML elements.
    anchors: BTreeSet<String>,
}

/// The id mdBook (and GitHub) give a heading: its text without markup, lower-cased, spaces as
/// `-`, and every character other than letters, digits, `-` and `_` dropped. With `smart`
/// (mdBook's smart punctuation), `--` and `---` outside code are dashes, and dropped too.
fn heading_id(text: &str, smart: bool) -> String {
    let text = strip_inline_markup(text, smart);
    text.trim()
        .chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_lowercase().collect::<String>())
            } else if c.is_whitespace() {
                Some("-".to_owned())
            } else {
                None
            }
        })
        .collect()
}

/// A heading's text as rendered: code spans as their text, links as their text, HTML tags
/// dropped; with `smart`, runs of `-` longer than one (dashes) dropped.
fn strip_inline_markup(text: &str, smart: bool) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if c == '`' {
            let run = rest.chars().take_while(|c| *c == '`').count();
            let fence = &rest[..run];
            if let Some(end) = rest[run..].find(fence) {
                out.push_str(&rest[run..run + end]);
                rest = &rest[run + end + run..];
                continue;
            }
        }
        if c == '<' {
            if let Some(end) = rest.find('>') {
                let tag = &rest[1..end];
                if tag
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphabetic() || c == '/')
                {
                    rest = &rest[end + 1..];
                    continue;
                }
            }
        }
        if smart && rest.starts_with("--") {
            rest = rest.trim_start_matches('-');
            continue;
        }
        if c == ']' && rest[1..].starts_with('(') {
            // `[text](dest)`: keep the text, drop the destination.
            if let Some(end) = rest.find(')') {
                rest = &rest[end + 1..];
                continue;
            }
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// `line` with the contents of its code spans blanked out (same length), so that nothing in
/// them is read as a link.
fn mask_code_spans(line: &str) -> String {
    let bytes = line.as_bytes();
    let mut out = bytes.to_vec();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'`' {
            i += 1;
            continue;
        }
        let run = bytes[i..].iter().take_while(|b| **b == b'`').count();
        // The closing run: exactly as many backticks.
        let mut j = i + run;
        let mut close = None;
        while j < bytes.len() {
            if bytes[j] == b'`' {
                let r = bytes[j..].iter().take_while(|b| **b == b'`').count();
                if r == run {
                    close = Some(j);
                    break;
                }
                j += r;
            } else {
                j += 1;
            }
        }
        match close {
            Some(j) => {
                for b in &mut out[i..j + run] {
                    *b = b' ';
                }
                i = j + run;
            }
            None => i += run,
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| line.to_owned())
}

/// The destination that starts `text` (just after `(`): `<…>` or up to whitespace or the `)`
/// that closes the link, parentheses balanced.
fn destination(text: &str) -> Option<String> {
    let text = text.trim_start();
    if let Some(rest) = text.strip_prefix('<') {
        return rest.find('>').map(|end| rest[..end].to_owned());
    }
    let mut depth = 0;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' if depth == 0 => return Some(text[..i].to_owned()),
            ')' => depth -= 1,
            c if c.is_whitespace() => return Some(text[..i].to_owned()),
            _ => {}
        }
    }
    None
}

/// The value of each `name="…"` attribute in `line`.
fn attributes<'a>(line: &'a str, name: &str) -> Vec<&'a str> {
    let mut out = Vec::new();
    for quote in ['"', '\''] {
        let pattern = format!("{name}={quote}");
        for (at, _) in line.match_indices(&pattern) {
            let before = line[..at].chars().last();
            if before.is_some_and(|c| !c.is_whitespace()) {
                continue;
            }
            let rest = &line[at + pattern.len()..];
            if let Some(end) = rest.find(quote) {
                out.push(&rest[..end]);
            }
        }
    }
    out
}

fn scan(text: &str, smart: bool) -> Page {
    let mut page = Page::default();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut add_heading = |page: &mut Page, text: &str| {
        let text = text.trim();
        // mdBook's explicit id: `## Heading {#id}`.
        if let Some(open) = text.rfind("{#") {
            if text.ends_with('}') {
                page.anchors
                    .insert(text[open + 2..text.len() - 1].to_owned());
                return;
            }
        }
        let id = heading_id(text, smart);
        let n = seen.entry(id.clone()).or_insert(0);
        let unique = if *n == 0 {
            id.clone()
        } else {
            format!("{id}-{n}")
        };
        *n += 1;
        page.anchors.insert(unique);
    };

    let mut fence: Option<(char, usize)> = None;
    let mut in_comment = false;
    let mut previous = String::new();
    let mut previous_is_paragraph = false;
    for (index, raw) in text.lines().enumerate() {
        let number = index + 1;
        let trimmed = raw.trim_start();
        let indent = raw.len() - trimmed.len();

        // Fenced code blocks.
        if let Some((c, len)) = fence {
            let run = trimmed.chars().take_while(|x| *x == c).count();
            if run >= len && trimmed[run..].trim().is_empty() {
                fence = None;
            }
            previous_is_paragraph = false;
            continue;
        }
        if indent <= 3 {
            for c in ['`', '~'] {
                let run = trimmed.chars().take_while(|x| *x == c).count();
                if run >= 3 {
                    fence = Some((c, run));
                }
            }
            if fence.is_some() {
                previous_is_paragraph = false;
                continue;
            }
        }

        // HTML comments, which may span lines.
        let mut line = String::new();
        let mut rest = raw;
        loop {
            if in_comment {
                match rest.find("-->") {
                    Some(end) => {
                        in_comment = false;
                        rest = &rest[end + 3..];
                    }
                    None => break,
                }
            } else {
                match rest.find("<!--") {
                    Some(start) => {
                        line.push_str(&rest[..start]);
                        in_comment = true;
                        rest = &rest[start + 4..];
                    }
                    None => {
                        line.push_str(rest);
                        break;
                    }
                }
            }
        }
        let masked = mask_code_spans(&line);
        let trimmed = masked.trim_start();

        // Headings: ATX (`## Title`) and setext (a line underlined with `===` or `---`).
        let hashes = trimmed.chars().take_while(|c| *c == '#').count();
        let is_atx = indent <= 3
            && (1..=6).contains(&hashes)
            && trimmed[hashes..]
                .chars()
                .next()
                .is_none_or(char::is_whitespace);
        if is_atx {
            let text = line.trim_start()[hashes..].trim();
            let text = text.trim_end_matches('#').trim_end();
            add_heading(&mut page, text);
        } else if indent <= 3
            && previous_is_paragraph
            && !trimmed.trim().is_empty()
            && (trimmed.trim().chars().all(|c| c == '=')
                || trimmed.trim().chars().all(|c| c == '-'))
        {
            add_heading(&mut page, &previous);
        }

        // Links.
        if let Some(definition) = trimmed.strip_prefix('[').filter(|d| !d.starts_with('^')) {
            if let Some((_, dest)) = definition.split_once("]:") {
                if let Some(dest) = dest.split_whitespace().next() {
                    page.links.push(Link {
                        line: number,
                        dest: dest.trim_matches(['<', '>']).to_owned(),
                    });
                }
            }
        }
        for (at, _) in masked.match_indices("](") {
            if let Some(dest) = destination(&masked[at + 2..]) {
                page.links.push(Link { line: number, dest });
            }
        }
        for name in ["href", "src"] {
            for dest in attributes(&masked, name) {
                page.links.push(Link {
                    line: number,
                    dest: dest.to_owned(),
                });
            }
        }
        for name in ["id", "name"] {
            for id in attributes(&masked, name) {
                page.anchors.insert(id.to_owned());
            }
        }

        let blank = masked.trim().is_empty();
        let list_item = trimmed.starts_with("- ")
            || trimmed.starts_with("* ")
            || trimmed.starts_with("+ ")
            || trimmed
                .split_once(". ")
                .is_some_and(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
        previous_is_paragraph = !blank
            && !is_atx
            && !list_item
            && !trimmed.starts_with('|')
            && !trimmed.starts_with('>');
        previous = line.clone();
    }
    page
}

/// The pages checked: README.md, docs/*.md and every Markdown file under docs/src/.
fn pages() -> Vec<PathBuf> {
    let root = root();
    let mut out = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            out.push(path);
        }
    }
    out.extend(markdown_under(&root.join("docs/src")));
    out.sort();
    out
}

fn markdown_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(markdown_under(&path));
        } else if path.extension().is_some_and(|e| e == "md") {
            out.push(path);
        }
    }
    out
}

/// `path` with `.` and `..` resolved, without touching the filesystem.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| text.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(b) => {
                out.push(b);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether a destination leaves the repository: a URL with a scheme (`https:`, `mailto:`).
fn is_external(dest: &str) -> bool {
    let scheme: String = dest
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
        .collect();
    !scheme.is_empty() && dest[scheme.len()..].starts_with(':')
}

/// Whether the page at `path` is rendered with smart punctuation: a page of the book, unless
/// docs/book.toml turns it off (GitHub, which shows the other pages, has none).
fn smart_punctuation(path: &Path) -> bool {
    let book = std::fs::read_to_string(root().join("docs/book.toml")).unwrap_or_default();
    path.starts_with(root().join("docs/src"))
        && !book
            .lines()
            .any(|l| l.replace(' ', "").starts_with("smart-punctuation=false"))
}

/// The page at `path`, scanned once.
fn scanned<'a>(cache: &'a mut BTreeMap<PathBuf, Page>, path: &Path) -> Option<&'a Page> {
    if !cache.contains_key(path) {
        let text = std::fs::read_to_string(path).ok()?;
        cache.insert(path.to_owned(), scan(&text, smart_punctuation(path)));
    }
    cache.get(path)
}

/// Every broken link of every page, as `file:line: link: why`, and how many links were checked.
fn broken_links() -> (Vec<String>, usize) {
    let root = root();
    let shown = |path: &Path| {
        path.strip_prefix(&root)
            .unwrap_or(path)
            .display()
            .to_string()
    };
    let mut cache = BTreeMap::new();
    let mut problems = Vec::new();
    let mut checked = 0;
    for file in pages() {
        let relative = shown(&file);
        let links: Vec<(usize, String)> = scanned(&mut cache, &file)
            .unwrap_or_else(|| panic!("reading {relative}"))
            .links
            .iter()
            .map(|l| (l.line, l.dest.clone()))
            .collect();
        for (line, dest) in links {
            if dest.is_empty() || is_external(&dest) {
                continue;
            }
            checked += 1;
            let (path, anchor) = dest.split_once('#').unwrap_or((&dest, ""));
            let path = percent_decode(path);
            let target = if path.is_empty() {
                file.clone()
            } else if path.starts_with('/') {
                problems.push(format!(
                    "{relative}:{line}: link `{dest}`: an absolute path; write it relative to \
                     the page"
                ));
                continue;
            } else {
                normalize(&file.parent().unwrap().join(&path))
            };
            if !target.exists() {
                problems.push(format!(
                    "{relative}:{line}: link `{dest}`: {} does not exist",
                    shown(&target)
                ));
                continue;
            }
            if anchor.is_empty() || target.extension().is_none_or(|e| e != "md") {
                continue;
            }
            let anchors = &scanned(&mut cache, &target)
                .expect("a readable page")
                .anchors;
            if !anchors.contains(anchor) {
                problems.push(format!(
                    "{relative}:{line}: link `{dest}`: {} has no heading with the id `{anchor}`",
                    shown(&target)
                ));
            }
        }
    }
    (problems, checked)
}

#[test]
fn internal_links_lead_somewhere() {
    let (problems, checked) = broken_links();
    assert!(
        problems.is_empty(),
        "{} broken link(s) of {checked}:\n{}",
        problems.len(),
        problems.join("\n")
    );
    // The scanner must have found the links there are (the README alone has dozens).
    assert!(checked > 100, "only {checked} internal links found");
}

#[test]
fn every_page_of_the_book_is_in_the_summary() {
    let src = root().join("docs/src");
    let summary_path = src.join("SUMMARY.md");
    let summary = std::fs::read_to_string(&summary_path)
        .unwrap_or_else(|e| panic!("reading docs/src/SUMMARY.md: {e}"));
    let listed: BTreeSet<PathBuf> = scan(&summary, true)
        .links
        .iter()
        .filter(|l| !l.dest.is_empty() && !is_external(&l.dest))
        .map(|l| normalize(&src.join(l.dest.split('#').next().unwrap())))
        .collect();
    let pages: Vec<PathBuf> = markdown_under(&src)
        .into_iter()
        .filter(|p| *p != summary_path)
        .collect();
    assert!(
        pages.len() >= 5,
        "only {} pages under docs/src",
        pages.len()
    );
    let missing: Vec<String> = pages
        .iter()
        .filter(|p| !listed.contains(*p))
        .map(|p| p.strip_prefix(root()).unwrap().display().to_string())
        .collect();
    assert!(
        missing.is_empty(),
        "pages of the book that docs/src/SUMMARY.md does not list:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_scanner_reads_links_and_headings_as_mdbook_does() {
    let page = scan(
        "# Config keys\n\
         ## `[pipeline.sql_limits]`\n\
         ## What's *new*: [the API](x.md)\n\
         ## Repeat\n## Repeat\n\
         Setext heading\n--------------\n\
         ## Custom {#my-id}\n\
         ## a -- b  c `d--e`\n\
         ## `[workloads.<name>]`\n\
         See [a](a.md#x) and ![img](img/p.png \"title\") and `[not](code.md)`.\n\
         ```\n[not](fenced.md)\n```\n\
         <!-- [not](comment.md) -->\n\
         [ref]: ref.md#y\n\
         <a href=\"html.md\">h</a>\n",
        true,
    );
    let dests: Vec<&str> = page.links.iter().map(|l| l.dest.as_str()).collect();
    assert_eq!(
        dests,
        ["x.md", "a.md#x", "img/p.png", "ref.md#y", "html.md"]
    );
    assert_eq!(page.links[1].line, 11);
    for id in [
        "config-keys",
        "pipelinesql_limits",
        "whats-new-the-api",
        "repeat",
        "repeat-1",
        "setext-heading",
        "my-id",
        "a--b--c-d--e",
        "workloadsname",
    ] {
        assert!(page.anchors.contains(id), "{id} not in {:?}", page.anchors);
    }
}
