//! The admission policy: a pure function from a request and a snapshot of the world to a decision.
//!
//! [`evaluate`] does no I/O. The lease store builds the [`Snapshot`] (GPUs held, spend, blocked
//! teams, GPUs in use) inside the same transaction that records the lease, and the API adds the
//! drivers' inventories, so the decision and the lease it creates cannot disagree. Every check that
//! fails is reported, each with a stable [`ReasonCode`], so a front-end can show a person all that
//! stands in the way at once. Placement (which substrate, model and GPUs) lives here too, because
//! "is there capacity" and "which GPUs" are the same question.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use gpuwarden_schema::config::{contains_ignoring_case, Config, Role};
use gpuwarden_schema::Workload;
use serde::{Deserialize, Deserializer, Serialize};
use utoipa::ToSchema;

use crate::drivers::{Gpu, Inventory};

/// Who is asking: the principal a bearer token maps to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The token's name (a user for `member`, a front-end for `service`).
    pub name: String,
    /// What it may do.
    pub role: Role,
    /// Teams it acts for (ignored for `admin`).
    pub teams: Vec<String>,
}

impl Principal {
    /// Whether the principal may read the team's leases and figures.
    pub fn may_read(&self, team: &str) -> bool {
        self.role == Role::Admin || self.teams.iter().any(|t| t == team)
    }

    /// Why the principal may not change leases of `team` for `user`, or `None` when it may.
    /// Admins act for anyone; members for themselves in their teams; services for anyone in
    /// their teams (membership of the user is checked by [`evaluate`]); viewers never write.
    pub fn write_refusal(&self, team: &str, user: &str) -> Option<String> {
        match self.role {
            Role::Admin => None,
            Role::Viewer => Some(format!("{} is a viewer and may only read", self.name)),
            _ if !self.teams.iter().any(|t| t == team) => {
                Some(format!("{} does not act for team {team}", self.name))
            }
            Role::Member if user != self.name => Some(format!(
                "{} is a member and acts only as itself, not as {user}",
                self.name
            )),
            Role::Member | Role::Service => None,
        }
    }
}

/// The body of `POST /v1/admission`.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AdmissionRequest {
    /// The team the lease is charged to.
    pub team: String,
    /// The person the lease is for.
    pub user: String,
    /// The project the work belongs to.
    pub project: String,
    /// The kind of work; its `[workloads.<kind>]` policy applies.
    #[schema(value_type = WorkloadName)]
    pub workload: Workload,
    /// GPUs wanted, at least 1.
    #[schema(minimum = 1)]
    pub gpus: u32,
    /// A case-insensitive substring of the GPU model wanted (`"H100"`); any allowed model when
    /// absent.
    #[serde(default)]
    pub gpu_model: Option<String>,
    /// The substrate to run on; the workload's preference order when absent.
    #[serde(default)]
    pub substrate: Option<String>,
    /// How long the lease is wanted, as `"30m"` or `"2h"`; the workload's `max_duration` when
    /// absent.
    #[serde(default, deserialize_with = "optional_duration")]
    #[schema(value_type = Option<String>, example = "2h")]
    pub duration: Option<Duration>,
    /// Free-form labels carried into lease events.
    #[serde(default)]
    pub labels: Option<BTreeMap<String, String>>,
    /// Evaluate only: no lease is created and nothing is recorded.
    #[serde(default)]
    pub dry_run: bool,
    /// The program to run for the lease (argv, no shell), on substrates that run one (`local`);
    /// other drivers ignore it. It is not part of the policy's decision and is not stored: a
    /// re-adopted lease keeps running the process it has.
    #[serde(default)]
    pub command: Option<Vec<String>>,
}

/// The kind of work; each has its own policy in `[workloads.<kind>]`.
// `schema::Workload` carries no OpenAPI derive (schema stays free of HTTP concerns); this enum
// stands for it in the document.
#[derive(ToSchema)]
#[schema(as = Workload)]
#[serde(rename_all = "snake_case")]
#[allow(dead_code)]
pub(crate) enum WorkloadName {
    Training,
    Inference,
    Notebook,
    Batch,
}

fn optional_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let text = Option::<String>::deserialize(d)?;
    text.map(|t| gpuwarden_schema::config::parse_duration(&t).map_err(serde::de::Error::custom))
        .transpose()
}

/// An admission request and who makes it.
#[derive(Debug, Clone)]
pub struct Request {
    /// The caller.
    pub principal: Principal,
    /// What it asks for.
    pub admission: AdmissionRequest,
}

