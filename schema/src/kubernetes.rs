//! Kubernetes' own name rules, where gpuwarden's configuration names Kubernetes things.

/// Checks a label or annotation key as Kubernetes does (`metadata.labels`): an optional prefix
/// (a DNS subdomain of at most 253 characters) and `/`, then a name of 1 to 63 characters,
/// letters, digits, `-`, `_` and `.`, beginning and ending with a letter or digit.
pub fn check_label_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        let dns_label = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        if prefix.is_empty() || prefix.len() > 253 || !prefix.split('.').all(dns_label) {
            return Err(format!(
                "its prefix {prefix:?} is not a DNS subdomain (lower-case letters, digits, '-' \
                 and '.', at most 253 characters)"
            ));
        }
    }
    let edge = |b: u8| b.is_ascii_alphanumeric();
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && name.bytes().next().is_some_and(edge)
        && name.bytes().last().is_some_and(edge);
    if ok {
        Ok(())
    } else {
        Err(format!(
            "its name {name:?} must be 1 to 63 letters, digits, '-', '_' or '.', beginning and \
             ending with a letter or digit"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::check_label_key;

    #[test]
    fn label_keys_follow_kubernetes_rules() {
        for good in [
            "app",
            "gpuwarden.io/workload",
            "nvidia.com/gpu.product",
            "a_b.c-d",
        ] {
            assert!(check_label_key(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "/x",
            "Gpuwarden.io/x",
            "a/",
            "-x",
            "x-",
            "a b",
            "gpuwarden.io/",
            "a/b/c",
        ] {
            assert!(check_label_key(bad).is_err(), "{bad}");
        }
        assert!(check_label_key(&"x".repeat(64)).is_err());
    }
}
