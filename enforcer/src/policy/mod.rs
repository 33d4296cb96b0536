//! The admission policy: a pure function from a request and a snapshot of the world to a decision.
//!
//! [`evaluate`] and [`evaluate_resize`] do no I/O and read no clock: everything they depend on is
//! in their arguments, the [`Request`] (or the [`Holding`]), the [`Snapshot`], and the
//! [`Placements`] placement keeps between decisions. The lease store builds the snapshot's
//! holdings, spend and blocks inside the same transaction that records the lease, and the
//! service adds the drivers' inventories, so the decision and the lease it creates cannot
//! disagree. Every check that fails is reported, each with a stable [`ReasonCode`], so a
//! front-end can show a person all that stands in the way at once. Placement (which substrate,
//! model and GPUs) is decided here too, because "is there capacity" and "which GPUs" are the same
//! question.
//!
//! - [`request`]: what the policy is asked (principal, admission request, holding);
//! - [`decision`]: what it answers (decision, reasons, estimate, placement);
//! - [`placement`]: the fleet index, the holdings and the placement state kept between calls;
//! - this module: the snapshot and the two evaluations.

pub mod decision;
pub mod placement;
pub mod request;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use gpuwarden_schema::config::{contains_ignoring_case, Config};

pub use self::decision::{Decision, Estimate, Placement, Reason, ReasonCode};
use self::placement::FreeGpus;
pub use self::placement::{FleetIndex, HeldGpus, Placements};
pub use self::request::{AdmissionRequest, Holding, Principal, Request};
pub(crate) use self::request::{ReleaseReasonName, WorkloadName};
use crate::inventory::{Inventory, Refusal, RefusalCode};

/// One substrate as placement sees it: what it has and what open leases hold of it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SubstrateState {
    /// The substrate's `[[substrates]]` name.
    pub name: String,
    /// What its driver reports.
    pub inventory: Arc<Inventory>,
    /// UUIDs held by open leases.
    pub busy: Arc<HeldGpus>,
    /// GPUs of pooled capacity held by open leases, by model.
    pub pooled_in_use: BTreeMap<String, u32>,
    /// `inventory` arranged for placement, kept by the caller from one request to the next
    /// while the driver reports the same inventory; built on the spot when absent or stale.
    pub index: Option<Arc<FleetIndex>>,
    /// Why the substrate refuses this request's user whatever is free (asked of its driver by
    /// the caller); placement passes such a substrate by.
    pub refusal: Option<Refusal>,
}

impl SubstrateState {
    /// The placement index of this state's inventory.
    fn fleet(&self) -> Arc<FleetIndex> {
        match &self.index {
            Some(index) if index.is_of(&self.inventory) => index.clone(),
            _ => Arc::new(FleetIndex::new(self.inventory.clone())),
        }
    }
}

/// Everything [`evaluate`] needs to know about the world, gathered by the caller.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Teams, workload policies and pricing.
    pub config: Arc<Config>,
    /// GPUs each team holds in open leases.
    pub held_gpus: BTreeMap<String, u32>,
    /// Month-to-date spend per team: the latest `team_spend` signal plus what the team's open
    /// leases have accrued since it.
    pub spend_usd: BTreeMap<String, f64>,
    /// Teams whose new admissions are stopped.
    pub blocked: BTreeSet<String>,
    /// Substrates in the order placement may try them when nothing else orders them.
    pub substrates: Vec<SubstrateState>,
}

fn matches(model: &str, pattern: &str) -> bool {
    contains_ignoring_case(model, pattern)
}

fn hours(d: Duration) -> f64 {
    d.as_secs_f64() / 3600.0
}

fn money(usd: f64) -> String {
    format!("${usd:.2}")
}

