//! Sizes in the config are written as a number of bytes or with a unit: `1073741824`,
//! `"512MiB"`, `"1GiB"`, `"64 MB"`.

use serde::de::{self, Deserializer, Visitor};

/// Parses `"512MiB"`-style text (or a bare number of bytes); the error says what a valid size
/// looks like.
pub fn parse(text: &str) -> Result<u64, String> {
    let invalid = || {
        format!(
            "invalid size \"{text}\": write a number of bytes or a number and a unit, like \
             \"512MiB\", \"1GiB\" or \"64MB\""
        )
    };
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let number: u64 = number.parse().map_err(|_| invalid())?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(invalid()),
    };
    number.checked_mul(scale).ok_or_else(invalid)
}

struct Size;

impl Visitor<'_> for Size {
    type Value = u64;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a size: a number of bytes, or text like \"512MiB\"")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
        u64::try_from(v).map_err(|_| E::custom(format!("invalid size {v}: must not be negative")))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
        parse(v).map_err(E::custom)
    }
}

pub(crate) fn required<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    deserializer.deserialize_any(Size)
}

pub(crate) fn optional<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<u64>, D::Error> {
    deserializer.deserialize_any(Size).map(Some)
}

/// The JSON Schema of a size in the config (`#[schemars(schema_with)]` on each such field): a
/// number of bytes or text such as `"512MiB"`. The generated reference page of the config keys
/// reads it.
pub(crate) fn schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "type": ["integer", "string"], "format": "size" })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bytes_and_units() {
        assert_eq!(parse("1024").unwrap(), 1024);
        assert_eq!(parse("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse("1 GiB").unwrap(), 1 << 30);
        assert_eq!(parse("64MB").unwrap(), 64_000_000);
        assert_eq!(parse("8kib").unwrap(), 8192);
    }

    #[test]
    fn rejects_text_that_is_not_a_size() {
        for bad in ["", "MiB", "1.5GiB", "-1", "12 parsecs", "99999999999TiB"] {
            let err = parse(bad).unwrap_err();
            assert!(err.contains("invalid size"), "{bad}: {err}");
            assert!(err.contains("\"512MiB\""), "{bad}: {err}");
        }
    }
}