/// One substrate as placement sees it: what it has and what open leases hold of it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SubstrateState {
    /// The substrate's `[[substrates]]` name.
    pub name: String,
    /// What its driver reports.
    pub inventory: Arc<Inventory>,
    /// UUIDs held by open leases.
    pub busy: BTreeSet<String>,
    /// GPUs of pooled capacity held by open leases, by model.
    pub pooled_in_use: BTreeMap<String, u32>,
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

/// A stable reason for a denial; front-ends may switch on these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReasonCode {
    /// The caller may not act for this team, or the user is not one of its members.
    NotMember,
    /// The workload policy caps GPUs per lease (or the substrate is not one it allows).
    WorkloadLimit,
    /// The team may not use the GPU model asked for.
    ModelNotAllowed,
    /// The duration asked for is longer than the workload's `max_duration`.
    DurationLimit,
    /// GPUs held plus GPUs asked would exceed the team's quota.
    QuotaExceeded,
    /// Month-to-date spend plus this lease's estimate would exceed the team's monthly budget.
    BudgetExceeded,
    /// No fitting substrate has enough free GPUs of a fitting model.
    NoCapacity,
    /// The team's admissions are blocked (over budget, or by an administrator).
    TeamBlocked,
}

impl ReasonCode {
    /// Every code, in a stable order.
    pub const ALL: [ReasonCode; 8] = [
        Self::NotMember,
        Self::WorkloadLimit,
        Self::ModelNotAllowed,
        Self::DurationLimit,
        Self::QuotaExceeded,
        Self::BudgetExceeded,
        Self::NoCapacity,
        Self::TeamBlocked,
    ];

    /// The snake_case code used in JSON, actions and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotMember => "not_member",
            Self::WorkloadLimit => "workload_limit",
            Self::ModelNotAllowed => "model_not_allowed",
            Self::DurationLimit => "duration_limit",
            Self::QuotaExceeded => "quota_exceeded",
            Self::BudgetExceeded => "budget_exceeded",
            Self::NoCapacity => "no_capacity",
            Self::TeamBlocked => "team_blocked",
        }
    }
}

/// One failed check.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Reason {
    /// Stable code.
    pub code: ReasonCode,
    /// For a person, with the numbers behind it.
    pub message: String,
}

/// What the lease would cost, priced as the lake prices GPU-hours.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, ToSchema)]
pub struct Estimate {
    /// Price of one GPU-hour of the model × GPUs.
    pub usd_per_hour: f64,
    /// Cost over the requested duration (or the workload's `max_duration`); null when the lease
    /// has no end, in which case the budget check counts one hour.
    pub max_usd: Option<f64>,
}

/// Where an admitted lease goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The substrate.
    pub substrate: String,
    /// The full model name of the GPUs.
    pub gpu_model: String,
    /// How many GPUs.
    pub gpu_count: u32,
    /// The GPUs chosen; empty on pooled capacity.
    pub gpu_uuids: Vec<String>,
}

/// The answer to a request.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Every check that failed; empty when admitted.
    pub reasons: Vec<Reason>,
    /// What the lease would cost.
    pub estimate: Estimate,
    /// Where it goes; `None` when there is no capacity.
    pub placement: Option<Placement>,
    /// When the lease ends, if it has a duration.
    pub duration: Option<Duration>,
}

impl Decision {
    /// Whether every check passed.
    pub fn admitted(&self) -> bool {
        self.reasons.is_empty() && self.placement.is_some()
    }

    /// Whether a check with `code` failed.
    pub fn has(&self, code: ReasonCode) -> bool {
        self.reasons.iter().any(|r| r.code == code)
    }