/// Decides an admission request against a snapshot. Pure: the same inputs give the same answer.
pub fn evaluate(request: &Request, snapshot: &Snapshot, placements: &mut Placements) -> Decision {
    let req = &request.admission;
    let config = &snapshot.config;
    let policy = config.workload(req.workload);
    let team = config.team(&req.team);
    let duration = req.duration.or(policy.max_duration);
    let mut decision = Decision {
        reasons: Vec::new(),
        estimate: Estimate {
            usd_per_hour: 0.0,
            max_usd: None,
            gpu_model: None,
        },
        placement: None,
        duration,
    };

    if let Some(why) = request.principal.write_refusal(&req.team, &req.user) {
        decision.deny(ReasonCode::NotMember, why);
    }
    match team {
        None => decision.deny(
            ReasonCode::NotMember,
            format!("there is no team named {}", req.team),
        ),
        Some(t) if !t.members.is_empty() && !t.members.iter().any(|m| m == &req.user) => decision
            .deny(
                ReasonCode::NotMember,
                format!("{} is not a member of team {}", req.user, t.name),
            ),
        Some(_) => {}
    }

    if !config.workloads.is_empty() && !config.workloads.contains_key(&req.workload) {
        let offered: Vec<&str> = config.workloads.keys().map(|w| w.as_str()).collect();
        decision.deny(
            ReasonCode::WorkloadNotOffered,
            format!(
                "{} leases are not offered here; the config defines {}",
                req.workload,
                offered.join(", ")
            ),
        );
    }

    if let Some(max) = policy.max_gpus {
        if req.gpus > max {
            decision.deny(
                ReasonCode::WorkloadLimit,
                format!(
                    "{} leases may hold at most {max} GPUs; {} were asked for",
                    req.workload, req.gpus
                ),
            );
        }
    }
    if let Some(s) = &req.substrate {
        if !policy.substrates.is_empty() && !policy.substrates.contains(s) {
            decision.deny(
                ReasonCode::WorkloadLimit,
                format!(
                    "{} leases run on {}, not on {s}",
                    req.workload,
                    policy.substrates.join(", ")
                ),
            );
        }
    }

    let allowed: &[String] = team.map_or(&[], |t| t.allowed_models.as_slice());
    let model_allowed =
        |model: &str| allowed.is_empty() || allowed.iter().any(|a| matches(model, a));
    if let Some(wanted) = &req.gpu_model {
        let fits = allowed.is_empty()
            || allowed
                .iter()
                .any(|a| matches(wanted, a) || matches(a, wanted));
        if !fits {
            decision.deny(
                ReasonCode::ModelNotAllowed,
                format!(
                    "team {} may use {}, not {wanted}",
                    req.team,
                    allowed.join(", ")
                ),
            );
        }
    }

    if let (Some(asked), Some(max)) = (req.duration, policy.max_duration) {
        if asked > max {
            decision.deny(
                ReasonCode::DurationLimit,
                format!(
                    "{} leases may last at most {}; {} was asked for",
                    req.workload,
                    humantime::format_duration(max),
                    humantime::format_duration(asked)
                ),
            );
        }
    }

    if let Some(t) = team {
        let held = snapshot.held_gpus.get(&t.name).copied().unwrap_or(0);
        if u64::from(held) + u64::from(req.gpus) > u64::from(t.gpu_quota) {
            decision.deny(
                ReasonCode::QuotaExceeded,
                format!(
                    "team {} holds {held} of its {} GPUs and asked for {} more",
                    t.name, t.gpu_quota, req.gpus
                ),
            );
        }
    }

    if snapshot.blocked.contains(&req.team) {
        decision.deny(
            ReasonCode::TeamBlocked,
            format!("team {}'s new admissions are blocked", req.team),
        );
    }

    if let (Some(program), false) = (
        req.command.as_ref().and_then(|argv| argv.first()),
        policy.programs.is_empty(),
    ) {
        if !policy.programs.contains(program) {
            decision.deny(
                ReasonCode::ProgramNotAllowed,
                format!(
                    "{} leases may run {}, not {program}",
                    req.workload,
                    policy.programs.join(", ")
                ),
            );
        }
    }

    // Substrates that refuse the user are passed by; when every candidate does, the refusals
    // are the answer rather than a lack of capacity.
    let candidates = candidate_substrates(req, snapshot, &policy.substrates);
    let all_refused = !candidates.is_empty() && candidates.iter().all(|s| s.refusal.is_some());
    if all_refused {
        let mut seen = Vec::new();
        for refusal in candidates.iter().filter_map(|s| s.refusal.as_ref()) {
            let code = match refusal.code {
                RefusalCode::AccountUnmapped => ReasonCode::AccountUnmapped,
                RefusalCode::AccountPrivileged => ReasonCode::AccountPrivileged,
            };
            if !seen.contains(&code) {
                seen.push(code);
                decision.deny(code, refusal.message.clone());
            }
        }
    }

    let placement = place(
        req,
        snapshot,
        placements,
        &policy.substrates,
        &model_allowed,
    );
    // Price what would be placed. Without a placement, the dearest model the request could be
    // placed on once GPUs free up (else the model asked for, else the default price): never
    // cheaper per GPU than what a smaller request would be placed on.
    let priced_model = match &placement {
        Some(p) => Some(p.gpu_model.clone()),
        None => dearest_fitting(req, snapshot, &policy.substrates, &model_allowed)
            .map(str::to_owned)
            .or_else(|| req.gpu_model.clone()),
    };
    let per_gpu = priced_model
        .as_deref()
        .map_or(config.pricing.default_usd_per_gpu_hour, |m| {
            config.pricing.usd_per_gpu_hour(m)
        });
    let usd_per_hour = per_gpu * f64::from(req.gpus);
    decision.estimate = Estimate {
        usd_per_hour,
        max_usd: duration.map(|d| usd_per_hour * hours(d)),
        gpu_model: priced_model,
    };

    if let Some(t) = team {
        let spent = snapshot.spend_usd.get(&t.name).copied().unwrap_or(0.0);
        let cost = decision.estimate.max_usd.unwrap_or(usd_per_hour);
        if spent + cost > t.monthly_budget_usd {
            decision.deny(
                ReasonCode::BudgetExceeded,
                format!(
                    "team {} has spent {} of its {} monthly budget and this lease may cost {}",
                    t.name,
                    money(spent),
                    money(t.monthly_budget_usd),
                    money(cost)
                ),
            );
        }
    }

    match placement {
        Some(p) => decision.placement = Some(p),
        None if all_refused => {}
        None => {
            let model = req.gpu_model.as_deref().unwrap_or("any allowed model");
            let free = free_gpus(
                snapshot,
                placements,
                req,
                &policy.substrates,
                &model_allowed,
            );
            decision.deny(
                ReasonCode::NoCapacity,
                format!(
                    "{} GPUs of {model} asked for, at most {free} free together on one fitting substrate",
                    req.gpus
                ),
            );
        }
    }
    decision
}

