//! JSON Schema documents for the four records, generated from the Rust types so they cannot
//! disagree with them. The committed copies under `schema/json/` are for producers in other
//! languages; a test fails when they drift from what this module generates.

use schemars::generate::SchemaSettings;
use schemars::JsonSchema;

use crate::{Action, LeaseEvent, Sample, Signal};

/// `(file name, pretty-printed JSON Schema)` for each record, in a stable order.
pub fn documents() -> Vec<(&'static str, String)> {
    vec![
        ("sample.v1.schema.json", document::<Sample>("sample")),
        (
            "lease_event.v1.schema.json",
            document::<LeaseEvent>("lease_event"),
        ),
        ("signal.v1.schema.json", document::<Signal>("signal")),
        ("action.v1.schema.json", document::<Action>("action")),
    ]
}

fn document<T: JsonSchema>(name: &str) -> String {
    let generator = SchemaSettings::draft2020_12().into_generator();
    let mut schema = generator.into_root_schema_for::<T>();
    schema.insert(
        "$id".into(),
        format!("urn:gpuwarden:schema:{name}:v1").into(),
    );
    let mut text = serde_json::to_string_pretty(&schema).expect("a schema is plain JSON");
    text.push('\n');
    text
}
