//! What the admission API accepts in its fields, stated once. The OpenAPI document's patterns and
//! bounds are these constants, and the handlers check requests against the same constants, so a
//! client generated from the document sends nothing the server refuses for its shape, and the
//! server refuses everything the document rules out (`schemathesis`, run by `tests/openapi.rs`,
//! holds both sides to it).
//!
//! The patterns are written in the subset of regular expressions that ECMA-262 (what JSON Schema
//! names), Python's `re` and Rust's `regex` read alike: explicit ASCII classes, no `\s`, `\d` or
//! look-around, anchored with `^` and `$` and unable to match a newline.

use std::sync::LazyLock;
use std::time::Duration;

use regex::Regex;
use serde::{Deserialize, Deserializer};

/// The most characters a name (`team`, `user`, `project`) or a reason may have.
pub const MAX_NAME_CHARS: usize = 256;

/// A name: no control characters, and no space at either end. Teams must also be configured;
/// users and projects are free-form.
pub const NAME_PATTERN: &str = r"^[^\x00-\x1f\x7f ]([^\x00-\x1f\x7f]*[^\x00-\x1f\x7f ])?$";

/// Free text that must say something (`exempt`'s reason): at least one character that is not a
/// space or a control character.
pub const TEXT_PATTERN: &str = r"[^\x00-\x20\x7f]";

/// The units [`DURATION_PATTERN`] takes, as one group (a macro, so `concat!` can use it).
macro_rules! duration_unit {
    () => {
        "(ms|msec|millis|s|sec|secs|second|seconds|m|min|mins|minute|minutes|h|hr|hrs|hour|hours|d|day|days|w|wk|wks|week|weeks)"
    };
}

/// A duration as people write it: parts of a whole number (at most six digits, no leading zeros)
/// and a unit, optionally separated by one space, adding up to more than zero: one part with a
/// number above zero, which up to three zero parts may precede (`"0h 30m"`) and up to three more
/// parts may follow (`"1h30m"`). Units: `ms`, `s`, `m`, `h`, `d`, `w` and their long forms
/// (`msec`, `millis`, `sec`, `secs`, `second`, `seconds`, `min`, `mins`, `minute`, `minutes`,
/// `hr`, `hrs`, `hour`, `hours`, `day`, `days`, `wk`, `wks`, `week`, `weeks`). Examples: `"30m"`,
/// `"2h"`, `"1h30m"`, `"1h 30m"`, `"3 days"`. The longest is four parts of 999999 weeks, about
/// 76,000 years: every duration the pattern admits fits in the millisecond timestamps leases
/// carry.
pub const DURATION_PATTERN: &str = concat!(
    "^(0 ?",
    duration_unit!(),
    " ?){0,3}[1-9][0-9]{0,5} ?",
    duration_unit!(),
    "( ?(0|[1-9][0-9]{0,5}) ?",
    duration_unit!(),
    "){0,3}$"
);

/// An argument of a lease's command: any text without a NUL character, which no program's
/// argument can hold. The first, the program, must also not be empty.
pub const ARGUMENT_PATTERN: &str = r"^[^\x00]*$";

/// An admission's `Idempotency-Key` header: 1 to [`MAX_KEY_CHARS`] visible ASCII characters
/// but `"`, bare or quoted (the structured-field string the IETF draft of the header writes).
pub const IDEMPOTENCY_KEY_PATTERN: &str = r#"^([!#-~]{1,255}|"[!#-~]{1,255}")$"#;

/// The most characters an `Idempotency-Key` may have, quotes aside.
pub const MAX_KEY_CHARS: usize = 255;

/// The most GPUs one request may name: the largest count a lease can hold.
pub const MAX_GPUS: u32 = u32::MAX;

static NAME: LazyLock<Regex> = LazyLock::new(|| Regex::new(NAME_PATTERN).expect("a valid regex"));
static TEXT: LazyLock<Regex> = LazyLock::new(|| Regex::new(TEXT_PATTERN).expect("a valid regex"));
static KEY: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(IDEMPOTENCY_KEY_PATTERN).expect("a valid regex"));
static DURATION: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(DURATION_PATTERN).expect("a valid regex"));

