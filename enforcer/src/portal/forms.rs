//! The portal's forms as the browser sends them, checked and turned into what the service is
//! asked; and what a request form's admission answered, as the pages show it.
//!
//! A request form is decoded as the API decodes its body, so a field is refused for the same
//! reasons, named the same way, whichever door it came through.

use std::collections::BTreeMap;

use gpuwarden_schema::config::Role;
use serde::Deserialize;

use crate::policy::{AdmissionRequest, Principal};
use crate::service::{Admission, Team};
use crate::web;

/// The sign-in form: the API token, checked once and never kept.
#[derive(Debug, Deserialize)]
pub(super) struct SigninForm {
    #[serde(default)]
    pub(super) token: String,
}

/// A form that only says which session sent it (sign-out, release).
#[derive(Debug, Deserialize)]
pub(super) struct CsrfForm {
    #[serde(default)]
    pub(super) csrf: String,
}

/// The extension form of an open lease.
#[derive(Debug, Deserialize)]
pub(super) struct ExtendForm {
    #[serde(default)]
    pub(super) csrf: String,
    #[serde(default)]
    pub(super) duration: String,
}

/// The request form's fields, as the browser sends them.
#[derive(Debug, Clone, Default, Deserialize)]
pub(super) struct RequestForm {
    #[serde(default)]
    pub(super) csrf: String,
    /// The form's one-use token (a new one each time the form is drawn): a second submission of
    /// the same form, as a reload sends, asks nothing.
    #[serde(default)]
    pub(super) submission: String,
    #[serde(default)]
    pub(super) team: String,
    #[serde(default)]
    pub(super) user: String,
    #[serde(default)]
    pub(super) project: String,
    #[serde(default)]
    pub(super) workload: String,
    #[serde(default)]
    pub(super) gpu_model: String,
    #[serde(default)]
    pub(super) gpus: String,
    #[serde(default)]
    pub(super) duration: String,
    /// `key=value`, one a line.
    #[serde(default)]
    pub(super) labels: String,
    /// Set by the "Check cost" button: a dry run.
    #[serde(default)]
    pub(super) check: Option<String>,
}

impl RequestForm {
    /// The admission request these fields make, decoded as the API decodes its body (so a
    /// field is refused for the same reasons, named the same way): the field at fault and why,
    /// otherwise.
    pub(super) fn admission(
        &self,
        principal: &Principal,
        dry_run: bool,
    ) -> Result<AdmissionRequest, String> {
        let user = if principal.role == Role::Member || self.user.trim().is_empty() {
            principal.name.clone()
        } else {
            self.user.trim().to_owned()
        };
        let gpus: serde_json::Value = match self.gpus.trim().parse::<u64>() {
            Ok(n) => n.into(),
            Err(_) => {
                return Err(format!(
                    "GPUs: \"{}\" is not a whole number of GPUs",
                    self.gpus.trim()
                ))
            }
        };
        let mut labels = BTreeMap::new();
        for line in self.labels.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let Some((k, v)) = line.split_once('=') else {
                return Err(format!(
                    "labels: \"{line}\" is not key=value (one label a line)"
                ));
            };
            labels.insert(k.trim().to_owned(), v.trim().to_owned());
        }
        let mut body = serde_json::json!({
            "team": self.team.trim(),
            "user": user,
            "project": self.project.trim(),
            "workload": self.workload.trim(),
            "gpus": gpus,
            "dry_run": dry_run,
        });
        if !self.gpu_model.trim().is_empty() {
            body["gpu_model"] = self.gpu_model.trim().into();
        }
        if !self.duration.trim().is_empty() {
            body["duration"] = self.duration.trim().into();
        }
        if !labels.is_empty() {
            body["labels"] = serde_json::json!(labels);
        }
        let request: AdmissionRequest =
            web::decode(body.to_string().as_bytes()).map_err(|e| e.to_string())?;
        request
            .check_fields()
            .map_err(|(field, why)| format!("{field}: {why}"))?;
        Ok(request)
    }
}

/// What an admission answered, for a page.
pub(super) struct Outcome {
    /// The request asked.
    pub(super) request: AdmissionRequest,
    /// Its decision and lease.
    pub(super) admission: Admission,
    /// The team after the decision.
    pub(super) team: Option<Team>,
}