    fn deny(&mut self, code: ReasonCode, message: String) {
        self.reasons.push(Reason { code, message });
    }
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
pub fn evaluate(request: &Request, snapshot: &Snapshot) -> Decision {
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

    let placement = place(req, snapshot, &policy.substrates, &model_allowed);
    // Price what would be placed; without a placement, the model asked for (or the default).
    let priced_model = placement
        .as_ref()
        .map(|p| p.gpu_model.clone())
        .or_else(|| req.gpu_model.clone())
        .unwrap_or_default();
    let usd_per_hour = config.pricing.usd_per_gpu_hour(&priced_model) * f64::from(req.gpus);
    decision.estimate = Estimate {
        usd_per_hour,
        max_usd: duration.map(|d| usd_per_hour * hours(d)),
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
        None => {
            let model = req.gpu_model.as_deref().unwrap_or("any allowed model");
            let free = free_gpus(snapshot, req, &policy.substrates, &model_allowed);
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

/// A lease as [`evaluate_resize`] sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Holding {
    /// The lease's team.
    pub team: String,
    /// Its kind of work.
    pub workload: Workload,
    /// Where it runs.
    pub substrate: String,
    /// Full model name of its GPUs.
    pub gpu_model: String,
    /// The GPUs it holds now (empty on pooled capacity).
    pub gpu_uuids: Vec<String>,
    /// How many it holds now.
    pub gpu_count: u32,
    /// How long it has left, if it ends.
    pub remaining: Option<Duration>,
}

/// Decides whether a lease may change to `gpus` GPUs on its substrate and model. Shrinking keeps
/// the first GPUs; growing adds free ones. The same codes as admission apply: `workload_limit`
/// (above `max_gpus` or below `min_gpus`), `quota_exceeded`, `budget_exceeded` and
/// `team_blocked` (growth only), `no_capacity`.
pub fn evaluate_resize(lease: &Holding, gpus: u32, snapshot: &Snapshot) -> Decision {
    let config = &snapshot.config;
    let policy = config.workload(lease.workload);
    let usd_per_hour = config.pricing.usd_per_gpu_hour(&lease.gpu_model) * f64::from(gpus);
    let mut decision = Decision {
        reasons: Vec::new(),
        estimate: Estimate {
            usd_per_hour,
            max_usd: lease.remaining.map(|d| usd_per_hour * hours(d)),
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
                    .map(|(m, c)| c.saturating_sub(s.pooled_in_use.get(m).copied().unwrap_or(0)))
            })
            .filter(|&free| free >= growth)
            .map(|_| Vec::new()),
        Some(s) => {
            let free: Vec<&Gpu> = s
                .inventory
                .gpus
                .iter()
                .filter(|g| g.model == lease.gpu_model && !s.busy.contains(&g.uuid))
                .collect();
            (free.len() >= growth as usize).then(|| {
                let mut uuids = lease.gpu_uuids.clone();
                uuids.extend(choose(&free, growth as usize, lease.workload));
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

/// Models on a substrate that fit the request and the team, in inventory order, with their free
/// named GPUs and free pooled count. Whether a model fits is decided once per model, not once
/// per GPU.
fn fitting_models<'a>(
    sub: &'a SubstrateState,
    req: &AdmissionRequest,
    model_allowed: &dyn Fn(&str) -> bool,
) -> Vec<(&'a str, Vec<&'a Gpu>, u32)> {
    let fits = |m: &str| req.gpu_model.as_deref().is_none_or(|w| matches(m, w)) && model_allowed(m);
    // Every model seen, with where its entry is in `out` (None: it does not fit).
    let mut seen: Vec<(&str, Option<usize>)> = Vec::new();
    let mut out: Vec<(&str, Vec<&Gpu>, u32)> = Vec::new();
    let mut verdict = |model: &'a str, out: &mut Vec<(&'a str, Vec<&'a Gpu>, u32)>| {
        if let Some(&(_, entry)) = seen.iter().find(|(m, _)| *m == model) {
            return entry;
        }
        let entry = fits(model).then(|| {
            out.push((model, Vec::new(), 0));
            out.len() - 1
        });
        seen.push((model, entry));
        entry
    };
    for gpu in &sub.inventory.gpus {
        if let Some(i) = verdict(&gpu.model, &mut out) {
            if !sub.busy.contains(&gpu.uuid) {
                out[i].1.push(gpu);
            }
        }
    }
    for (model, count) in &sub.inventory.pooled {
        if let Some(i) = verdict(model, &mut out) {
            let used = sub.pooled_in_use.get(model).copied().unwrap_or(0);
            out[i].2 += count.saturating_sub(used);
        }
    }
    out
}

fn free_gpus(
    snapshot: &Snapshot,
    req: &AdmissionRequest,
    preference: &[String],
    model_allowed: &dyn Fn(&str) -> bool,
) -> usize {
    candidate_substrates(req, snapshot, preference)
        .into_iter()
        .flat_map(|s| fitting_models(s, req, model_allowed))
        .map(|(_, named, pooled)| named.len().max(pooled as usize))
        .max()
        .unwrap_or(0)
}

fn place(
    req: &AdmissionRequest,
    snapshot: &Snapshot,
    preference: &[String],
    model_allowed: &dyn Fn(&str) -> bool,
) -> Option<Placement> {
    let n = req.gpus as usize;
    if n == 0 {
        return None;
    }
    for sub in candidate_substrates(req, snapshot, preference) {
        for (model, free, pooled) in fitting_models(sub, req, model_allowed) {
            if free.len() >= n {
                let gpus = choose(&free, n, req.workload);
                return Some(Placement {
                    substrate: sub.name.clone(),
                    gpu_model: model.to_owned(),
                    gpu_count: req.gpus,
                    gpu_uuids: gpus,
                });
            }
            if pooled as usize >= n {
                return Some(Placement {
                    substrate: sub.name.clone(),
                    gpu_model: model.to_owned(),
                    gpu_count: req.gpus,
                    gpu_uuids: Vec::new(),
                });
            }
        }
    }
    None
}

/// Picks `n` of the free GPUs: training and batch pack onto as few hosts as possible (keeping
/// whole hosts free for the next big job); inference and notebooks spread across hosts, so one
/// host's failure takes down as little of a service as possible.
fn choose(free: &[&Gpu], n: usize, workload: Workload) -> Vec<String> {
    let hosts_sorted = by_host(free);
    let mut hosts: Vec<(&str, &[&Gpu])> = Vec::new();
    let mut start = 0;
    for i in 1..=hosts_sorted.len() {
        if i == hosts_sorted.len() || hosts_sorted[i].host != hosts_sorted[start].host {
            hosts.push((hosts_sorted[start].host.as_str(), &hosts_sorted[start..i]));
            start = i;
        }
    }
    let mut chosen = Vec::with_capacity(n);
    match workload {
        Workload::Training | Workload::Batch => {
            // One host if any fits (the tightest fit), else the fullest hosts first.
            if let Some((_, gpus)) = hosts
                .iter()
                .filter(|(_, g)| g.len() >= n)
                .min_by_key(|(h, g)| (g.len(), *h))
            {
                return gpus[..n].iter().map(|g| g.uuid.clone()).collect();
            }
            hosts.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(b.0)));
            for (_, gpus) in &hosts {
                for g in *gpus {
                    if chosen.len() == n {
                        break;
                    }
                    chosen.push(g.uuid.clone());
                }
            }
        }
        Workload::Inference | Workload::Notebook => {
            // Round-robin: the host given fewest so far next, the one with most free first.
            let mut taken = vec![0usize; hosts.len()];
            while chosen.len() < n {
                let Some(i) = (0..hosts.len())
                    .filter(|&i| taken[i] < hosts[i].1.len())
                    .min_by_key(|&i| (taken[i], std::cmp::Reverse(hosts[i].1.len()), hosts[i].0))
                else {
                    break;
                };
                chosen.push(hosts[i].1[taken[i]].uuid.clone());
                taken[i] += 1;
            }
        }
    }
    chosen
}

/// `free` ordered by host name, then by index on the host. Host names are compared once per
/// host, not once per comparison of two GPUs: each host gets its rank among the names, and the
/// GPUs are sorted by (rank, index), which drivers' listings mostly are already.
fn by_host<'a>(free: &[&'a Gpu]) -> Vec<&'a Gpu> {
    let mut names: Vec<&str> = Vec::new();
    let mut host_of: Vec<usize> = Vec::with_capacity(free.len());
    for gpu in free {
        // A driver lists a host's GPUs together, so the last host seen is usually the one.
        let i = match names.last() {
            Some(&last) if last == gpu.host => names.len() - 1,
            _ => names
                .iter()
                .position(|h| *h == gpu.host)
                .unwrap_or_else(|| {
                    names.push(&gpu.host);
                    names.len() - 1
                }),
        };
        host_of.push(i);
    }
    let mut order: Vec<usize> = (0..names.len()).collect();
    order.sort_unstable_by_key(|&i| names[i]);
    let mut rank = vec![0usize; names.len()];
    for (r, &i) in order.iter().enumerate() {
        rank[i] = r;
    }
    let mut keyed: Vec<((usize, u32), &Gpu)> = free
        .iter()
        .zip(&host_of)
        .map(|(g, &h)| ((rank[h], g.index), *g))
        .collect();
    if !keyed.is_sorted_by_key(|(k, _)| *k) {
        keyed.sort_by_key(|(k, _)| *k);
    }
    keyed.into_iter().map(|(_, g)| g).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuwarden_schema::config::{GpuPrice, PricingConfig, TeamConfig, WorkloadPolicy};

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
                    }),
                    ..SubstrateState::default()
                },
                SubstrateState {
                    name: "pool".into(),
                    inventory: Arc::new(Inventory {
                        gpus: Vec::new(),
                        pooled: vec![(H100.into(), 8)],
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
        let d = evaluate(&request(Workload::Training, 2), &snapshot());
        assert!(d.admitted(), "{:?}", d.reasons);
        let p = d.placement.unwrap();
        assert_eq!(p.substrate, "sim");
        assert_eq!(p.gpu_model, H100);
        // 2 × $4/h, for 2 h.
        assert_eq!(d.estimate.usd_per_hour, 8.0);
        assert_eq!(d.estimate.max_usd, Some(16.0));
    }

    #[test]
    fn estimate_without_a_duration_runs_to_the_workload_max() {
        let mut r = request(Workload::Training, 3);
        r.admission.duration = None;
        let d = evaluate(&r, &snapshot());
        assert_eq!(d.estimate.usd_per_hour, 12.0);
        assert_eq!(d.estimate.max_usd, Some(12.0 * 24.0));
        assert_eq!(d.duration, Some(Duration::from_secs(24 * 3600)));
    }

    #[test]
    fn estimate_without_any_bound_has_no_maximum() {
        let mut r = request(Workload::Batch, 1);
        r.admission.duration = None;
        r.admission.gpu_model = Some("h100".into());
        let d = evaluate(&r, &snapshot());
        assert!(d.admitted(), "{:?}", d.reasons);
        assert_eq!(d.estimate.usd_per_hour, 4.0);
        assert_eq!(d.estimate.max_usd, None);
    }

    #[test]
    fn not_member_for_a_user_outside_the_team_or_a_principal_of_another_team() {
        let mut r = request(Workload::Training, 1);
        r.admission.user = "eve".into();
        let d = evaluate(&r, &snapshot());
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
        assert_eq!(
            codes(&evaluate(&r, &snapshot())),
            vec![ReasonCode::NotMember]
        );
    }

    #[test]
    fn workload_limit_names_the_cap() {
        let d = evaluate(&request(Workload::Training, 9), &snapshot());
        assert!(d.has(ReasonCode::WorkloadLimit));
        let m = &d.reasons[0].message;
        assert!(m.contains("at most 8") && m.contains("9 were asked"), "{m}");
    }

    #[test]
    fn model_not_allowed() {
        let mut r = request(Workload::Training, 1);
        r.admission.gpu_model = Some("a100".into());
        let d = evaluate(&r, &snapshot());
        assert!(d.has(ReasonCode::ModelNotAllowed), "{:?}", d.reasons);
        // The A100s exist, but this team may not use them, so there is no capacity either.
        assert!(d.has(ReasonCode::NoCapacity));
    }

    #[test]
    fn duration_limit() {
        let mut r = request(Workload::Training, 1);
        r.admission.duration = Some(Duration::from_secs(48 * 3600));
        let d = evaluate(&r, &snapshot());
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
        let d = evaluate(&request(Workload::Training, 3), &s);
        assert_eq!(codes(&d), vec![ReasonCode::QuotaExceeded]);
        assert!(d.reasons[0]
            .message
            .contains("holds 14 of its 16 GPUs and asked for 3"));
        assert!(evaluate(&request(Workload::Training, 2), &s).admitted());
    }

    #[test]
    fn budget_exceeded_counts_spend_plus_the_estimate() {
        let mut s = snapshot();
        // 2 GPUs × $4 × 2 h = $16; 9,985 + 16 > 10,000.
        s.spend_usd.insert("ml".into(), 9_985.0);
        let d = evaluate(&request(Workload::Training, 2), &s);
        assert_eq!(codes(&d), vec![ReasonCode::BudgetExceeded]);
        assert!(
            d.reasons[0].message.contains("$9985.00"),
            "{}",
            d.reasons[0].message
        );
        assert!(d.reasons[0].message.contains("$16.00"));
        s.spend_usd.insert("ml".into(), 9_984.0);
        assert!(evaluate(&request(Workload::Training, 2), &s).admitted());
    }

    #[test]
    fn no_capacity_when_no_fitting_substrate_has_enough_free() {
        let mut r = request(Workload::Training, 7);
        r.admission.substrate = Some("sim".into());
        let d = evaluate(&r, &snapshot());
        assert_eq!(codes(&d), vec![ReasonCode::NoCapacity]);
        assert!(
            d.reasons[0].message.contains("at most 6 free"),
            "{}",
            d.reasons[0].message
        );
    }

    #[test]
    fn team_blocked() {
        let mut s = snapshot();
        s.blocked.insert("ml".into());
        assert_eq!(
            codes(&evaluate(&request(Workload::Training, 1), &s)),
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
        let d = evaluate(&r, &s);
        let mut got = codes(&d);
        got.sort();
        assert_eq!(got, ReasonCode::ALL.to_vec());
        assert!(!d.admitted());
    }

    #[test]
    fn training_packs_onto_the_fewest_hosts() {
        // Two fit on b exactly (tightest fit), leaving a whole for a bigger job.
        let d = evaluate(&request(Workload::Training, 2), &snapshot());
        assert_eq!(d.placement.unwrap().gpu_uuids, vec!["GPU-b-0", "GPU-b-1"]);
        // Five need two hosts: all of a, then one of b.
        let d = evaluate(&request(Workload::Training, 5), &snapshot());
        let uuids = d.placement.unwrap().gpu_uuids;
        assert_eq!(
            uuids,
            vec!["GPU-a-0", "GPU-a-1", "GPU-a-2", "GPU-a-3", "GPU-b-0"]
        );
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
        let free: Vec<&Gpu> = listed.iter().collect();
        let hosts: Vec<(&str, u32)> = by_host(&free)
            .iter()
            .map(|g| (g.host.as_str(), g.index))
            .collect();
        assert_eq!(
            hosts,
            vec![
                ("h-1", 0),
                ("h-1", 1),
                ("h-1", 2),
                ("h-10", 0),
                ("h-10", 1),
                ("h-2", 0),
                ("h-2", 1),
                ("h-2", 2),
            ]
        );
        // Training: the tightest host that fits, its lowest indices.
        assert_eq!(
            choose(&free, 2, Workload::Training),
            vec!["GPU-h-10-0", "GPU-h-10-1"]
        );
        assert_eq!(
            choose(&free, 3, Workload::Training),
            vec!["GPU-h-1-0", "GPU-h-1-1", "GPU-h-1-2"]
        );
        // Across hosts: the fullest first, ties by name.
        assert_eq!(
            choose(&free, 4, Workload::Training),
            vec!["GPU-h-1-0", "GPU-h-1-1", "GPU-h-1-2", "GPU-h-2-0"]
        );
        // Spread: one per host in turn, the fullest hosts (then names) first.
        assert_eq!(
            choose(&free, 4, Workload::Inference),
            vec!["GPU-h-1-0", "GPU-h-2-0", "GPU-h-10-0", "GPU-h-1-1"]
        );
    }

    #[test]
    fn inference_spreads_across_hosts() {
        let d = evaluate(&request(Workload::Inference, 4), &snapshot());
        let uuids = d.placement.unwrap().gpu_uuids;
        let hosts: BTreeSet<&str> = uuids.iter().map(|u| &u[4..5]).collect();
        assert_eq!(hosts.len(), 2, "{uuids:?}");
        assert_eq!(uuids, vec!["GPU-a-0", "GPU-b-0", "GPU-a-1", "GPU-b-1"]);
    }

    #[test]
    fn busy_gpus_are_not_placed_and_pooled_capacity_counts_by_model() {
        let mut s = snapshot();
        for i in 0..4 {
            s.substrates[0].busy.insert(format!("GPU-a-{i}"));
        }
        s.substrates[1].pooled_in_use.insert(H100.into(), 5);
        // sim has 2 free H100, pool has 3: four fit nowhere.
        let d = evaluate(&request(Workload::Training, 4), &s);
        assert_eq!(codes(&d), vec![ReasonCode::NoCapacity]);
        let d = evaluate(&request(Workload::Training, 3), &s);
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
        let d = evaluate(&request(Workload::Training, 1), &s);
        assert_eq!(d.placement.unwrap().substrate, "pool");
        let mut r = request(Workload::Training, 1);
        r.admission.substrate = Some("elsewhere".into());
        let d = evaluate(&r, &s);
        assert!(d.has(ReasonCode::WorkloadLimit) && d.has(ReasonCode::NoCapacity));
    }
}