/// Decides whether a lease may change to `gpus` GPUs on its substrate and model. Shrinking keeps
/// the first GPUs; growing adds free ones. The same codes as admission apply: `workload_limit`
/// (above `max_gpus` or below `min_gpus`), `quota_exceeded`, `budget_exceeded` and
/// `team_blocked` (growth only), `no_capacity`.
pub fn evaluate_resize(
    lease: &Holding,
    gpus: u32,
    snapshot: &Snapshot,
    placements: &mut Placements,
) -> Decision {
    let config = &snapshot.config;
    let policy = config.workload(lease.workload);
    let usd_per_hour = config.pricing.usd_per_gpu_hour(&lease.gpu_model) * f64::from(gpus);
    let mut decision = Decision {
        reasons: Vec::new(),
        estimate: Estimate {
            usd_per_hour,
            max_usd: lease.remaining.map(|d| usd_per_hour * hours(d)),
            gpu_model: Some(lease.gpu_model.clone()),
        },
        placement: None,
        duration: lease.remaining,
    };
    if let Some(max) = policy.max_gpus.filter(|&m| gpus > m) {
        decision.deny(
            ReasonCode::WorkloadLimit,
            format!(
                "{} leases may hold at most {max} GPUs; {gpus} were asked for",
                lease.workload
            ),
        );
    }
    let min = policy.min_gpus.unwrap_or(1).max(1);
    if gpus < min {
        decision.deny(
            ReasonCode::WorkloadLimit,
            format!(
                "{} leases hold at least {min} GPUs; {gpus} were asked for",
                lease.workload
            ),
        );
    }
    let growth = gpus.saturating_sub(lease.gpu_count);
    if let Some(t) = config.team(&lease.team) {
        let held = snapshot.held_gpus.get(&t.name).copied().unwrap_or(0);
        if growth > 0 && u64::from(held) + u64::from(growth) > u64::from(t.gpu_quota) {
            decision.deny(
                ReasonCode::QuotaExceeded,
                format!(
                    "team {} holds {held} of its {} GPUs and asked for {growth} more",
                    t.name, t.gpu_quota
                ),
            );
        }
        let spent = snapshot.spend_usd.get(&t.name).copied().unwrap_or(0.0);
        let extra = config.pricing.usd_per_gpu_hour(&lease.gpu_model)
            * f64::from(growth)
            * lease.remaining.map_or(1.0, hours);
        if growth > 0 && spent + extra > t.monthly_budget_usd {
            decision.deny(
                ReasonCode::BudgetExceeded,
                format!(
                    "team {} has spent {} of its {} monthly budget and the added GPUs may cost {}",
                    t.name,
                    money(spent),
                    money(t.monthly_budget_usd),
                    money(extra)
                ),
            );
        }
    }
    if growth > 0 && snapshot.blocked.contains(&lease.team) {
        decision.deny(
            ReasonCode::TeamBlocked,
            format!("team {}'s new admissions are blocked", lease.team),
        );
    }
    let sub = snapshot
        .substrates
        .iter()
        .find(|s| s.name == lease.substrate);
    let placement = match sub {
        _ if growth == 0 => Some(
            lease
                .gpu_uuids
                .iter()
                .take(gpus as usize)
                .cloned()
                .collect(),
        ),
        None => None,
        Some(_) if lease.gpu_uuids.is_empty() => sub
            .and_then(|s| {
                s.inventory
                    .pooled
                    .iter()
                    .find(|(m, _)| m == &lease.gpu_model)
                    .map(|(m, c)| match s.inventory.queues {
                        true => c.saturating_sub(lease.gpu_count),
                        false => c.saturating_sub(s.pooled_in_use.get(m).copied().unwrap_or(0)),
                    })
            })
            .filter(|&free| free >= growth)
            .map(|_| Vec::new()),
        Some(s) => {
            let index = s.fleet();
            let free = FreeGpus::new(&index, &s.busy, placements.free_of(&s.name, &index));
            let growth = growth as usize;
            (0..index.models.len())
                .find(|&m| index.model_name(m) == lease.gpu_model)
                .filter(|&m| free.of_model(m) >= growth)
                .map(|m| {
                    let mut uuids = lease.gpu_uuids.clone();
                    uuids.extend(free.choose(m, growth, lease.workload));
                    uuids
                })
        }
    };
    match placement {
        Some(gpu_uuids) => {
            decision.placement = Some(Placement {
                substrate: lease.substrate.clone(),
                gpu_model: lease.gpu_model.clone(),
                gpu_count: gpus,
                gpu_uuids,
            })
        }
        None => decision.deny(
            ReasonCode::NoCapacity,
            format!(
                "{growth} more GPUs of {} asked for on {}, not enough free",
                lease.gpu_model, lease.substrate
            ),
        ),
    }
    decision
}

/// The substrates a request may use, in the order to try them.
fn candidate_substrates<'a>(
    req: &AdmissionRequest,
    snapshot: &'a Snapshot,
    preference: &[String],
) -> Vec<&'a SubstrateState> {
    let by_name = |name: &str| snapshot.substrates.iter().find(|s| s.name == name);
    match (&req.substrate, preference.is_empty()) {
        (Some(s), _) => by_name(s).into_iter().collect(),
        (None, false) => preference.iter().filter_map(|n| by_name(n)).collect(),
        (None, true) => snapshot.substrates.iter().collect(),
    }
}

/// The candidates that do not refuse the request's user, in order.
fn open_substrates<'a>(
    req: &AdmissionRequest,
    snapshot: &'a Snapshot,
    preference: &[String],
) -> impl Iterator<Item = &'a SubstrateState> {
    candidate_substrates(req, snapshot, preference)
        .into_iter()
        .filter(|s| s.refusal.is_none())
}

/// A model a request may be placed on, on one substrate.
struct Fitting<'a> {
    /// Full model name.
    name: &'a str,
    /// Its slot in the substrate's index, if the substrate names GPUs of it.
    named: Option<usize>,
    /// Free named GPUs of it.
    free: usize,
    /// Free pooled GPUs of it.
    pooled: u32,
}

