//! The API's OpenAPI document: the operations (from each handler's `#[utoipa::path]`), the
//! bodies, the bearer scheme, the answers every operation shares, the field rules, and the links
//! from each answer carrying a lease to the operations on it; and `/openapi.json`, which
//! serves it.

use axum::http::header;
use axum::response::{IntoResponse, Response};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::OpenApi;

// The operations by name, with the `__path_` items `#[utoipa::path]` writes beside each: named
// through a module path, utoipa would tag every operation with the module's name. The Slurm
// hook's operations are its own door's (`slurm::routes`); the API's document describes them.
#[allow(clippy::wildcard_imports)]
use super::handlers::*;
#[allow(clippy::wildcard_imports)]
use crate::slurm::routes::*;

use super::types::{
    AdmissionResponse, DecisionKind, ExemptRequest, ExtendRequest, Lease, LeaseState,
    ResizeRequest, TeamView,
};
use super::{ErrorBody, ErrorDetail};
use crate::fields;
use crate::policy::{self, AdmissionRequest, Estimate, Reason};

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "An API token from `[[tokens]]` (the config keeps its SHA-256)",
                    ))
                    .build(),
            ),
        );
    }
}

/// The answers every operation of a kind can give, added once rather than listed on each: 401
/// and 429 where a token is required, 400 and 413 where a body is read, 500 on every `/v1`
/// operation.
struct CommonResponses;

fn error_response(description: &str) -> utoipa::openapi::Response {
    use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
    ResponseBuilder::new()
        .description(description)
        .content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ErrorBody")))
                .build(),
        )
        .build()
}

impl utoipa::Modify for CommonResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::header::HeaderBuilder;
        use utoipa::openapi::{ObjectBuilder, Type};
        for (path, item) in openapi.paths.paths.iter_mut() {
            for operation in [&mut item.get, &mut item.post].into_iter().flatten() {
                let responses = &mut operation.responses.responses;
                let mut add = |status: &str, response: utoipa::openapi::Response| {
                    responses.entry(status.into()).or_insert(response.into());
                };
                if operation.security.is_some() {
                    let mut unauthorized = error_response(
                        "No bearer token, or one that matches no `[[tokens]]` entry",
                    );
                    unauthorized.headers.insert(
                        "WWW-Authenticate".into(),
                        HeaderBuilder::new()
                            .schema(ObjectBuilder::new().schema_type(Type::String))
                            .description(Some("`Bearer`"))
                            .build(),
                    );
                    add("401", unauthorized);
                    let mut locked_out = error_response(
                        "Too many bearer tokens that matched nothing came from this address, or \
                         this token was presented too often (`enforcer.login_limits`); the token \
                         was not checked",
                    );
                    locked_out.headers.insert(
                        "Retry-After".into(),
                        HeaderBuilder::new()
                            .schema(
                                ObjectBuilder::new()
                                    .schema_type(Type::Integer)
                                    .minimum(Some(1)),
                            )
                            .description(Some("Seconds until the lockout ends"))
                            .build(),
                    );
                    add("429", locked_out);
                }
                if operation.request_body.is_some() {
                    add(
                        "400",
                        error_response("The body is missing or is not JSON (the error names the line and column)"),
                    );
                    add(
                        "413",
                        error_response("The body is larger than `enforcer.max_request_bytes`"),
                    );
                }
                if path.starts_with("/v1/") {
                    add(
                        "500",
                        error_response(
                            "The enforcer failed (its store, or a bug); the detail is in its log",
                        ),
                    );
                }
            }
        }
    }
}

/// The bounds and patterns of [`fields`], written into the request schemas that the handlers
/// check against them.
struct FieldRules;

