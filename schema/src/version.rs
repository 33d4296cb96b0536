//! The contract version carried by every record as `"v": 1`.
//!
//! A zero-sized type rather than an integer, so a record built in Rust cannot claim another
//! version, and a record of a version this build does not know fails to decode with a reason
//! that names `v`.

use std::borrow::Cow;
use std::fmt;

use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// Version 1 of the gpuwarden contracts; serializes as the integer `1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct V1;

impl V1 {
    /// The integer this version is written as.
    pub const NUMBER: u8 = 1;
}

impl Serialize for V1 {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u8(Self::NUMBER)
    }
}

impl<'de> Deserialize<'de> for V1 {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct VersionVisitor;
        impl Visitor<'_> for VersionVisitor {
            type Value = V1;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("the contract version 1")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<V1, E> {
                if v == u64::from(V1::NUMBER) {
                    Ok(V1)
                } else {
                    Err(E::custom(format!(
                        "unsupported contract version {v}; this build reads version 1"
                    )))
                }
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<V1, E> {
                match u64::try_from(v) {
                    Ok(v) => self.visit_u64(v),
                    Err(_) => Err(E::custom(format!(
                        "unsupported contract version {v}; this build reads version 1"
                    ))),
                }
            }
        }
        deserializer.deserialize_u64(VersionVisitor)
    }
}

impl JsonSchema for V1 {
    fn schema_name() -> Cow<'static, str> {
        "ContractVersion".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "Contract version; this is version 1.",
            "type": "integer",
            "const": 1
        })
    }
    fn inline_schema() -> bool {
        true
    }
}