/// Checks a name field; the error says what a valid one looks like.
pub fn check_name(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err("must not be empty".into());
    }
    if value.chars().count() > MAX_NAME_CHARS {
        return Err(format!("must be at most {MAX_NAME_CHARS} characters"));
    }
    if !NAME.is_match(value) {
        return Err("must have no control characters and no space at either end".into());
    }
    Ok(())
}

/// Reads an `Idempotency-Key` header's value: the key, without the quotes it may have.
pub fn idempotency_key(value: &[u8]) -> Result<String, String> {
    let text = std::str::from_utf8(value).unwrap_or("\u{fffd}");
    if !KEY.is_match(text) {
        return Err(format!(
            "must be 1 to {MAX_KEY_CHARS} visible ASCII characters other than '\"' (a UUID, \
             for example), optionally in double quotes"
        ));
    }
    Ok(text.trim_matches('"').to_owned())
}

/// Checks a free-text field that must say something.
pub fn check_text(value: &str) -> Result<(), String> {
    if value.chars().count() > MAX_NAME_CHARS {
        return Err(format!("must be at most {MAX_NAME_CHARS} characters"));
    }
    if !TEXT.is_match(value) {
        return Err("must say something: it is empty or only spaces".into());
    }
    Ok(())
}

/// Checks a lease's command (argv): a program, then its arguments, none holding a NUL.
pub fn check_command(argv: &[String]) -> Result<(), String> {
    match argv.first() {
        None => Err("must name a program: it is an empty list".into()),
        Some(program) if program.is_empty() => {
            Err("must name a program: the first is empty".into())
        }
        Some(_) if argv.iter().any(|a| a.contains('\0')) => {
            Err("an argument holds a NUL character, which no program can be given".into())
        }
        Some(_) => Ok(()),
    }
}

/// Parses a duration field: the pattern first, then its value.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let invalid = || {
        format!(
            "invalid duration \"{text}\": write whole numbers with units adding up to more than \
             zero, like \"30m\", \"2h\", \"1h30m\" or \"3d\""
        )
    };
    if !DURATION.is_match(text) {
        return Err(invalid());
    }
    humantime::parse_duration(text).map_err(|_| invalid())
}

/// Deserializes an optional duration field with [`parse_duration`].
pub fn optional_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    Option::<String>::deserialize(d)?
        .map(|t| parse_duration(&t).map_err(serde::de::Error::custom))
        .transpose()
}

/// Deserializes a GPU count as JSON Schema reads `"type": "integer"`: any JSON number without a
/// fractional part (`2`, `2.0`, `2e0`), from 0 to [`MAX_GPUS`]. The handlers check the minimum
/// of 1, naming the field.
pub fn gpu_count<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let number = serde_json::Number::deserialize(d)?;
    let whole = match (number.as_u64(), number.as_f64()) {
        (Some(n), _) => Some(n),
        (None, Some(f)) if f.fract() == 0.0 && (0.0..=f64::from(MAX_GPUS)).contains(&f) => {
            Some(f as u64)
        }
        _ => None,
    };
    whole.and_then(|n| u32::try_from(n).ok()).ok_or_else(|| {
        serde::de::Error::custom(format!(
            "must be a whole number from 1 to {MAX_GPUS}, not {number}"
        ))
    })
}

/// A whole number as JSON Schema's `integer` allows it (`3`, `3.0`, `3e0`) that fits `u64`.
fn whole<E: serde::de::Error>(number: &serde_json::Number) -> Result<u64, E> {
    match (number.as_u64(), number.as_f64()) {
        (Some(n), _) => Ok(n),
        // 2^64 is the first float past u64::MAX.
        (None, Some(f)) if f.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&f) => {
            Ok(f as u64)
        }
        _ => Err(E::custom(format!(
            "must be a whole number of 0 or more, not {number}"
        ))),
    }
}

/// A required whole number (see `whole`).
pub fn whole_u64<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    whole(&serde_json::Number::deserialize(d)?)
}

/// An optional whole number (see `whole`); null is none.
pub fn optional_whole<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Option::<serde_json::Number>::deserialize(d)?
        .map(|n| whole(&n))
        .transpose()
}