impl utoipa::Modify for FieldRules {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::schema::{KnownFormat, SchemaFormat};
        use utoipa::openapi::{RefOr, Schema};
        let key = openapi
            .paths
            .paths
            .get_mut("/v1/admission")
            .and_then(|item| item.post.as_mut())
            .and_then(|op| op.parameters.as_mut())
            .and_then(|ps| ps.iter_mut().find(|p| p.name == "Idempotency-Key"))
            .and_then(|p| p.schema.as_mut());
        let Some(RefOr::T(Schema::Object(key))) = key else {
            panic!("POST /v1/admission has no Idempotency-Key header to constrain");
        };
        key.min_length = Some(1);
        key.max_length = Some(fields::MAX_KEY_CHARS + 2);
        key.pattern = Some(fields::IDEMPOTENCY_KEY_PATTERN.into());
        let Some(components) = openapi.components.as_mut() else {
            return;
        };
        let mut constrain =
            |schema: &str, property: &str, rule: &dyn Fn(&mut utoipa::openapi::Object)| {
                let Some(RefOr::T(Schema::Object(object))) = components.schemas.get_mut(schema)
                else {
                    panic!("the OpenAPI document has no object schema {schema}");
                };
                let Some(RefOr::T(Schema::Object(field))) = object.properties.get_mut(property)
                else {
                    panic!("{schema} has no property {property} to constrain");
                };
                rule(field);
            };
        let name = |o: &mut utoipa::openapi::Object| {
            o.min_length = Some(1);
            o.max_length = Some(fields::MAX_NAME_CHARS);
            o.pattern = Some(fields::NAME_PATTERN.into());
        };
        let duration = |o: &mut utoipa::openapi::Object| {
            o.pattern = Some(fields::DURATION_PATTERN.into());
        };
        let gpus = |o: &mut utoipa::openapi::Object| {
            o.format = Some(SchemaFormat::KnownFormat(KnownFormat::Int64));
            o.minimum = Some(1usize.into());
            o.maximum = Some((fields::MAX_GPUS as usize).into());
        };
        for property in ["team", "user", "project"] {
            constrain("AdmissionRequest", property, &name);
        }
        constrain("AdmissionRequest", "gpus", &gpus);
        constrain("AdmissionRequest", "duration", &duration);
        constrain("ResizeRequest", "gpus", &gpus);
        constrain("ExtendRequest", "duration", &duration);
        constrain("ExemptRequest", "duration", &duration);
        constrain("ExemptRequest", "reason", &|o| {
            o.max_length = Some(fields::MAX_NAME_CHARS);
            o.pattern = Some(fields::TEXT_PATTERN.into());
        });
        let Some(RefOr::T(Schema::Object(admission))) =
            components.schemas.get_mut("AdmissionRequest")
        else {
            panic!("the OpenAPI document has no AdmissionRequest");
        };
        let Some(RefOr::T(Schema::Array(command))) = admission.properties.get_mut("command") else {
            panic!("AdmissionRequest's command is not an array");
        };
        let argument = || {
            utoipa::openapi::ObjectBuilder::new()
                .schema_type(utoipa::openapi::Type::String)
                .pattern(Some(fields::ARGUMENT_PATTERN))
        };
        command.min_items = Some(1);
        command.items =
            utoipa::openapi::schema::ArrayItems::RefOrSchema(Box::new(argument().into()));
        command.prefix_items = vec![argument().min_length(Some(1)).into()];
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "gpuwarden enforcer",
        description = "Admission and leases for GPU fleets: a denial is a 200 decision with every reason."
    ),
    paths(admission, list_leases, get_lease, release_lease, extend_lease, resize_lease, exempt_lease, get_team, slurm_submit, slurm_modify, healthz, readyz),
    components(schemas(
        AdmissionRequest, AdmissionResponse, DecisionKind, Reason, policy::ReasonCode, Estimate,
        Lease, LeaseState, ExtendRequest, ExemptRequest, ResizeRequest, TeamView, ErrorBody, ErrorDetail,
        policy::WorkloadName, policy::ReleaseReasonName, crate::slurm::SubmitRequest,
        crate::slurm::ModifyRequest
    )),
    modifiers(&BearerAuth, &CommonResponses, &FieldRules)
)]
struct ApiDoc;

/// The OpenAPI document of [`super::router`], without its links (see [`openapi_json`]).
pub fn openapi() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The operations on one lease that an answer carrying it links to: (link name, operationId,
/// description).
const LEASE_LINKS: [(&str, &str, &str); 5] = [
    ("GetLease", "get_lease", "The lease"),
    ("ReleaseLease", "release_lease", "End the lease"),
    ("ExtendLease", "extend_lease", "Move the lease's end later"),
    (
        "ResizeLease",
        "resize_lease",
        "Change the lease's GPU count",
    ),
    (
        "ExemptLease",
        "exempt_lease",
        "Exempt the lease from the runtime rules",
    ),
];

/// [`openapi`] as pretty JSON with a trailing newline: what `/openapi.json` serves and
/// `enforcer/openapi.json` holds. It adds the links from every answer that carries a lease to the
/// operations on that lease, so a client (or a stateful test) can follow a lease from its
/// admission to its release. They are written here, as JSON, because utoipa 5.5 serializes a
/// Link's fields in snake case (`operation_id`) where OpenAPI spells them `operationId`.
pub fn openapi_json() -> String {
    let mut document = serde_json::to_value(openapi()).expect("an OpenAPI document is plain JSON");
    for (path, method, id) in [
        ("/v1/admission", "post", "$response.body#/lease/id"),
        ("/v1/leases/{id}/resize", "post", "$response.body#/lease/id"),
        ("/v1/leases/{id}", "get", "$response.body#/id"),
        ("/v1/leases/{id}/extend", "post", "$response.body#/id"),
        ("/v1/leases/{id}/exempt", "post", "$response.body#/id"),
    ] {
        let ok = &mut document["paths"][path][method]["responses"]["200"];
        assert!(ok.is_object(), "{method} {path} documents no 200 answer");
        ok["links"] = LEASE_LINKS
            .iter()
            .map(|(name, operation, description)| {
                let link = serde_json::json!({
                    "operationId": operation,
                    "parameters": {"id": id},
                    "description": description,
                });
                (name.to_string(), link)
            })
            .collect();
    }
    let mut text =
        serde_json::to_string_pretty(&document).expect("an OpenAPI document is plain JSON");
    text.push('\n');
    text
}

/// `/openapi.json`: [`openapi_json`].
pub(super) async fn openapi_document() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], openapi_json()).into_response()
}
