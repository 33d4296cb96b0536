//! Where a field is in the config: the path of keys and list indexes that leads to it, as
//! problems name it (`teams[1].gpu_quota`).
//!
//! [`super::validate`] says which field each rule is about, and [`super::load`] finds the
//! field's line and column from its path.

/// One step of a field path: a key of a table, or an index in a list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Seg {
    Key(String),
    Index(usize),
}

/// The steps from the top of the file to a field.
pub(crate) type FieldPath = Vec<Seg>;

/// The step to the key `k` of a table.
pub(crate) fn key(k: &str) -> Seg {
    Seg::Key(k.to_string())
}

/// `path` as a person reads it: keys joined with `.`, indexes in brackets.
pub(crate) fn display_path(path: &[Seg]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Seg::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_reads_as_dotted_keys_and_bracketed_indexes() {
        let path = vec![key("teams"), Seg::Index(1), key("gpu_quota")];
        assert_eq!(display_path(&path), "teams[1].gpu_quota");
        assert_eq!(display_path(&[]), "");
    }
}