/// An optional whole number that fits `u32` (a uid).
pub fn optional_whole_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    optional_whole(d)?
        .map(|n| {
            u32::try_from(n)
                .map_err(|_| serde::de::Error::custom(format!("{n} is more than 4294967295")))
        })
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_numbers_may_be_written_as_floats() {
        let parse = |json: &str| {
            let mut de = serde_json::Deserializer::from_str(json);
            optional_whole(&mut de).map_err(|e| e.to_string())
        };
        assert_eq!(parse("3"), Ok(Some(3)));
        assert_eq!(parse("13081.0"), Ok(Some(13081)));
        assert_eq!(parse("null"), Ok(None));
        assert!(parse("1.5").is_err());
        assert!(parse("-1").is_err());
        assert!(parse("1e30").is_err());
    }

    #[test]
    fn durations_the_pattern_admits_parse_and_others_do_not() {
        for (text, secs) in [
            ("30m", 1800),
            ("2h", 7200),
            ("1h30m", 5400),
            ("1h 30m", 5400),
            ("3 days", 3 * 86400),
            ("0h 5m", 300),
            ("5m 0s", 300),
            ("999999w", 999_999 * 7 * 86400),
        ] {
            assert_eq!(
                parse_duration(text),
                Ok(Duration::from_secs(secs)),
                "{text}"
            );
        }
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        for bad in [
            "",
            "0s",
            "0h0m",
            "5",
            " 5m",
            "5m ",
            "5m\n",
            "1.5h",
            "05m",
            "1 2h",
            "-5m",
            "5M",
            "5 parsecs",
            "1000000s",
            "1s1s1s1s1s1s1s1s",
            "1h  30m",
            "1h\t30m",
        ] {
            let err = parse_duration(bad).unwrap_err();
            assert!(err.contains("invalid duration"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn the_longest_duration_fits_in_millisecond_timestamps() {
        let longest =
            parse_duration("0w 0w 0w 999999w 999999w 999999w 999999w").expect("seven parts");
        let now_ms = 4_102_444_800_000_i64; // 2100-01-01
        let end = i64::try_from(longest.as_millis()).expect("fits in i64") + now_ms;
        assert!(end > now_ms);
        assert!(parse_duration("999999w 999999w 999999w 999999w 1s").is_err());
        assert!(parse_duration("0s 0s 0s 0s 1s").is_err());
    }

    #[test]
    fn names_have_no_control_characters_and_no_space_at_the_ends() {
        for good in ["research", "a", "ml platform", "é", "team-1"] {
            assert_eq!(check_name(good), Ok(()), "{good:?}");
        }
        for bad in ["", " ", " a", "a ", "a\n", "\u{7f}", "a\tb"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_name(&"x".repeat(MAX_NAME_CHARS)).is_ok());
        assert!(check_name(&"x".repeat(MAX_NAME_CHARS + 1)).is_err());
    }

    #[test]
    fn commands_name_a_program_and_hold_no_nul() {
        let argv = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(check_command(&argv(&["python", "train.py", ""])).is_ok());
        for bad in [&[][..], &[""], &["sh", "a\0b"]] {
            assert!(check_command(&argv(bad)).is_err(), "{bad:?}");
        }
        let pattern = Regex::new(ARGUMENT_PATTERN).unwrap();
        assert!(pattern.is_match("any text\n at all"));
        assert!(!pattern.is_match("a\0b"));
    }

    #[test]
    fn text_must_say_something() {
        assert!(check_text("weekend benchmark").is_ok());
        for bad in ["", "   ", "\n\t"] {
            assert!(check_text(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn gpu_counts_are_whole_numbers_in_range() {
        let parse = |json: &str| {
            let mut de = serde_json::Deserializer::from_str(json);
            gpu_count(&mut de).map_err(|e| e.to_string())
        };
        assert_eq!(parse("2"), Ok(2));
        assert_eq!(parse("20798.0"), Ok(20798));
        assert_eq!(parse("2e0"), Ok(2));
        assert_eq!(parse("4294967295"), Ok(u32::MAX));
        for bad in ["1.5", "-1", "4294967296", "4294967296.0", "\"2\"", "1e20"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
