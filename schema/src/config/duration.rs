//! Durations in the config are written as people say them: `"30s"`, `"5m"`, `"1h30m"`.

use std::time::Duration;

use serde::{Deserialize, Deserializer};

/// Parses `"30m"`-style text; the error says what a valid duration looks like.
pub fn parse(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim()).map_err(|_| {
        format!("invalid duration \"{text}\": write a number and a unit, like \"30s\", \"5m\", \"2h\" or \"1h30m\"")
    })
}

pub(crate) fn required<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(deserializer)?;
    parse(&text).map_err(serde::de::Error::custom)
}

pub(crate) fn optional<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Duration>, D::Error> {
    let text = String::deserialize(deserializer)?;
    parse(&text).map(Some).map_err(serde::de::Error::custom)
}

/// A duration, or `"forever"` (`None`): how long something is kept.
pub(crate) fn or_forever<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Duration>, D::Error> {
    let text = String::deserialize(deserializer)?;
    if text.trim() == "forever" {
        return Ok(None);
    }
    parse(&text)
        .map(Some)
        .map_err(|e| serde::de::Error::custom(format!("{e}, or \"forever\"")))
}

/// The JSON Schema of a duration in the config (`#[schemars(schema_with)]` on each such field):
/// text such as `"30s"`. The generated reference page of the config keys reads it.
pub(crate) fn schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "type": "string", "format": "duration" })
}

/// [`schema`] for a field read with [`or_forever`].
pub(crate) fn schema_or_forever(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "anyOf": [{ "type": "string", "format": "duration" }, { "const": "forever" }]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_human_durations() {
        assert_eq!(parse("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse("250ms").unwrap(), Duration::from_millis(250));
    }

    #[test]
    fn rejects_text_that_is_not_a_duration() {
        for bad in ["", "5", "five minutes", "5 parsecs", "-5m"] {
            let err = parse(bad).unwrap_err();
            assert!(err.contains("invalid duration"), "{bad}: {err}");
            assert!(err.contains("\"30s\""), "{bad}: {err}");
        }
    }
}
