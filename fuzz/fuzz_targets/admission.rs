//! `POST /v1/admission` bodies as the enforcer's API reads them, up to the policy's answer, with
//! no IO: `api::decode` (what the `ApiJson` extractor runs on the body), then
//! `AdmissionRequest::check_fields` (what the service checks before anything else), then
//! `policy::evaluate` against the example config's teams and simulated fleet.
//!
//! A body the API refuses must be the caller's fault (400 or 422, never a 5xx); a request the
//! policy admits must be placed on GPUs that exist, of the model asked for, as many as asked for,
//! each once; a denial says why; the decision is the same when asked twice.
#![no_main]

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::{Arc, LazyLock};

use gpuwarden_enforcer::api::decode;
use gpuwarden_enforcer::drivers::{Gpu, Inventory};
use gpuwarden_enforcer::policy::{
    evaluate, AdmissionRequest, Placements, Principal, Request, Snapshot, SubstrateState,
};
use gpuwarden_schema::config::{self, contains_ignoring_case, Role};
use gpuwarden_schema::fleet::simulated_inventory;
use libfuzzer_sys::fuzz_target;

/// The example config, its simulated substrates' GPUs, nothing held, nothing spent.
static SNAPSHOT: LazyLock<Snapshot> = LazyLock::new(|| {
    let text = include_str!("../../examples/gpuwarden.toml");
    // The example takes its secrets from the environment, as an operator's config would.
    std::env::set_var("GPUWARDEN_SQL_PASSWORD", "fuzz");
    std::env::set_var(
        "GPUWARDEN_SIGNING_KEY",
        "fuzz-signing-key-of-at-least-32-bytes!!",
    );
    let config = config::parse("examples/gpuwarden.toml", text).expect("the example config");
    let substrates = config
        .substrates
        .iter()
        .map(|s| SubstrateState {
            name: s.name.clone(),
            inventory: Arc::new(Inventory {
                // As the simulated driver reports it.
                gpus: simulated_inventory(s).into_iter().map(Gpu::from).collect(),
                pooled: Vec::new(),
                queues: false,
            }),
            ..SubstrateState::default()
        })
        .collect();
    Snapshot {
        config: Arc::new(config),
        held_gpus: BTreeMap::new(),
        spend_usd: BTreeMap::new(),
        blocked: BTreeSet::new(),
        substrates,
    }
});

fuzz_target!(|bytes: &[u8]| {
    let request: AdmissionRequest = match decode(bytes) {
        Ok(request) => request,
        Err(err) => {
            let status = err.status().as_u16();
            assert!(
                matches!(status, 400 | 422),
                "{status} for a malformed body: {err}"
            );
            assert!(!err.to_string().trim().is_empty(), "{err:?}");
            return;
        }
    };
    if let Err((field, why)) = request.check_fields() {
        assert!(!why.trim().is_empty(), "{field}");
        return;
    }
    let snapshot = &*SNAPSHOT;
    // A front-end acting for every team: the policy's own checks decide, not the token's.
    let principal = Principal {
        name: "fuzz".into(),
        role: Role::Service,
        teams: snapshot
            .config
            .teams
            .iter()
            .map(|t| t.name.clone())
            .collect(),
    };
    let asked = Request {
        principal,
        admission: request.clone(),
    };
    let decision = evaluate(&asked, snapshot, &mut Placements::default());
    let again = evaluate(&asked, snapshot, &mut Placements::default());
    assert_eq!(
        decision, again,
        "the same request decided twice differently"
    );

    let estimate = &decision.estimate;
    assert!(
        estimate.usd_per_hour.is_finite() && estimate.usd_per_hour >= 0.0,
        "{estimate:?}"
    );
    if let Some(max) = estimate.max_usd {
        assert!(max.is_finite() && max >= 0.0, "{estimate:?}");
    }
    for reason in &decision.reasons {
        assert!(!reason.message.trim().is_empty(), "{reason:?}");
    }
    if !decision.admitted() {
        assert!(
            !decision.reasons.is_empty(),
            "denied without a reason: {decision:?}"
        );
        return;
    }
    let placement = decision.placement.as_ref().expect("admitted means placed");
    assert_eq!(placement.gpu_count, request.gpus, "{decision:?}");
    if let Some(s) = &request.substrate {
        assert_eq!(&placement.substrate, s, "{decision:?}");
    }
    if let Some(model) = &request.gpu_model {
        assert!(
            contains_ignoring_case(&placement.gpu_model, model),
            "{decision:?}"
        );
    }
    let substrate = snapshot
        .substrates
        .iter()
        .find(|s| s.name == placement.substrate)
        .expect("placed on a substrate that exists");
    if !substrate.inventory.gpus.is_empty() {
        assert_eq!(
            placement.gpu_uuids.len() as u64,
            u64::from(request.gpus),
            "{decision:?}"
        );
        let mut seen = HashSet::new();
        for uuid in &placement.gpu_uuids {
            assert!(seen.insert(uuid), "{uuid} placed twice: {decision:?}");
            let gpu = substrate
                .inventory
                .gpus
                .iter()
                .find(|g| &g.uuid == uuid)
                .unwrap_or_else(|| panic!("{uuid} is not on {}", substrate.name));
            assert_eq!(gpu.model, placement.gpu_model, "{decision:?}");
        }
    }
});