/// Models on a substrate that fit the request and the team, in inventory order (named models
/// first, then pooled ones not named), with how many of each are free. Whether a model fits is
/// decided once per model.
fn fitting_models<'a>(
    sub: &'a SubstrateState,
    free: &FreeGpus<'a>,
    req: &AdmissionRequest,
    model_allowed: &dyn Fn(&str) -> bool,
) -> Vec<Fitting<'a>> {
    let fits = |m: &str| req.gpu_model.as_deref().is_none_or(|w| matches(m, w)) && model_allowed(m);
    let index = free.index;
    let mut out: Vec<Fitting<'a>> = Vec::new();
    // Every model seen, and whether it fits.
    let mut seen: Vec<(&str, bool)> = Vec::new();
    for m in 0..index.models.len() {
        let name = &sub.inventory.gpus[index.models[m].first].model;
        let fit = fits(name);
        seen.push((name, fit));
        if fit {
            out.push(Fitting {
                name,
                named: Some(m),
                free: free.of_model(m),
                pooled: 0,
            });
        }
    }
    for (model, count) in &sub.inventory.pooled {
        let fit = match seen.iter().find(|(m, _)| m == model) {
            Some(&(_, fit)) => fit,
            None => {
                let fit = fits(model);
                seen.push((model, fit));
                fit
            }
        };
        if !fit {
            continue;
        }
        // A queueing substrate starts what fits later: only its size bounds a request.
        let used = match sub.inventory.queues {
            true => 0,
            false => sub.pooled_in_use.get(model).copied().unwrap_or(0),
        };
        let pooled = count.saturating_sub(used);
        match out.iter_mut().find(|f| f.name == model) {
            Some(f) => f.pooled += pooled,
            None => out.push(Fitting {
                name: model,
                named: None,
                free: 0,
                pooled,
            }),
        }
    }
    out
}

/// The dearest of the models a request could be placed on (those of its candidate substrates
/// that match its model and the team's), whatever is free now; the first listed of equal price.
fn dearest_fitting<'a>(
    req: &AdmissionRequest,
    snapshot: &'a Snapshot,
    preference: &[String],
    model_allowed: &dyn Fn(&str) -> bool,
) -> Option<&'a str> {
    let pricing = &snapshot.config.pricing;
    let fits = |m: &str| req.gpu_model.as_deref().is_none_or(|w| matches(m, w)) && model_allowed(m);
    let mut dearest: Option<(&'a str, f64)> = None;
    for sub in candidate_substrates(req, snapshot, preference) {
        let index = sub.fleet();
        let named: Vec<&'a str> = index
            .models
            .iter()
            .map(|m| sub.inventory.gpus[m.first].model.as_str())
            .collect();
        let pooled = sub.inventory.pooled.iter().map(|(m, _)| m.as_str());
        for model in named.into_iter().chain(pooled).filter(|m| fits(m)) {
            let price = pricing.usd_per_gpu_hour(model);
            if dearest.is_none_or(|(_, p)| price > p) {
                dearest = Some((model, price));
            }
        }
    }
    dearest.map(|(model, _)| model)
}

fn free_gpus(
    snapshot: &Snapshot,
    placements: &mut Placements,
    req: &AdmissionRequest,
    preference: &[String],
    model_allowed: &dyn Fn(&str) -> bool,
) -> usize {
    open_substrates(req, snapshot, preference)
        .flat_map(|s| {
            let index = s.fleet();
            let free = FreeGpus::new(&index, &s.busy, placements.free_of(&s.name, &index));
            fitting_models(s, &free, req, model_allowed)
                .iter()
                .map(|f| f.free.max(f.pooled as usize))
                .max()
        })
        .max()
        .unwrap_or(0)
}

