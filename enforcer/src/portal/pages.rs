//! The body of each page, as escaped HTML: the request form with its estimate and decision,
//! the leases, the team, the admin's overview and the scorecard. Every value shown goes through
//! [`e`]; numbers are formatted by [`super::html`]. The sign-in form is [`super::session`]'s.

use std::collections::HashMap;
use std::fmt::Write as _;

use axum::http::StatusCode;
use gpuwarden_schema::config::{Config, Role};
use gpuwarden_schema::{Action, ActionKind, LeaseEvent, LeaseEventKind, ReleaseReason, Workload};
use serde_json::{json, Value};

use super::forms::{Outcome, RequestForm};
use super::html::{alert, at, e, query_value, span, usd};
use super::insights::TeamIdle;
use super::reasons::{explain, Context, Explained};
use super::session::Signed;
use super::state::{random_token, Portal};
use crate::scorecard;
use crate::service::ServiceError;
use crate::store::{Lease, LeaseState};

fn options(values: &[String], selected: &str) -> String {
    let mut out = String::new();
    for v in values {
        let sel = if v == selected { " selected" } else { "" };
        let _ = write!(out, r#"<option value="{v}"{sel}>{v}</option>"#, v = e(v));
    }
    out
}

/// What an estimate says: the GPUs and the model priced, the price per hour and the most the
/// lease may cost; and, when nothing was placed, which model the price assumed.
fn estimate_text(outcome: &Outcome) -> String {
    let decision = &outcome.admission.decision;
    let est = &decision.estimate;
    let n = outcome.request.gpus;
    let per_gpu = if n > 0 {
        est.usd_per_hour / f64::from(n)
    } else {
        0.0
    };
    let gpus = format!("{n} GPU{}", if n == 1 { "" } else { "s" });
    let what = match &est.gpu_model {
        Some(model) => format!("{gpus} of {model}"),
        None => gpus,
    };
    let priced = match (&decision.placement, &est.gpu_model) {
        (Some(_), _) => "",
        (None, Some(m)) if outcome.request.gpu_model.as_deref() == Some(m.as_str()) => {
            " Nothing could be placed: priced as the model asked for."
        }
        (None, Some(_)) => {
            " Nothing could be placed: priced as the dearest model the request could get."
        }
        (None, None) => " No GPU model fits the request: priced at the default price.",
    };
    match (est.max_usd, decision.duration) {
        (Some(max), Some(d)) => format!(
            "{what} × {}/h = {}/h; up to {} for {}.{priced}",
            usd(per_gpu),
            usd(est.usd_per_hour),
            usd(max),
            span(d.as_millis() as i64)
        ),
        _ => format!(
            "{what} × {}/h = {}/h, with no end: it costs that for every hour it runs.{priced}",
            usd(per_gpu),
            usd(est.usd_per_hour)
        ),
    }
}

fn explained(portal: &Portal, signed: &Signed, outcome: &Outcome) -> Vec<Explained> {
    let config = portal.service().config();
    let teams = portal.teams_of(&signed.principal);
    let ctx = Context {
        config,
        request: &outcome.request,
        team: outcome.team.as_ref(),
        teams: &teams,
    };
    explain(&outcome.admission.decision, &ctx)
}

/// The summary line of a decision.
fn summary(outcome: &Outcome) -> String {
    let decision = &outcome.admission.decision;
    let estimate = estimate_text(outcome);
    match (&outcome.admission.lease, decision.admitted()) {
        (Some(lease), true) => format!(
            "Admitted: lease {} holds {} GPU{} of {} on {}. {estimate}",
            lease.id,
            lease.gpu_count,
            if lease.gpu_count == 1 { "" } else { "s" },
            lease.gpu_model,
            lease.substrate
        ),
        (None, true) => match &decision.placement {
            Some(p) => format!(
                "Would be admitted: {} on {}. {estimate}",
                p.gpu_model, p.substrate
            ),
            None => format!("Would be admitted. {estimate}"),
        },
        _ => {
            let n = decision.reasons.len();
            let verb = if outcome.request.dry_run {
                "Would be denied"
            } else {
                "Denied"
            };
            format!(
                "{verb}: {n} reason{}. {estimate}",
                if n == 1 { "" } else { "s" }
            )
        }
    }
}

/// The script's answer for an estimate.
pub(super) fn estimate_json(portal: &Portal, signed: &Signed, outcome: &Outcome) -> Value {
    let reasons: Vec<Value> = explained(portal, signed, outcome)
        .into_iter()
        .map(|x| json!({"code": x.code.as_str(), "problem": x.problem, "fix": x.fix}))
        .collect();
    json!({
        "decision": if outcome.admission.decision.admitted() { "admitted" } else { "denied" },
        "summary": summary(outcome),
        "usd_per_hour": outcome.admission.decision.estimate.usd_per_hour,
        "max_usd": outcome.admission.decision.estimate.max_usd,
        "gpu_model": outcome.admission.decision.estimate.gpu_model,
        "reasons": reasons,
    })
}

fn reasons_list(reasons: &[Explained]) -> String {
    let mut out = String::from(r#"<ul id="estimate-reasons" class="reasons">"#);
    for r in reasons {
        let _ = write!(
            out,
            r#"<li data-code="{code}"><strong>{problem}</strong> <span class="fix">{fix}</span></li>"#,
            code = r.code.as_str(),
            problem = e(&r.problem),
            fix = e(&r.fix)
        );
    }
    out.push_str("</ul>");
    out
}

/// The decision in one line at the top of the page, where it is seen at once: on a phone the
/// form is taller than the screen and the estimate below it is out of sight. A lease admitted
/// says where it is; a denial says the first reason and leads to all of them.
fn decision_notice(
    outcome: &Result<Outcome, (StatusCode, String)>,
    reasons: &[Explained],
) -> String {
    let o = match outcome {
        Ok(o) => o,
        Err((_, why)) => {
            return format!(
                r#"<p class="error" role="alert" id="decision">Nothing was asked: {}</p>"#,
                e(why)
            )
        }
    };
    if let (Some(lease), false) = (&o.admission.lease, o.request.dry_run) {
        return format!(
            r#"<p class="notice" role="status" id="decision">{}: see <a href="/ui/leases">My leases</a>.</p>"#,
            e(format_args!("Lease {} admitted", lease.id))
        );
    }
    if o.admission.decision.admitted() {
        return format!(
            r#"<p class="notice" role="status" id="decision">{}</p>"#,
            e(summary(o))
        );
    }
    let verb = if o.request.dry_run {
        "Would be denied"
    } else {
        "Denied"
    };
    let first = reasons
        .first()
        .map(|r| format!(": {}", r.problem))
        .unwrap_or_else(|| ".".to_owned());
    let more = match reasons.len() {
        0 | 1 => String::new(),
        n => format!(" ({} more reason{})", n - 1, if n == 2 { "" } else { "s" }),
    };
    let role = if o.request.dry_run { "status" } else { "alert" };
    format!(
        r##"<p class="error" role="{role}" id="decision"><strong>{verb}</strong>{first}{more} <a href="#estimate-title">Every reason, and what would make it pass</a></p>"##,
        first = e(first),
        more = e(more),
    )
}

/// The kinds of work the request form offers: those the config defines (`[workloads.*]`), or
/// every kind when it defines none.
pub(super) fn offered_workloads(config: &Config) -> Vec<Workload> {
    if config.workloads.is_empty() {
        Workload::ALL.to_vec()
    } else {
        config.workloads.keys().copied().collect()
    }
}

pub(super) fn request(
    portal: &Portal,
    signed: &Signed,
    form: &RequestForm,
    models: &[String],
    teams: &[String],
    outcome: Option<&Result<Outcome, (StatusCode, String)>>,
) -> String {
    let config = portal.service().config();
    let mut out = String::new();
    // The decision of a submitted request, above the form.
    let (summary_text, reasons, class) = match outcome {
        Some(Ok(o)) => {
            let class = if o.admission.decision.admitted() {
                "admitted"
            } else {
                "denied"
            };
            (summary(o), explained(portal, signed, o), class)
        }
        Some(Err((_, why))) => (why.clone(), Vec::new(), "invalid"),
        None => (
            "Fill in the form to see what the lease would cost.".to_owned(),
            Vec::new(),
            "idle",
        ),
    };
    if let Some(outcome) = outcome {
        out.push_str(&decision_notice(outcome, &reasons));
    }
    let user_field = if signed.principal.role == Role::Member {
        format!(
            r#"<p class="field"><span class="label">User</span> <span id="user">{}</span></p>"#,
            e(&signed.principal.name)
        )
    } else {
        format!(
            r#"<p class="field"><label for="user">User (a member of the team)</label><input id="user" name="user" value="{}" required></p>"#,
            e(&form.user)
        )
    };
    let offered = offered_workloads(config);
    let workloads: Vec<String> = offered.iter().map(|w| w.as_str().to_owned()).collect();
    let mut workload_hints = String::new();
    for w in offered {
        let p = config.workload(w);
        let mut limits = Vec::new();
        if let Some(max) = p.max_gpus {
            limits.push(format!("up to {max} GPUs"));
        }
        if let Some(d) = p.max_duration {
            limits.push(format!("at most {}", span(d.as_millis() as i64)));
        }
        if let Some(t) = p.idle_timeout {
            limits.push(format!(
                "{} after {} idle",
                match p.on_idle {
                    gpuwarden_schema::config::OnIdle::Alert => "alerts",
                    gpuwarden_schema::config::OnIdle::Reclaim => "reclaimed",
                    gpuwarden_schema::config::OnIdle::Resize => "shrunk",
                },
                span(t.as_millis() as i64)
            ));
        }
        if !limits.is_empty() {
            let _ = write!(workload_hints, "<li>{w}: {}</li>", e(limits.join(", ")));
        }
    }
    let mut model_options = String::from(r#"<option value="">Any model the team may use</option>"#);
    model_options.push_str(&options(models, &form.gpu_model));
    let _ = write!(
        out,
        r#"<div class="columns">
<form method="post" action="/ui/request" class="card" id="request-form">
<input type="hidden" name="csrf" value="{csrf}">
<input type="hidden" name="submission" value="{submission}">
<p class="field"><label for="team">Team</label><select id="team" name="team">{teams}</select></p>
{user_field}
<p class="field"><label for="project">Project</label><input id="project" name="project" value="{project}" required placeholder="what the work is for, e.g. llm-finetune"></p>
<p class="field"><label for="workload">Workload</label><select id="workload" name="workload">{workloads}</select></p>
<p class="field"><label for="gpu_model">GPU model</label><select id="gpu_model" name="gpu_model">{models}</select></p>
<p class="field"><label for="gpus">GPUs</label><input id="gpus" name="gpus" type="number" min="1" step="1" value="{gpus}" required></p>
<p class="field"><label for="duration">Duration</label><input id="duration" name="duration" value="{duration}" placeholder="e.g. 30m, 2h, 1d" aria-describedby="duration-hint"><span id="duration-hint" class="hint">Empty: the workload's longest.</span></p>
<p class="field"><label for="labels">Labels <span class="hint">(key=value, one a line; optional)</span></label><textarea id="labels" name="labels" rows="2">{labels}</textarea></p>
<p class="buttons"><button type="submit" id="ask">Ask for GPUs</button> <button type="submit" name="check" value="1" id="check" class="secondary">Check cost</button></p>
</form>
<section class="card" aria-labelledby="estimate-title">
<h2 id="estimate-title">Estimate and decision</h2>
<div id="estimate" class="{class}" aria-live="polite"><p id="estimate-summary">{summary}</p>{reasons}</div>
<h3>Workload limits</h3><ul class="hints">{hints}</ul>
</section>
</div>"#,
        csrf = e(&signed.csrf),
        submission = random_token(),
        teams = options(teams, &form.team),
        project = e(&form.project),
        workloads = options(&workloads, &form.workload),
        models = model_options,
        gpus = e(&form.gpus),
        duration = e(&form.duration),
        labels = e(&form.labels),
        summary = e(&summary_text),
        reasons = reasons_list(&reasons),
        hints = workload_hints,
    );
    out
}

fn open(lease: &Lease) -> bool {
    matches!(
        lease.state,
        LeaseState::Granted | LeaseState::Active | LeaseState::Releasing
    )
}

/// The idle warnings and idle alerts (a workload whose `on_idle` is `alert`, or a lease at its
/// minimum size) among `actions`, by lease, newest first.
fn warnings(actions: &[Action]) -> HashMap<String, Vec<&Action>> {
    let mut out: HashMap<String, Vec<&Action>> = HashMap::new();
    for a in actions {
        if a.action == ActionKind::Alert && (a.reason == "idle_warning" || a.reason == "idle") {
            if let Some(id) = &a.lease_id {
                out.entry(id.clone()).or_default().push(a);
            }
        }
    }
    out
}

/// Durations an extension may offer for `lease`: those that keep it within its workload's
/// `max_duration` (any for an admin).
fn extensions(portal: &Portal, signed: &Signed, lease: &Lease) -> Vec<&'static str> {
    let Some(expires_at) = lease.expires_at else {
        return Vec::new();
    };
    let max = portal
        .service()
        .config()
        .workload(lease.workload)
        .max_duration;
    [
        ("30m", 1_800_000),
        ("1h", 3_600_000),
        ("2h", 7_200_000),
        ("4h", 14_400_000),
    ]
    .into_iter()
    .filter(|(_, ms)| {
        signed.principal.role == Role::Admin
            || max.is_none_or(|m| expires_at + ms - lease.granted_at <= m.as_millis() as i64)
    })
    .map(|(text, _)| text)
    .collect()
}

/// A lease's labels as pills on a line of their own (nothing without labels).
fn labels(lease: &Lease) -> String {
    if lease.labels.is_empty() {
        return String::new();
    }
    let pills = lease
        .labels
        .iter()
        .map(|(k, v)| format!(r#"<span class="label-pill">{}={}</span>"#, e(k), e(v)))
        .collect::<Vec<_>>()
        .join(" ");
    format!(r#"<span class="labels">{pills}</span>"#)
}

pub(super) async fn leases(portal: &Portal, signed: &Signed) -> Result<String, ServiceError> {
    let service = portal.service();
    let now = service.now();
    let pricing = &service.config().pricing;
    let p = &signed.principal;
    let mut all = service.leases(p, None, None).await?;
    if p.role == Role::Member {
        all.retain(|l| l.user == p.name);
    }
    let (open_leases, ended): (Vec<Lease>, Vec<Lease>) = all.into_iter().partition(open);
    // Every idle warning and alert of the open leases, however busy the rest of the fleet was.
    let since = open_leases
        .iter()
        .map(|l| l.granted_at)
        .min()
        .unwrap_or(now);
    let ids: std::collections::HashSet<String> = open_leases.iter().map(|l| l.id.clone()).collect();
    // The ended leases shown, whose `reclaim` Actions say who or what ended them: read in the
    // same scan, back to the earliest of their ends.
    let shown: Vec<&Lease> = ended.iter().take(10).collect();
    let actions_since = shown
        .iter()
        .map(|l| l.released_at.unwrap_or(l.updated_at))
        .fold(since, i64::min);
    let mut asked = ids.clone();
    asked.extend(shown.iter().map(|l| l.id.clone()));
    let actions = service.lease_actions(asked, actions_since).await?;
    let warned = warnings(&actions);
    let sizes = sizes(&service.lease_events(ids, since).await?);
    let mut out = String::new();
    if open_leases.is_empty() {
        out.push_str(r#"<p id="no-leases">No open leases."#);
        if p.role != Role::Viewer {
            out.push_str(r#" <a href="/ui/request">Request GPUs</a>."#);
        }
        out.push_str("</p>");
    } else {
        out.push_str(
            r#"<div class="table-wrap"><table class="leases" id="open-leases"><caption>Open leases</caption><thead><tr><th scope="col">Lease</th><th scope="col">Team · user</th><th scope="col">GPUs</th><th scope="col">State</th><th scope="col">Age · time left</th><th scope="col">Cost so far</th><th scope="col">Utilization · idle warnings</th><th scope="col"><span class="sr-only">Actions</span></th></tr></thead><tbody>"#,
        );
        for lease in &open_leases {
            let price = pricing.usd_per_gpu_hour(&lease.gpu_model);
            let rate = price * f64::from(lease.gpu_count);
            let held = gpu_hours(
                lease.granted_at,
                now,
                lease.gpu_count,
                sizes.get(&lease.id).map_or(&[][..], Vec::as_slice),
            );
            let left = match lease.expires_at {
                Some(end) => format!("{} left", span(end - now)),
                None => "no end".to_owned(),
            };
            let util = match service.utilization(&lease.id) {
                Some(u) if u.idle_ms > 0 => format!(
                    "{:.0} %, idle for {} ({} ago)",
                    u.util_pct,
                    span(u.idle_ms),
                    span(now - u.ts_ms)
                ),
                Some(u) => format!("{:.0} % ({} ago)", u.util_pct, span(now - u.ts_ms)),
                None => "no signal yet".to_owned(),
            };
            let warning = match warned.get(&lease.id).and_then(|w| w.first()) {
                Some(a) => format!(
                    r#"<br><span class="warning">Idle warning, {}: {}</span>"#,
                    at(a.ts_ms),
                    e(&a.detail)
                ),
                None => String::new(),
            };
            let writable = p.write_refusal(&lease.team, &lease.user).is_none()
                && matches!(lease.state, LeaseState::Granted | LeaseState::Active);
            let mut buttons = String::new();
            if writable {
                let _ = write!(
                    buttons,
                    r#"<form method="post" action="/ui/leases/{id}/release" class="inline"><input type="hidden" name="csrf" value="{csrf}"><button type="submit" class="danger" aria-label="Release lease {id}">Release</button></form>"#,
                    id = e(&lease.id),
                    csrf = e(&signed.csrf)
                );
                let choices = extensions(portal, signed, lease);
                if !choices.is_empty() {
                    let opts: Vec<String> = choices.iter().map(|c| (*c).to_owned()).collect();
                    let _ = write!(
                        buttons,
                        r#"<form method="post" action="/ui/leases/{id}/extend" class="inline"><input type="hidden" name="csrf" value="{csrf}"><label class="sr-only" for="extend-{id}">Extend lease {id} by</label><select id="extend-{id}" name="duration">{opts}</select> <button type="submit" class="secondary">Extend</button></form>"#,
                        id = e(&lease.id),
                        csrf = e(&signed.csrf),
                        opts = options(&opts, "1h")
                    );
                }
            }
            let _ = write!(
                out,
                r#"<tr data-lease="{id}"><td data-label="Lease"><code class="id">{id}</code><br><span class="hint">{workload} · {project}</span>{labels}</td><td data-label="Team · user">{team} · {user}</td><td data-label="GPUs"><span class="model">{count} × {model}</span><br><span class="hint">on {substrate}</span></td><td data-label="State" class="state">{state}</td><td data-label="Age · time left" class="nowrap">{age}<br><span class="hint">{left}</span></td><td data-label="Cost so far" class="cost">{cost}<br><span class="hint">{rate}/h now</span></td><td data-label="Utilization · idle warnings">{util}{warning}</td><td data-label="Actions" class="actions">{buttons}</td></tr>"#,
                id = e(&lease.id),
                project = e(&lease.project),
                team = e(&lease.team),
                user = e(&lease.user),
                workload = lease.workload,
                state = lease.state.as_str(),
                count = lease.gpu_count,
                model = e(&lease.gpu_model),
                substrate = e(&lease.substrate),
                age = span(now - lease.granted_at),
                cost = usd(price * held),
                rate = usd(rate),
                util = e(&util),
                labels = labels(lease),
            );
        }
        out.push_str("</tbody></table></div>");
    }
    if !ended.is_empty() {
        out.push_str(
            r#"<div class="table-wrap"><table class="leases" id="ended-leases"><caption>Recently ended</caption><thead><tr><th scope="col">Lease</th><th scope="col">Team · user</th><th scope="col">GPUs</th><th scope="col">Ended</th><th scope="col">Why</th></tr></thead><tbody>"#,
        );
        for lease in shown {
            // Newest first: the Action of its end.
            let reclaim = actions.iter().find(|a| {
                a.action == ActionKind::Reclaim && a.lease_id.as_deref() == Some(&lease.id)
            });
            let why = match lease.release_reason {
                Some(reason) => ended_why(reason, reclaim.map(|a| a.detail.as_str())),
                None => lease.state.as_str().to_owned(),
            };
            let _ = write!(
                out,
                r#"<tr data-lease="{id}"><td data-label="Lease"><code class="id">{id}</code><br><span class="hint">{workload} · {project}</span>{labels}</td><td data-label="Team · user">{team} · {user}</td><td data-label="GPUs"><span class="model">{count} × {model}</span></td><td data-label="Ended" class="nowrap">{ended}</td><td data-label="Why" class="state">{why}</td></tr>"#,
                id = e(&lease.id),
                project = e(&lease.project),
                team = e(&lease.team),
                user = e(&lease.user),
                workload = lease.workload,
                count = lease.gpu_count,
                model = e(&lease.gpu_model),
                ended = lease.released_at.map(at).unwrap_or_default(),
                why = e(why),
                labels = labels(lease),
            );
        }
        out.push_str("</tbody></table></div>");
    }
    Ok(out)
}

/// Who or what ended a lease with reason `user`, read from its `reclaim` Action's detail. A
/// release through the API or the portal records who asked (`Service::release_by`); a
/// substrate's own ending records reason `user` too, with what happened as its detail (a Slurm
/// job that completed or was cancelled, a deleted pod or Kueue Workload), and no person caused
/// it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum UserEnding<'a> {
    /// The holder asked (a member or an admin for their own lease).
    Person(&'a str),
    /// A service token, a front-end acting for the holder, asked.
    Service(&'a str),
    /// Released through the API or the portal before releases recorded who asked.
    Unnamed,
    /// Its substrate ended it: what happened (empty when it did not say).
    Substrate(&'a str),
}

fn user_ending(detail: &str) -> UserEnding<'_> {
    match detail.strip_prefix("released (user)") {
        Some(rest) => match rest.strip_prefix(": asked by ") {
            Some(who) => match who.strip_prefix("service ") {
                Some(token) => UserEnding::Service(token),
                None => UserEnding::Person(who),
            },
            None => UserEnding::Unnamed,
        },
        None => UserEnding::Substrate(detail),
    }
}

/// Why a lease ended, in words: who ended it, or which rule, or what its substrate saw.
/// `detail` is its `reclaim` Action's, when the audit trail still has it.
fn ended_why(reason: ReleaseReason, detail: Option<&str>) -> String {
    match reason {
        ReleaseReason::User => match detail.map(user_ending) {
            Some(UserEnding::Person(who)) => format!("released by {who}"),
            Some(UserEnding::Service(token)) => format!("released by service {token}"),
            Some(UserEnding::Substrate(what)) if !what.is_empty() => format!("ended: {what}"),
            _ => "released".to_owned(),
        },
        ReleaseReason::Admin => "ended by an admin".to_owned(),
        ReleaseReason::Expired => "expired: its time was up".to_owned(),
        ReleaseReason::Idle => "reclaimed: idle".to_owned(),
        ReleaseReason::Budget => "reclaimed: the team's budget ran out".to_owned(),
        ReleaseReason::Failed => "failed on its substrate".to_owned(),
    }
}

/// Each lease's GPU counts over time from its `granted` and `resized` events: (from when, how
/// many), oldest first.
fn sizes(events: &[LeaseEvent]) -> HashMap<String, Vec<(i64, u32)>> {
    let mut out: HashMap<String, Vec<(i64, u32)>> = HashMap::new();
    for ev in events {
        if matches!(ev.event, LeaseEventKind::Granted | LeaseEventKind::Resized) {
            out.entry(ev.lease_id.clone())
                .or_default()
                .push((ev.ts_ms, ev.gpu_count));
        }
    }
    for sizes in out.values_mut() {
        sizes.sort_by_key(|&(ts, _)| ts);
    }
    out
}

/// The GPU-hours a lease granted at `granted_at` has held by `now`, each GPU count of `sizes`
/// (oldest first, from [`sizes`]) counted from its time until the next; before the first,
/// the first. Without any, the lease counts at `current` throughout: a resized lease costs what
/// it held when, not its present size times its age.
fn gpu_hours(granted_at: i64, now: i64, current: u32, sizes: &[(i64, u32)]) -> f64 {
    let mut count = sizes.first().map_or(current, |&(_, n)| n);
    let mut from = granted_at;
    let mut gpu_ms: i128 = 0;
    for &(ts, n) in sizes {
        let ts = ts.clamp(granted_at, now.max(granted_at));
        gpu_ms += i128::from(ts - from) * i128::from(count);
        from = ts;
        count = n;
    }
    gpu_ms += i128::from((now - from).max(0)) * i128::from(count);
    gpu_ms as f64 / 3_600_000.0
}

fn meter(id: &str, label: &str, value: f64, max: f64) -> String {
    format!(
        r#"<meter id="{id}" min="0" max="{max}" value="{value}" aria-label="{label}"></meter>"#,
        id = e(id),
        label = e(label),
        max = max.max(0.0),
        value = value.clamp(0.0, max.max(0.0)),
    )
}

pub(super) async fn team(
    portal: &Portal,
    signed: &Signed,
    name: &str,
    teams: &[String],
) -> Result<String, ServiceError> {
    let service = portal.service();
    let t = service.team(&signed.principal, name).await?;
    let now = service.now();
    let pricing = &service.config().pricing;
    let leases = service
        .leases(&signed.principal, Some(name.to_owned()), None)
        .await?;
    // Each open lease costs its price until it expires or the month ends, whichever comes
    // first: a two-hour notebook adds two hours, not the rest of the month.
    let (_, month_end) = gpuwarden_schema::calendar::month_of(now);
    let (mut burn, mut still_to_spend) = (0.0, 0.0);
    for l in leases.iter().filter(|l| open(l)) {
        let per_hour = pricing.usd_per_gpu_hour(&l.gpu_model) * f64::from(l.gpu_count);
        let until = l.expires_at.map_or(month_end, |at| at.min(month_end));
        burn += per_hour;
        still_to_spend += per_hour * (until - now).max(0) as f64 / 3_600_000.0;
    }
    let forecast = t.month_to_date_usd + still_to_spend;
    let left = t.monthly_budget_usd - t.month_to_date_usd;
    let status = if t.month_to_date_usd > t.monthly_budget_usd {
        "over budget".to_owned()
    } else if forecast > t.monthly_budget_usd {
        format!(
            "forecast over budget by {}",
            usd(forecast - t.monthly_budget_usd)
        )
    } else {
        "forecast within budget".to_owned()
    };
    let mut out = String::new();
    if teams.len() > 1 {
        out.push_str(r#"<nav aria-label="Teams" class="teams"><ul>"#);
        for other in teams {
            let current = if other == name {
                r#" aria-current="page""#
            } else {
                ""
            };
            let _ = write!(
                out,
                r#"<li><a href="/ui/team?team={q}"{current}>{t}</a></li>"#,
                q = e(query_value(other)),
                t = e(other)
            );
        }
        out.push_str("</ul></nav>");
    }
    if t.blocked {
        out.push_str(&alert(&format!(
            "Team {name}'s new requests are blocked (over its monthly budget, or by an admin)."
        )));
    }
    let free = t.gpu_quota.saturating_sub(t.gpus_held);
    let _ = write!(
        out,
        r#"<div class="columns">
<section class="card" aria-labelledby="quota-title"><h2 id="quota-title">Quota</h2>
<p id="quota"><strong>{held} of {quota} GPUs</strong> held in open leases; {free} free.</p>
{quota_meter}
</section>
<section class="card" aria-labelledby="spend-title"><h2 id="spend-title">Spend this month</h2>
<p id="spend"><strong>{mtd}</strong> of {budget} spent; {left} left.</p>
{spend_meter}
<p id="forecast">Month-end forecast: <strong>{forecast}</strong> ({status}): {still} more for the open leases until they expire or the month ends, at {burn}/h now.</p>
<p class="hint" id="spend-source">Counted by the enforcer up to now ({now}): the pipeline's latest month-to-date figure plus what open leases have cost since. Budgets are checked against this.</p>
</section>
</div>"#,
        held = t.gpus_held,
        quota = t.gpu_quota,
        quota_meter = meter(
            "quota-meter",
            "GPUs held of the quota",
            f64::from(t.gpus_held),
            f64::from(t.gpu_quota)
        ),
        mtd = usd(t.month_to_date_usd),
        budget = usd(t.monthly_budget_usd),
        left = usd(left.max(0.0)),
        spend_meter = meter(
            "spend-meter",
            "Spent of the monthly budget",
            t.month_to_date_usd,
            t.monthly_budget_usd
        ),
        forecast = usd(forecast),
        status = e(&status),
        still = usd(still_to_spend),
        burn = usd(burn),
        now = at(now),
    );
    out.push_str(r#"<section class="card" aria-labelledby="idle-title"><h2 id="idle-title">Idle cost this month</h2>"#);
    match portal.insights() {
        None => out.push_str(
            r#"<p id="idle">Idle cost is read from the lake, and this enforcer runs without one.</p>"#,
        ),
        Some(insights) => match insights.team_idle(name, now, 5).await {
            Err(why) => out.push_str(&alert(&format!("The lake could not be read: {why}"))),
            Ok(idle) => {
                out.push_str(&idle_summary(&idle, t.month_to_date_usd));
                if idle.top.is_empty() {
                    out.push_str("<p>No lease had idle cost this month.</p>");
                } else {
                    out.push_str(r#"<table id="idle-leases"><caption>Leases with the highest idle cost</caption><thead><tr><th scope="col">Lease</th><th scope="col">User</th><th scope="col">Workload</th><th scope="col">Idle cost</th><th scope="col">Cost</th></tr></thead><tbody>"#);
                    for l in &idle.top {
                        let _ = write!(
                            out,
                            r#"<tr><td data-label="Lease"><code>{}</code></td><td data-label="User">{}</td><td data-label="Workload">{}</td><td data-label="Idle cost">{}</td><td data-label="Cost">{}</td></tr>"#,
                            e(&l.lease_id),
                            e(&l.user),
                            e(&l.workload),
                            usd(l.idle_cost_usd),
                            usd(l.cost_usd)
                        );
                    }
                    out.push_str("</tbody></table>");
                }
            }
        },
    }
    out.push_str("</section>");
    Ok(out)
}

/// The idle card's lines: the lake's idle cost of the month, and where it comes from. It is
/// read from the pipeline's hourly rollups, which reach only as far as their watermark, while
/// the spend card beside it (`enforcer_spend`) is the enforcer's own count up to now: the page
/// says so, rather than show two figures of the same month that disagree without a word.
fn idle_summary(idle: &TeamIdle, enforcer_spend: f64) -> String {
    let Some(as_of) = idle.as_of_ms else {
        return r#"<p id="idle">The lake's hourly rollups have not run yet: idle cost is known once the pipeline has rolled up the collector's samples.</p>"#.to_owned();
    };
    let source = format!(
        "From the lake's hourly rollups, whose data reach {}. The spend beside it ({}) is the \
         enforcer's own count up to now, so the two differ by what the rollups have not reached \
         yet.",
        at(as_of),
        usd(enforcer_spend)
    );
    if idle.cost_usd <= 0.0 {
        return format!(
            r#"<p id="idle">The rollups have priced none of this team's GPU-hours this month yet.</p><p class="hint" id="idle-source">{}</p>"#,
            e(source)
        );
    }
    let share = 100.0 * idle.idle_cost_usd / idle.cost_usd;
    format!(
        r#"<p id="idle"><strong>{}</strong> of {} paid for idle GPUs ({share:.1} %).</p><p class="hint" id="idle-source">{}</p>"#,
        usd(idle.idle_cost_usd),
        usd(idle.cost_usd),
        e(source)
    )
}

/// How the audit trail shows an action: its kind and reason as a person reads them. A lease
/// that its holder or an admin ended is stored as a `reclaim`, like those the rules take back,
/// but it is the person's release, and reads as one; one its substrate ended (reason `user`
/// too, see [`UserEnding`]) reads as what happened there.
fn action_words(a: &Action) -> (String, String) {
    match (a.action, a.reason.as_str()) {
        (ActionKind::Reclaim, "user") => match user_ending(&a.detail) {
            UserEnding::Person(who) => ("release".to_owned(), format!("by {who}, its holder")),
            UserEnding::Service(token) => ("release".to_owned(), format!("by service {token}")),
            UserEnding::Unnamed => (
                "release".to_owned(),
                "through the API or the portal".to_owned(),
            ),
            UserEnding::Substrate(what) => (
                "ended".to_owned(),
                if what.is_empty() {
                    "by its substrate".to_owned()
                } else {
                    what.to_owned()
                },
            ),
        },
        (ActionKind::Reclaim, "admin") => ("release".to_owned(), "by an admin".to_owned()),
        (kind, reason) => (kind.as_str().to_owned(), reason.to_owned()),
    }
}

fn actions_table(actions: &[Action]) -> String {
    let mut out = String::from(
        r#"<table id="actions"><caption>Recent actions (the audit trail)</caption><thead><tr><th scope="col">When</th><th scope="col">Action</th><th scope="col">Reason</th><th scope="col">Team</th><th scope="col">Lease</th><th scope="col">Outcome</th><th scope="col">Detail</th></tr></thead><tbody>"#,
    );
    for a in actions {
        let (action, reason) = action_words(a);
        let _ = write!(
            out,
            r#"<tr data-lease="{}"><td data-label="When" class="nowrap">{}</td><td data-label="Action" class="action">{}</td><td data-label="Reason">{}</td><td data-label="Team">{}</td><td data-label="Lease"><code class="id">{}</code></td><td data-label="Outcome">{}</td><td data-label="Detail">{}</td></tr>"#,
            e(a.lease_id.as_deref().unwrap_or("")),
            at(a.ts_ms),
            e(action),
            e(reason),
            e(a.team.as_deref().unwrap_or("")),
            e(a.lease_id.as_deref().unwrap_or("")),
            a.outcome.as_str(),
            e(&a.detail)
        );
    }
    out.push_str("</tbody></table>");
    out
}

pub(super) async fn admin(portal: &Portal, signed: &Signed) -> Result<String, ServiceError> {
    let service = portal.service();
    let mut out = String::from(
        r#"<table id="teams"><caption>Every team</caption><thead><tr><th scope="col">Team</th><th scope="col">GPUs held</th><th scope="col">Spent this month</th><th scope="col">Blocked</th></tr></thead><tbody>"#,
    );
    let mut blocked = Vec::new();
    for t in &service.config().teams {
        let team = service.team(&signed.principal, &t.name).await?;
        if team.blocked {
            blocked.push(team.name.clone());
        }
        let _ = write!(
            out,
            r#"<tr data-team="{name}"><td data-label="Team"><a href="/ui/team?team={q}">{name}</a></td><td data-label="GPUs held">{held} of {quota}</td><td data-label="Spent this month">{mtd} of {budget}</td><td data-label="Blocked">{blocked}</td></tr>"#,
            name = e(&team.name),
            q = e(query_value(&team.name)),
            held = team.gpus_held,
            quota = team.gpu_quota,
            mtd = usd(team.month_to_date_usd),
            budget = usd(team.monthly_budget_usd),
            blocked = if team.blocked { "yes" } else { "no" },
        );
    }
    out.push_str("</tbody></table>");
    let _ = write!(
        out,
        r#"<section class="card" aria-labelledby="blocked-title"><h2 id="blocked-title">Blocked teams</h2><p id="blocked">{}</p></section>"#,
        if blocked.is_empty() {
            "None.".to_owned()
        } else {
            e(blocked.join(", ")).to_string()
        }
    );
    // A release names who asked in its own detail: no lease is read to name its holder.
    let actions = service.recent_actions(50, None).await?;
    out.push_str(&actions_table(&actions));
    out.push_str(r#"<p><a href="/ui/scorecard">The maturity scorecard</a></p>"#);
    Ok(out)
}

pub(super) async fn scorecard(portal: &Portal) -> String {
    let Some(insights) = portal.insights() else {
        return alert(
            "The scorecard reads the lake, and this enforcer runs without one; run `gpuwarden assess --config FILE` where the lake is.",
        );
    };
    let evidence = match insights.evidence().await {
        Ok(evidence) => evidence,
        Err(why) => return alert(&format!("The lake could not be read: {why}")),
    };
    let card = scorecard::assess(portal.service().config(), &evidence);
    let mut out = format!(
        r#"<p id="average">Average <strong>{:.2}</strong> of 5: <strong class="band">{}</strong>{}.</p>"#,
        card.average,
        card.band.as_str(),
        match card.as_of_ms {
            Some(ms) => format!(
                ", from the {} days of the lake up to {}",
                scorecard::WINDOW_DAYS,
                at(ms)
            ),
            None => ", from an empty lake".to_owned(),
        }
    );
    out.push_str(r#"<table id="scorecard"><thead><tr><th scope="col">Capability</th><th scope="col">Score</th><th scope="col">Evidence</th><th scope="col">To raise it</th></tr></thead><tbody>"#);
    for s in &card.scores {
        let evidence: String = s
            .evidence
            .iter()
            .map(|line| format!("<li>{}</li>", e(line)))
            .collect();
        let capability = serde_json::to_value(s.capability)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        let _ = write!(
            out,
            r#"<tr data-capability="{capability}"><th scope="row">{title}</th><td data-label="Score" class="score"><span class="dots" aria-hidden="true">{dots}</span> <span class="value">{score}</span><span class="sr-only"> of 5</span></td><td data-label="Evidence"><ul>{evidence}</ul></td><td data-label="To raise it">{next}</td></tr>"#,
            title = e(s.title),
            dots = "●".repeat(s.score as usize) + &"○".repeat(5 - s.score as usize),
            score = s.score,
            next = e(s
                .next
                .as_deref()
                .unwrap_or("Nothing: this is the top score.")),
        );
    }
    out.push_str("</tbody></table>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: i64 = 3_600_000;

    #[test]
    fn a_resized_lease_costs_what_it_held_when_not_its_size_times_its_age() {
        // 2 GPUs for an hour, then 4 for an hour: 6 GPU-hours, not 4 × 2.
        let sizes = [(0, 2), (H, 4)];
        assert_eq!(gpu_hours(0, 2 * H, 4, &sizes), 6.0);
        // Shrunk back to 1 for the third hour.
        assert_eq!(gpu_hours(0, 3 * H, 1, &[(0, 2), (H, 4), (2 * H, 1)]), 7.0);
        // No events (an outbox that no longer holds them): the present size throughout.
        assert_eq!(gpu_hours(0, 2 * H, 4, &[]), 8.0);
        // A grant recorded after the lease's time (a hold bound later) changes nothing before.
        assert_eq!(gpu_hours(0, 2 * H, 3, &[(H / 2, 3)]), 6.0);
        // A clock before the grant counts nothing.
        assert_eq!(gpu_hours(H, 0, 3, &[(H, 3)]), 0.0);
    }

    #[test]
    fn sizes_are_read_from_grants_and_resizes_in_time_order() {
        let event = |ts_ms, event, gpu_count| LeaseEvent {
            v: Default::default(),
            ts_ms,
            event,
            lease_id: "l1".into(),
            team: "ml".into(),
            user: "ada".into(),
            project: "p".into(),
            workload: Workload::Training,
            substrate: "sim".into(),
            gpu_model: "H100".into(),
            gpu_count,
            gpu_uuids: Vec::new(),
            labels: None,
            reason: None,
        };
        // Newest first, as the store reads them.
        let got = sizes(&[
            event(2 * H, LeaseEventKind::Released, 4),
            event(H, LeaseEventKind::Resized, 4),
            event(0, LeaseEventKind::Granted, 2),
        ]);
        assert_eq!(got["l1"], [(0, 2), (H, 4)]);
    }

    fn action(kind: ActionKind, reason: &str) -> Action {
        with_detail(kind, reason, "released (user): asked by ada")
    }

    fn with_detail(kind: ActionKind, reason: &str, detail: &str) -> Action {
        Action {
            v: Default::default(),
            ts_ms: 0,
            action: kind,
            lease_id: Some("l1".into()),
            team: Some("ml".into()),
            reason: reason.into(),
            policy: None,
            driver: None,
            outcome: gpuwarden_schema::Outcome::Ok,
            detail: detail.into(),
        }
    }

    #[test]
    fn a_person_s_release_reads_as_theirs_not_as_a_reclaim() {
        let words = |kind, reason| {
            let (a, r) = action_words(&action(kind, reason));
            format!("{a}: {r}")
        };
        assert_eq!(
            words(ActionKind::Reclaim, "user"),
            "release: by ada, its holder"
        );
        assert_eq!(words(ActionKind::Reclaim, "admin"), "release: by an admin");
        // What the rules take back stays a reclaim.
        assert_eq!(words(ActionKind::Reclaim, "idle"), "reclaim: idle");
        assert_eq!(
            words(ActionKind::Deny, "quota_exceeded"),
            "deny: quota_exceeded"
        );
        let table = actions_table(&[action(ActionKind::Reclaim, "user")]);
        assert!(table.contains(r#"<td data-label="Action" class="action">release</td><td data-label="Reason">by ada, its holder</td>"#), "{table}");
        assert_eq!(
            ended_why(ReleaseReason::User, Some("released (user): asked by ada")),
            "released by ada"
        );
    }

    #[test]
    fn an_ending_no_person_caused_is_not_worded_as_someone_s_release() {
        let words = |detail| {
            let (a, r) = action_words(&with_detail(ActionKind::Reclaim, "user", detail));
            format!("{a}: {r}")
        };
        // A substrate's own ending records reason `user` too.
        assert_eq!(
            words("its Slurm job completed"),
            "ended: its Slurm job completed"
        );
        assert_eq!(words("its pod was deleted"), "ended: its pod was deleted");
        assert_eq!(words(""), "ended: by its substrate");
        // A front-end's token, and a release from before releases said who asked.
        assert_eq!(
            words("released (user): asked by service portal"),
            "release: by service portal"
        );
        assert_eq!(
            words("released (user)"),
            "release: through the API or the portal"
        );
        let why = |detail| ended_why(ReleaseReason::User, detail);
        assert_eq!(
            why(Some("its Slurm job was cancelled")),
            "ended: its Slurm job was cancelled"
        );
        assert_eq!(
            why(Some("its Workload was deleted")),
            "ended: its Workload was deleted"
        );
        assert_eq!(
            why(Some("released (user): asked by service kueue-front")),
            "released by service kueue-front"
        );
        // Its Action no longer in the audit trail: said without naming anyone.
        assert_eq!(why(None), "released");
        assert_eq!(why(Some("released (user)")), "released");
        assert_eq!(ended_why(ReleaseReason::Idle, None), "reclaimed: idle");
    }

    #[test]
    fn the_idle_card_says_where_its_figures_come_from_and_why_they_lag() {
        let empty = idle_summary(&TeamIdle::default(), 0.61);
        assert!(empty.contains("hourly rollups have not run yet"), "{empty}");
        assert!(!empty.contains("$0.00 of $0.00"), "{empty}");
        let unpriced = idle_summary(
            &TeamIdle {
                as_of_ms: Some(1_767_225_600_000),
                ..TeamIdle::default()
            },
            0.61,
        );
        assert!(
            unpriced.contains("The rollups have priced none of this team's GPU-hours"),
            "{unpriced}"
        );
        assert!(
            unpriced.contains("whose data reach 2026-01-01 00:00 UTC. The spend beside it ($0.61) is the enforcer&#39;s own count up to now"),
            "{unpriced}"
        );
        let priced = idle_summary(
            &TeamIdle {
                as_of_ms: Some(1_767_225_600_000),
                idle_cost_usd: 1.0,
                cost_usd: 4.0,
                top: Vec::new(),
            },
            5.0,
        );
        assert!(
            priced.contains("<strong>$1.00</strong> of $4.00 paid for idle GPUs (25.0 %)"),
            "{priced}"
        );
        assert!(priced.contains("id=\"idle-source\""), "{priced}");
    }

    #[test]
    fn the_form_offers_only_the_workloads_the_config_defines() {
        let mut config = Config::default();
        assert_eq!(offered_workloads(&config), Workload::ALL);
        config
            .workloads
            .insert(Workload::Notebook, Default::default());
        config
            .workloads
            .insert(Workload::Training, Default::default());
        assert_eq!(
            offered_workloads(&config),
            [Workload::Training, Workload::Notebook]
        );
    }
}