fn place(
    req: &AdmissionRequest,
    snapshot: &Snapshot,
    placements: &mut Placements,
    preference: &[String],
    model_allowed: &dyn Fn(&str) -> bool,
) -> Option<Placement> {
    let n = req.gpus as usize;
    if n == 0 {
        return None;
    }
    for sub in open_substrates(req, snapshot, preference) {
        let index = sub.fleet();
        let free = FreeGpus::new(&index, &sub.busy, placements.free_of(&sub.name, &index));
        for model in fitting_models(sub, &free, req, model_allowed) {
            let gpu_uuids = match model.named {
                Some(m) if model.free >= n => free.choose(m, n, req.workload),
                _ if model.pooled as usize >= n => Vec::new(),
                _ => continue,
            };
            return Some(Placement {
                substrate: sub.name.clone(),
                gpu_model: model.name.to_owned(),
                gpu_count: req.gpus,
                gpu_uuids,
            });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::placement::{pick, RECENT_CHANGES};
    use super::*;
    use crate::inventory::Gpu;
    use gpuwarden_schema::config::Role;
    use gpuwarden_schema::config::{GpuPrice, PricingConfig, TeamConfig, WorkloadPolicy};
    use gpuwarden_schema::Workload;

    /// A decision with nothing kept from an earlier one.
    fn decide(request: &Request, snapshot: &Snapshot) -> Decision {
        evaluate(request, snapshot, &mut Placements::default())
    }

    fn gpu(host: &str, index: u32, model: &str) -> Gpu {
        Gpu {
            uuid: format!("GPU-{host}-{index}"),
            host: host.into(),
            index,
            model: model.into(),
        }
    }

    const H100: &str = "NVIDIA H100 80GB HBM3";
    const A100: &str = "NVIDIA A100-SXM4-40GB";

    fn config() -> Config {
        let mut config = Config {
            pricing: PricingConfig {
                default_usd_per_gpu_hour: 1.0,
                gpu: vec![
                    GpuPrice {
                        model_match: "h100".into(),
                        usd_per_gpu_hour: 4.0,
                    },
                    GpuPrice {
                        model_match: "A100".into(),
                        usd_per_gpu_hour: 2.5,
                    },
                ],
                ..PricingConfig::default()
            },
            teams: vec![TeamConfig {
                name: "ml".into(),
                members: vec!["ada".into(), "bob".into()],
                gpu_quota: 16,
                monthly_budget_usd: 10_000.0,
                allowed_models: vec!["H100".into()],
            }],
            ..Config::default()
        };
        config.workloads.insert(
            Workload::Training,
            WorkloadPolicy {
                max_gpus: Some(8),
                max_duration: Some(Duration::from_secs(24 * 3600)),
                ..WorkloadPolicy::default()
            },
        );
        config.workloads.insert(
            Workload::Inference,
            WorkloadPolicy {
                max_gpus: Some(8),
                max_duration: Some(Duration::from_secs(24 * 3600)),
                ..WorkloadPolicy::default()
            },
        );
        // Batch is offered without limits; notebooks are not offered.
        config
            .workloads
            .insert(Workload::Batch, WorkloadPolicy::default());
        config
    }

    /// Two substrates: `sim` with hosts a (4 H100), b (2 H100), c (4 A100); `pool` with 8 H100.
    fn snapshot() -> Snapshot {
        let mut gpus = Vec::new();
        for i in 0..4 {
            gpus.push(gpu("a", i, H100));
        }
        for i in 0..2 {
            gpus.push(gpu("b", i, H100));
        }
        for i in 0..4 {
            gpus.push(gpu("c", i, A100));
        }
        Snapshot {
            config: Arc::new(config()),
            held_gpus: BTreeMap::new(),
            spend_usd: BTreeMap::new(),
            blocked: BTreeSet::new(),
            substrates: vec![
                SubstrateState {
                    name: "sim".into(),
                    inventory: Arc::new(Inventory {
                        gpus,
                        pooled: Vec::new(),
                        queues: false,
                    }),
                    ..SubstrateState::default()
                },
                SubstrateState {
                    name: "pool".into(),
                    inventory: Arc::new(Inventory {
                        gpus: Vec::new(),
                        pooled: vec![(H100.into(), 8)],
                        queues: false,
                    }),
                    ..SubstrateState::default()
                },
            ],
        }
    }

    fn admin() -> Principal {
        Principal {
            name: "root".into(),
            role: Role::Admin,
            teams: Vec::new(),
        }
    }

    fn request(workload: Workload, gpus: u32) -> Request {
        Request {
            principal: admin(),
            admission: AdmissionRequest {
                team: "ml".into(),
                user: "ada".into(),
                project: "p".into(),
                workload,
                gpus,
                gpu_model: None,
                substrate: None,
                duration: Some(Duration::from_secs(2 * 3600)),
                labels: None,
                dry_run: false,
                command: None,
            },
        }
    }

    fn codes(d: &Decision) -> Vec<ReasonCode> {
        d.reasons.iter().map(|r| r.code).collect()
    }

    #[test]
    fn admits_within_every_limit_and_prices_the_placed_model() {
        let d = decide(&request(Workload::Training, 2), &snapshot());
        assert!(d.admitted(), "{:?}", d.reasons);
        let p = d.placement.unwrap();
        assert_eq!(p.substrate, "sim");
        assert_eq!(p.gpu_model, H100);
        // 2 × $4/h, for 2 h.
        assert_eq!(d.estimate.usd_per_hour, 8.0);
        assert_eq!(d.estimate.max_usd, Some(16.0));
    }

    #[test]
    fn a_request_that_cannot_be_placed_is_priced_at_the_dearest_model_it_could_get() {
        // ml may use H100 only: 6 named on sim, 8 pooled; 12 fit nowhere. Priced at H100's
        // $4, not the $1 default: asking for more never looks cheaper per GPU.
        let mut r = request(Workload::Batch, 12);
        let d = decide(&r, &snapshot());
        assert_eq!(codes(&d), vec![ReasonCode::NoCapacity]);
        assert_eq!(d.estimate.gpu_model.as_deref(), Some(H100));
        assert_eq!(d.estimate.usd_per_hour, 48.0);
        assert_eq!(d.estimate.max_usd, Some(96.0));
        // A team that may use any model: the dearest of H100 ($4) and A100 ($2.50).
        let mut snap = snapshot();
        Arc::make_mut(&mut snap.config).teams[0]
            .allowed_models
            .clear();
        let d = decide(&r, &snap);
        assert_eq!(d.estimate.gpu_model.as_deref(), Some(H100));
        assert_eq!(d.estimate.usd_per_hour, 48.0);
        // Asked for A100: the A100 it names, at its price.
        r.admission.gpu_model = Some("a100".into());
        let d = decide(&r, &snap);
        assert_eq!(d.estimate.gpu_model.as_deref(), Some(A100));
        assert_eq!(d.estimate.usd_per_hour, 30.0);
        // A model no substrate has: priced by its name (here the default), and named.
        r.admission.gpu_model = Some("B200".into());
        let d = decide(&r, &snap);
        assert_eq!(d.estimate.gpu_model.as_deref(), Some("B200"));
        assert_eq!(d.estimate.usd_per_hour, 12.0);
        // Placed: the placed model, named in full.
        let d = decide(&request(Workload::Batch, 2), &snap);
        assert!(d.admitted(), "{:?}", d.reasons);
        assert_eq!(d.estimate.gpu_model.as_deref(), Some(H100));
    }

    #[test]
    fn estimate_without_a_duration_runs_to_the_workload_max() {
        let mut r = request(Workload::Training, 3);
        r.admission.duration = None;
        let d = decide(&r, &snapshot());
        assert_eq!(d.estimate.usd_per_hour, 12.0);
        assert_eq!(d.estimate.max_usd, Some(12.0 * 24.0));
        assert_eq!(d.duration, Some(Duration::from_secs(24 * 3600)));
    }

    #[test]
    fn estimate_without_any_bound_has_no_maximum() {
        let mut r = request(Workload::Batch, 1);
        r.admission.duration = None;
        r.admission.gpu_model = Some("h100".into());
        let d = decide(&r, &snapshot());
        assert!(d.admitted(), "{:?}", d.reasons);
        assert_eq!(d.estimate.usd_per_hour, 4.0);
        assert_eq!(d.estimate.max_usd, None);
    }

    #[test]
    fn not_member_for_a_user_outside_the_team_or_a_principal_of_another_team() {
        let mut r = request(Workload::Training, 1);
        r.admission.user = "eve".into();
        let d = decide(&r, &snapshot());
        assert_eq!(codes(&d), vec![ReasonCode::NotMember]);
        assert!(d.reasons[0]
            .message
            .contains("eve is not a member of team ml"));

        let mut r = request(Workload::Training, 1);
        r.principal = Principal {
            name: "portal".into(),
            role: Role::Service,
            teams: vec!["other".into()],
        };
        assert_eq!(codes(&decide(&r, &snapshot())), vec![ReasonCode::NotMember]);
    }

    #[test]
    fn a_kind_the_config_does_not_define_is_not_offered_unless_it_defines_none() {
        let d = decide(&request(Workload::Notebook, 1), &snapshot());
        assert_eq!(codes(&d), vec![ReasonCode::WorkloadNotOffered]);
        let m = &d.reasons[0].message;
        assert!(
            m.contains("notebook leases are not offered")
                && m.contains("training, inference, batch"),
            "{m}"
        );
        // A config without any [workloads.*] offers every kind, with the default policy.
        let mut s = snapshot();
        let mut config = (*s.config).clone();
        config.workloads.clear();
        s.config = Arc::new(config);
        assert!(decide(&request(Workload::Notebook, 1), &s).admitted());
    }

    #[test]
    fn workload_limit_names_the_cap() {
        let d = decide(&request(Workload::Training, 9), &snapshot());
        assert!(d.has(ReasonCode::WorkloadLimit));
        let m = &d.reasons[0].message;
        assert!(m.contains("at most 8") && m.contains("9 were asked"), "{m}");
    }

    #[test]
    fn model_not_allowed() {
        let mut r = request(Workload::Training, 1);
        r.admission.gpu_model = Some("a100".into());
        let d = decide(&r, &snapshot());
        assert!(d.has(ReasonCode::ModelNotAllowed), "{:?}", d.reasons);
        // The A100s exist, but this team may not use them, so there is no capacity either.
        assert!(d.has(ReasonCode::NoCapacity));
    }

    #[test]
    fn duration_limit() {
        let mut r = request(Workload::Training, 1);
        r.admission.duration = Some(Duration::from_secs(48 * 3600));
        let d = decide(&r, &snapshot());
        assert_eq!(codes(&d), vec![ReasonCode::DurationLimit]);
        assert!(
            d.reasons[0].message.contains("1day"),
            "{}",
            d.reasons[0].message
        );
        assert!(
            d.reasons[0].message.contains("2days"),
            "{}",
            d.reasons[0].message
        );
    }

    #[test]
    fn quota_exceeded_counts_gpus_already_held() {
        let mut s = snapshot();
        s.held_gpus.insert("ml".into(), 14);
        let d = decide(&request(Workload::Training, 3), &s);
        assert_eq!(codes(&d), vec![ReasonCode::QuotaExceeded]);
        assert!(d.reasons[0]
            .message
            .contains("holds 14 of its 16 GPUs and asked for 3"));
        assert!(decide(&request(Workload::Training, 2), &s).admitted());
    }

    #[test]
    fn budget_exceeded_counts_spend_plus_the_estimate() {
        let mut s = snapshot();
        // 2 GPUs × $4 × 2 h = $16; 9,985 + 16 > 10,000.
        s.spend_usd.insert("ml".into(), 9_985.0);
        let d = decide(&request(Workload::Training, 2), &s);
        assert_eq!(codes(&d), vec![ReasonCode::BudgetExceeded]);
        assert!(
            d.reasons[0].message.contains("$9985.00"),
            "{}",
            d.reasons[0].message
        );
        assert!(d.reasons[0].message.contains("$16.00"));
        s.spend_usd.insert("ml".into(), 9_984.0);
        assert!(decide(&request(Workload::Training, 2), &s).admitted());
    }

    #[test]
    fn no_capacity_when_no_fitting_substrate_has_enough_free() {
        let mut r = request(Workload::Training, 7);
        r.admission.substrate = Some("sim".into());
        let d = decide(&r, &snapshot());
        assert_eq!(codes(&d), vec![ReasonCode::NoCapacity]);
        assert!(
            d.reasons[0].message.contains("at most 6 free"),
            "{}",
            d.reasons[0].message
        );
    }

    #[test]
    fn a_substrate_refusing_the_user_is_passed_by_and_refusals_answer_when_all_refuse() {
        let refuse = |code, message: &str| {
            Some(Refusal {
                code,
                message: message.into(),
            })
        };
        let mut snap = snapshot();
        snap.substrates[0].refusal = refuse(RefusalCode::AccountUnmapped, "ada has no account");
        // The pool takes what sim refuses.
        let d = decide(&request(Workload::Training, 2), &snap);
        assert!(d.admitted(), "{:?}", d.reasons);
        assert_eq!(d.placement.expect("placed").substrate, "pool");
        // Named, the refusing substrate answers with its refusal, not with a lack of capacity.
        let mut r = request(Workload::Training, 2);
        r.admission.substrate = Some("sim".into());
        let d = decide(&r, &snap);
        assert_eq!(codes(&d), vec![ReasonCode::AccountUnmapped]);
        assert_eq!(d.reasons[0].message, "ada has no account");
        snap.substrates[1].refusal = refuse(RefusalCode::AccountPrivileged, "ada is root");
        let d = decide(&request(Workload::Training, 2), &snap);
        assert_eq!(
            codes(&d),
            vec![ReasonCode::AccountUnmapped, ReasonCode::AccountPrivileged]
        );
    }

    #[test]
    fn program_not_allowed_compares_the_first_word_with_the_workload_s_programs() {
        let mut snap = snapshot();
        let mut config = config();
        config
            .workloads
            .entry(Workload::Batch)
            .or_default()
            .programs = vec!["/usr/bin/python3".into()];
        snap.config = Arc::new(config);
        let with = |argv: &[&str]| {
            let mut r = request(Workload::Batch, 1);
            r.admission.command = Some(argv.iter().map(|a| a.to_string()).collect());
            decide(&r, &snap)
        };
        assert!(with(&["/usr/bin/python3", "train.py"]).admitted());
        let d = with(&["python3", "train.py"]);
        assert_eq!(codes(&d), vec![ReasonCode::ProgramNotAllowed]);
        assert!(
            d.reasons[0].message.contains("/usr/bin/python3"),
            "{}",
            d.reasons[0].message
        );
        assert_eq!(
            codes(&with(&["/bin/sh", "-c", "id"])),
            vec![ReasonCode::ProgramNotAllowed]
        );
        // Without a command nothing runs, so there is nothing to allow.
        let d = decide(&request(Workload::Batch, 1), &snap);
        assert!(d.admitted(), "{:?}", d.reasons);
    }

    #[test]
    fn team_blocked() {
        let mut s = snapshot();
        s.blocked.insert("ml".into());
        assert_eq!(
            codes(&decide(&request(Workload::Training, 1), &s)),
            vec![ReasonCode::TeamBlocked]
        );
    }

    #[test]
    fn every_failed_check_is_reported_at_once() {
        let mut s = snapshot();
        s.held_gpus.insert("ml".into(), 16);
        s.blocked.insert("ml".into());
        s.spend_usd.insert("ml".into(), 10_000.0);
        let mut r = request(Workload::Training, 12);
        r.admission.user = "eve".into();
        r.admission.gpu_model = Some("A100".into());
        r.admission.duration = Some(Duration::from_secs(100 * 3600));
        r.admission.command = Some(vec!["/bin/sh".into()]);
        let mut config = config();
        config
            .workloads
            .entry(Workload::Training)
            .or_default()
            .programs = vec!["/usr/bin/python3".into()];
        s.config = Arc::new(config);
        let d = decide(&r, &s);
        let mut got = codes(&d);
        got.sort();
        // The account codes stand in for no_capacity when every substrate refuses the user, so
        // they are never reported with it; resize_unsupported is the service's, for resizes;
        // workload_not_offered is tested on its own (a kind not offered has no limits to break).
        let expected: Vec<ReasonCode> = ReasonCode::ALL
            .into_iter()
            .filter(|c| {
                ![
                    ReasonCode::AccountUnmapped,
                    ReasonCode::AccountPrivileged,
                    ReasonCode::ResizeUnsupported,
                    ReasonCode::WorkloadNotOffered,
                ]
                .contains(c)
            })
            .collect();
        assert_eq!(got, expected);
        assert!(!d.admitted());
    }

    #[test]
    fn training_packs_onto_the_fewest_hosts() {
        // Two fit on b exactly (tightest fit), leaving a whole for a bigger job.
        let d = decide(&request(Workload::Training, 2), &snapshot());
        assert_eq!(d.placement.unwrap().gpu_uuids, vec!["GPU-b-0", "GPU-b-1"]);
        // Five need two hosts: all of a, then one of b.
        let d = decide(&request(Workload::Training, 5), &snapshot());
        let uuids = d.placement.unwrap().gpu_uuids;
        assert_eq!(
            uuids,
            vec!["GPU-a-0", "GPU-a-1", "GPU-a-2", "GPU-a-3", "GPU-b-0"]
        );
    }

    /// `n` GPUs of the inventory's first model, with `busy` held, as placement picks them.
    fn indexed(gpus: &[Gpu], busy: &HeldGpus, n: usize, w: Workload) -> Vec<String> {
        let index = FleetIndex::new(Arc::new(Inventory {
            gpus: gpus.to_vec(),
            pooled: Vec::new(),
            queues: false,
        }));
        let picked = FreeGpus::new(&index, busy, &mut None).choose(0, n, w);
        picked
    }

    /// What placement must pick, the long way: every host with a free GPU of the first model,
    /// by name, each with its free GPUs by index, all handed to [`pick`].
    fn full_scan(gpus: &[Gpu], busy: &HeldGpus, n: usize, w: Workload) -> Vec<String> {
        let mut hosts: BTreeMap<&str, Vec<&Gpu>> = BTreeMap::new();
        for g in gpus {
            if g.model == gpus[0].model && !busy.contains(&g.uuid) {
                hosts.entry(&g.host).or_default().push(g);
            }
        }
        for free in hosts.values_mut() {
            free.sort_by_key(|g| g.index);
        }
        pick(hosts.into_iter().collect(), n, w)
    }

    #[test]
    fn placement_orders_hosts_by_name_and_gpus_by_index_whatever_the_listing_order() {
        // Listed out of order, hosts interleaved: h-2 has 3 free, h-10 has 2, h-1 has 3.
        let listed = [
            gpu("h-2", 2, "H100"),
            gpu("h-10", 1, "H100"),
            gpu("h-2", 0, "H100"),
            gpu("h-1", 2, "H100"),
            gpu("h-10", 0, "H100"),
            gpu("h-1", 1, "H100"),
            gpu("h-2", 1, "H100"),
            gpu("h-1", 0, "H100"),
        ];
        let none = HeldGpus::default();
        // Training: the tightest host that fits, its lowest indices.
        assert_eq!(
            indexed(&listed, &none, 2, Workload::Training),
            vec!["GPU-h-10-0", "GPU-h-10-1"]
        );
        assert_eq!(
            indexed(&listed, &none, 3, Workload::Training),
            vec!["GPU-h-1-0", "GPU-h-1-1", "GPU-h-1-2"]
        );
        // Across hosts: the fullest first, ties by name.
        assert_eq!(
            indexed(&listed, &none, 4, Workload::Training),
            vec!["GPU-h-1-0", "GPU-h-1-1", "GPU-h-1-2", "GPU-h-2-0"]
        );
        // Spread: one per host in turn, the fullest hosts (then names) first.
        assert_eq!(
            indexed(&listed, &none, 4, Workload::Inference),
            vec!["GPU-h-1-0", "GPU-h-2-0", "GPU-h-10-0", "GPU-h-1-1"]
        );
        // A held GPU makes h-1 the tightest fit for two, and is never picked.
        let busy = HeldGpus::from(["GPU-h-1-0"]);
        assert_eq!(
            indexed(&listed, &busy, 2, Workload::Training),
            vec!["GPU-h-1-1", "GPU-h-1-2"]
        );
        assert_eq!(
            indexed(&listed, &busy, 3, Workload::Inference),
            vec!["GPU-h-2-0", "GPU-h-1-1", "GPU-h-10-0"]
        );
    }

    #[test]
    fn indexed_placement_picks_what_a_scan_of_every_free_gpu_picks() {
        // Fleets of varied hosts (sizes 1 to 8, two models, listed shuffled); GPUs taken and
        // freed at random, one index following the changes (now and then a burst longer than
        // the changes remembered, or a copy of the holdings, which it must recount); every
        // workload and size after each change: the index looks at few hosts and must agree
        // with the scan of all of them.
        let mut next = crate::xorshift(0x9e37_79b9_7f4a_7c15_u64);
        let workloads = [
            Workload::Training,
            Workload::Batch,
            Workload::Inference,
            Workload::Notebook,
        ];
        let mut checked = 0;
        for _ in 0..60 {
            let mut gpus = Vec::new();
            for h in 0..1 + next(12) {
                let model = if next(4) == 0 { "A100" } else { "H100" };
                for i in 0..1 + next(8) {
                    gpus.push(gpu(&format!("h-{h}"), i as u32, model));
                }
            }
            for i in (1..gpus.len()).rev() {
                gpus.swap(i, next(i as u64 + 1) as usize);
            }
            let index = FleetIndex::new(Arc::new(Inventory {
                gpus: gpus.clone(),
                pooled: Vec::new(),
                queues: false,
            }));
            let mut held = HeldGpus::from(["GPU-gone-0"]);
            let mut kept = None;
            for _ in 0..40 {
                let changes = match next(20) {
                    0 => RECENT_CHANGES + 1,
                    _ => 1 + next(3) as usize,
                };
                for _ in 0..changes {
                    let uuid = match next(10) {
                        0 => "GPU-gone-1".to_owned(),
                        _ => gpus[next(gpus.len() as u64) as usize].uuid.clone(),
                    };
                    if !held.remove(&uuid) {
                        held.insert(uuid);
                    }
                }
                if next(10) == 0 {
                    held = held.clone();
                }
                let free = gpus
                    .iter()
                    .filter(|g| g.model == gpus[0].model && !held.contains(&g.uuid))
                    .count();
                let state = FreeGpus::new(&index, &held, &mut kept);
                assert_eq!(state.of_model(0), free);
                for n in 1..=free.min(10) {
                    for w in workloads {
                        let got = state.choose(0, n, w);
                        assert_eq!(
                            got,
                            full_scan(&gpus, &held, n, w),
                            "{n} {w:?} of {gpus:?}, held {held:?}"
                        );
                        assert_eq!(got.len(), n);
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 10_000, "only {checked} placements checked");
    }

    #[test]
    fn inference_spreads_across_hosts() {
        let d = decide(&request(Workload::Inference, 4), &snapshot());
        let uuids = d.placement.unwrap().gpu_uuids;
        let hosts: BTreeSet<&str> = uuids.iter().map(|u| &u[4..5]).collect();
        assert_eq!(hosts.len(), 2, "{uuids:?}");
        assert_eq!(uuids, vec!["GPU-a-0", "GPU-b-0", "GPU-a-1", "GPU-b-1"]);
    }

    #[test]
    fn busy_gpus_are_not_placed_and_pooled_capacity_counts_by_model() {
        let mut s = snapshot();
        for i in 0..4 {
            Arc::make_mut(&mut s.substrates[0].busy).insert(format!("GPU-a-{i}"));
        }
        s.substrates[1].pooled_in_use.insert(H100.into(), 5);
        // sim has 2 free H100, pool has 3: four fit nowhere.
        let d = decide(&request(Workload::Training, 4), &s);
        assert_eq!(codes(&d), vec![ReasonCode::NoCapacity]);
        let d = decide(&request(Workload::Training, 3), &s);
        let p = d.placement.unwrap();
        assert_eq!(p.substrate, "pool");
        assert!(p.gpu_uuids.is_empty());
        assert_eq!(p.gpu_model, H100);
    }

    #[test]
    fn substrate_preference_of_the_workload_orders_placement() {
        let mut s = snapshot();
        let mut config = config();
        config
            .workloads
            .get_mut(&Workload::Training)
            .unwrap()
            .substrates = vec!["pool".into(), "sim".into()];
        s.config = Arc::new(config);
        let d = decide(&request(Workload::Training, 1), &s);
        assert_eq!(d.placement.unwrap().substrate, "pool");
        let mut r = request(Workload::Training, 1);
        r.admission.substrate = Some("elsewhere".into());
        let d = decide(&r, &s);
        assert!(d.has(ReasonCode::WorkloadLimit) && d.has(ReasonCode::NoCapacity));
    }
}
